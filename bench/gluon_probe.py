"""The MoE backward's hidden kernel in Gluon (mha_compile/kernels/gluon_moe.py, warp-specialised:
ping-pong, and cooperative at large) against the Triton one (triton_moe._moe_bwd_hidden_kernel),
under each config.

    PYTHONPATH=. python bench/gluon_probe.py [--presets medium,large]   # H200
    PYTHONPATH=. python bench/gluon_probe.py --offline                  # no GPU: compile for sm_90a

Each row gives the median CUDA-graph time of one whole-layout call, its TFLOP/s and its error
against an fp32 reference (checked before the time means anything). Offline, each config and
activation is compiled for the H200 (sm_90a) and read with offline_sass.sass_stats: registers,
spill bytes, shared memory, wgmma and setmaxnreg counts.

History (bench/results/gluon_probe.txt): this probe began (session 9) with GEMM1 written the
same way, one [TILE, BLOCK_N] accumulator a consumer. On the H200 it lost to the Triton GEMM1
in every config (at large 975 us at best against 825: the Triton kernel's 8-warp [128, 256]
tiles already keep the tensor cores fed, and a consumer's gelu epilogue is short beside its
dots), so it left the probe; its code is in git (d713d07). The hidden kernel, with two
accumulators and a long epilogue a job, won: 1687 against 2196 us at large. Session 14 retried
GEMM1 with b1 added after its dots (both kernels' wgmmas had been serialised by ptxas, C7515):
it lost again with gelu, 988 against 825 us at large at [128, 64] and [64, 128] jobs (192de8d,
reverted). The hidden kernel with the same change: 1642 us at large, as before it.
"""
import argparse
import json

import torch
import triton

from mha_compile.kernels import gluon_moe

# The configs tried; the first is gluon_moe.CONFIGS' (every TILE's since session 15, run 10), the
# second was TILE 128's before. Runs 1-2 (the probe's own copy of the kernel): [128, 64] jobs
# 1849-1893 us at large with 456 bytes of spills a thread (offline), [64, 128] jobs 1687 with 44.
# Run 3 (gluon_moe, no spills in either): 1622 and 1681.
CONFIGS = [dict(tile_m=64, block_n=128, block_k=64, nbuf=3), dict(tile_m=128, block_n=64, block_k=64, nbuf=3),
           dict(tile_m=64, block_n=128, block_k=32, nbuf=6), dict(tile_m=64, block_n=128, block_k=32, nbuf=4)]
# The cooperative kernel's ([128, 128] jobs, two consumers on one stage's W tiles): the first is
# gluon_moe.COOP_CONFIG (TILE 128 at D ≥ COOP_MIN_D); BK 64 with 2 stages lost by ~25% (run 14).
COOP_CONFIGS = [gluon_moe.COOP_CONFIG, dict(tile_m=128, block_n=128, block_k=32, nbuf=4, coop=True)]
# KEEP_U's (triton_moe.KEEP_HIDDEN, staged in session 35): the computing kernels' configs, then more stages in
# the shared memory the stages' xs and W1 tiles left (a ping-pong stage is 24 KiB with them gone,
# a cooperative one 16: nbuf 6 and 10 take 208 and 224 KiB with the staging tiles); the third is
# gluon_moe.KEPT_CONFIG, what the kept hidden kernel runs since session 36.
KEPT_CONFIGS = [CONFIGS[0], COOP_CONFIGS[0], gluon_moe.KEPT_CONFIG, dict(COOP_CONFIGS[0], nbuf=10)]


def compile_offline(kernel, args, constexprs, num_warps=4):
    """Compile a Gluon kernel for the H200 (sm_90a) without a GPU: offline_sass.sass_stats of it.
    args: every other parameter's value (CPU tensors, descriptors on CPU tensors, ints; an int 1
    would be a constant on the GPU, so pass another)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    import offline_sass

    signature = {name: "constexpr" if name in constexprs else mangle_type(args[name]) for name in kernel.arg_names}
    values = {(i,): constexprs[name] for i, name in enumerate(kernel.arg_names) if name in constexprs}
    compiled = triton.compile(GluonASTSource(kernel, signature, values), target=offline_sass.H200.target,
                              options=dict(num_warps=num_warps))
    return offline_sass.sass_stats(compiled)


def offline_configs(act):
    """The configs --offline compiles for `act`: every one for gelu, the shipped ones for the rest."""
    if act == "swiglu":
        return [gluon_moe.SWIGLU_CONFIG]
    return CONFIGS + COOP_CONFIGS if act == "gelu" else [CONFIGS[0], COOP_CONFIGS[0]]


def offline(act="gelu", tile_m=64, block_n=128, block_k=64, nbuf=3, coop=False, kept=False):
    """compile_offline of gluon_moe's hidden kernel (the cooperative one with coop) for `act`
    under one config; kept: its KEEP_U variant (u read, not computed)."""
    E, D, F, S = 2, 2 * block_k, 2 * block_n, 256
    bf = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16)  # noqa: E731
    xs, gs, w1, w2, b1, hw, du = bf(S, D), bf(S, D), bf(E, D, F), bf(E, F, D), bf(E, F), bf(S, F), bf(S, F)
    weight, gw, index = torch.empty(S), torch.empty(S, 8), torch.empty(S, dtype=torch.int32)
    w3, du3 = (bf(E, D, F), bf(S, F)) if act == "swiglu" else (None, None)
    kernel = gluon_moe._hidden_coop_kernel if coop else gluon_moe._hidden_kernel
    tensors = gluon_moe.kernel_args(xs, gs, w1, w2, b1, weight, gw, hw, du, tile_m // 2 if coop else tile_m,
                                    block_n, block_k, w3, du3, u=bf(S, F) if kept else None)
    args = dict(zip(kernel.arg_names, tensors[:6] + tensors[8:] if coop else tensors))
    args.update(slot_pair_ptr=index, tile_expert_ptr=index, PAIRS=1000, D=D, F=F, GW_COLS=40, NUM_JOBS=1000,
                has_b1=3, TILE=128)
    return compile_offline(kernel, args, dict(ACT=gluon_moe.ACTS[act], NBUF=nbuf,
                                              CONSUMER_REGS=gluon_moe.CONSUMER_REGS,
                                              PRODUCER_REGS=gluon_moe.PRODUCER_REGS, KEEP_U=kept))


def reference(c, weight, act="gelu"):
    """fp32, expert by expert over the slot layout, 0 on padding slots: the hidden kernel's (hw,
    ∂u, gw[:, :F/64]) with `act` (not swiglu), for the flat top-k weights."""
    from mha_compile.kernels.reference import act_backward, act_forward

    groups, E, F = c.groups, c.E, c.F
    bounds = groups.expert_slots.tolist()
    valid = (groups.slot_pair < groups.pairs)[:, None]
    h = torch.zeros(c.S, F, device=c.dev, dtype=torch.float32)
    du, gw = torch.zeros_like(h), torch.zeros(c.S, F // 64, device=c.dev, dtype=torch.float32)
    for e in range(E):
        lo, hi = bounds[e], bounds[E + e]
        if hi == lo:
            continue
        u = c.xs[lo:hi].float() @ c.w1[e].float() + c.b1[e].float()
        h[lo:hi] = act_forward(act, u)
        g = c.gs[lo:hi].float() @ c.w2[e].float().t()
        du[lo:hi] = act_backward(act, g, u)[0]
        gw[lo:hi] = (h[lo:hi] * g).view(hi - lo, F // 64, 64).sum(-1)
    w = weight[groups.slot_pair.clamp(max=groups.pairs - 1).long()][:, None] * valid
    return h * w, du * w, gw * valid


def _time(name, fn, flops, err, cfg=""):
    """One row: the median CUDA-graph time of fn, its TFLOP/s and its error (checked first)."""
    try:
        error = err(fn())
        torch.cuda.synchronize()
        ms = triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
        print(f"{name:<22} {ms * 1e3:8.1f} us {flops / ms / 1e9:5.0f} TF/s  rel err {error:.1e}  {cfg}", flush=True)
    except Exception as error:  # a config that does not fit or fails: say so, keep going
        print(f"{name:<22} FAILED {type(error).__name__}: {str(error).splitlines()[0][:160]}  {cfg}", flush=True)


def probe_cli(offline_rows, probe_preset, presets="medium,large"):
    """The Gluon probes' command line. --offline (or no GPU): print each of offline_rows() (a dict
    a build) as a JSON line. On the GPU: probe_preset(case) for gemm_probe.slot_case of each of
    --presets, under a header naming the GPU and the versions."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default=presets)
    parser.add_argument("--offline", action="store_true", help="compile for sm_90a only (no GPU needed)")
    args = parser.parse_args()
    if args.offline or not torch.cuda.is_available():
        for row in offline_rows():
            print(json.dumps(row), flush=True)
        return
    from gemm_probe import slot_case

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for preset in args.presets.split(","):
        probe_preset(slot_case(preset, "gelu"))


def offline_rows():
    """The builds under every config the probe times, then the KEEP_U builds (u read, not computed)
    under KEPT_CONFIGS, each act but swiglu (rows with kept=True)."""
    for act in gluon_moe.ACTS:
        for cfg in offline_configs(act):
            yield dict(act=act, config=cfg, kept=False, **offline(act, **cfg))
    for act in ("gelu", "gelu_tanh", "silu"):
        for cfg in KEPT_CONFIGS if act == "gelu" else KEPT_CONFIGS[:2]:
            yield dict(act=act, config=cfg, kept=True, **offline(act, **cfg, kept=True))


def probe_preset(c):
    """The Triton hidden kernel, then the Gluon one under each config, on the slot case c; then
    the first two configs with gelu (tanh) and silu: what the epilogue's activation costs, and
    whether the config that suits gelu suits them."""
    from mha_compile.kernels import triton_moe as moe

    weight = c.weight.reshape(-1)
    cols = moe.gw_columns(c.D, c.F, True)
    gw = torch.zeros(c.S, cols, device=c.dev, dtype=torch.float32)
    hw, du = torch.empty(c.S, c.F, device=c.dev, dtype=c.dt), torch.empty(c.S, c.F, device=c.dev, dtype=c.dt)
    flops = 4 * c.S * c.D * c.F

    def triton_hidden():
        moe._hidden(moe.tile_grid(c.groups, c.F, "BLOCK_F"), c.xs, c.gs, c.groups.slot_pair,
                    c.groups.tile_expert, weight, c.w1, c.b1, c.w1, c.w2, hw, hw, du, du, gw,
                    c.groups.pairs, c.D, c.F, cols, HAS_B1=True, KEEP_U=False, ACT=moe.ACT_CODE["gelu"],
                    PRECISION=moe.dot_precision(c.dt), TILE=c.groups.tile, GW_BLOCK=moe.GW_BLOCK)
        return hw, du, gw[:, :c.F // 64]

    def gluon_hidden(cfg, act, hidden=None):
        gw.zero_()
        gluon_moe.backward_hidden(c.xs, c.gs, c.groups, c.w1, c.b1, c.w2, weight, act, hw, du, gw, config=cfg,
                                  hidden=hidden)
        return hw, du, gw[:, :c.F // 64]

    for act in ("gelu", "gelu_tanh", "silu"):
        want = reference(c, weight, act)
        err = lambda got: max(float((g.float() - w).norm() / w.norm()) for g, w in zip(got, want))  # noqa: E731
        if act == "gelu":
            _time("hidden triton", triton_hidden, flops, err)
        for cfg in CONFIGS + COOP_CONFIGS if act == "gelu" else CONFIGS[:2] + COOP_CONFIGS[:1]:
            _time(f"hidden gluon {act}", lambda: gluon_hidden(cfg, act), flops, err, cfg)
        # KEEP_U: u = xs W1 + b1 from the forward's GEMM1 (in bf16) read, not computed: half the
        # FLOPs, the error against the fp32 reference from u's rounding
        kept_u = torch.empty_like(hw)
        moe.experts_up(c.xs, c.groups, c.w1, c.b1, None, act, kept_u)
        for cfg in KEPT_CONFIGS if act == "gelu" else KEPT_CONFIGS[:2]:
            _time(f"hidden gluon {act} +u", lambda: gluon_hidden(cfg, act, kept_u), flops // 2, err, cfg)


if __name__ == "__main__":
    probe_cli(offline_rows, probe_preset)
