"""Each grouped GEMM of the MoE, alone, under every config and flag variant: what limits it.

    PYTHONPATH=. python bench/gemm_probe.py [--presets medium,large] [--act gelu] [--out probe.json]

For the MoE kernels of triton_moe (GEMM1 `up`, GEMM2 and ∂x `slots_gemm`, the backward's
`hidden`, the weight gradients `wgrad`) on the real slot layout of a preset (bf16, random
routing with the preset's R·k pairs), each config of the kernel's list (and a few more) is
launched alone and timed as a CUDA-graph replay (triton.testing.do_bench_cudagraph: no host
time in it). Per variant: ms, TFLOP/s of the work done (padding slots included), registers,
spills, shared memory, and whether Triton emitted Hopper's wgmma (`warp_group_dot` in the
TTGIR) and asynchronous copies. cuBLAS on a dense GEMM of the same shape (torch.mm) is the
yardstick. A variant that fails prints its error and the probe goes on.
"""
import argparse
import json
from types import SimpleNamespace

import torch
import triton
import triton.testing

from mha_compile import models
from mha_compile.kernels import gluon_moe
from mha_compile.kernels import triton_moe as moe


class _Recorder:
    """Stands in for a @triton.jit kernel inside a Launcher: launches it, keeps the compiled kernel."""

    def __init__(self, kernel):
        self.kernel, self.last = kernel, None

    def warmup(self, *args, **kwargs):  # a Launcher's builds (fits, its first config that fits)
        return self.kernel.warmup(*args, **kwargs)

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def call(*args, **kwargs):
            self.last = run(*args, **kwargs)
            return self.last
        return call


def variant(launcher, config, fn):
    """Runs fn with `launcher` forced to `config`; returns (ms, compiled kernel). gluon_moe is
    switched off meanwhile (as MHA_COMPILE_GLUON=0): on the H200 triton_moe's GEMM2 and
    weight-gradient entries would otherwise run its kernels, not the config asked for."""
    saved = launcher.kernel, launcher.configs, launcher.tuned
    launcher.kernel, launcher.configs, launcher.tuned = _Recorder(saved[0]), [config], None
    # A Launcher launches the config it chose before for a call it met before (its _chosen, keyed
    # by the kernel's id among the rest): a recorder freed after one variant can come back at the
    # same id in the next, which would then time the config before's. A fresh cache a variant.
    chosen = getattr(launcher, "_chosen", None)
    if chosen is not None:
        launcher._chosen = {}
    enabled, gluon_moe.ENABLED = gluon_moe.ENABLED, False
    try:
        fn()
        compiled = launcher.kernel.last
        if not torch.cuda.is_available():  # --dry on the CPU: the interpreter runs it, nothing to time
            return float("nan"), None
        torch.cuda.synchronize()
        ms = triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
    finally:
        launcher.kernel, launcher.configs, launcher.tuned = saved
        if chosen is not None:
            launcher._chosen = chosen
        gluon_moe.ENABLED = enabled
    return ms, compiled


def describe(compiled):
    if compiled is None:
        return dict(regs=None, spills=None, smem=None, wgmma=None, wgmma_wait=None, async_copy=None, tma=None,
                    local_load=None)
    ttgir = compiled.asm.get("ttgir", "")
    return dict(regs=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None),
                smem=compiled.metadata.shared, wgmma=ttgir.count("warp_group_dot ") + ttgir.count("warp_group_dot\""),
                wgmma_wait=ttgir.count("warp_group_dot_wait"), async_copy=ttgir.count("async_copy_global_to_local"),
                tma=ttgir.count("async_tma_copy"), local_load=ttgir.count("local_load"))


def extra(configs, *more):
    return list(configs) + [m for m in more if m not in configs]


def slot_case(preset, act):
    """The preset's slot layout with random routing (R·k pairs, two distinct experts a row),
    weights and gathered slot rows, bf16 on the GPU (fp32 on the CPU); printed as a header."""
    p = models.PRESETS[preset]
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    B, H, D, F, E, k = p["B"], p["H"], p["D"], p["F"], p["E"], p["k"]
    R = B * H
    x = torch.randn(R, D, device=dev, dtype=dt)
    G = torch.randn(R, D, device=dev, dtype=dt)
    index = torch.randint(0, E, (R, k), device=dev, dtype=torch.int32)
    index[:, 1] = (index[:, 0] + 1 + torch.randint(0, E - 1, (R,), device=dev, dtype=torch.int32)) % E
    weight = torch.rand(R, k, device=dev, dtype=torch.float32)
    w1 = torch.randn(E, D, F, device=dev, dtype=dt) * D ** -0.5
    w2 = torch.randn(E, F, D, device=dev, dtype=dt) * F ** -0.5
    b1 = torch.randn(E, F, device=dev, dtype=dt) * 0.1
    b2 = torch.randn(E, D, device=dev, dtype=dt) * 0.1
    groups = moe.group(index, E)
    xs, gs, _ = moe.gather_rows(x, None, groups, H, dt, G)
    print(f"\n{preset}: S={groups.slots} slots (TILE {groups.tile}), D={D}, F={F}, E={E}, act {act}", flush=True)
    return SimpleNamespace(dev=dev, dt=dt, D=D, F=F, E=E, S=groups.slots, weight=weight, w1=w1, w2=w2,
                           b1=b1, b2=b2, groups=groups, xs=xs, gs=gs, code=moe.ACT_CODE[act])


def probe(preset, act, rows_out, kernels):
    c = slot_case(preset, act)
    dev, dt, D, F, S, weight, w1, w2, b1, b2, groups, xs, gs, code = (
        c.dev, c.dt, c.D, c.F, c.S, c.weight, c.w1, c.w2, c.b1, c.b2, c.groups, c.xs, c.gs, c.code)
    h = moe.experts_up(xs, groups, w1, b1, None, act)
    # u = xs W1 + b1 as the forward keeps it (moe.KEEP_HIDDEN), for the hidden kernel's variant
    # that reads it: written by the Triton GEMM1, which also writes h
    kept_u = torch.empty_like(h)
    moe.experts_up(xs, groups, w1, b1, None, act, kept_u)
    hw = torch.randn_like(h)
    du = torch.randn_like(h)
    gw = torch.empty(S, moe.gw_columns(D, F, True), device=dev, dtype=torch.float32)
    gemm = 2 * S * D * F

    def report(kernel, what, cfg, flops, fn, launcher, read_bytes=0):
        if kernel not in kernels:
            return
        row = dict(preset=preset, kernel=kernel, variant=what, config=cfg)
        try:
            ms, compiled = variant(launcher, cfg, fn)
            row.update(ms=ms, tflops=flops / ms / 1e9, **describe(compiled))
            rate = f"{row['tflops']:>6.0f} TF/s" if flops else f"{read_bytes / ms / 1e9:>6.2f} TB/s"
            print(f"{kernel:<10}{what:<14}{ms * 1e3:>8.1f} us {rate}  regs {row['regs']} "
                  f"spills {row['spills']} smem {row['smem']} wgmma {row['wgmma']} async {row['async_copy']} "
                  f"local_load {row['local_load']}  {cfg}", flush=True)
        except Exception as error:  # a config that does not fit: say so, keep going
            row.update(error=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
            print(f"{kernel:<10}{what:<14} FAILED {row['error']}  {cfg}", flush=True)
        rows_out.append(row)

    up_more = [dict(BLOCK_F=256, BLOCK_K=64, num_warps=8, num_stages=3),
               dict(BLOCK_F=128, BLOCK_K=128, num_warps=8, num_stages=3),
               dict(BLOCK_F=128, BLOCK_K=64, num_warps=4, num_stages=3),
               # session 18: with the fast activations [128, 256] takes 169 registers, not 254
               dict(BLOCK_F=256, BLOCK_K=32, num_warps=8, num_stages=4),
               dict(BLOCK_F=256, BLOCK_K=32, num_warps=8, num_stages=5),
               dict(BLOCK_F=256, BLOCK_K=64, num_warps=8, num_stages=2),
               # two persistent programs an SM (one's dots beside the other's epilogue): lost at
               # 254 registers (926-936 against 833 us, 8481635); at 168 registers (session 19)
               # BLOCK_K 32 with 4 stages won at medium and joined _up's list
               dict(BLOCK_F=128, BLOCK_K=32, num_warps=4, num_stages=4, SM_PROGRAMS=2),
               dict(BLOCK_F=128, BLOCK_K=64, num_warps=4, num_stages=2, SM_PROGRAMS=2),
               dict(BLOCK_F=64, BLOCK_K=64, num_warps=4, num_stages=4, SM_PROGRAMS=2)]
    for cfg in extra(moe._up.configs, *up_more):
        report("up", "gemm1", cfg, gemm, lambda: moe.experts_up(xs, groups, w1, b1, None, act), moe._up)
        report("up", "gemm1 +u", cfg, gemm, lambda: moe.experts_up(xs, groups, w1, b1, None, act, kept_u), moe._up)
    if "up_gluon" in kernels:
        gluon_up(preset, c, act, h, rows_out, kept_u)

    gemm_more = [dict(BLOCK_N=128, BLOCK_K=128, N_INNER=False, num_warps=8, num_stages=3),
                 dict(BLOCK_N=128, BLOCK_K=64, N_INNER=False, num_warps=8, num_stages=3)]
    for cfg in extra(moe._slots_gemm.configs, *gemm_more):
        report("slots", "gemm2", cfg, gemm,
               lambda: moe.slots_gemm(h, w2, (F * D, D, 1), D, groups, bias=b2, scale=weight.reshape(-1)),
               moe._slots_gemm)
        report("slots", "dx", cfg, gemm, lambda: moe.slots_gemm(du, w1, (D * F, 1, F), D, groups), moe._slots_gemm)

    def hidden(has_b1, kept=False):
        return lambda: moe._hidden(
            moe.tile_grid(groups, F, "BLOCK_F"), xs, gs, groups.slot_pair,
            groups.tile_expert, weight, w1, b1, w1, w2, kept_u if kept else hw, hw, du, du, gw,
            groups.pairs, D, F, gw.shape[1], HAS_B1=has_b1, KEEP_U=kept, ACT=code,
            PRECISION=moe.dot_precision(dt), TILE=groups.tile, GW_BLOCK=moe.GW_BLOCK)
    # the 2-D order (N_INNER False), out of the shipped list, kept here as the yardstick
    hidden_more = [dict(BLOCK_F=128, BLOCK_K=64, TWO_LOOPS=False, N_INNER=False, num_warps=8, num_stages=3),
                   dict(BLOCK_F=128, BLOCK_K=32, TWO_LOOPS=False, N_INNER=True, num_warps=4, num_stages=4)]
    for cfg in extra(moe._hidden.configs, *hidden_more):
        report("hidden", "b1", cfg, 2 * gemm, hidden(True), moe._hidden)
        report("hidden", "no-b1", cfg, 2 * gemm, hidden(False), moe._hidden)
        report("hidden", "kept u", cfg, gemm, hidden(True, True), moe._hidden)
    # ∂b1's per-tile sums of ∂u, which the hidden kernel's epilogue no longer takes (b1 above
    # is u's bias alone): a memory-bound read of ∂u.
    for cfg in moe._tile_sums.configs:
        report("hidden", "db1 sums", cfg, 0, lambda: moe.tile_sums(du, groups), moe._tile_sums,
               read_bytes=du.numel() * du.element_size())

    wgrad_more = [dict(BLOCK_I=128, BLOCK_J=128, BLOCK_S=64, num_warps=4, num_stages=3),
                  dict(BLOCK_I=256, BLOCK_J=128, BLOCK_S=64, num_warps=8, num_stages=3),
                  dict(BLOCK_I=128, BLOCK_J=256, BLOCK_S=32, num_warps=8, num_stages=4)]
    for cfg in extra(moe._wgrad.configs, *wgrad_more):
        report("wgrad", "dW1", cfg, gemm, lambda: moe.weight_grads(xs, du, None, groups), moe._wgrad)
        report("wgrad", "dW2", cfg, gemm, lambda: moe.weight_grads(hw, gs, None, groups), moe._wgrad)

    # cuBLAS on dense GEMMs of the same extents (the yardstick).
    if dev == "cpu":
        return
    for what, a, b in (("S×D·D×F", xs, w1[0]), ("S×F·F×D", h, w2[0]), ("D×S·S×F", xs.t(), du)):
        ms = triton.testing.do_bench_cudagraph(lambda: torch.mm(a, b), rep=60, return_mode="median")
        rows_out.append(dict(preset=preset, kernel="cublas", variant=what, ms=ms, tflops=gemm / ms / 1e9))
        print(f"{'cublas':<10}{what:<14}{ms * 1e3:>8.1f} us {gemm / ms / 1e9:>6.0f} TF/s", flush=True)


# gluon_moe's GEMM1 (GLUON_UP), its jobs' columns in two halves: [128, 128] jobs take 128
# accumulator registers a thread and spill none, [64, 256] 16 bytes with gelu (offline, sm_90a,
# session 33). The first is UP_CONFIGS[128], the fourth UP_CONFIGS[64]; a config that does not
# tile the layout (gluon_moe.up_config_fits: tile_m over TILE, say) is skipped. stage_tiles=2: two
# staging tiles a consumer, a job's h written while the job before's store is in flight (Nsight
# Compute at medium, session 35: a third of the kernel's stalls at CTA barriers, its epilogue's),
# for one stage of the ring (224 KiB of shared memory); staged in session 35, not yet timed.
GLUON_UP_CONFIGS = [dict(tile_m=128, block_n=128, block_k=64, nbuf=4), dict(tile_m=64, block_n=256, block_k=64, nbuf=3),
                    dict(tile_m=128, block_n=64, block_k=64, nbuf=4), dict(tile_m=64, block_n=128, block_k=64, nbuf=4),
                    dict(tile_m=128, block_n=128, block_k=32, nbuf=6),
                    dict(tile_m=128, block_n=128, block_k=64, nbuf=3, stage_tiles=2),
                    dict(tile_m=64, block_n=128, block_k=64, nbuf=4, stage_tiles=2)]


def gluon_up(preset, c, act, h_triton, rows_out, u_triton):
    """gluon_moe.experts_up under each GLUON_UP_CONFIGS entry (TILE 128's row split where tile_m is
    64), checked against the Triton GEMM1's h (same inputs; both fp32-accumulated, bf16 out) before
    it is timed; the Triton kernel's autotuned call is timed beside it. Then the shipped config with
    KEEP_U (u = xs W1 + b1 written too, moe.KEEP_HIDDEN), h and u checked against the Triton
    GEMM1's (u_triton)."""
    if c.dev != "cuda":
        print("up_gluon: needs the H200 (Gluon has no interpreter)", flush=True)
        return
    why = gluon_moe.up_unsupported(c.xs, c.w1, h_triton, act, c.groups.tile)
    if why is not None:
        print(f"up_gluon: {why}", flush=True)
        return
    gemm = 2 * c.S * c.D * c.F
    ms = triton.testing.do_bench_cudagraph(lambda: moe.experts_up(c.xs, c.groups, c.w1, c.b1, None, act), rep=60,
                                           return_mode="median")
    print(f"{'up':<10}{'triton':<14}{ms * 1e3:>8.1f} us {gemm / ms / 1e9:>6.0f} TF/s  (autotuned)", flush=True)
    rows_out.append(dict(preset=preset, kernel="up_gluon", variant="triton", ms=ms, tflops=gemm / ms / 1e9))

    def timed(variant, cfg, hidden=None):
        """One Gluon GEMM1 row: run once, check h (and u with hidden) against the Triton GEMM1's,
        then time it; a config that does not fit or is wrong is said so, and the probe goes on."""
        row = dict(preset=preset, kernel="up_gluon", variant=variant, config=cfg)
        try:
            h = torch.empty_like(h_triton)
            run = lambda: gluon_moe.experts_up(c.xs, c.groups, c.w1, c.b1, act, h, cfg, hidden=hidden)  # noqa: E731
            run()
            torch.cuda.synchronize()
            pairs = ((h, h_triton),) if hidden is None else ((h, h_triton), (hidden, u_triton))
            err = max(float((got.float() - w.float()).norm() / w.float().norm()) for got, w in pairs)
            row.update(err=err)
            if not err < 2e-2:
                raise AssertionError(f"differs from the Triton GEMM1's: relative error {err:.2e}")
            ms = triton.testing.do_bench_cudagraph(run, rep=60, return_mode="median")
            row.update(ms=ms, tflops=gemm / ms / 1e9)
            print(f"{'up':<10}{variant:<14}{ms * 1e3:>8.1f} us {gemm / ms / 1e9:>6.0f} TF/s  err {err:.1e}  {cfg}",
                  flush=True)
        except Exception as error:  # noqa: BLE001 - a config that does not fit or is wrong: say so, keep going
            row.update(error=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
            print(f"{'up':<10}{variant:<14} FAILED {row['error']}  {cfg}", flush=True)
        rows_out.append(row)

    for cfg in GLUON_UP_CONFIGS:
        if not gluon_moe.up_config_fits(cfg, c.groups.tile, c.D, c.F):
            print(f"{'up':<10}{'gluon':<14} skipped: does not tile TILE {c.groups.tile}, D={c.D}, F={c.F}  {cfg}",
                  flush=True)
            continue
        timed("gluon", cfg)
    timed("gluon +u", gluon_moe.UP_CONFIGS[c.groups.tile], torch.empty_like(h_triton))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="medium,large")
    parser.add_argument("--act", default="gelu")
    parser.add_argument("--kernels", default="up,slots,hidden,wgrad",
                        help="comma list of the kernels to probe (and up_gluon: gluon_moe's GEMM1 under each of its configs)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (TRITON_INTERPRET=1, no times)"
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}")
    rows = []
    gluon_moe.GLUON_UP = False  # experts_up is the Triton GEMM1 here: the yardstick up_gluon compares with
    for preset in args.presets.split(","):
        probe(preset, args.act, rows, args.kernels.split(","))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
