"""Training modes users use, each compiled with backend="mha" and compared with eager (issue 7):
gradient accumulation, torch.no_grad evaluation between steps, model.eval(), zero_grad with and
without set_to_none, activation checkpointing around the block, torch.autocast bf16.

Each run trains an eager model and a compiled deep copy in lockstep on the same batches and
records losses, evaluation outputs, gradients and the final parameters; fp32 records must agree to
SPEC §4's 1e-5 (relative norm), and the backend must have replaced the region in every graph.

The optimiser is SGD with momentum: its update is linear in the gradient, so two correct runs stay
within rounding of each other and every recorded quantity is a SPEC §4 comparison. Adam is not:
its first update is ≈ lr·sign(g), so a gradient element near zero turns a rounding difference
into an lr-sized step (measured: 3e-5 in ∂head_w one Adam step later); test_gradient_health
bounds the Adam loss curve separately.
"""
import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from mha_compile import models, tasks
from mha_compile.kernels import reference
from numerics import TOLERANCE, relative_error
from training_utils import region_matches

FP32 = TOLERANCE[torch.float32]
BK = "block.pool.key.bias"


def _forecaster(seed=0, cls=models.Forecaster):
    torch.manual_seed(seed)
    return cls(16, 4, 3, dim=32, heads=2, hidden=64, experts=4, top_k=2)


def _batches(count, batch=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [tasks.two_sines(batch, 16, 4, 3, gen) for _ in range(count)]


def _train(model, run, steps, accumulate=1, eval_between=None, set_to_none=True):
    """Adam steps over fresh batches; returns a record of everything a user would observe."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = _batches(steps * accumulate + steps)
    record = {"loss": [], "eval": [], "grads": []}
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        for micro in range(accumulate):
            series, target = batches[step * accumulate + micro]
            loss = (run(series) - target).square().mean() / accumulate
            loss.backward()
            record["loss"].append(loss.detach())
        record["grads"].append({n: p.grad.clone() for n, p in model.named_parameters() if n != BK})
        opt.step()
        if eval_between is not None:
            series, _ = batches[steps * accumulate + step]
            record["eval"].append(eval_between(model, run, series))
    record["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return record


def _compare(got, want, tolerance=FP32):
    for key in ("loss", "eval"):
        for i, (g, w) in enumerate(zip(got[key], want[key], strict=True)):
            assert relative_error(g, w) <= tolerance, f"{key}[{i}]: {relative_error(g, w):.3g}"
    for step, (g, w) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        for name in w:
            error = relative_error(g[name], w[name])
            assert error <= tolerance, f"step {step} ∂{name}: {error:.3g}"
    for name in want["params"]:
        error = relative_error(got["params"][name], want["params"][name])
        assert error <= tolerance, f"final {name}: {error:.3g}"


def _side_by_side(steps=3, cls=models.Forecaster, **train):
    torch._dynamo.reset()
    eager = _forecaster(cls=cls)
    mine = copy.deepcopy(eager)
    want = _train(eager, eager, steps, **train)
    with region_matches() as matches:
        got = _train(mine, torch.compile(mine, backend="mha"), steps, **train)
    return got, want, matches


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none):
    got, want, matches = _side_by_side(set_to_none=set_to_none)
    assert matches == [1]
    _compare(got, want)


def test_gradient_accumulation():
    """Three micro-batches summed into .grad before each step: the region's backward must add
    into existing gradients, not overwrite them."""
    got, want, matches = _side_by_side(accumulate=3)
    assert matches == [1]
    _compare(got, want)
    single, _, _ = _side_by_side(accumulate=1)
    assert relative_error(single["grads"][0]["block.moe.w1"], got["grads"][0]["block.moe.w1"]) > 1e-2  # it did accumulate


def _no_grad_eval(model, run, series):
    with torch.no_grad():
        return run(series)


def test_no_grad_eval_between_steps():
    got, want, matches = _side_by_side(eval_between=_no_grad_eval)
    assert matches == [1, 1], f"grad and no_grad graphs must both be rewritten, got {matches}"
    _compare(got, want)


def _eval_mode(model, run, series):
    model.eval()
    out = run(series).detach()
    model.train()
    return out


def test_model_eval_between_steps():
    got, want, matches = _side_by_side(eval_between=_eval_mode)
    assert matches and all(m == 1 for m in matches), f"every graph must be rewritten, got {matches}"
    _compare(got, want)


class CheckpointedForecaster(models.Forecaster):
    """The Forecaster with the MHA block under non-reentrant activation checkpointing."""

    def forward(self, series):
        B = series.shape[0]
        tok = self.norm(self.embed(series.transpose(1, 2)))
        ctx = self.context(series.flatten(1)).view(B, self.horizons, self.dim)
        out = checkpoint(self.block, ctx, tok, use_reentrant=False)
        return torch.einsum("bhd,hdn->bhn", out, self.head_w) + self.head_b


def test_activation_checkpointing_trains_like_eager():
    got, want, matches = _side_by_side(cls=CheckpointedForecaster)
    assert sum(matches) == 1, f"regions replaced per graph: {matches}"  # else eager against eager
    _compare(got, want)


# --- torch.autocast(bf16) -------------------------------------------------------------------
# Under CPU autocast the block sees bf16 ctx and tok (Linear and LayerNorm outputs) and fp32
# parameters. Eager runs every Linear/einsum in bf16; the region computes in fp32 from those bf16
# inputs (SPEC §4: fp32 accumulation, fp32 router) and returns bf16. Checked at SPEC's bf16 bound:
# - the region against the eager block in fp32 on the same bf16-rounded ctx and tok (SPEC §4);
# - the whole compiled model against eager autocast, outputs and every gradient.
# Rows whose top-k choice differs between the two sides are counted and reported, and left out
# of the comparison (outputs) and of the loss (gradients), never absorbed by a looser bound.
# Measured (seed 0, 128 series = 384 rows): 1 row flipped; region vs fp32 block 2.4e-3; model vs
# eager autocast 5.6e-3; the model against eager *fp32* is 3.9e-2 for both eager autocast and
# compiled autocast (the rounding is in the embed/context/head Linears, outside the region).
BF16 = 2e-2
FLIPS = 2e-2  # the share of rows whose top-k choice may flip through bf16 rounding (kernel_cases.FLIP_FRACTION)


def _region_spy(monkeypatch):
    seen = []
    right = reference.region_forward

    def spy(ctx, tok, *args):
        result = right(ctx, tok, *args)
        seen.append((ctx.detach(), tok.detach(), result[0].detach(), result[4].long()))
        return result

    monkeypatch.setattr(reference, "region_forward", spy)
    return seen


def _topk_hook(model, seen, fp32=False):
    def hook(module, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        logits = module.router(x.float()) if fp32 else module.router(x)
        seen.append(torch.topk(torch.softmax(logits.float(), dim=-1), module.top_k, dim=-1).indices)

    return model.moe.register_forward_pre_hook(hook)


def _same_choice(a, b):
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def test_autocast_bf16(monkeypatch, capsys):
    torch._dynamo.reset()
    eager = _forecaster()
    mine = copy.deepcopy(eager)
    compiled = torch.compile(mine, backend="mha")
    series, target = _batches(1, batch=128)[0]
    region = _region_spy(monkeypatch)
    chosen_e = []
    handle = _topk_hook(eager.block, chosen_e)
    with region_matches() as matches, torch.autocast("cpu", dtype=torch.bfloat16):
        out_e, out_c = eager(series), compiled(series)
    handle.remove()
    assert matches == [1] and len(region) == 1 and len(chosen_e) == 1
    ctx, tok, region_out, chosen_c = region[0]
    assert ctx.dtype == tok.dtype == region_out.dtype == torch.bfloat16

    # The region against the eager block in fp32 on the same bf16-rounded inputs.
    chosen_ref = []
    handle = _topk_hook(eager.block, chosen_ref, fp32=True)
    with torch.no_grad():
        block_ref = eager.block(ctx.float(), tok.float())
    handle.remove()
    kept = _same_choice(chosen_c, chosen_ref[0]).view(ctx.shape[0], ctx.shape[1])
    region_error = relative_error(region_out[kept], block_ref[kept])

    # The model against eager autocast; flipped rows out of the comparison and of the loss.
    same = _same_choice(chosen_c, chosen_e[0]).view(out_c.shape[0], out_c.shape[1])
    flips, ref_flips = int((~same).sum()), int((~kept).sum())
    model_error = relative_error(out_c[same], out_e[same])
    print(f"autocast bf16: rows {same.numel()}, top-k flips vs eager autocast {flips}, vs fp32 block {ref_flips}; "
          f"region vs fp32 block {region_error:.3g}; model vs eager autocast {model_error:.3g}")
    assert flips <= FLIPS * same.numel() and ref_flips <= FLIPS * same.numel(), "more flips than rounding explains"
    assert region_error <= BF16, f"region vs fp32 block on the same bf16 inputs: {region_error:.3g} > {BF16}"
    assert model_error <= BF16, f"compiled vs eager autocast: {model_error:.3g} > {BF16}"

    weight = same[..., None].float()
    for out in (out_e, out_c):
        ((out.float() - target).square() * weight).sum().div(weight.sum()).backward()
    worst = 0.0
    for (name, p_e), p_c in zip(eager.named_parameters(), mine.parameters()):
        if name == BK:
            assert torch.count_nonzero(p_c.grad) == 0
            continue
        assert torch.isfinite(p_c.grad).all() and torch.count_nonzero(p_c.grad) > 0, name
        error = relative_error(p_c.grad, p_e.grad)
        worst = max(worst, error)
        assert error <= BF16, f"∂{name} compiled vs eager autocast: {error:.3g} > {BF16}"
    print(f"autocast bf16: worst gradient error vs eager autocast {worst:.3g}")
