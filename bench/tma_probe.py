"""GEMM1 (`up`) with Hopper's TMA loads and stores (tensor descriptors), one program per job or
persistent, with and without its activation, against the shipped pointer-load kernel under
each of its configs: what TMA would add, and what the epilogue costs.

    PYTHONPATH=. python bench/tma_probe.py [--presets medium,large]

Each variant runs on the preset's real slot layout (bf16, gelu), timed as a CUDA-graph replay;
with the activation, its output is compared with the shipped kernel's (max abs difference), so
that a fast wrong variant shows. The same TMA kernel also times g = gs W2ᵀ (the backward's
second product, W2 read transposed, no activation). On the CPU (TRITON_INTERPRET=1) it runs
the variants at tiny sizes, untimed.
"""
import argparse

import torch
import triton
import triton.language as tl
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

from mha_compile.kernels import triton_moe as moe
from mha_compile.kernels.triton_util import act_fwd, num_sms

from gemm_probe import slot_case  # bench/, on the path when this runs as a script


@triton.jit
def _job(job, NF, slot_pair_ptr, tile_expert_ptr, PAIRS, TILE: tl.constexpr, BLOCK_F: tl.constexpr):
    """(tile, first column, slot rows, which are real, expert) of job `job`; a tile's NF jobs adjacent."""
    t = job // NF
    f0 = (job % NF) * BLOCK_F
    offs_s = t.to(tl.int64) * TILE + tl.arange(0, TILE)
    valid = tl.load(slot_pair_ptr + offs_s) < PAIRS
    e = tl.load(tile_expert_ptr + t)
    return t, f0, offs_s, valid, e


@triton.jit
def _up_tma_kernel(xs_desc, w1_desc, h_desc, b1_ptr, slot_pair_ptr, tile_expert_ptr, PAIRS, D, F, NUM_TILES,
                   ACT: tl.constexpr, PERSISTENT: tl.constexpr, TILE: tl.constexpr, BLOCK_F: tl.constexpr,
                   BLOCK_K: tl.constexpr, TRANS_B: tl.constexpr = False):
    """h = act(xs W1[e] + b1[e]) over (tile, F block) jobs, every operand through a descriptor;
    ACT -1: no activation; TRANS_B: w1_desc holds [E, F, D] (W2) and is read transposed."""
    NF = tl.cdiv(F, BLOCK_F)
    if PERSISTENT:
        start, step = tl.program_id(0), tl.num_programs(0)
    else:
        start, step = tl.program_id(0), NUM_TILES * NF
    for job in tl.range(start, NUM_TILES * NF, step, flatten=True):
        t, f0, offs_s, valid, e = _job(job, NF, slot_pair_ptr, tile_expert_ptr, PAIRS, TILE, BLOCK_F)
        acc = tl.zeros([TILE, BLOCK_F], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            a = xs_desc.load([t * TILE, k0])
            if TRANS_B:
                w = tl.trans(w1_desc.load([e, f0, k0]).reshape(BLOCK_F, BLOCK_K))
            else:
                w = w1_desc.load([e, k0, f0]).reshape(BLOCK_K, BLOCK_F)
            acc = tl.dot(a, w, acc)
        offs_f = f0 + tl.arange(0, BLOCK_F)
        acc += tl.load(b1_ptr + e * F + offs_f, mask=offs_f < F, other=0.0).to(tl.float32)[None, :]
        if ACT >= 0:
            acc = act_fwd(acc, acc, ACT)
        h = tl.where(valid[:, None], acc, 0.0)
        h_desc.store([t * TILE, f0], h.to(h_desc.dtype))


def _desc(t, block):
    return TensorDescriptor.from_tensor(t, block)


def up_tma(xs, groups, w1, b1, act_code, cfg, persistent, h, trans_b=False):
    TILE, BF, BK = groups.tile, cfg["BLOCK_F"], cfg["BLOCK_K"]
    F = w1.shape[1] if trans_b else w1.shape[2]
    jobs = groups.num_tiles * triton.cdiv(F, BF)
    grid = (min(jobs, num_sms(xs.device)),) if persistent else (jobs,)
    meta = {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages", "maxnreg")} if xs.is_cuda else {}
    _up_tma_kernel[grid](_desc(xs, [TILE, BK]), _desc(w1, [1, BF, BK] if trans_b else [1, BK, BF]),
                         _desc(h, [TILE, BF]), b1,
                         groups.slot_pair, groups.tile_expert, groups.pairs, xs.shape[1], F, groups.num_tiles,
                         ACT=act_code, PERSISTENT=persistent, TILE=TILE, BLOCK_F=BF, BLOCK_K=BK, TRANS_B=trans_b,
                         **meta)
    return h


def shipped(launcher, cfg, fn):
    saved = launcher.configs, launcher.tuned
    launcher.configs, launcher.tuned = [cfg], None
    try:
        return fn()
    finally:
        launcher.configs, launcher.tuned = saved


def probe(preset, act):
    c = slot_case(preset, act)
    dev, dt, D, F, E, S, w1, w2, b1, groups, xs, gs, code = (
        c.dev, c.dt, c.D, c.F, c.E, c.S, c.w1, c.w2, c.b1, c.groups, c.xs, c.gs, c.code)
    gemm = 2 * S * D * F

    rows = []

    def timed(what, flops, fn, check=None):
        try:
            out = fn()
            diff = None if check is None else check(out)
            ms = (triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") if dev == "cuda"
                  else float("nan"))
            rows.append(dict(variant=what, ms=ms, diff=diff))
            err = "" if diff is None else f"  Δ {diff:.2e}"
            print(f"{what:<64}{ms * 1e3:>8.1f} us {flops / ms / 1e9:>6.0f} TF/s{err}", flush=True)
        except Exception as error:  # a config that does not fit: say so, keep going
            rows.append(dict(variant=what, error=f"{type(error).__name__}: {error}"))
            print(f"{what:<64} FAILED {type(error).__name__}: {str(error).splitlines()[0][:150]}", flush=True)

    ref_h = None
    for cfg in moe._up.configs if dev == "cuda" else moe._up.configs[:1]:
        run = lambda: shipped(moe._up, cfg, lambda: moe.experts_up(xs, groups, w1, b1, None, act))  # noqa: E731
        ref_h = run().clone()
        timed(f"up shipped (pointer loads) {cfg}", gemm, run)
    h = torch.empty_like(ref_h)
    valid = (groups.slot_pair < groups.pairs)[:, None]  # the shipped GEMM1 leaves act(b1) on padding rows
    # act -1: no activation (bias and padding rows only), to show what the epilogue costs
    configs = ([dict(BLOCK_F=bf, BLOCK_K=bk, num_warps=w, num_stages=st)
                for bf, bk, w, st in ((128, 64, 8, 4), (256, 64, 8, 3), (128, 128, 8, 3))]
               if dev == "cuda" else [dict(BLOCK_F=32, BLOCK_K=32)])
    for cfg in configs:
        for persistent in (False, True):
            for a in (code, -1):
                timed(f"up tma persistent={persistent:d} act={a} {cfg}", gemm,
                      lambda: up_tma(xs, groups, w1, b1, a, cfg, persistent, h),
                      (lambda out: ((out.float() - ref_h.float()) * valid).abs().max().item()) if a == code else None)

    # the same kernel on the hidden kernel's g = gs W2ᵀ (W2[e] read transposed), no activation
    zero_bias = torch.zeros(E, F, device=dev, dtype=dt)
    tiles = range(min(4, groups.num_tiles))  # checked on a few tiles: a full [S,F,D] reference is too big
    ref_g = torch.cat([gs[t * groups.tile:(t + 1) * groups.tile].float()
                       @ w2[int(groups.tile_expert[t])].float().t() for t in tiles])
    for cfg in configs[:3]:
        timed(f"g = gs W2ᵀ tma persistent {cfg}", gemm,
              lambda: up_tma(gs, groups, w2, zero_bias, -1, cfg, True, h, trans_b=True),
              lambda out: (out[:len(tiles) * groups.tile].float() - ref_g).abs().max().item())

    if dev == "cuda":
        ms = triton.testing.do_bench_cudagraph(lambda: torch.mm(xs, w1[0]), rep=60, return_mode="median")
        print(f"{'cublas S×D·D×F':<64}{ms * 1e3:>8.1f} us {gemm / ms / 1e9:>6.0f} TF/s", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="medium,large")
    parser.add_argument("--act", default="gelu")
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (TRITON_INTERPRET=1, no times)"
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}")
    for preset in args.presets.split(","):
        probe(preset, args.act)


if __name__ == "__main__":
    main()
