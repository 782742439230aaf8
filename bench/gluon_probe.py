"""GEMM1 and the backward's hidden kernel as warp-specialised ping-pong kernels in Gluon, against the
shipped Triton kernels: a probe of the lever PERF_NOTES v12 names for the grouped GEMMs.

    PYTHONPATH=. python bench/gluon_probe.py [--kernels up,hidden] [--presets medium,large]  # H200
    PYTHONPATH=. python bench/gluon_probe.py --offline            # no GPU: compile for sm_90a

Why: Nsight Compute (bench/results/ncu_large.txt) shows every MoE GEMM latency-bound at one
program an SM: the shipped kernels issue their dots and their activation epilogues in turn, so
the tensor cores idle through every epilogue (GEMM1 at large: 547 us a call without the gelu,
~850-980 with it). Triton 3.6's `tl` cannot split one program's warps into roles on Hopper;
Gluon can (`gl.warp_specialize`), and the accumulators of Hopper's wgmma live in the registers
of the warpgroup that issues it, so the overlap takes the CUTLASS "ping-pong" shape:
  - a producer warp issues the TMA loads of a job's operand tiles into a ring of NBUF stages;
  - two consumer warpgroups take the (tile, F block) jobs of this program in turn: while one
    runs its epilogue, the other runs its dots. Job i's K steps are ring positions i·KSTEPS ...;
    the consumers pass a turn between them (two more barriers) so that their K loops run one at
    a time, in job order: a ring wait is by the parity of a stage's use, and a consumer a whole
    job ahead would take an older use of the stage for its own (CUTLASS orders its ping-pong
    consumers the same way).
One program per SM walks the jobs in triton_moe._tile_of_job's order (a tile's F blocks adjacent).

The two kernels (GEMMS, the dots a K step):
  up (1):     u = xs W1[e] + b1[e];  h = gelu(u)                    (out0 = h)
  hidden (2): u as above, g = gs W2[e]ᵀ (W2 read as [E·F, D], fed transposed);
              hw = w·gelu(u), ∂u = w·g·gelu′(u) (out0, out1), gw[s, n] = Σ_f gelu(u) g (BLOCK_N = 64,
              triton_moe.GW_BLOCK: one ∂w partial column a job).
Each writes 0 on padding slots, as the shipped kernels do. Limits: gelu (erf), bf16, D a
multiple of BLOCK_K (W1 is read as [E·D, F]), F of BLOCK_N for the hidden kernel.

Status (session 9): written and compiled for sm_90a without a GPU (`--offline`: wgmma, the
partitions' setmaxnreg, shared memory within the H200's; ~210 B of spills for GEMM1 at
BLOCK_N 128, ~440 for the hidden kernel); NOT YET RUN on a GPU. Its first run checks each config
against an fp32 reference (`rel err`) before its time means anything.
"""
import argparse
import json

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Every partition takes (descs, bufs, bars, ptrs, sizes): worker partitions share one signature
# and take no Python constants (a tuple with one fails to flatten), hence one small worker
# function per kernel that calls the shared body with its constants.
#   descs = (xs, gs, W1 as [E·D, F], W2 as [E·F, D], out0, out1) TMA descriptors;
#   bufs  = (xs, gs, W1, W2 rings of NBUF stages; out0, out1 staging tiles, one a consumer);
#   bars  = (ready, empty) a ring stage, and turn, one a consumer;
#   ptrs  = (b1, weight (the flat top-k weights), gw, slot_pair, tile_expert);
#   sizes = (PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1).
# GEMM1 passes xs, W1 and out0 again where it has no gs, W2 and out1 (never read there).


@gluon.jit
def _job(job, F, TILE, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(first slot row, its tile, F block) of a job: TILE_M rows (the tile's, or half of them) by
    BLOCK_N columns, a row block's F blocks adjacent (triton_moe._tile_of_job's order)."""
    blocks = gl.cdiv(F, BLOCK_N)
    r = job // blocks
    row = r * TILE_M
    return row, row // TILE, job - r * blocks


@gluon.jit
def _produce(descs, bufs, bars, ptrs, sizes, GEMMS: gl.constexpr):
    xs_desc, gs_desc, w1_desc, w2_desc, out0_desc, out1_desc = descs
    xs_bufs, gs_bufs, w1_bufs, w2_bufs, out0_bufs, out1_bufs = bufs
    ready, empty, turn = bars
    b1_ptr, weight_ptr, gw_ptr, slot_pair_ptr, tile_expert_ptr = ptrs
    PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1, TILE = sizes
    TILE_M: gl.constexpr = xs_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = xs_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w1_desc.block_type.shape[1]
    NBUF: gl.constexpr = xs_bufs.type.shape[0]
    # a stage's bytes: xs and W1 tiles, and as many again for gs and W2 (same block sizes)
    nbytes: gl.constexpr = GEMMS * (xs_desc.block_type.nbytes + w1_desc.block_type.nbytes)
    ksteps = gl.cdiv(D, BLOCK_K)
    pos = 0
    for job in range(gl.program_id(0), NUM_JOBS, gl.num_programs(0)):
        row, t, n = _job(job, F, TILE, TILE_M, BLOCK_N)
        e = gl.load(tile_expert_ptr + t)
        for k in range(ksteps):
            stage = pos % NBUF
            # Barriers start with phase 1 complete: the first NBUF waits on "empty" pass.
            mbarrier.wait(empty.index(stage), ((pos // NBUF) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(xs_desc, [row, k * BLOCK_K], bar, xs_bufs.index(stage))
            tma.async_copy_global_to_shared(w1_desc, [e * D + k * BLOCK_K, n * BLOCK_N], bar, w1_bufs.index(stage))
            if GEMMS == 2:
                tma.async_copy_global_to_shared(gs_desc, [row, k * BLOCK_K], bar, gs_bufs.index(stage))
                tma.async_copy_global_to_shared(w2_desc, [e * F + n * BLOCK_N, k * BLOCK_K], bar,
                                                w2_bufs.index(stage))
            pos += 1


@gluon.jit
def _consume(descs, bufs, bars, ptrs, sizes, GEMMS: gl.constexpr, which: gl.constexpr):
    """Jobs i of this program with i % 2 == which: the dots over the ring, then the epilogue."""
    xs_desc, gs_desc, w1_desc, w2_desc, out0_desc, out1_desc = descs
    xs_bufs, gs_bufs, w1_bufs, w2_bufs, out0_bufs, out1_bufs = bufs
    ready, empty, turn = bars
    b1_ptr, weight_ptr, gw_ptr, slot_pair_ptr, tile_expert_ptr = ptrs
    PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1, TILE = sizes
    TILE_M: gl.constexpr = xs_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = xs_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w1_desc.block_type.shape[1]
    NBUF: gl.constexpr = xs_bufs.type.shape[0]
    NB: gl.constexpr = BLOCK_N // 64  # ∂w partial columns a job (triton_moe.GW_BLOCK = 64)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    out0_buf = out0_bufs.index(which)
    out1_buf = out1_bufs.index(which)
    ksteps = gl.cdiv(D, BLOCK_K)
    i = 0  # this program's jobs
    own = 0  # this consumer's
    for job in range(gl.program_id(0), NUM_JOBS, gl.num_programs(0)):
        if i % 2 == which:
            row, t, n = _job(job, F, TILE, TILE_M, BLOCK_N)
            e = gl.load(tile_expert_ptr + t)
            offs_n = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_layout)
            acc_u = gl.zeros([TILE_M, BLOCK_N], gl.float32, acc_layout)
            acc_g = gl.zeros([TILE_M, BLOCK_N], gl.float32, acc_layout)
            if has_b1 != 0:
                bias = gl.load(b1_ptr + e * F + offs_n, mask=offs_n < F, other=0.0)
                acc_u = acc_u + bias.to(gl.float32)[None, :]
            # Consumer 0 goes first: a fresh barrier passes a wait on parity 1.
            mbarrier.wait(turn.index(which), (own & 1) ^ (1 - which))
            pos = i * ksteps
            prev = 0
            for k in range(ksteps):
                stage = pos % NBUF
                mbarrier.wait(ready.index(stage), (pos // NBUF) & 1)
                acc_u = warpgroup_mma(xs_bufs.index(stage), w1_bufs.index(stage), acc_u, is_async=True)
                # This step's wgmmas stay in flight: the step before has read its stage.
                if GEMMS == 2:
                    acc_g = warpgroup_mma(gs_bufs.index(stage), w2_bufs.index(stage).permute((1, 0)), acc_g,
                                          is_async=True)
                    acc_u, acc_g = warpgroup_mma_wait(num_outstanding=2, deps=(acc_u, acc_g))
                else:
                    acc_u = warpgroup_mma_wait(num_outstanding=1, deps=(acc_u, ))
                if k > 0:
                    mbarrier.arrive(empty.index(prev), count=1)
                prev = stage
                pos += 1
            if GEMMS == 2:
                acc_u, acc_g = warpgroup_mma_wait(num_outstanding=0, deps=(acc_u, acc_g))
            else:
                acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_u, ))
            mbarrier.arrive(empty.index(prev), count=1)
            mbarrier.arrive(turn.index(1 - which), count=1)  # the other consumer's K loop may start
            own += 1

            offs_s = row + gl.arange(0, TILE_M, layout=rows_layout)
            pair = gl.load(slot_pair_ptr + offs_s)
            valid = pair < PAIRS
            cdf = 0.5 * (1.0 + gl.erf(acc_u * 0.7071067811865476))
            h = acc_u * cdf
            tma.store_wait(0)  # this consumer's last stores have left its staging tiles
            if GEMMS == 2:
                w = gl.load(weight_ptr + pair, mask=valid, other=0.0)
                hg = h * acc_g
                for c in gl.static_range(NB):
                    lo = n * BLOCK_N + c * 64
                    part = gl.where(((offs_n >= lo) & (offs_n < lo + 64))[None, :], hg, 0.0)
                    gl.store(gw_ptr + offs_s * GW_COLS + n * NB + c, gl.where(valid, gl.sum(part, axis=1), 0.0))
                pdf = gl.exp(-0.5 * acc_u * acc_u) * 0.3989422804014327
                du = gl.where(valid[:, None], (w[:, None] * acc_g) * (cdf + acc_u * pdf), 0.0)
                out0_buf.store(gl.where(valid[:, None], w[:, None] * h, 0.0).to(out0_desc.dtype))
                out1_buf.store(du.to(out1_desc.dtype))
            else:
                out0_buf.store(gl.where(valid[:, None], h, 0.0).to(out0_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(out0_desc, [row, n * BLOCK_N], out0_buf)
            if GEMMS == 2:
                tma.async_copy_shared_to_global(out1_desc, [row, n * BLOCK_N], out1_buf)
        i += 1
    tma.store_wait(0)


@gluon.jit
def _produce_up(descs, bufs, bars, ptrs, sizes):
    _produce(descs, bufs, bars, ptrs, sizes, 1)


@gluon.jit
def _consume_up_odd(descs, bufs, bars, ptrs, sizes):
    _consume(descs, bufs, bars, ptrs, sizes, 1, 1)


@gluon.jit
def _produce_hidden(descs, bufs, bars, ptrs, sizes):
    _produce(descs, bufs, bars, ptrs, sizes, 2)


@gluon.jit
def _consume_hidden_odd(descs, bufs, bars, ptrs, sizes):
    _consume(descs, bufs, bars, ptrs, sizes, 2, 1)


@gluon.jit
def _pingpong_kernel(xs_desc, gs_desc, w1_desc, w2_desc, out0_desc, out1_desc,
                     b1_ptr, weight_ptr, gw_ptr, slot_pair_ptr, tile_expert_ptr,
                     PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1, TILE,
                     GEMMS: gl.constexpr, NBUF: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     PRODUCER_REGS: gl.constexpr):
    dtype: gl.constexpr = xs_desc.dtype
    xs_bufs = gl.allocate_shared_memory(dtype, [NBUF] + xs_desc.block_type.shape, xs_desc.layout)
    w1_bufs = gl.allocate_shared_memory(dtype, [NBUF] + w1_desc.block_type.shape, w1_desc.layout)
    out0_bufs = gl.allocate_shared_memory(dtype, [2] + out0_desc.block_type.shape, out0_desc.layout)
    gs_bufs, w2_bufs, out1_bufs = xs_bufs, w1_bufs, out0_bufs  # GEMM1: stand-ins, never read
    if GEMMS == 2:
        gs_bufs = gl.allocate_shared_memory(dtype, [NBUF] + gs_desc.block_type.shape, gs_desc.layout)
        w2_bufs = gl.allocate_shared_memory(dtype, [NBUF] + w2_desc.block_type.shape, w2_desc.layout)
        out1_bufs = gl.allocate_shared_memory(dtype, [2] + out1_desc.block_type.shape, out1_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NBUF):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for c in gl.static_range(2):
        mbarrier.init(turn.index(c), count=1)
    args = ((xs_desc, gs_desc, w1_desc, w2_desc, out0_desc, out1_desc),
            (xs_bufs, gs_bufs, w1_bufs, w2_bufs, out0_bufs, out1_bufs), (ready, empty, turn),
            (b1_ptr, weight_ptr, gw_ptr, slot_pair_ptr, tile_expert_ptr), (PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1, TILE))
    # The default partition (this kernel's 4 warps) is consumer 0; workers: consumer 1 (a
    # warpgroup) and the producer (one warp, the fewest registers a warp can have).
    if GEMMS == 2:
        gl.warp_specialize([(_consume, args + (2, 0)), (_consume_hidden_odd, args), (_produce_hidden, args)],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consume, args + (1, 0)), (_consume_up_odd, args), (_produce_up, args)],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def descriptor(t, block):
    """A Gluon TMA descriptor of the 2-D tensor t in `block` tiles, the default swizzle."""
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def kernel_args(xs, gs, w1, w2, b1, weight, gw, out0, out1, tile, block_n, block_k):
    """_pingpong_kernel's tensor arguments in order (GEMM1: gs, w2, weight, gw, out1 None)."""
    E, D, F = w1.shape
    hidden = gs is not None
    w1_desc = descriptor(w1.view(E * D, F), [block_k, block_n])
    return [descriptor(xs, [tile, block_k]), descriptor(gs if hidden else xs, [tile, block_k]), w1_desc,
            descriptor(w2.view(E * F, D), [block_n, block_k]) if hidden else w1_desc,
            descriptor(out0, [tile, block_n]), descriptor(out1 if hidden else out0, [tile, block_n]),
            w1 if b1 is None else b1, weight if hidden else out0, gw if hidden else out0]


def pingpong(xs, groups, w1, b1, gs=None, w2=None, weight=None, gw=None, block_n=128, block_k=64, nbuf=4,
             tile_m=None, consumer_regs=232, producer_regs=24, num_sms=132):
    """GEMM1 (gs None): h [S,F] bf16 = gelu(xs W1[e] + b1[e]), triton_moe.experts_up's contract for
    act="gelu". The hidden kernel (gs, W2, the flat top-k weights and gw [S, ≥ F/64] fp32 given):
    (hw, ∂u) [S,F] bf16 and gw[:, :F/64], the shipped hidden kernel's contract (BLOCK_N 64 or
    128). A job is tile_m slot rows (the tile's, or 64 of them) by BLOCK_N columns."""
    E, D, F = w1.shape
    hidden = gs is not None
    tile_m = tile_m or groups.tile
    if D % block_k or (hidden and F % block_n) or groups.tile % tile_m or (hidden and block_n % 64):
        raise ValueError(f"D={D}, F={F}, TILE={groups.tile}: this probe needs D a multiple of BLOCK_K={block_k},"
                         f" TILE of tile_m={tile_m}" + (f", F of BLOCK_N={block_n} and it of 64" if hidden else ""))
    out0 = torch.empty(xs.shape[0], F, device=xs.device, dtype=xs.dtype)
    out1 = torch.empty_like(out0) if hidden else None
    jobs = groups.num_tiles * (groups.tile // tile_m) * triton.cdiv(F, block_n)
    _pingpong_kernel[(min(num_sms, jobs),)](
        *kernel_args(xs, gs, w1, w2, b1, weight, gw, out0, out1, tile_m, block_n, block_k),
        groups.slot_pair, groups.tile_expert, groups.pairs, D, F, gw.shape[1] if hidden else 0, jobs,
        int(b1 is not None), groups.tile, GEMMS=2 if hidden else 1, NBUF=nbuf, CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=producer_regs, num_warps=4)
    return (out0, out1) if hidden else out0


def compile_offline(kernel, args, constexprs, num_warps=4):
    """Compile a Gluon kernel for the H200 (sm_90a) without a GPU: offline_sass.sass_stats of it.
    args: every other parameter's value (CPU tensors, descriptors on CPU tensors, ints; an int 1
    would be a constant on the GPU, so pass another)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    import offline_sass

    signature = {name: "constexpr" if name in constexprs else mangle_type(args[name]) for name in kernel.arg_names}
    values = {(i,): constexprs[name] for i, name in enumerate(kernel.arg_names) if name in constexprs}
    compiled = triton.compile(GluonASTSource(kernel, signature, values), target=offline_sass.H200,
                              options=dict(num_warps=num_warps))
    return offline_sass.sass_stats(compiled)


def offline(kernel, tile=128, block_n=128, block_k=64, nbuf=4, tile_m=None, consumer_regs=232, producer_regs=24):
    """compile_offline of `kernel` ("up" or "hidden") under one config."""
    hidden = kernel == "hidden"
    tile = tile_m or tile
    E, D, F, S = 2, 2 * block_k, 2 * block_n, 2 * tile
    bf = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16)
    xs, w1, w2, b1, out0, out1 = bf(S, D), bf(E, D, F), bf(E, F, D), bf(E, F), bf(S, F), bf(S, F)
    gs, weight, gw = (bf(S, D), torch.empty(S, dtype=torch.float32), torch.empty(S, 8)) if hidden else (None,) * 3
    index = torch.empty(S, dtype=torch.int32)
    names = _pingpong_kernel.arg_names
    args = dict(zip(names, kernel_args(xs, gs, w1, w2, b1, weight, gw, out0, out1, tile, block_n, block_k)))
    args.update(slot_pair_ptr=index, tile_expert_ptr=index, PAIRS=1000, D=D, F=F, GW_COLS=40, NUM_JOBS=1000, has_b1=3,
                TILE=128)
    return compile_offline(_pingpong_kernel, args, dict(GEMMS=2 if hidden else 1, NBUF=nbuf,
                                                        CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs))


def reference(c, weight=None):
    """fp32, expert by expert over the slot layout, 0 on padding slots: GEMM1's h (weight None),
    else the hidden kernel's (hw, ∂u, gw[:, :F/64]) for the flat top-k weights."""
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
        cdf = 0.5 * (1.0 + torch.erf(u * 0.7071067811865476))
        h[lo:hi] = u * cdf
        if weight is not None:
            g = c.gs[lo:hi].float() @ c.w2[e].float().t()
            du[lo:hi] = g * (cdf + u * torch.exp(-0.5 * u * u) * 0.3989422804014327)
            gw[lo:hi] = (h[lo:hi] * g).view(hi - lo, F // 64, 64).sum(-1)
    if weight is None:
        return h * valid
    w = weight[groups.slot_pair.clamp(max=groups.pairs - 1).long()][:, None] * valid
    return h * w, du * w, gw * valid


# Session 10's first run (bench/results/gluon_probe.txt): the hidden kernel with [128, 64] jobs
# beat the shipped one (1893 against 2193 us at large), GEMM1's [128, 128] jobs spilled and lost
# 2x. A job of 64 rows by 128 columns halves the wgmma count for the same work (one m64n128
# instruction where [128, 64] takes two m64n64) and took the hidden kernel's spills from 456 to
# 44 bytes (offline, sm_90a).
CONFIGS = {"up": [dict(block_n=64, block_k=64, nbuf=4), dict(block_n=128, block_k=64, nbuf=4, tile_m=64),
                  dict(block_n=256, block_k=64, nbuf=3, tile_m=64), dict(block_n=256, block_k=64, nbuf=4, tile_m=64)],
           "hidden": [dict(block_n=64, block_k=64, nbuf=3), dict(block_n=128, block_k=64, nbuf=3, tile_m=64),
                      dict(block_n=128, block_k=32, nbuf=6, tile_m=64), dict(block_n=128, block_k=32, nbuf=4, tile_m=64)]}


def _time(name, fn, flops, err, cfg=""):
    """One row: the median CUDA-graph time of fn, its TFLOP/s and its error (checked first)."""
    try:
        error = err(fn())
        torch.cuda.synchronize()
        ms = triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
        print(f"{name:<12} {ms * 1e3:8.1f} us {flops / ms / 1e9:5.0f} TF/s  rel err {error:.1e}  {cfg}", flush=True)
    except Exception as error:  # a config that does not fit or fails: say so, keep going
        print(f"{name:<12} FAILED {type(error).__name__}: {str(error).splitlines()[0][:160]}  {cfg}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernels", default="up,hidden")
    parser.add_argument("--presets", default="medium,large")
    parser.add_argument("--offline", action="store_true", help="compile for sm_90a only (no GPU needed)")
    args = parser.parse_args()
    kernels = args.kernels.split(",")
    if args.offline or not torch.cuda.is_available():
        for kernel in kernels:
            for cfg in CONFIGS[kernel]:
                print(json.dumps(dict(kernel=kernel, config=cfg, **offline(kernel, **cfg))), flush=True)
        return
    from gemm_probe import slot_case
    from mha_compile.kernels import triton_moe as moe

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for preset in args.presets.split(","):
        c = slot_case(preset, "gelu")
        if "up" in kernels:
            want = reference(c)
            err = lambda h: float((h.float() - want).norm() / want.norm())
            _time("up shipped", lambda: moe.experts_up(c.xs, c.groups, c.w1, c.b1, None, "gelu"),
                  2 * c.S * c.D * c.F, err)
            for cfg in CONFIGS["up"]:
                _time("up gluon", lambda: pingpong(c.xs, c.groups, c.w1, c.b1, **cfg), 2 * c.S * c.D * c.F, err, cfg)
        if "hidden" in kernels:
            weight = c.weight.reshape(-1)
            want = reference(c, weight)
            cols = moe.gw_columns(c.D, c.F, True)
            gw = torch.zeros(c.S, cols, device=c.dev, dtype=torch.float32)
            err = lambda got: max(float((g.float() - w).norm() / w.norm()) for g, w in zip(got, want))
            hw, du = torch.empty(c.S, c.F, device=c.dev, dtype=c.dt), torch.empty(c.S, c.F, device=c.dev, dtype=c.dt)

            def shipped():
                moe._hidden(moe.tile_grid(c.groups, c.F, "BLOCK_F"), c.xs, c.gs, c.groups.slot_pair,
                            c.groups.tile_expert, weight, c.w1, c.b1, c.w1, c.w2, hw, du, du, gw,
                            c.groups.pairs, c.D, c.F, cols, HAS_B1=True, ACT=moe.ACT_CODE["gelu"],
                            PRECISION=moe.dot_precision(c.dt), TILE=c.groups.tile, GW_BLOCK=moe.GW_BLOCK)
                return hw, du, gw[:, :c.F // 64]

            def gluon_hidden(cfg):
                gw.zero_()
                return (*pingpong(c.xs, c.groups, c.w1, c.b1, c.gs, c.w2, weight, gw, **cfg), gw[:, :c.F // 64])

            _time("hidden shipped", shipped, 4 * c.S * c.D * c.F, err)
            for cfg in CONFIGS["hidden"]:
                _time("hidden gluon", lambda: gluon_hidden(cfg), 4 * c.S * c.D * c.F, err, cfg)


if __name__ == "__main__":
    main()
