"""The router kernels alone: the forward's (triton_router._router_fwd_kernel) under each row block
and warp count, and the backward's two passes (∂logits by blocks of rows, then ∂y by batch row and
D block) under each config of either kernel: what their times a step are set by.

    PYTHONPATH=. python bench/router_probe.py [--presets medium,large]   # H200

The forward router: 76 us at 32 rows and 4 warps, 46 at 64 rows (now first). The backward was one
program a batch row (H rows) until session 24: 167.8 us at large at its best (one warp), against
145 for the two passes (bench/results/router_probe.txt).
Each row: the median CUDA-graph time, the traffic's rate, registers and spills, and how far the
result is from the shipped config's: the experts chosen must be the same; ∂y (bf16) may differ
by one rounding where its fp32 sums ran in another order (~2e-3 of the largest at most),
∂inv and ∂logits by ~1e-7.
"""
import argparse
from types import SimpleNamespace

import torch
import triton
import triton.testing

from gemm_probe import variant
from mha_compile import models
from mha_compile.kernels import triton_moe, triton_router

ROUTE_CONFIGS = [dict(BLOCK_R=r, num_warps=w, num_stages=3) for r in (16, 32, 64, 128) for w in (1, 2, 4, 8)]


def routing(preset, dt=torch.bfloat16, dev="cuda"):
    """A preset's routed tokens: random x [R,D], inv [B,D] and Wg routed by the router kernel
    (renorm) and grouped (triton_moe.group); with the preset's sizes and the seeded `rand` that
    drew them, for the inputs built after."""
    p = models.PRESETS[preset]
    B, H, D, E, k = p["B"], p["H"], p["D"], p["E"], p["k"]
    g = torch.Generator(device=dev).manual_seed(0)
    rand = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    x, inv, wg = rand(B * H, D).to(dt), rand(B, D), (rand(E, D) * D ** -0.5).to(dt)
    weight, index, probs = triton_router.route(x, inv, wg, k, True, H)
    return SimpleNamespace(p=p, rand=rand, x=x, inv=inv, wg=wg, weight=weight, index=index, probs=probs,
                           groups=triton_moe.group(index, E))


def case(preset, dt=torch.bfloat16, dev="cuda"):
    """(router_combine_backward's arguments, their traffic in bytes) at a preset: the routed
    tokens of `routing`; ∂x_slot and the ∂w partial sums random, zero on padding slots."""
    r = routing(preset, dt, dev)
    B, H, D, F, E, k = (r.p[n] for n in ("B", "H", "D", "F", "E", "k"))
    x, groups, rand = r.x, r.groups, r.rand
    valid = (groups.slot_pair < groups.pairs)[:, None]
    dx_slot = (rand(groups.slots, D) * valid).to(dt)
    gw_part = rand(groups.slots, triton_moe.gw_columns(D, F, True)) * valid
    # ∂x_slot in, ∂y out; π and ∂logits, the ∂w partials, ∂inv
    traffic = (x.numel() + dx_slot.numel()) * x.element_size() + 4 * (gw_part.numel() + B * D + 2 * B * H * E)
    print(f"\n{preset}: R={B * H}, D={D}, E={E}, k={k}, S={groups.slots}; traffic {traffic / 1e6:.0f} MB", flush=True)
    inputs = (r.probs, r.wg, r.weight, r.index, groups.pair_slot, dx_slot, gw_part, H, True, dt,
              triton_router.router_precision(dt), True)
    return SimpleNamespace(x=x, inv=r.inv, wg=r.wg, index=r.index, horizons=H), inputs, traffic


def row(label, launcher, cfg, run, traffic, compare):
    """One printed row: run() (which returns the kernel's outputs) under launcher's config cfg, timed
    by gemm_probe.variant, with the traffic's rate and compare(outputs), a phrase; or why it
    failed (a config that does not build or fit: the probe goes on). Returns the median time in
    ms: nan where it failed, or off the GPU (the interpreter runs it once, nothing is timed).
    Only the last call's outputs are kept: the timing's CUDA graph replays thousands of calls."""
    try:
        last = []

        def call():
            last[:] = [run()]
        ms, compiled = variant(launcher, cfg, call)
        print(f"{label}  {ms * 1e3:7.1f} us {traffic / ms / 1e9:5.2f} TB/s  regs {getattr(compiled, 'n_regs', '-')} "
              f"spills {getattr(compiled, 'n_spills', '-')}  {compare(last[0])}", flush=True)
        return ms
    except Exception as error:  # noqa: BLE001 - any failure is the row's result
        print(f"{label}  FAILED {type(error).__name__}: {str(error).splitlines()[0][:160]}", flush=True)
        return float("nan")


def route(x, inv, wg, top_k, horizons):
    """The forward's router under each ROUTE_CONFIGS: time, rate over x's and inv's bytes, and
    whether the experts chosen and the weights are the shipped config's."""
    want_w, want_i, probs = triton_router.route(x, inv, wg, top_k, True, horizons)
    traffic = x.numel() * x.element_size() + 4 * (inv.numel() + 2 * want_w.numel() + probs.numel())
    compare = lambda got: (f"same experts {bool((got[1] == want_i).all())}, weights max diff "  # noqa: E731
                           f"{float((got[0] - want_w).abs().max()):.1e}")
    for cfg in ROUTE_CONFIGS:
        row(f"route BLOCK_R {cfg['BLOCK_R']:>3} warps {cfg['num_warps']}", triton_router._route, cfg,
            lambda: triton_router.route(x, inv, wg, top_k, True, horizons), traffic, compare)


def _max_diff(want):
    """compare() for row: the largest difference of the outputs from want's (relative to their
    largest value)."""
    return lambda got: "max diff {:.1e}".format(max(
        float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, want)))


def backward(inputs, traffic):
    """The backward's two passes under each config of its ∂logits kernel, then of its ∂y kernel, the
    other at the autotuner's pick: the whole call's time, its rate over `traffic` bytes (∂x_slot
    and ∂y once, π, the ∂w partials, ∂inv and ∂logits; the passes also write and read ∂logits), and
    the largest difference from the outputs at the first configs (the interpreter's)."""
    want = triton_router.router_combine_backward(*inputs)
    compare = _max_diff(want)
    for name, launcher in (("dlogits", triton_router._dlogits), ("dy", triton_router._combine_dy)):
        for cfg in launcher.configs:
            label = " ".join(f"{k}={v}" for k, v in cfg.items() if k != "num_stages")
            row(f"backward {name:<7} {label:<28}", launcher, cfg,
                lambda: triton_router.router_combine_backward(*inputs), traffic, compare)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="medium,large")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for preset in args.presets.split(","):
        c, inputs, traffic = case(preset)
        route(c.x, c.inv, c.wg, c.index.shape[1], c.horizons)
        backward(inputs, traffic)


if __name__ == "__main__":
    main()
