"""Synthetic forecasting tasks for the overfit suite: each a signal the Forecaster must learn.

Every task is a plain function `task(batch, window, variates, horizons, generator)` that returns
`(series [B,T,N], target [B,H,N])`, float32 on the CPU, O(1) in scale. Per-sample parameters are
drawn from `generator`, so a batch holds many instances of the same rule: the model has to learn
the rule, not one curve. The docstrings state the signal exactly.

`TASKS` lists them in the suite's order. The last one, `pooled_selection`, is built so that only
the block's attention pool over variate tokens can solve it (see its docstring).
"""
import contextlib
import math

import torch


def _time(window, horizons):
    """Window times 0..T-1 and horizon times T..T+H-1, as float32 rows."""
    t = torch.arange(window + horizons, dtype=torch.float32)
    return t[:window], t[window:]


def constant_level(batch, window, variates, horizons, generator):
    """x[t,n] = c[n] with c ~ U(-2, 2) per sample and variate; the forecast is c[n] at every horizon."""
    level = 4 * torch.rand(batch, 1, variates, generator=generator) - 2
    return level.expand(batch, window, variates).clone(), level.expand(batch, horizons, variates).clone()


def linear_trend(batch, window, variates, horizons, generator):
    """x[t,n] = a[n] + s[n]·t/T with a ~ U(-1, 1), s ~ U(-1, 1); the forecast continues the line."""
    past, future = _time(window, horizons)
    a = 2 * torch.rand(batch, 1, variates, generator=generator) - 1
    s = 2 * torch.rand(batch, 1, variates, generator=generator) - 1
    line = lambda t: a + s * t[None, :, None] / window
    return line(past), line(future)


def single_sine(batch, window, variates, horizons, generator):
    """x[t,n] = A[n]·sin(2π t/8 + φ[n]), A ~ U(0.5, 1.5), φ ~ U(0, 2π); the forecast continues it."""
    past, future = _time(window, horizons)
    amp = 0.5 + torch.rand(batch, 1, variates, generator=generator)
    phase = 2 * math.pi * torch.rand(batch, 1, variates, generator=generator)
    wave = lambda t: amp * torch.sin(2 * math.pi * t[None, :, None] / 8 + phase)
    return wave(past), wave(future)


def two_sines(batch, window, variates, horizons, generator):
    """x = A1·sin(2π t/11 + φ1) + A2·sin(2π t/4.5 + φ2) per variate, amplitudes U(0.3, 1), phases
    U(0, 2π); the forecast continues the sum (a fourth-order linear recurrence)."""
    past, future = _time(window, horizons)
    amp = 0.3 + 0.7 * torch.rand(batch, 2, 1, variates, generator=generator)
    phase = 2 * math.pi * torch.rand(batch, 2, 1, variates, generator=generator)
    period = torch.tensor([11.0, 4.5])[None, :, None, None]

    def wave(t):
        return (amp * torch.sin(2 * math.pi * t[None, None, :, None] / period + phase)).sum(1)

    return wave(past), wave(future)


def step_change(batch, window, variates, horizons, generator):
    """x[t,n] = a[n] for t < τ, b[n] from τ on; a, b ~ U(-1.5, 1.5), τ ~ U{2..T-2} per sample.
    The forecast is the new level b[n] at every horizon (the level after the step persists)."""
    a = 3 * torch.rand(batch, 1, variates, generator=generator) - 1.5
    b = 3 * torch.rand(batch, 1, variates, generator=generator) - 1.5
    tau = torch.randint(2, window - 1, (batch, 1, 1), generator=generator)
    t = torch.arange(window)[None, :, None]
    return torch.where(t < tau, a, b), b.expand(batch, horizons, variates).clone()


def ar1(batch, window, variates, horizons, generator):
    """Noise-free AR(1) toward a mean: x[t+1] = μ + φ[n]·(x[t] − μ), φ[n] = 0.6 + 0.3·n/(N-1)
    (fixed per variate), μ ~ U(-0.5, 0.5) and x[0] − μ ~ U(-2, 2) per sample and variate.
    The forecast is x[T-1+h] = μ + φ^h·(x[T-1] − μ)."""
    phi = 0.6 + 0.3 * torch.arange(variates, dtype=torch.float32) / max(1, variates - 1)
    mu = torch.rand(batch, 1, variates, generator=generator) - 0.5
    dev = 4 * torch.rand(batch, 1, variates, generator=generator) - 2
    powers = phi[None, None, :] ** torch.arange(window + horizons, dtype=torch.float32)[None, :, None]
    series = mu + dev * powers
    return series[:, :window], series[:, window:]


def lead_lag(batch, window, variates, horizons, generator):
    """Variate 0 leads: it is white noise z ~ N(0,1). Variate n ≥ 1 is z delayed by lag L_n = H + n − 1
    (≥ H), so its next H values are already in the leader's window: target[h,n] = z[T+h−L_n].
    The leader's own future is unpredictable noise, so its target is its last value (persistence).
    A model that reads each variate alone cannot do better than noise on the followers."""
    lags = [0] + [horizons + n - 1 for n in range(1, variates)]
    span = window + horizons + max(lags)
    z = torch.randn(batch, span, generator=generator)
    start = max(lags)  # window time 0 is z index `start`
    full = torch.stack([z[:, start - lag: start - lag + window + horizons] for lag in lags], dim=-1)
    series, target = full[:, :window].clone(), full[:, window:].clone()
    target[:, :, 0] = series[:, -1:, 0]
    return series, target


def horizon_offsets(batch, window, variates, horizons, generator):
    """A noisy level: x[t,n] = c[n] + 0.1·ε, c ~ U(-1, 1); target[h,n] = c[n] + o[h,n] with a fixed
    table o[h,n] = (h+1)·(−1)^n·0.5 / H + 0.25·sin(h + n): each horizon has its own offset."""
    level = 2 * torch.rand(batch, 1, variates, generator=generator) - 1
    noise = 0.1 * torch.randn(batch, window, variates, generator=generator)
    h = torch.arange(horizons, dtype=torch.float32)[:, None]
    n = torch.arange(variates, dtype=torch.float32)[None, :]
    sign = 1 - 2 * (torch.arange(variates) % 2).float()[None, :]
    offsets = (h + 1) * sign * 0.5 / horizons + 0.25 * torch.sin(h + n)
    return level + noise, level + offsets[None]


def pooled_selection(batch, window, variates, horizons, generator, sharpness=4.0):
    """The one task the pool is needed for. Each variate n carries a key k[n] and a value v[n]
    (both N(0,1)) in its window: x[t,n] = k[n]·cos(2π t/T) + v[n]·sin(2π t/T). Every variate's
    target at every horizon is the softmax-weighted value of all variates,
        target[h,n] = Σ_m softmax_m(s·k[m]) · v[m] · (h+1)/H,   s = `sharpness`,
    so each target depends on the others through a selection that is multiplicative in (k, v).

    The attention pool computes exactly this form: its scores are linear in each variate's token
    (so a query can align with k) and it averages the tokens' values with the softmax weights.

    Why the suite cuts the context path for this task (`overfit(..., context=False)`): ctx =
    Linear(series.flatten(1)) sees every variate, and the top-k MoE after it is a one-hidden-layer
    network on that projection. On a fixed batch that pair memorises any target: measured with the
    pool cut and the context path kept (N=4 and N=8, B=256/512, 400 steps), the loss falls to 1e-3
    and below, as low as with the pool. So on a fixed batch "fails without the pool" can only be
    shown when the input reaches the block through the variate tokens alone; then the pool is the
    only place the variates meet, and cutting it leaves a constant forecast (loss ≈ 1).
    """
    past, future = _time(window, horizons)
    key = torch.randn(batch, 1, variates, generator=generator)
    value = torch.randn(batch, 1, variates, generator=generator)
    angle = 2 * math.pi * past[None, :, None] / window
    series = key * torch.cos(angle) + value * torch.sin(angle)
    selected = (torch.softmax(sharpness * key, dim=-1) * value).sum(-1, keepdim=True)  # [B,1,1]
    scale = (torch.arange(horizons, dtype=torch.float32) + 1)[None, :, None] / horizons
    return series, (selected * scale).expand(batch, horizons, variates).clone()


TASKS = {
    "constant_level": constant_level,
    "linear_trend": linear_trend,
    "single_sine": single_sine,
    "two_sines": two_sines,
    "step_change": step_change,
    "ar1": ar1,
    "lead_lag": lead_lag,
    "horizon_offsets": horizon_offsets,
    "pooled_selection": pooled_selection,
}


# Suite geometry: the tiny preset's block (D=32, P=2, F=64, E=4, k=2) on short windows.
SUITE = dict(window=16, variates=4, horizons=3)
MODEL = dict(dim=32, heads=2, hidden=64, experts=4, top_k=2)


def cut_pool(model):
    """Zero and freeze the pool's output projection: inv = 0, so the pool adds nothing to y."""
    out = model.block.pool.out
    with torch.no_grad():
        out.weight.zero_()
        out.bias.zero_()
    out.weight.requires_grad_(False)
    out.bias.requires_grad_(False)


def cut_context(model):
    """Zero and freeze the context path's weight: ctx is then a learned constant per horizon (its
    bias), so nothing about the input reaches the block except through the variate tokens."""
    weight = model.context.weight
    with torch.no_grad():
        weight.zero_()
    weight.requires_grad_(False)


@contextlib.contextmanager
def require_lowered(what="the model"):
    """Raise unless the backend="mha" compiles inside this block replace a region: a compiled
    run that silently fell back to the captured graph would compare eager with eager (the
    seed's dead fast path; the first H200 run of bench/train_curves.py did exactly that)."""
    from mha_compile import backend

    reports = []
    observe = lambda report, gm, lowered: reports.append(report)
    backend.observers.append(observe)
    try:
        yield reports
    finally:
        backend.observers.remove(observe)
    if not any(r.replaced for r in reports):  # a graph that fell back ran as captured
        reasons = "; ".join([f"fallback: {r.fallback}" for r in reports if r.fallback] +
                            [m["reason"] for r in reports for m in r.near_misses]) or "no candidate region"
        raise RuntimeError(f"backend='mha' replaced no region of {what}: {reasons}")


def overfit(task, steps, seed=0, batch=256, lr=3e-3, compile_options=None, compile=True, pool=True,
            context=True, dtype=torch.float32, device="cpu", geometry=SUITE, model_kwargs=MODEL):
    """Train a fresh Forecaster on one fixed batch of `task`; returns the loss of every step.

    The loss is the MSE divided by the target's variance (1.0 = predicting the mean), so one
    threshold reads the same on every task. `pool=False` cuts the pool (see `cut_pool`),
    `context=False` the context path (see `cut_context`).
    `compile=False` trains eagerly (the reference curve); otherwise backend="mha".
    """
    from mha_compile.models import Forecaster

    gen = torch.Generator().manual_seed(1000 + seed)
    series, target = task(batch, geometry["window"], geometry["variates"], geometry["horizons"], gen)
    series, target = series.to(device, dtype), target.to(device, dtype)
    scale = 1.0 / target.float().var().item()
    torch.manual_seed(seed)
    model = Forecaster(**geometry, **model_kwargs).to(device, dtype)
    if not pool:
        cut_pool(model)
    if not context:
        cut_context(model)
    run = torch.compile(model, backend="mha", options=compile_options) if compile else model
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        with require_lowered("the Forecaster") if compile and step == 0 else contextlib.nullcontext():
            loss = (run(series) - target).float().square().mean() * scale
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# The overfit suite: task -> (threshold on MSE / Var(target), step budget, context path kept).
# Thresholds and budgets were chosen from compiled runs on seeds 0-3 (tests/training/test_overfit.py).
THRESHOLDS = {
    "constant_level": (3e-3, 120, True),
    "linear_trend": (3e-3, 150, True),
    "single_sine": (3e-3, 150, True),
    "two_sines": (3e-3, 150, True),
    "step_change": (3e-3, 200, True),
    "ar1": (3e-3, 150, True),
    "lead_lag": (3e-3, 200, True),
    "horizon_offsets": (3e-3, 200, True),
    "pooled_selection": (1e-2, 300, False),
}
