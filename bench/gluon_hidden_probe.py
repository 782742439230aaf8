"""The backward's hidden kernel as a warp-specialised ping-pong kernel in Gluon, against the shipped
Triton kernel (triton_moe._moe_bwd_hidden_kernel, 2.14 ms of a large step): the second half of
the lever bench/gluon_up_probe.py opens (its docstring says why; PERF_NOTES v12).

    PYTHONPATH=. python bench/gluon_hidden_probe.py [--presets medium,large]    # on the H200
    PYTHONPATH=. python bench/gluon_hidden_probe.py --offline                   # no GPU: sm_90a

Per (tile t, F block n) job, expert e, slots s of the tile:
    u = xs[s] W1[e] + b1[e],  g = gs[s] W2[e]ᵀ      (two accumulators [TILE, BLOCK_N])
    hw = w · gelu(u),  ∂u = w · g · gelu′(u)        (bf16 [S,F], 0 on padding slots)
    gw[s, n] = Σ_f gelu(u) g over the block           (fp32, the ∂w partials; BLOCK_N = GW_BLOCK)
A producer warp loads xs, gs [TILE, BLOCK_K] and W1 [BLOCK_K, BLOCK_N], W2 [BLOCK_N, BLOCK_K]
(read as [E·F, D] and fed to the wgmma transposed) into a ring; two consumer warpgroups take
the jobs in turn, passing a turn so their K loops run one at a time (gluon_up_probe.py).
Limits: gelu (erf), bf16, D a multiple of BLOCK_K, F of BLOCK_N, BLOCK_N = GW_BLOCK (64).

Status (session 9): written and compiled for sm_90a without a GPU; NOT YET RUN on a GPU. Its
first run checks every output against the fp32 reference before its time means anything.
"""
import argparse
import json

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait

from gluon_up_probe import _job, compile_offline, descriptor


# Every partition takes (descs, bufs, bars, ptrs, sizes), as in gluon_up_probe.py: descs = (xs,
# gs, W1 as [E·D, F], W2 as [E·F, D], hw, ∂u); bufs = (xs, gs, W1, W2 rings; hw and ∂u staging, two
# each); bars = (ready, empty, turn); ptrs = (b1, weight, gw, slot_pair, tile_expert); sizes =
# (PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1).


@gluon.jit
def _producer(descs, bufs, bars, ptrs, sizes):
    xs_desc, gs_desc, w1_desc, w2_desc, hw_desc, du_desc = descs
    xs_bufs, gs_bufs, w1_bufs, w2_bufs, hw_bufs, du_bufs = bufs
    ready, empty, turn = bars
    b1_ptr, weight_ptr, gw_ptr, slot_pair_ptr, tile_expert_ptr = ptrs
    PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1 = sizes
    TILE: gl.constexpr = xs_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = xs_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w1_desc.block_type.shape[1]
    NBUF: gl.constexpr = xs_bufs.type.shape[0]
    nbytes: gl.constexpr = (xs_desc.block_type.nbytes + gs_desc.block_type.nbytes + w1_desc.block_type.nbytes
                            + w2_desc.block_type.nbytes)
    ksteps = gl.cdiv(D, BLOCK_K)
    pos = 0
    for job in range(gl.program_id(0), NUM_JOBS, gl.num_programs(0)):
        t, n = _job(job, F, BLOCK_N)
        e = gl.load(tile_expert_ptr + t)
        for k in range(ksteps):
            stage = pos % NBUF
            mbarrier.wait(empty.index(stage), ((pos // NBUF) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(xs_desc, [t * TILE, k * BLOCK_K], bar, xs_bufs.index(stage))
            tma.async_copy_global_to_shared(gs_desc, [t * TILE, k * BLOCK_K], bar, gs_bufs.index(stage))
            tma.async_copy_global_to_shared(w1_desc, [e * D + k * BLOCK_K, n * BLOCK_N], bar, w1_bufs.index(stage))
            tma.async_copy_global_to_shared(w2_desc, [e * F + n * BLOCK_N, k * BLOCK_K], bar, w2_bufs.index(stage))
            pos += 1


@gluon.jit
def _consumer_odd(descs, bufs, bars, ptrs, sizes):
    _consumer(descs, bufs, bars, ptrs, sizes, 1)


@gluon.jit
def _consumer(descs, bufs, bars, ptrs, sizes, which: gl.constexpr):
    """Jobs i of this program with i % 2 == which: both GEMMs over the ring, then the epilogue."""
    xs_desc, gs_desc, w1_desc, w2_desc, hw_desc, du_desc = descs
    xs_bufs, gs_bufs, w1_bufs, w2_bufs, hw_bufs, du_bufs = bufs
    ready, empty, turn = bars
    b1_ptr, weight_ptr, gw_ptr, slot_pair_ptr, tile_expert_ptr = ptrs
    PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1 = sizes
    TILE: gl.constexpr = xs_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = xs_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w1_desc.block_type.shape[1]
    NBUF: gl.constexpr = xs_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    hw_buf = hw_bufs.index(which)
    du_buf = du_bufs.index(which)
    ksteps = gl.cdiv(D, BLOCK_K)
    i = 0  # this program's jobs
    own = 0  # this consumer's
    for job in range(gl.program_id(0), NUM_JOBS, gl.num_programs(0)):
        if i % 2 == which:
            t, n = _job(job, F, BLOCK_N)
            e = gl.load(tile_expert_ptr + t)
            offs_n = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_layout)
            acc_u = gl.zeros([TILE, BLOCK_N], gl.float32, acc_layout)
            acc_g = gl.zeros([TILE, BLOCK_N], gl.float32, acc_layout)
            if has_b1 != 0:
                bias = gl.load(b1_ptr + e * F + offs_n, mask=offs_n < F, other=0.0)
                acc_u = acc_u + bias.to(gl.float32)[None, :]
            mbarrier.wait(turn.index(which), (own & 1) ^ (1 - which))
            pos = i * ksteps
            prev = 0
            for k in range(ksteps):
                stage = pos % NBUF
                mbarrier.wait(ready.index(stage), (pos // NBUF) & 1)
                acc_u = warpgroup_mma(xs_bufs.index(stage), w1_bufs.index(stage), acc_u, is_async=True)
                acc_g = warpgroup_mma(gs_bufs.index(stage), w2_bufs.index(stage).permute((1, 0)), acc_g,
                                      is_async=True)
                # This step's two wgmmas in flight: the step before has read its stage.
                acc_u, acc_g = warpgroup_mma_wait(num_outstanding=2, deps=(acc_u, acc_g))
                if k > 0:
                    mbarrier.arrive(empty.index(prev), count=1)
                prev = stage
                pos += 1
            acc_u, acc_g = warpgroup_mma_wait(num_outstanding=0, deps=(acc_u, acc_g))
            mbarrier.arrive(empty.index(prev), count=1)
            mbarrier.arrive(turn.index(1 - which), count=1)  # the other consumer's K loop may start
            own += 1
            offs_s = t * TILE + gl.arange(0, TILE, layout=rows_layout)
            pair = gl.load(slot_pair_ptr + offs_s)
            valid = pair < PAIRS
            w = gl.load(weight_ptr + pair, mask=valid, other=0.0)
            cdf = 0.5 * (1.0 + gl.erf(acc_u * 0.7071067811865476))
            h = acc_u * cdf
            gl.store(gw_ptr + offs_s * GW_COLS + n, gl.where(valid, gl.sum(h * acc_g, axis=1), 0.0))
            pdf = gl.exp(-0.5 * acc_u * acc_u) * 0.3989422804014327
            du = gl.where(valid[:, None], (w[:, None] * acc_g) * (cdf + acc_u * pdf), 0.0)
            hw = gl.where(valid[:, None], w[:, None] * h, 0.0)
            tma.store_wait(0)  # this consumer's last stores have left its staging tiles
            hw_buf.store(hw.to(hw_desc.dtype))
            du_buf.store(du.to(du_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(hw_desc, [t * TILE, n * BLOCK_N], hw_buf)
            tma.async_copy_shared_to_global(du_desc, [t * TILE, n * BLOCK_N], du_buf)
        i += 1
    tma.store_wait(0)


@gluon.jit
def _hidden_pingpong_kernel(xs_desc, gs_desc, w1_desc, w2_desc, hw_desc, du_desc,
                            b1_ptr, weight_ptr, gw_ptr, slot_pair_ptr, tile_expert_ptr,
                            PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1,
                            NBUF: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    dtype: gl.constexpr = xs_desc.dtype
    xs_bufs = gl.allocate_shared_memory(dtype, [NBUF] + xs_desc.block_type.shape, xs_desc.layout)
    gs_bufs = gl.allocate_shared_memory(dtype, [NBUF] + gs_desc.block_type.shape, gs_desc.layout)
    w1_bufs = gl.allocate_shared_memory(dtype, [NBUF] + w1_desc.block_type.shape, w1_desc.layout)
    w2_bufs = gl.allocate_shared_memory(dtype, [NBUF] + w2_desc.block_type.shape, w2_desc.layout)
    hw_bufs = gl.allocate_shared_memory(dtype, [2] + hw_desc.block_type.shape, hw_desc.layout)
    du_bufs = gl.allocate_shared_memory(dtype, [2] + du_desc.block_type.shape, du_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NBUF):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for c in gl.static_range(2):
        mbarrier.init(turn.index(c), count=1)
    args = ((xs_desc, gs_desc, w1_desc, w2_desc, hw_desc, du_desc),
            (xs_bufs, gs_bufs, w1_bufs, w2_bufs, hw_bufs, du_bufs), (ready, empty, turn),
            (b1_ptr, weight_ptr, gw_ptr, slot_pair_ptr, tile_expert_ptr), (PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1))
    gl.warp_specialize([
        (_consumer, args + (0, )),
        (_consumer_odd, args),
        (_producer, args),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def hidden_descriptors(xs, gs, w1, w2, hw, du, tile, block_n, block_k):
    E, D, F = w1.shape
    return (descriptor(xs, [tile, block_k]), descriptor(gs, [tile, block_k]),
            descriptor(w1.view(E * D, F), [block_k, block_n]), descriptor(w2.view(E * F, D), [block_n, block_k]),
            descriptor(hw, [tile, block_n]), descriptor(du, [tile, block_n]))


def hidden_pingpong(xs, gs, groups, weight, w1, b1, w2, gw, block_k=64, nbuf=3, consumer_regs=232,
                    producer_regs=24, num_sms=132):
    """(hw, ∂u) [S,F] bf16 and gw[:, :F/64] written, as the shipped hidden kernel for act="gelu";
    weight: the top-k weights, flat [R·k]."""
    E, D, F = w1.shape
    block_n = 64  # = triton_moe.GW_BLOCK: one ∂w partial column a job
    if D % block_k or F % block_n:
        raise ValueError(f"D={D}, F={F}: this probe needs D a multiple of {block_k} and F of {block_n}")
    hw = torch.empty(xs.shape[0], F, device=xs.device, dtype=xs.dtype)
    du = torch.empty_like(hw)
    jobs = groups.num_tiles * (F // block_n)
    descs = hidden_descriptors(xs, gs, w1, w2, hw, du, groups.tile, block_n, block_k)
    _hidden_pingpong_kernel[(min(num_sms, jobs),)](
        *descs, w1 if b1 is None else b1, weight, gw, groups.slot_pair, groups.tile_expert,
        groups.pairs, D, F, gw.shape[1], jobs, int(b1 is not None),
        NBUF=nbuf, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, num_warps=4)
    return hw, du


def offline(tile=128, block_k=64, nbuf=3, consumer_regs=232, producer_regs=24):
    """compile_offline of the kernel under one config."""
    E, D, F, S = 2, 2 * block_k, 128, 2 * tile
    bf = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16)
    xs, gs, hw, du = bf(S, D), bf(S, D), bf(S, F), bf(S, F)
    w1, w2, b1 = bf(E, D, F), bf(E, F, D), bf(E, F)
    index, gw = torch.empty(S, dtype=torch.int32), torch.empty(S, 8, dtype=torch.float32)
    names = ("xs_desc", "gs_desc", "w1_desc", "w2_desc", "hw_desc", "du_desc")
    args = dict(zip(names, hidden_descriptors(xs, gs, w1, w2, hw, du, tile, 64, block_k)))
    args.update(b1_ptr=b1, weight_ptr=gw, gw_ptr=gw, slot_pair_ptr=index, tile_expert_ptr=index, PAIRS=1000, D=D, F=F,
                GW_COLS=40, NUM_JOBS=1000, has_b1=3)
    return compile_offline(_hidden_pingpong_kernel, args,
                           dict(NBUF=nbuf, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs))


def reference(c, weight):
    """(hw, ∂u, gw[:, :F/64]) in fp32, expert by expert over the slot layout; 0 on padding slots."""
    groups, E, F = c.groups, c.E, c.F
    bounds = groups.expert_slots.tolist()
    hw = torch.zeros(c.S, F, device=c.dev, dtype=torch.float32)
    du, gw = torch.zeros_like(hw), torch.zeros(c.S, F // 64, device=c.dev, dtype=torch.float32)
    valid = groups.slot_pair < groups.pairs
    w = torch.where(valid, weight[groups.slot_pair.clamp(max=groups.pairs - 1).long()], 0.0)[:, None]
    for e in range(E):
        lo, hi = bounds[e], bounds[E + e]
        if hi == lo:
            continue
        u = c.xs[lo:hi].float() @ c.w1[e].float() + c.b1[e].float()
        g = c.gs[lo:hi].float() @ c.w2[e].float().t()
        cdf = 0.5 * (1.0 + torch.erf(u * 0.7071067811865476))
        h = u * cdf
        hw[lo:hi] = w[lo:hi] * h
        du[lo:hi] = w[lo:hi] * g * (cdf + u * torch.exp(-0.5 * u * u) * 0.3989422804014327)
        gw[lo:hi] = (h * g).view(hi - lo, F // 64, 64).sum(-1)
    return hw * valid[:, None], du * valid[:, None], gw * valid[:, None]


CONFIGS = [dict(block_k=64, nbuf=3), dict(block_k=64, nbuf=2), dict(block_k=32, nbuf=4)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="medium,large")
    parser.add_argument("--offline", action="store_true", help="compile for sm_90a only (no GPU needed)")
    args = parser.parse_args()
    if args.offline or not torch.cuda.is_available():
        for cfg in CONFIGS:
            print(json.dumps(dict(config=cfg, **offline(**cfg))), flush=True)
        return
    from gemm_probe import slot_case
    from mha_compile.kernels import triton_moe as moe

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for preset in args.presets.split(","):
        c = slot_case(preset, "gelu")
        weight = c.weight.reshape(-1)
        flops = 4 * c.S * c.D * c.F
        want = reference(c, weight)
        err = lambda got: max(float((g.float() - w).norm() / w.norm()) for g, w in zip(got, want))
        cols = moe.gw_columns(c.D, c.F, True)
        gw = torch.zeros(c.S, cols, device=c.dev, dtype=torch.float32)
        hw, du = torch.empty(c.S, c.F, device=c.dev, dtype=c.dt), torch.empty(c.S, c.F, device=c.dev, dtype=c.dt)

        def shipped():
            moe._hidden(moe.tile_grid(c.groups, c.F, "BLOCK_F"), c.xs, c.gs, c.groups.slot_pair,
                        c.groups.tile_expert, weight, c.w1, c.b1, c.w1, c.w2, hw, du, du, gw,
                        c.groups.pairs, c.D, c.F, cols, HAS_B1=True, ACT=moe.ACT_CODE["gelu"],
                        PRECISION=moe.dot_precision(c.dt), TILE=c.groups.tile, GW_BLOCK=moe.GW_BLOCK)
            return hw, du, gw[:, :c.F // 64]
        got = shipped()
        ms = triton.testing.do_bench_cudagraph(shipped, rep=60, return_mode="median")
        print(f"shipped      {ms * 1e3:8.1f} us {flops / ms / 1e9:5.0f} TF/s  rel err {err(got):.1e}", flush=True)
        for cfg in CONFIGS:
            try:
                run = lambda: hidden_pingpong(c.xs, c.gs, c.groups, weight, c.w1, c.b1, c.w2, gw, **cfg)
                gw.zero_()
                got = (*run(), gw[:, :c.F // 64])
                torch.cuda.synchronize()
                ms = triton.testing.do_bench_cudagraph(run, rep=60, return_mode="median")
                print(f"ping-pong    {ms * 1e3:8.1f} us {flops / ms / 1e9:5.0f} TF/s  rel err {err(got):.1e}  {cfg}",
                      flush=True)
            except Exception as error:  # a config that does not fit or fails: say so, keep going
                reason = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                print(f"ping-pong    FAILED {reason}  {cfg}", flush=True)


if __name__ == "__main__":
    main()
