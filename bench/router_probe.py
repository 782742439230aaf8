"""The router kernels alone: the forward's (triton_router._router_fwd_kernel) under each row block
and warp count, and the router and combine backward (_router_combine_bwd_kernel) under each D
block and warp count: what their times a step are set by.

    PYTHONPATH=. python bench/router_probe.py [--presets medium,large]   # H200

The backward: one program a batch row (H rows): the router's logits again, ∂w from the hidden
kernel's partial sums, ∂logits, then ∂y = ∂logits Wg + Σ_j ∂x_slot over D blocks. On the H200
(bench/results/router_probe.txt) it took 256 us at large at 2 warps, the autotuner's pick then,
for ~300 MB of traffic (~70 us at 4.3 TB/s); one warp a program took 167 and is now the first
config. The forward router: 76 us at 32 rows and 4 warps, 46 at 64 rows (now first).
Each row: the median CUDA-graph time, the traffic's rate, registers and spills, and how far the
result is from the shipped config's: the experts chosen must be the same; ∂y (bf16) may differ
by one rounding where its fp32 sums ran in another order (~2e-3 of the largest at most),
∂inv and ∂logits by ~1e-7.
"""
import argparse

import torch
import triton
import triton.testing

from gemm_probe import variant
from mha_compile import models
from mha_compile.kernels import triton_moe, triton_router

CONFIGS = [dict(num_warps=w, num_stages=3) for w in (1, 2, 4, 8)]
BLOCKS_D = (16, 32, 64, 128)
ROUTE_CONFIGS = [dict(BLOCK_R=r, num_warps=w, num_stages=3) for r in (16, 32, 64, 128) for w in (1, 2, 4, 8)]


def case(preset, dt=torch.bfloat16, dev="cuda"):
    """(router_combine_backward's arguments, their traffic in bytes) at a preset: random tokens
    routed by the router kernel (renorm), grouped; ∂x_slot and the ∂w partial sums random, zero
    on padding slots."""
    p = models.PRESETS[preset]
    B, H, D, F, E, k = p["B"], p["H"], p["D"], p["F"], p["E"], p["k"]
    g = torch.Generator(device=dev).manual_seed(0)
    rand = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    x, inv, wg = rand(B * H, D).to(dt), rand(B, D), (rand(E, D) * D ** -0.5).to(dt)
    weight, index = triton_router.route(x, inv, wg, k, True, H)
    groups = triton_moe.group(index, E)
    valid = (groups.slot_pair < groups.pairs)[:, None]
    dx_slot = (rand(groups.slots, D) * valid).to(dt)
    gw_part = rand(groups.slots, triton_moe.gw_columns(D, F, True)) * valid
    traffic = (2 * x.numel() + dx_slot.numel()) * x.element_size() + 4 * (gw_part.numel() + B * D + B * H * E)
    print(f"\n{preset}: R={B * H}, D={D}, E={E}, k={k}, S={groups.slots}; traffic {traffic / 1e6:.0f} MB", flush=True)
    return (x, inv, wg, weight, index, groups.pair_slot, dx_slot, gw_part, H, True, dt), traffic


def route(x, inv, wg, top_k, horizons):
    """The forward's router under each ROUTE_CONFIGS: time, rate over x's and inv's bytes, and
    whether the experts chosen and the weights are the shipped config's."""
    want_w, want_i = triton_router.route(x, inv, wg, top_k, True, horizons)
    traffic = x.numel() * x.element_size() + 4 * inv.numel() + 8 * want_w.numel()
    for cfg in ROUTE_CONFIGS:
        try:
            got = []
            ms, compiled = variant(triton_router._route, cfg, lambda: got.append(
                triton_router.route(x, inv, wg, top_k, True, horizons)))
            weight, index = got[-1]
            print(f"route BLOCK_R {cfg['BLOCK_R']:>3} warps {cfg['num_warps']}  {ms * 1e3:7.1f} us "
                  f"{traffic / ms / 1e9:5.2f} TB/s  regs {compiled.n_regs} spills {compiled.n_spills}  "
                  f"same experts {bool((index == want_i).all())}, weights max diff "
                  f"{float((weight - want_w).abs().max()):.1e}", flush=True)
        except Exception as error:  # a config that does not build or fit: say so, keep going
            print(f"route BLOCK_R {cfg['BLOCK_R']:>3} warps {cfg['num_warps']}  FAILED {type(error).__name__}: "
                  f"{str(error).splitlines()[0][:160]}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="medium,large")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    launcher = triton_router._combine_bwd
    for preset in args.presets.split(","):
        inputs, traffic = case(preset)
        route(*inputs[:3], inputs[4].shape[1], inputs[8])
        want = triton_router.router_combine_backward(*inputs)
        for block_d in BLOCKS_D:
            for cfg in CONFIGS:
                try:
                    got = []
                    ms, compiled = variant(launcher, cfg, lambda: got.append(
                        triton_router.router_combine_backward(*inputs, block_d=block_d)))
                    diff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                               for a, b in zip(got[-1], want))
                    print(f"BLOCK_D {block_d:>3} warps {cfg['num_warps']}  {ms * 1e3:7.1f} us "
                          f"{traffic / ms / 1e9:5.2f} TB/s  regs {compiled.n_regs} spills {compiled.n_spills}"
                          f"  max diff {diff:.1e}", flush=True)
                except Exception as error:  # a config that does not build or fit: say so, keep going
                    print(f"BLOCK_D {block_d:>3} warps {cfg['num_warps']}  FAILED {type(error).__name__}: "
                          f"{str(error).splitlines()[0][:160]}", flush=True)


if __name__ == "__main__":
    main()
