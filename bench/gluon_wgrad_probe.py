"""The MoE weight-gradient GEMM as a warp-specialised Gluon kernel, against the Triton one
(triton_moe._moe_wgrad_kernel), the largest kernel of a large training step after the hidden
kernel moved to Gluon (1.39 ms a step; cuBLAS takes 654 TFLOP/s on the same extents:
bench/results/gemm_probe.txt). Not on the live path yet: it writes the whole layout's ∂W in one
pass, where the backward also needs runs of tiles added into fp32 totals and split sums.

First H200 run (session 10, bench/results/gluon_wgrad_probe.txt, large, whole layout, bf16):
∂W1 435 against the Triton kernel's 575 us (641 against 485 TFLOP/s), ∂W2 440 against 604, rel
err 1.7e-3 for both (the fp32 reference's bf16 rounding).

    PYTHONPATH=. python bench/gluon_wgrad_probe.py [--presets medium,large]   # H200
    PYTHONPATH=. python bench/gluon_wgrad_probe.py --offline                  # compile for sm_90a

∂W[e] [I,J] = Σ_{s ∈ e} A[s]ᵀ B[s] over expert e's slots (A [S,I]: xs or hw; B [S,J]: ∂u or gs),
written in B's dtype. The Triton kernel loads its tiles with pointer loads inside its K loop
(cp.async), one program per (e, I block, J block). Here:
  - one program per SM walks the (e, I block, J block) jobs, expert-major, so the tiles running
    together share an expert's K window in L2;
  - a producer warp issues TMA loads into a ring: per stage A's [BK, 64] halves of the job's
    128 rows of ∂W, and B's [BK, BN] tile;
  - two consumer warpgroups each own 64 of the 128 rows ("cooperative"): both wait on a stage,
    each issues its wgmma with A fed transposed from shared memory ([64, BK] from the [BK, 64]
    tile), and both release the stage (the empty barrier counts two arrivals);
  - the epilogue stores the [64, BN] fp32 accumulator straight from registers (once a job; a
    job's K loop is ~8k slots at large).
Each expert's slot range is a whole number of tiles (TILE ≥ 64 here), so BK = 64 never crosses
into the next expert's rows; padding slots are zero rows.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from gluon_probe import _time, compile_offline, probe_cli
from mha_compile.kernels import gluon_moe


@gluon.jit
def _wjob(job, I, J, BM: gl.constexpr, BN: gl.constexpr):
    """(e, first row of ∂W[e], first column) of a job, expert-major."""
    ni = I // BM
    nj = J // BN
    e = job // (ni * nj)
    rest = job - e * (ni * nj)
    i = rest // nj
    return e, i * BM, (rest - i * nj) * BN


# Partitions take (descs, bufs, bars, ptrs, sizes) (+ which, a runtime value: see gluon_moe).
#   descs = (A as [S, I] in [BK, 64] blocks, B as [S, J] in [BK, BN] blocks);
#   bufs  = (A ring [2·NBUF, BK, 64] (stage·2 + half), B ring [NBUF, BK, BN]);
#   bars  = (ready, empty) a stage;  ptrs = (out [E·I, J], expert_slots [2E]);  sizes = (I, J, E, JOBS).


@gluon.jit
def _produce(descs, bufs, bars, ptrs, sizes):
    a_desc, b_desc = descs
    a_bufs, b_bufs = bufs
    ready, empty = bars
    out_ptr, expert_slots_ptr = ptrs
    I, J, E, JOBS = sizes
    BK: gl.constexpr = a_desc.block_type.shape[0]
    HALF: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    NBUF: gl.constexpr = b_bufs.type.shape[0]
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    pos = 0
    for job in range(gl.program_id(0), JOBS, gl.num_programs(0)):
        e, i0, j0 = _wjob(job, I, J, 2 * HALF, BN)
        lo = gl.load(expert_slots_ptr + e)
        hi = gl.load(expert_slots_ptr + E + e)
        for s0 in range(lo, hi, BK):
            stage = pos % NBUF
            mbarrier.wait(empty.index(stage), ((pos // NBUF) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [s0, i0], bar, a_bufs.index(2 * stage))
            tma.async_copy_global_to_shared(a_desc, [s0, i0 + HALF], bar, a_bufs.index(2 * stage + 1))
            tma.async_copy_global_to_shared(b_desc, [s0, j0], bar, b_bufs.index(stage))
            pos += 1


@gluon.jit
def _consume(descs, bufs, bars, ptrs, sizes, which):
    """Rows [which·64, which·64 + 64) of every job's 128: the K loop over the ring, then the store."""
    a_desc, b_desc = descs
    a_bufs, b_bufs = bufs
    ready, empty = bars
    out_ptr, expert_slots_ptr = ptrs
    I, J, E, JOBS = sizes
    HALF: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    NBUF: gl.constexpr = b_bufs.type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    pos = 0
    for job in range(gl.program_id(0), JOBS, gl.num_programs(0)):
        e, i0, j0 = _wjob(job, I, J, 2 * HALF, BN)
        lo = gl.load(expert_slots_ptr + e)
        hi = gl.load(expert_slots_ptr + E + e)
        acc = gl.zeros([HALF, BN], gl.float32, acc_layout)
        prev = 0
        for s0 in range(lo, hi, BK):
            stage = pos % NBUF
            mbarrier.wait(ready.index(stage), (pos // NBUF) & 1)
            acc = warpgroup_mma(a_bufs.index(2 * stage + which).permute((1, 0)), b_bufs.index(stage), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if s0 > lo:  # the step before has finished reading its stage
                mbarrier.arrive(empty.index(prev), count=1)
            prev = stage
            pos += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if hi > lo:
            mbarrier.arrive(empty.index(prev), count=1)
        rows = e * I + i0 + which * HALF + gl.arange(0, HALF, layout=rows_layout)
        cols = j0 + gl.arange(0, BN, layout=cols_layout)
        gl.store(out_ptr + rows.to(gl.int64)[:, None] * J + cols[None, :], acc.to(out_ptr.dtype.element_ty))


@gluon.jit
def _consume_second(descs, bufs, bars, ptrs, sizes, which):
    _consume(descs, bufs, bars, ptrs, sizes, which)


@gluon.jit
def _wgrad_kernel(a_desc, b_desc, out_ptr, expert_slots_ptr, I, J, E, JOBS,
                  NBUF: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * NBUF] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NBUF] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NBUF):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumers release a stage
    args = ((a_desc, b_desc), (a_bufs, b_bufs), (ready, empty), (out_ptr, expert_slots_ptr), (I, J, E, JOBS))
    zero = gl.program_id(0) * 0
    gl.warp_specialize([(_consume, args + (zero, )), (_consume_second, args + (zero + 1, )), (_produce, args)],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def kernel_args(a, b, out, block_k, block_n):
    """_wgrad_kernel's tensor arguments: A and B as TMA descriptors, then out."""
    dtype = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    return [gluon_moe._descriptor(a, [block_k, 64], dtype), gluon_moe._descriptor(b, [block_k, block_n], dtype),
            out]


def wgrad(a, b, groups, block_k=64, block_n=256, nbuf=3, consumer_regs=232, producer_regs=24, num_sms=132):
    """∂W [E, I, J] in b's dtype = Σ_{s∈e} A[s]ᵀ B[s] (triton_moe.weight_grads' first output)."""
    E, (I, J) = groups.experts, (a.shape[1], b.shape[1])
    if I % 128 or J % block_n or groups.tile % block_k:
        raise ValueError(f"I={I}, J={J}, TILE={groups.tile}: needs I % 128, J % {block_n}, TILE % {block_k} == 0")
    out = torch.empty(E, I, J, device=a.device, dtype=b.dtype)
    jobs = E * (I // 128) * (J // block_n)
    _wgrad_kernel[(min(num_sms, jobs),)](*kernel_args(a, b, out, block_k, block_n), groups.expert_slots, I, J, E,
                                         jobs, NBUF=nbuf, CONSUMER_REGS=consumer_regs,
                                         PRODUCER_REGS=producer_regs, num_warps=4)
    return out


CONFIGS = [dict(block_k=64, block_n=256, nbuf=3), dict(block_k=64, block_n=256, nbuf=4),
           dict(block_k=64, block_n=128, nbuf=4), dict(block_k=32, block_n=256, nbuf=6)]


def offline(block_k=64, block_n=256, nbuf=3):
    """compile_offline of the kernel under one config."""
    S, E, I, J = 256, 2, 128, 2 * block_n
    a, b = torch.empty(S, I, dtype=torch.bfloat16), torch.empty(S, J, dtype=torch.bfloat16)
    out, slots = torch.empty(E, I, J, dtype=torch.bfloat16), torch.empty(2 * E, dtype=torch.int32)
    args = dict(zip(_wgrad_kernel.arg_names, kernel_args(a, b, out, block_k, block_n)))
    args.update(expert_slots_ptr=slots, I=I, J=J, E=E, JOBS=1000)
    return compile_offline(_wgrad_kernel, args, dict(NBUF=nbuf, CONSUMER_REGS=232, PRODUCER_REGS=24))


def reference(a, b, groups):
    """fp32, expert by expert: Σ_{s∈e} A[s]ᵀ B[s]."""
    bounds = groups.expert_slots.tolist()
    E = groups.experts
    out = torch.zeros(E, a.shape[1], b.shape[1], device=a.device, dtype=torch.float32)
    for e in range(E):
        lo, hi = bounds[e], bounds[E + e]
        out[e] = a[lo:hi].float().t() @ b[lo:hi].float()
    return out


def offline_rows():
    for cfg in CONFIGS:
        yield dict(config=cfg, **offline(**cfg))


def probe_preset(c):
    """∂W1's and ∂W2's shapes, the Triton kernel then the Gluon one under each config."""
    from mha_compile.kernels import triton_moe as moe

    du = torch.randn(c.S, c.F, device=c.dev, dtype=c.dt) * (c.groups.slot_pair < c.groups.pairs)[:, None]
    for name, a, b in (("dW1", c.xs, du), ("dW2", du, c.gs)):  # ∂W1 = xsᵀ ∂u; ∂W2's shape (hw ~ ∂u)
        want = reference(a, b, c.groups)
        err = lambda got: float((got.float() - want).norm() / want.norm())  # noqa: E731
        flops = 2 * c.S * a.shape[1] * b.shape[1]
        _time(f"{name} triton", lambda: moe.weight_grads(a, b, None, c.groups)[0], flops, err)
        for cfg in CONFIGS:
            _time(f"{name} gluon", lambda: wgrad(a, b, c.groups, **cfg), flops, err, cfg)


if __name__ == "__main__":
    probe_cli(offline_rows, probe_preset)
