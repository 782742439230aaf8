"""The MoE's warp-specialised Gluon kernels for Hopper (sm_90): the backward's hidden kernel (below),
its weight-gradient GEMM, and the forward's GEMM2 and GEMM1 (each described at its section further
down; GEMM1's is the default since session 34, MHA_COMPILE_GLUON_UP=0 keeps the Triton one).

The hidden kernel has triton_moe._moe_bwd_hidden_kernel's contract (read its docstring for the
math): per slot s of expert e and F block, u = xs[s] W1[e] + b1[e] and g = gs[s] W2[e]ᵀ, then
    hw = w · act(u),   ∂u = (w · g) ⊙ act′(u)   [S,F] in the weights' dtype
    gw[s, c] = Σ_f act(u) g over the c-th GW_BLOCK (64) columns of F (triton_util.GW_BLOCK)
with zeros on padding slots. triton_moe.moe_backward runs this kernel where `unsupported`
finds nothing against it, and the Triton kernel everywhere else (CPU, other GPUs, fp32, sizes
below): both are tested against float64.

Why a second kernel: Nsight Compute (bench/results/ncu_large.txt) shows the Triton kernel
latency-bound, one program an SM, issuing its dots and its activation epilogue in turn. Triton's
`tl` cannot give one program's warps different roles; Gluon's `gl.warp_specialize` can, and
since Hopper's wgmma accumulates in the registers of the warpgroup that issues it, the overlap
takes CUTLASS's "ping-pong" shape:
  - a producer warp issues the TMA loads of each job's tiles (xs, gs [TILE_M, BLOCK_K]; W1 read
    as [E·D, F], W2 as [E·F, D] and fed transposed) into a ring of NBUF stages;
  - two consumer warpgroups take this program's (rows, F block) jobs in turn: one runs its
    epilogue while the other runs its dots. A job's K steps are ring positions i·KSTEPS ...; a
    turn barrier pair keeps the consumers' K loops in job order (a ring wait goes by the parity
    of a stage's use, and a consumer a whole job ahead would take an older use for its own).
One program per SM walks the jobs, a row block's F blocks adjacent. A job is 64 slot rows by
128 columns (one m64n128 wgmma a K step and accumulator). On the H200, bf16, gelu
(bench/gluon_probe.py, bench/results/gluon_probe.txt, run 10): 1480-1544 against the Triton
kernel's ~2100 us a large-preset call, 146 against 213 at medium. At TILE 128 with D ≥ 512 the
cooperative form below (_hidden_coop_kernel) runs instead: both consumers on each job's 128 rows,
so the W tiles are loaded once for 128 rows rather than 64.

KEEP_U (options["keep_hidden"], triton_moe.KEEP_HIDDEN; on the H200 since session 36, its GPU tests
passing, −287 us a large training step, bench/PERF_NOTES.md v39): GEMM1 also stores u = xs W1 +
b1, through the same staging tile as h, and both hidden kernels read it (each consumer loads its
job's u tile while waiting for its turn) instead of computing it: their stages then hold gs and W2
only, half the dots and of the bytes a K step; KEPT_CONFIG runs the ping-pong at six stages.
Each partition gets the variant by a function of its own (the *_kept trampolines), as the
activation: worker partitions take no constants.
"""
import contextlib
import functools
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime import _allocation

from mha_compile.kernels.triton_util import (ACT_CODE, GW_BLOCK, act_bwd, act_fwd, capability as cuda_capability,
                                             interpreting, launch, num_sms, sigmoid)

# MHA_COMPILE_GLUON=0 runs the Triton kernels everywhere instead of these (to compare the two, or to
# step around a fault in one of these).
ENABLED = os.environ.get("MHA_COMPILE_GLUON", "1") != "0"
# The weight gradients added into totals (the runs of tiles) take the STREAM schedule (see
# _wgrad_kernel) where it applies; MHA_COMPILE_WGRAD_STREAM=0 takes the jobs instead. On the H200
# at large (session 22, bench/flag_ab.py, graph replays of the op's training step in turn, 8
# rounds): 5.98 against 6.14 ms, −99 us a step (median of the rounds' differences); its kernels
# 0.998 against 1.083 ms a step under the profiler.
WGRAD_STREAM = os.environ.get("MHA_COMPILE_WGRAD_STREAM", "1") != "0"
# ∂b1's column sums beside ∂W1 are spread over the row blocks' jobs (wgrad_sum_rows), where the
# jobs of row block 0 did them all and the call waited for them (ncu at large, PERF_NOTES v24-v25:
# ∂W1's calls took ~40 us more than ∂W2's a run); MHA_COMPILE_WGRAD_SUM_SPREAD=0 gives that back.
# On the H200 (session 23, bench/flag_ab.py, the op's training step replayed in turn, 8 rounds):
# large 5.857 against 6.012 ms, −125 us a step (median of the rounds' differences); medium −1.6 us.
WGRAD_SUM_SPREAD = os.environ.get("MHA_COMPILE_WGRAD_SUM_SPREAD", "1") != "0"
ACTS = {name: ACT_CODE[name] for name in ("gelu", "gelu_tanh", "silu", "swiglu")}
DTYPES = (torch.bfloat16, torch.float16)
# The config by the slot layout's TILE (triton_moe.tile_rows: 128 at the medium and large presets,
# 64 at small): a job's rows and columns, the K step and the ring's stages (3 of 48 KiB, and the
# staging tiles: 213 KiB of the H200's 227). bench/gluon_probe.py sweeps these. With libdevice's
# erf, gelu took 1577-1592 us a large call in jobs of [128, 64] against 1641-1693 in [64, 128]; with
# the A&S gelu, 1670-1681 against 1480-1544, and the other activations 0-5% less in [64, 128]
# (gluon_probe.txt, run 10), so every TILE now takes [64, 128].
_CONFIG = dict(tile_m=64, block_n=128, block_k=64, nbuf=3)
CONFIGS = {128: _CONFIG, 64: _CONFIG}
# The cooperative kernel (_hidden_coop_kernel) instead at TILE 128 without swiglu where D ≥
# COOP_MIN_D: jobs of [128, 128], 5 stages of 32 KiB and 64 KiB of staging tiles (224 KiB). BK 64
# with 2 stages took 1862-1870 us at large against 1449-1457 (gluon_probe.txt, run 14).
COOP_CONFIG = dict(tile_m=128, block_n=128, block_k=32, nbuf=5, coop=True)
COOP_MIN_D = 512
# swiglu holds three accumulators (u, u3 = xs W3, g): jobs of [64, 64] keep them at 32 registers a
# thread each; a stage is then 40 KiB (five tiles), 168 KiB with the staging tiles.
SWIGLU_CONFIG = dict(tile_m=64, block_n=64, block_k=64, nbuf=3)
# KEEP_U (u read, not computed): the stages hold gs and W2 only (24 KiB a ping-pong stage), so six
# fit. On the H200 (session 36, bench/gluon_probe.py, gelu, bench/results/gluon_probe_kept.txt):
# large 1032.7 us against 1234.7 for COOP_CONFIG read likewise and 1392.2 for the default kernel
# that computes u; the cooperative kernel at 10 stages 1041.0; medium 97.0 against 117.3 (the
# ping-pong at 3 stages 101.7).
KEPT_CONFIG = dict(_CONFIG, nbuf=6)
# The registers a thread of each partition (consumers: the two accumulators and the epilogue;
# producer: one warp that only issues loads).
CONSUMER_REGS, PRODUCER_REGS = 232, 24
F_MULTIPLE = 128  # F in whole column blocks (W2 is read as [E·F, D]) under either config
_GW_BLOCK = gl.constexpr(GW_BLOCK)  # the kernel's view of it


def _device_reason(tensors, names, capability):
    """What keeps these operands off a Gluon Hopper kernel (switch, GPU, dtypes, TMA), or None."""
    if not ENABLED:
        return "MHA_COMPILE_GLUON=0"
    if capability is None:
        if not tensors[0].is_cuda or interpreting():
            return "not on a CUDA GPU"
        capability = cuda_capability(tensors[0].device)
    if tuple(capability) != (9, 0):
        return f"needs sm_90 (wgmma, setmaxnreg), this GPU is sm_{capability[0]}{capability[1]}"
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
        return f"dtypes {sorted(map(str, dtypes))}: takes one of bf16, fp16 for all of {names}"
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors):
        return f"{names} must be contiguous and 16-byte aligned (TMA)"
    return None


def unsupported(xs, gs, w1, w2, w3, act, tile, capability=None):
    """Why the hidden kernel cannot take these operands (a sentence), or None when it can.
    capability: the GPU's (major, minor), read from xs's device when None."""
    if act not in ACTS or (w3 is not None) != (act == "swiglu"):
        return f"act {act!r} {'with' if w3 is not None else 'without'} W3: takes {', '.join(ACTS)} (W3 with swiglu)"
    operands = (xs, gs, w1, w2) + (() if w3 is None else (w3,))
    why = _device_reason(operands, "xs, gs, W1, W2" + ("" if w3 is None else ", W3"), capability)
    if why is not None:
        return why
    D, F = w1.shape[1], w1.shape[2]
    if tile not in CONFIGS or F % F_MULTIPLE or D % _CONFIG["block_k"]:
        return (f"D={D}, F={F}, TILE={tile}: needs TILE in {sorted(CONFIGS)}, F a multiple of {F_MULTIPLE}"
                f" and D of {_CONFIG['block_k']}")
    return None


def default_config(act, tile, D, kept=False):
    """The hidden kernel's config for these operands (`unsupported` found nothing against them);
    kept: it reads the forward's u (KEEP_U, never with swiglu)."""
    if act == "swiglu":
        return SWIGLU_CONFIG
    if kept:
        return KEPT_CONFIG
    return COOP_CONFIG if tile == 128 and D >= COOP_MIN_D else CONFIGS[tile]


@gluon.jit
def _act(u, ACT: gl.constexpr):
    """(act(u), act′(u)) in fp32: triton_util's act_fwd and act_bwd (∂h = 1), which a Gluon kernel
    can call (rcp.approx and ex2.approx; gelu's Φ by Abramowitz and Stegun 7.1.26); the compiler
    merges what the two share (gelu_cdf's inline PTX is pure)."""
    return act_fwd(u, u, ACT), act_bwd(1.0, u, u, ACT)[0]


@gluon.jit
def _stage_du(du_buf, du3_buf, wg, dact, silu, ACT: gl.constexpr):
    """∂u = w g act′(u) (and swiglu's ∂u3 = w g silu(u)) into the staging tiles; wg = w g, 0 on
    padding (see _epilogue)."""
    du_buf.store((wg * dact).to(du_buf.dtype))
    if ACT == 3:
        du3_buf.store((wg * silu).to(du3_buf.dtype))


@gluon.jit
def _job(job, F, TILE, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(first slot row, its tile, F block) of a job, a row block's F blocks adjacent."""
    blocks = F // BLOCK_N
    r = job // blocks
    row = r * TILE_M
    return row, row // TILE, job - r * blocks


@gluon.jit
def _job_rows(row, e, offs_n, slot_pair_ptr, weight_ptr, b1_ptr, PAIRS, F, has_b1, ROWS: gl.constexpr,
              rows_layout: gl.constexpr, cols_layout: gl.constexpr):
    """(offs_s, valid, w, bias) for _epilogue, of ROWS slot rows from `row` of expert e's job at
    columns offs_n: the slots, whether each is a pair (not padding), the routing weights, and b1's
    block (zeros without b1). Loaded before the dots: the pair ids, then the weights through them,
    are two dependent global loads that would otherwise stall the epilogue. b1 is added after the
    dots, not into the accumulator (an accumulator that a non-wgmma instruction writes before the K
    loop makes ptxas serialise every wgmma of the kernel: its warning C7515)."""
    offs_s = row + gl.arange(0, ROWS, layout=rows_layout)
    pair = gl.load(slot_pair_ptr + offs_s)
    valid = pair < PAIRS
    w = gl.load(weight_ptr + pair, mask=valid, other=0.0)
    bias = gl.zeros(offs_n.shape, gl.float32, cols_layout)
    if has_b1 != 0:
        bias = gl.load(b1_ptr + e * F + offs_n).to(gl.float32)
    return offs_s, valid, w, bias


@gluon.jit
def _epilogue(acc_u, acc_g, acc_u3, w, valid, offs_s, offs_n, row, n, bufs, descs, gw_ptr, GW_COLS,
              ACT: gl.constexpr):
    """A job's epilogue, from u (b1 added) and g (and swiglu's u3) [rows, BLOCK_N] fp32: the ∂w
    partials into gw, hw and ∂u (∂u3) through this consumer's staging tiles `bufs` by TMA stores
    (`descs`: hw, ∂u, ∂u3 or ∂u's again). w, valid, offs_s: the rows' weights, whether each is a
    pair (not padding) and their slots; offs_n: the job's columns, its n-th F block.
    hw and ∂u take no select for padding rows: their w is 0 (_job_rows) and xs, gs are 0 there,
    so u = b1, g = 0 and the products are ±0 for finite b1 (a select after the bf16 conversion
    took 2 SEL and 2 PRMT a pair of elements a tile: 552 of gelu's coop kernel's 4736 SASS)."""
    hw_buf, du_buf, du3_buf = bufs
    hw_desc, du_desc, du3_desc = descs
    BLOCK_N: gl.constexpr = hw_desc.block_type.shape[1]
    NB: gl.constexpr = BLOCK_N // _GW_BLOCK  # ∂w partial columns a job
    if ACT == 3:  # swiglu: h = silu(u) u3, ∂u = w g u3 silu′(u), ∂u3 = w g silu(u)
        sig = sigmoid(acc_u)
        silu = acc_u * sig
        h = silu * acc_u3
        dact = acc_u3 * (sig * (1.0 + acc_u * (1.0 - sig)))
    else:
        h, dact = _act(acc_u, ACT)
        silu = h
    # gelu stages ∂u before the ∂w sums, so that act′ is dead by then: its A&S form
    # spills 850-930 bytes a thread otherwise. The other activations stage it after, which
    # took them 1-5% less at large (bench/results/gluon_probe.txt, run 10).
    if ACT == 0:
        tma.store_wait(0)  # this consumer's last stores have left its staging tiles
        _stage_du(du_buf, du3_buf, (w[:, None] * acc_g), dact, silu, ACT)
    hg = h * acc_g
    if NB == 1:  # the job is one ∂w block: no column mask
        gl.store(gw_ptr + offs_s * GW_COLS + n, gl.where(valid, gl.sum(hg, axis=1), 0.0))
    else:
        for c in gl.static_range(NB):
            lo = n * BLOCK_N + c * _GW_BLOCK
            part = gl.where(((offs_n >= lo) & (offs_n < lo + _GW_BLOCK))[None, :], hg, 0.0)
            gl.store(gw_ptr + offs_s * GW_COLS + n * NB + c, gl.where(valid, gl.sum(part, axis=1), 0.0))
    if ACT != 0:
        tma.store_wait(0)
        _stage_du(du_buf, du3_buf, (w[:, None] * acc_g), dact, silu, ACT)
    hw_buf.store((w[:, None] * h).to(hw_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(hw_desc, [row, n * BLOCK_N], hw_buf)
    tma.async_copy_shared_to_global(du_desc, [row, n * BLOCK_N], du_buf)
    if ACT == 3:
        tma.async_copy_shared_to_global(du3_desc, [row, n * BLOCK_N], du3_buf)


# Every partition takes (descs, bufs, bars, ptrs, sizes) (+ its own): worker partitions take no
# Python constants (a tuple with one fails to flatten), so the odd consumer is told which it is
# by a runtime value, and its activation (the producer: whether there is a W3) by a small
# function of its own for each.
#   descs = (xs, gs, W1 as [E·D, F], W2 as [E·F, D], hw, ∂u, W3 as W1, ∂u3) TMA descriptors (W3,
#           ∂u3: W1's and ∂u's again without swiglu, never read);
#   bufs  = (xs, gs, W1, W2 rings of NBUF stages; hw, ∂u staging tiles, one a consumer; the W3
#           ring and ∂u3 staging tiles, or W1's and ∂u's again);
#   bars  = (ready, empty) a ring stage, and turn, one a consumer;
#   ptrs  = (b1, weight (the flat top-k weights), gw, u (the forward's, with KEEP_U; else hw's
#           pointer again, never read), slot_pair, tile_expert);
#   sizes = (PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1, TILE).


@gluon.jit
def _produce(descs, bufs, bars, ptrs, sizes, SWIGLU: gl.constexpr, KEEP_U: gl.constexpr = False):
    xs_desc, gs_desc, w1_desc, w2_desc, hw_desc, du_desc, w3_desc, du3_desc = descs
    xs_bufs, gs_bufs, w1_bufs, w2_bufs, hw_bufs, du_bufs, w3_bufs, du3_bufs = bufs
    ready, empty, turn = bars
    b1_ptr, weight_ptr, gw_ptr, u_ptr, slot_pair_ptr, tile_expert_ptr = ptrs
    PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1, TILE = sizes
    TILE_M: gl.constexpr = xs_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = xs_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w1_desc.block_type.shape[1]
    NBUF: gl.constexpr = xs_bufs.type.shape[0]
    if KEEP_U:  # u is read, not computed: the stages hold gs and W2 only
        nbytes: gl.constexpr = gs_desc.block_type.nbytes + w2_desc.block_type.nbytes
    else:
        nbytes: gl.constexpr = (2 + SWIGLU) * w1_desc.block_type.nbytes + 2 * xs_desc.block_type.nbytes
    ksteps = D // BLOCK_K
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
            if not KEEP_U:
                tma.async_copy_global_to_shared(xs_desc, [row, k * BLOCK_K], bar, xs_bufs.index(stage))
                tma.async_copy_global_to_shared(w1_desc, [e * D + k * BLOCK_K, n * BLOCK_N], bar,
                                                w1_bufs.index(stage))
            tma.async_copy_global_to_shared(gs_desc, [row, k * BLOCK_K], bar, gs_bufs.index(stage))
            tma.async_copy_global_to_shared(w2_desc, [e * F + n * BLOCK_N, k * BLOCK_K], bar, w2_bufs.index(stage))
            if SWIGLU:
                tma.async_copy_global_to_shared(w3_desc, [e * D + k * BLOCK_K, n * BLOCK_N], bar,
                                                w3_bufs.index(stage))
            pos += 1


@gluon.jit
def _pingpong_step(bufs, ready, stage, phase, acc_u, acc_g, acc_u3, use_acc: gl.constexpr, ACT: gl.constexpr,
                   KEEP_U: gl.constexpr = False):
    """One K step of a ping-pong consumer: wait for the stage, issue its wgmmas (use_acc=False: the
    job's first, from zero), and wait for the step before's, so that this step's stay in flight
    (the step before has then read its stage). KEEP_U: g's wgmma only (u is read)."""
    xs_bufs, gs_bufs, w1_bufs, w2_bufs, hw_bufs, du_bufs, w3_bufs, du3_bufs = bufs
    mbarrier.wait(ready.index(stage), phase)
    if KEEP_U:
        acc_g = warpgroup_mma(gs_bufs.index(stage), w2_bufs.index(stage).permute((1, 0)), acc_g,
                              use_acc=use_acc, is_async=True)
        acc_g = warpgroup_mma_wait(num_outstanding=1, deps=(acc_g,))
    else:
        acc_u = warpgroup_mma(xs_bufs.index(stage), w1_bufs.index(stage), acc_u, use_acc=use_acc, is_async=True)
        acc_g = warpgroup_mma(gs_bufs.index(stage), w2_bufs.index(stage).permute((1, 0)), acc_g, use_acc=use_acc,
                              is_async=True)
        if ACT == 3:
            acc_u3 = warpgroup_mma(xs_bufs.index(stage), w3_bufs.index(stage), acc_u3, use_acc=use_acc,
                                   is_async=True)
            acc_u, acc_g, acc_u3 = warpgroup_mma_wait(num_outstanding=3, deps=(acc_u, acc_g, acc_u3))
        else:
            acc_u, acc_g = warpgroup_mma_wait(num_outstanding=2, deps=(acc_u, acc_g))
    return acc_u, acc_g, acc_u3


@gluon.jit
def _consume(descs, bufs, bars, ptrs, sizes, which, ACT: gl.constexpr, KEEP_U: gl.constexpr = False):
    """This program's jobs i with i % 2 == which: the dots over the ring, then the epilogue.
    KEEP_U: the job's u tile (b1 in it) is loaded from u_ptr before this consumer's turn, and
    only g's dots run."""
    xs_desc, gs_desc, w1_desc, w2_desc, hw_desc, du_desc, w3_desc, du3_desc = descs
    xs_bufs, gs_bufs, w1_bufs, w2_bufs, hw_bufs, du_bufs, w3_bufs, du3_bufs = bufs
    ready, empty, turn = bars
    b1_ptr, weight_ptr, gw_ptr, u_ptr, slot_pair_ptr, tile_expert_ptr = ptrs
    PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1, TILE = sizes
    TILE_M: gl.constexpr = xs_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = xs_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w1_desc.block_type.shape[1]
    NBUF: gl.constexpr = xs_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    hw_buf = hw_bufs.index(which)
    du_buf = du_bufs.index(which)
    du3_buf = du3_bufs.index(which)
    ksteps = D // BLOCK_K
    i = 0  # this program's jobs
    own = 0  # this consumer's
    for job in range(gl.program_id(0), NUM_JOBS, gl.num_programs(0)):
        if i % 2 == which:
            row, t, n = _job(job, F, TILE, TILE_M, BLOCK_N)
            e = gl.load(tile_expert_ptr + t)
            offs_n = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_layout)
            acc_u = gl.zeros([TILE_M, BLOCK_N], gl.float32, acc_layout)
            acc_g = gl.zeros([TILE_M, BLOCK_N], gl.float32, acc_layout)
            acc_u3 = gl.zeros([TILE_M, BLOCK_N], gl.float32, acc_layout)
            # The epilogue's operands are loaded before this consumer's turn, while the other runs
            # its dots (_job_rows).
            offs_s, valid, w, bias = _job_rows(row, e, offs_n, slot_pair_ptr, weight_ptr, b1_ptr, PAIRS, F, has_b1,
                                               TILE_M, rows_layout, cols_layout)
            if KEEP_U:
                u = gl.load(u_ptr + offs_s.to(gl.int64)[:, None] * F + offs_n[None, :])  # int64: S·F may pass 2³¹
            # Consumer 0 goes first: a fresh barrier passes a wait on parity 1.
            mbarrier.wait(turn.index(which), (own & 1) ^ (1 - which))
            pos = i * ksteps
            # The first K step (D ≥ BLOCK_K) out of the loop, from zero accumulators that its
            # wgmmas leave out (use_acc=False) rather than registers zeroed every job (CS2R).
            stage = pos % NBUF
            acc_u, acc_g, acc_u3 = _pingpong_step(bufs, ready, stage, (pos // NBUF) & 1, acc_u, acc_g, acc_u3,
                                                  False, ACT, KEEP_U)
            prev = stage
            pos += 1
            for k in range(1, ksteps):
                stage = pos % NBUF
                acc_u, acc_g, acc_u3 = _pingpong_step(bufs, ready, stage, (pos // NBUF) & 1, acc_u, acc_g, acc_u3,
                                                      True, ACT, KEEP_U)
                mbarrier.arrive(empty.index(prev), count=1)
                prev = stage
                pos += 1
            if KEEP_U:
                acc_g = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g,))
            elif ACT == 3:
                acc_u, acc_g, acc_u3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc_u, acc_g, acc_u3))
            else:
                acc_u, acc_g = warpgroup_mma_wait(num_outstanding=0, deps=(acc_u, acc_g))
            mbarrier.arrive(empty.index(prev), count=1)
            mbarrier.arrive(turn.index(1 - which), count=1)  # the other consumer's K loop may start
            own += 1
            if KEEP_U:
                acc_u = u.to(gl.float32)
            else:
                acc_u = acc_u + bias[None, :]
            _epilogue(acc_u, acc_g, acc_u3, w, valid, offs_s, offs_n, row, n,
                      (hw_buf, du_buf, du3_buf), (hw_desc, du_desc, du3_desc), gw_ptr, GW_COLS, ACT)
        i += 1
    tma.store_wait(0)


@gluon.jit
def _consume_gelu(descs, bufs, bars, ptrs, sizes, which):
    _consume(descs, bufs, bars, ptrs, sizes, which, 0)


@gluon.jit
def _consume_gelu_tanh(descs, bufs, bars, ptrs, sizes, which):
    _consume(descs, bufs, bars, ptrs, sizes, which, 1)


@gluon.jit
def _consume_silu(descs, bufs, bars, ptrs, sizes, which):
    _consume(descs, bufs, bars, ptrs, sizes, which, 2)


@gluon.jit
def _consume_swiglu(descs, bufs, bars, ptrs, sizes, which):
    _consume(descs, bufs, bars, ptrs, sizes, which, 3)


@gluon.jit
def _consume_gelu_kept(descs, bufs, bars, ptrs, sizes, which):
    _consume(descs, bufs, bars, ptrs, sizes, which, 0, True)


@gluon.jit
def _consume_gelu_tanh_kept(descs, bufs, bars, ptrs, sizes, which):
    _consume(descs, bufs, bars, ptrs, sizes, which, 1, True)


@gluon.jit
def _consume_silu_kept(descs, bufs, bars, ptrs, sizes, which):
    _consume(descs, bufs, bars, ptrs, sizes, which, 2, True)


@gluon.jit
def _produce_two(descs, bufs, bars, ptrs, sizes):
    _produce(descs, bufs, bars, ptrs, sizes, False)


@gluon.jit
def _produce_three(descs, bufs, bars, ptrs, sizes):
    _produce(descs, bufs, bars, ptrs, sizes, True)


@gluon.jit
def _produce_kept(descs, bufs, bars, ptrs, sizes):
    _produce(descs, bufs, bars, ptrs, sizes, False, True)


@gluon.jit
def _pingpong_barriers(NBUF: gl.constexpr):
    """(ready, empty) a ring stage, each of count 1, and turn, one a consumer (the ping-pong kernels)."""
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NBUF):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for c in gl.static_range(2):
        mbarrier.init(turn.index(c), count=1)
    return ready, empty, turn


@gluon.jit
def _hidden_kernel(xs_desc, gs_desc, w1_desc, w2_desc, hw_desc, du_desc, w3_desc, du3_desc,
                   b1_ptr, weight_ptr, gw_ptr, u_ptr, slot_pair_ptr, tile_expert_ptr,
                   PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1, TILE,
                   ACT: gl.constexpr, NBUF: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr, KEEP_U: gl.constexpr = False):
    # Host descriptors, unlike the other two Gluon kernels: made on the device (tma.make_tensor_descriptor,
    # each partition its own) this kernel took 579 against 500 us a large-preset call on the H200
    # (session 13, bench/results/kernel_times.txt), for ~140 us less host time a launch.
    dtype: gl.constexpr = xs_desc.dtype
    xs_bufs = gl.allocate_shared_memory(dtype, [NBUF] + xs_desc.block_type.shape, xs_desc.layout)
    gs_bufs = gl.allocate_shared_memory(dtype, [NBUF] + gs_desc.block_type.shape, gs_desc.layout)
    w1_bufs = gl.allocate_shared_memory(dtype, [NBUF] + w1_desc.block_type.shape, w1_desc.layout)
    w2_bufs = gl.allocate_shared_memory(dtype, [NBUF] + w2_desc.block_type.shape, w2_desc.layout)
    hw_bufs = gl.allocate_shared_memory(dtype, [2] + hw_desc.block_type.shape, hw_desc.layout)
    du_bufs = gl.allocate_shared_memory(dtype, [2] + du_desc.block_type.shape, du_desc.layout)
    w3_bufs, du3_bufs = w1_bufs, du_bufs  # stand-ins, never read, but with swiglu
    if ACT == 3:
        w3_bufs = gl.allocate_shared_memory(dtype, [NBUF] + w3_desc.block_type.shape, w3_desc.layout)
        du3_bufs = gl.allocate_shared_memory(dtype, [2] + du3_desc.block_type.shape, du3_desc.layout)
    ready, empty, turn = _pingpong_barriers(NBUF)
    args = ((xs_desc, gs_desc, w1_desc, w2_desc, hw_desc, du_desc, w3_desc, du3_desc),
            (xs_bufs, gs_bufs, w1_bufs, w2_bufs, hw_bufs, du_bufs, w3_bufs, du3_bufs), (ready, empty, turn),
            (b1_ptr, weight_ptr, gw_ptr, u_ptr, slot_pair_ptr, tile_expert_ptr),
            (PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1, TILE))
    zero = gl.program_id(0) * 0  # which consumer, as a runtime value (see above)
    # The default partition (this kernel's 4 warps) is consumer 0; the workers are consumer 1 (a
    # warpgroup) and the producer (one warp, the fewest registers a warp can have).
    if KEEP_U and ACT == 0:
        gl.warp_specialize([(_consume, args + (zero, ACT, KEEP_U)), (_consume_gelu_kept, args + (zero + 1,)),
                            (_produce_kept, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif KEEP_U and ACT == 1:
        gl.warp_specialize([(_consume, args + (zero, ACT, KEEP_U)), (_consume_gelu_tanh_kept, args + (zero + 1,)),
                            (_produce_kept, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif KEEP_U:
        gl.warp_specialize([(_consume, args + (zero, ACT, KEEP_U)), (_consume_silu_kept, args + (zero + 1,)),
                            (_produce_kept, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif ACT == 0:
        gl.warp_specialize([(_consume, args + (zero, ACT)), (_consume_gelu, args + (zero + 1,)), (_produce_two, args)],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif ACT == 1:
        gl.warp_specialize([(_consume, args + (zero, ACT)), (_consume_gelu_tanh, args + (zero + 1,)),
                            (_produce_two, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif ACT == 2:
        gl.warp_specialize([(_consume, args + (zero, ACT)), (_consume_silu, args + (zero + 1,)), (_produce_two, args)],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consume, args + (zero, ACT)), (_consume_swiglu, args + (zero + 1,)),
                            (_produce_three, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------------------------------------
# The hidden kernel, cooperative (TILE 128, no swiglu, D ≥ COOP_MIN_D): a job is a tile's 128 rows
# by BLOCK_N columns; a producer warp fills the ring with xs's and gs's two [64, BK] halves and one
# W1 and one W2 block a stage, and two consumer warpgroups each own 64 rows of every job, both
# reading the stage's W blocks (the cooperative ring of the weight-gradient kernel below, "empty"
# counting both). A [64, 128] unit of work then loads 32 KiB a K step instead of the ping-pong's
# 48: that kernel is bound by its tile loads at large (its K loop with no wgmmas alone takes 1208
# of ~1480 us, gluon_probe.txt run 13). The price: both consumers run their epilogues at once,
# where the ping-pong hides one behind the other's dots, so the short K loops of D = 256 (medium)
# gain nothing. H200, bf16, BK 32 with 5 stages against the ping-pong (run 14, side by side,
# twice): large gelu 1449-1457 against 1473-1526 us, silu 1334-1343 against 1426-1485; medium
# gelu 147-148 against 146, silu 129 against 124-126.


@gluon.jit
def _coop_produce(descs, bufs, bars, ptrs, sizes, KEEP_U: gl.constexpr = False):
    xs_desc, gs_desc, w1_desc, w2_desc, hw_desc, du_desc = descs
    xs_bufs, gs_bufs, w1_bufs, w2_bufs, hw_bufs, du_bufs = bufs
    ready, empty = bars
    b1_ptr, weight_ptr, gw_ptr, u_ptr, slot_pair_ptr, tile_expert_ptr = ptrs
    PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1, TILE = sizes
    HALF: gl.constexpr = xs_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = xs_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w1_desc.block_type.shape[1]
    if KEEP_U:  # u is read, not computed: the stages hold gs and W2 only
        nbytes: gl.constexpr = 2 * gs_desc.block_type.nbytes + w2_desc.block_type.nbytes
    else:
        nbytes: gl.constexpr = 4 * xs_desc.block_type.nbytes + 2 * w1_desc.block_type.nbytes
    ksteps = D // BLOCK_K
    pos = 0
    for job in range(gl.program_id(0), NUM_JOBS, gl.num_programs(0)):
        row, t, n = _job(job, F, TILE, 2 * HALF, BLOCK_N)
        e = gl.load(tile_expert_ptr + t)
        for k in range(ksteps):
            stage = _ring_claim(ready, empty, pos, nbytes)
            bar = ready.index(stage)
            if not KEEP_U:
                tma.async_copy_global_to_shared(w1_desc, [e * D + k * BLOCK_K, n * BLOCK_N], bar,
                                                w1_bufs.index(stage))
                tma.async_copy_global_to_shared(xs_desc, [row, k * BLOCK_K], bar, xs_bufs.index(2 * stage))
                tma.async_copy_global_to_shared(xs_desc, [row + HALF, k * BLOCK_K], bar,
                                                xs_bufs.index(2 * stage + 1))
            tma.async_copy_global_to_shared(w2_desc, [e * F + n * BLOCK_N, k * BLOCK_K], bar, w2_bufs.index(stage))
            tma.async_copy_global_to_shared(gs_desc, [row, k * BLOCK_K], bar, gs_bufs.index(2 * stage))
            tma.async_copy_global_to_shared(gs_desc, [row + HALF, k * BLOCK_K], bar, gs_bufs.index(2 * stage + 1))
            pos += 1


@gluon.jit
def _coop_step(bufs, ready, pos, which, acc_u, acc_g, use_acc: gl.constexpr, KEEP_U: gl.constexpr = False):
    """One K step of a cooperative consumer on its half of the ring's pos-th stage (see
    _pingpong_step; KEEP_U: g's wgmma only)."""
    xs_bufs, gs_bufs, w1_bufs, w2_bufs, hw_bufs, du_bufs = bufs
    NBUF: gl.constexpr = w1_bufs.type.shape[0]
    stage = pos % NBUF
    mbarrier.wait(ready.index(stage), (pos // NBUF) & 1)
    if KEEP_U:
        acc_g = warpgroup_mma(gs_bufs.index(2 * stage + which), w2_bufs.index(stage).permute((1, 0)), acc_g,
                              use_acc=use_acc, is_async=True)
        acc_g = warpgroup_mma_wait(num_outstanding=1, deps=(acc_g,))
    else:
        acc_u = warpgroup_mma(xs_bufs.index(2 * stage + which), w1_bufs.index(stage), acc_u, use_acc=use_acc,
                              is_async=True)
        acc_g = warpgroup_mma(gs_bufs.index(2 * stage + which), w2_bufs.index(stage).permute((1, 0)), acc_g,
                              use_acc=use_acc, is_async=True)
        acc_u, acc_g = warpgroup_mma_wait(num_outstanding=2, deps=(acc_u, acc_g))
    return acc_u, acc_g


@gluon.jit
def _coop_consume(descs, bufs, bars, ptrs, sizes, which, ACT: gl.constexpr, KEEP_U: gl.constexpr = False):
    """Rows [which·64, which·64 + 64) of every job's 128: both dots over the ring, then _epilogue
    (KEEP_U: the rows' u tile, b1 in it, loaded from u_ptr before the K loop, and g's dots only)."""
    xs_desc, gs_desc, w1_desc, w2_desc, hw_desc, du_desc = descs
    xs_bufs, gs_bufs, w1_bufs, w2_bufs, hw_bufs, du_bufs = bufs
    ready, empty = bars
    b1_ptr, weight_ptr, gw_ptr, u_ptr, slot_pair_ptr, tile_expert_ptr = ptrs
    PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1, TILE = sizes
    HALF: gl.constexpr = xs_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = xs_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w1_desc.block_type.shape[1]
    NBUF: gl.constexpr = w1_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    staging = (hw_bufs.index(which), du_bufs.index(which), du_bufs.index(which))
    ksteps = D // BLOCK_K
    pos = 0
    for job in range(gl.program_id(0), NUM_JOBS, gl.num_programs(0)):
        row, t, n = _job(job, F, TILE, 2 * HALF, BLOCK_N)
        row = row + which * HALF
        e = gl.load(tile_expert_ptr + t)
        offs_n = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_layout)
        offs_s, valid, w, bias = _job_rows(row, e, offs_n, slot_pair_ptr, weight_ptr, b1_ptr, PAIRS, F, has_b1,
                                           HALF, rows_layout, cols_layout)
        if KEEP_U:
            u = gl.load(u_ptr + offs_s.to(gl.int64)[:, None] * F + offs_n[None, :])
        # The first K step (D ≥ BLOCK_K) from zero accumulators, out of the loop: in it they
        # are constants the wgmma leaves out, not 128 registers zeroed (CS2R) every job.
        acc_u = gl.zeros([HALF, BLOCK_N], gl.float32, acc_layout)
        acc_g = gl.zeros([HALF, BLOCK_N], gl.float32, acc_layout)
        acc_u, acc_g = _coop_step(bufs, ready, pos, which, acc_u, acc_g, False, KEEP_U)
        pos += 1
        for k in range(1, ksteps):
            acc_u, acc_g = _coop_step(bufs, ready, pos, which, acc_u, acc_g, True, KEEP_U)
            mbarrier.arrive(empty.index((pos + NBUF - 1) % NBUF), count=1)
            pos += 1
        if KEEP_U:
            acc_g = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g,))
            acc_u = u.to(gl.float32)
        else:
            acc_u, acc_g = warpgroup_mma_wait(num_outstanding=0, deps=(acc_u, acc_g))
            acc_u = acc_u + bias[None, :]
        mbarrier.arrive(empty.index((pos + NBUF - 1) % NBUF), count=1)
        _epilogue(acc_u, acc_g, acc_g, w, valid, offs_s, offs_n, row, n, staging,
                  (hw_desc, du_desc, du_desc), gw_ptr, GW_COLS, ACT)
    tma.store_wait(0)


@gluon.jit
def _coop_consume_gelu(descs, bufs, bars, ptrs, sizes, which):
    _coop_consume(descs, bufs, bars, ptrs, sizes, which, 0)


@gluon.jit
def _coop_consume_gelu_tanh(descs, bufs, bars, ptrs, sizes, which):
    _coop_consume(descs, bufs, bars, ptrs, sizes, which, 1)


@gluon.jit
def _coop_consume_silu(descs, bufs, bars, ptrs, sizes, which):
    _coop_consume(descs, bufs, bars, ptrs, sizes, which, 2)


@gluon.jit
def _coop_consume_gelu_kept(descs, bufs, bars, ptrs, sizes, which):
    _coop_consume(descs, bufs, bars, ptrs, sizes, which, 0, True)


@gluon.jit
def _coop_consume_gelu_tanh_kept(descs, bufs, bars, ptrs, sizes, which):
    _coop_consume(descs, bufs, bars, ptrs, sizes, which, 1, True)


@gluon.jit
def _coop_consume_silu_kept(descs, bufs, bars, ptrs, sizes, which):
    _coop_consume(descs, bufs, bars, ptrs, sizes, which, 2, True)


@gluon.jit
def _coop_produce_kept(descs, bufs, bars, ptrs, sizes):
    _coop_produce(descs, bufs, bars, ptrs, sizes, True)


@gluon.jit
def _hidden_coop_kernel(xs_desc, gs_desc, w1_desc, w2_desc, hw_desc, du_desc,
                        b1_ptr, weight_ptr, gw_ptr, u_ptr, slot_pair_ptr, tile_expert_ptr,
                        PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1, TILE,
                        ACT: gl.constexpr, NBUF: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                        PRODUCER_REGS: gl.constexpr, KEEP_U: gl.constexpr = False):
    dtype: gl.constexpr = xs_desc.dtype
    xs_bufs = gl.allocate_shared_memory(dtype, [2 * NBUF] + xs_desc.block_type.shape, xs_desc.layout)
    gs_bufs = gl.allocate_shared_memory(dtype, [2 * NBUF] + gs_desc.block_type.shape, gs_desc.layout)
    w1_bufs = gl.allocate_shared_memory(dtype, [NBUF] + w1_desc.block_type.shape, w1_desc.layout)
    w2_bufs = gl.allocate_shared_memory(dtype, [NBUF] + w2_desc.block_type.shape, w2_desc.layout)
    hw_bufs = gl.allocate_shared_memory(dtype, [2] + hw_desc.block_type.shape, hw_desc.layout)
    du_bufs = gl.allocate_shared_memory(dtype, [2] + du_desc.block_type.shape, du_desc.layout)
    ready, empty = _ring_barriers(NBUF)
    args = ((xs_desc, gs_desc, w1_desc, w2_desc, hw_desc, du_desc),
            (xs_bufs, gs_bufs, w1_bufs, w2_bufs, hw_bufs, du_bufs), (ready, empty),
            (b1_ptr, weight_ptr, gw_ptr, u_ptr, slot_pair_ptr, tile_expert_ptr),
            (PAIRS, D, F, GW_COLS, NUM_JOBS, has_b1, TILE))
    zero = gl.program_id(0) * 0  # which consumer, as a runtime value (see _hidden_kernel)
    if KEEP_U and ACT == 0:
        gl.warp_specialize([(_coop_consume, args + (zero, ACT, KEEP_U)), (_coop_consume_gelu_kept, args + (zero + 1,)),
                            (_coop_produce_kept, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif KEEP_U and ACT == 1:
        gl.warp_specialize([(_coop_consume, args + (zero, ACT, KEEP_U)),
                            (_coop_consume_gelu_tanh_kept, args + (zero + 1,)), (_coop_produce_kept, args)],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif KEEP_U:
        gl.warp_specialize([(_coop_consume, args + (zero, ACT, KEEP_U)), (_coop_consume_silu_kept, args + (zero + 1,)),
                            (_coop_produce_kept, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif ACT == 0:
        gl.warp_specialize([(_coop_consume, args + (zero, ACT)), (_coop_consume_gelu, args + (zero + 1,)),
                            (_coop_produce, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif ACT == 1:
        gl.warp_specialize([(_coop_consume, args + (zero, ACT)), (_coop_consume_gelu_tanh, args + (zero + 1,)),
                            (_coop_produce, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_coop_consume, args + (zero, ACT)), (_coop_consume_silu, args + (zero + 1,)),
                            (_coop_produce, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@functools.lru_cache(maxsize=None)
def _layout(block, dtype):
    """The shared-memory layout of a TMA tile: a pure function of its shape and dtype, kept, as
    working it out took ~7 of a descriptor's ~9 us of host time (6 descriptors a call)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def _descriptor(t, block, dtype):
    return TensorDescriptor.from_tensor(t, block, _layout(tuple(block), dtype))


def _gl_dtype(t):
    """Gluon's dtype of a bf16 or fp16 tensor."""
    return gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16


def kernel_args(xs, gs, w1, w2, b1, weight, gw, hw, du, tile_m, block_n, block_k, w3=None, du3=None, u=None):
    """_hidden_kernel's tensor arguments in order, its operands as TMA descriptors (W3 and ∂u3 with
    swiglu, else W1's and ∂u's again; u, the forward's pre-activations with KEEP_U, else hw again)."""
    E, D, F = w1.shape
    dtype = _gl_dtype(xs)
    w1_desc = _descriptor(w1.view(E * D, F), [block_k, block_n], dtype)
    du_desc = _descriptor(du, [tile_m, block_n], dtype)
    return [_descriptor(xs, [tile_m, block_k], dtype), _descriptor(gs, [tile_m, block_k], dtype), w1_desc,
            _descriptor(w2.view(E * F, D), [block_n, block_k], dtype), _descriptor(hw, [tile_m, block_n], dtype),
            du_desc, w1_desc if w3 is None else _descriptor(w3.view(E * D, F), [block_k, block_n], dtype),
            du_desc if du3 is None else _descriptor(du3, [tile_m, block_n], dtype),
            w1 if b1 is None else b1, weight, gw, hw if u is None else u]


def _torch_scratch(size, alignment, stream):
    """Global scratch for a launch (Triton's allocator protocol): torch's caching allocator on the
    current stream and device, whose blocks are 512-byte aligned."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


@contextlib.contextmanager
def device_scratch():
    """Triton's global-scratch allocator for the launches inside (kernels that make their TMA
    descriptors on the device write them there), set in this context only: triton.set_allocator
    would change it for the whole process."""
    token = _allocation._allocator.set(_torch_scratch)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


def _check_hidden(caller, hidden, like, act):
    """KEEP_U's u: a contiguous buffer of `like`'s shape and dtype (h's, hw's), and no swiglu."""
    if hidden is not None and (act == "swiglu" or hidden.shape != like.shape or hidden.dtype != like.dtype
                               or not hidden.is_contiguous()):
        raise ValueError(f"{caller}: hidden {tuple(hidden.shape)} {hidden.dtype} with act={act!r}: takes a contiguous "
                         f"u of shape {tuple(like.shape)} and dtype {like.dtype}, and no swiglu")


def backward_hidden(xs, gs, groups, w1, b1, w2, weight, act, hw, du, gw, w3=None, du3=None, config=None,
                    hidden=None):
    """Writes hw, ∂u [S,F] (∂u3 with swiglu, given W3) and gw[:, :F/64] (gw: fp32 rows [S, ·], or
    some columns of such rows, its row stride passed as GW_COLS) for the slot rows xs, gs [S,D] of
    `groups` (triton_moe.Groups, or one run of its tiles); weight: the flat top-k weights. Callers
    check `unsupported` first. config: default_config's when None (bench/gluon_probe.py passes
    others); one with coop=True runs the cooperative kernel. hidden: the forward's u = xs W1 + b1
    [S,F] (contiguous, h's dtype; not swiglu), read instead of computed (KEEP_U: the stages then
    hold gs and W2 only; xs and W1 are not read)."""
    E, D, F = w1.shape
    _check_hidden("backward_hidden", hidden, hw, act)
    config = config or default_config(act, groups.tile, D, kept=hidden is not None)
    tile_m, block_n, block_k, nbuf = (config[key] for key in ("tile_m", "block_n", "block_k", "nbuf"))
    jobs = groups.num_tiles * (groups.tile // tile_m) * (F // block_n)
    if config.get("coop"):
        if act == "swiglu" or tile_m != 128 or groups.tile != 128:
            raise ValueError(f"the cooperative hidden kernel takes jobs of 128 rows of TILE 128 and no swiglu; "
                             f"got act={act!r}, tile_m={tile_m}, TILE={groups.tile}")
        # a consumer's half of a job: the slot rows in [64, ·] boxes; no W3 or ∂u3
        args = kernel_args(xs, gs, w1, w2, b1, weight, gw, hw, du, tile_m // 2, block_n, block_k, u=hidden)
        kernel, args = _hidden_coop_kernel, args[:6] + args[8:]
    else:
        kernel, args = _hidden_kernel, kernel_args(xs, gs, w1, w2, b1, weight, gw, hw, du, tile_m, block_n,
                                                   block_k, w3, du3, u=hidden)
    launch(kernel, (min(num_sms(xs.device), jobs),),
        *args, groups.slot_pair, groups.tile_expert, groups.pairs, D, F, gw.stride(0), jobs, int(b1 is not None),
        groups.tile, ACT=ACTS[act], NBUF=nbuf, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
        KEEP_U=hidden is not None, num_warps=4)


# ---------------------------------------------------------------------------------------------
# The forward's GEMM1 (GLUON_UP; session 33 took back 192de8d's, which lost to the Triton GEMM1
# before the fast activations): h [S,F] = act(xs[s] W1[e] + b1[e]) over the tile
# rows s of expert e (triton_moe._moe_up_kernel's contract without swiglu's W3: a padding slot's
# row is act(b1[e]), as xs is 0 there). The hidden kernel's ping-pong: a producer warp loads xs
# [TILE_M, BLOCK_K] and W1 [BLOCK_K, BLOCK_N] tiles into the ring; two consumer warpgroups take
# this program's jobs in turn, one running its activation and its TMA store of h while the other
# runs its dots, a job's columns in two halves (UP_CONFIGS). Why: at medium (K = D = 256, four
# k-steps of 64) the Triton GEMM1's gelu epilogue, in line with its dots, is as long as they are
# (73 us a step for 22 us of FLOPs at 790 TFLOP/s, bench/results/step_profile_medium_reuse_new.txt).
# On the H200 (bench/gemm_probe.py --kernels up_gluon, session 34, bench/results/gemm_probe_up_gluon.txt),
# [128, 128] jobs against the autotuned Triton GEMM1 a call: medium 64.2 against 73.1 us with gelu,
# 45.9 against 58.8 with silu; large 657.7 against 720.2 and 573.4 against 669.8. On by default
# since; MHA_COMPILE_GLUON_UP=0 keeps the Triton GEMM1 (read at launch time: bench/flag_ab.py flips it).
GLUON_UP = os.environ.get("MHA_COMPILE_GLUON_UP", "1") != "0"
UP_ACTS = {name: ACT_CODE[name] for name in ("gelu", "gelu_tanh", "silu")}
# By TILE, each the fastest of bench/gemm_probe.py's up_gluon configs on the H200 (session 34):
# TILE 128 (medium, large) [128, 128] jobs, 128 fp32 accumulator registers a thread, in two column
# halves (two wgmmas a K step, each on half the W1 tile), whose activations run one after the
# other: with one [128, 128] accumulator gelu's erf spilled 266 bytes, in halves none (offline,
# sm_90a, session 33). A [128, 128] stage is 32 KiB, four of them and the two staging tiles 192.
# TILE 64 (small) [64, 128] jobs: 7.5 us a call with gelu, 6.7 with silu, against the Triton
# GEMM1's 8.8 and 7.0 and [64, 256] jobs' 9.8 and 7.0.
# A config may also say stage_tiles=2 (two staging tiles a consumer, 1 by default), for
# bench/gemm_probe.py: it lost on the H200 (session 36: [128, 128] at nbuf 3 66.5 us at medium and
# 687.0 at large against these configs' 65.1 and 668.3; bench/results/gemm_probe_up_gluon_stage_tiles.txt).
UP_CONFIGS = {128: dict(tile_m=128, block_n=128, block_k=64, nbuf=4),
              64: dict(tile_m=64, block_n=128, block_k=64, nbuf=4)}


def up_config_fits(config, tile, D, F):
    """Whether a GEMM1 config's blocks tile a layout of TILE-row tiles and W1 [E, D, F]: its
    tile_m divides TILE (a job of more rows would span tiles of two experts), block_n F, block_k D."""
    return tile % config["tile_m"] == 0 and F % config["block_n"] == 0 and D % config["block_k"] == 0


def up_unsupported(xs, w1, h, act, tile, capability=None):
    """Why GEMM1's Gluon kernel cannot take these operands (xs [S, D], W1 [E, D, F], h [S, F]), or None."""
    if act not in UP_ACTS:
        return f"act {act!r}: takes {', '.join(UP_ACTS)} (swiglu's GEMM1 runs in Triton)"
    why = _device_reason((xs, w1, h), "xs, W1, h", capability)
    if why is not None:
        return why
    D, F = w1.shape[1], w1.shape[2]
    config = UP_CONFIGS.get(tile)
    if config is None or not up_config_fits(config, tile, D, F):
        blocks = ", ".join(f"TILE {t}: {c['block_n']} and {c['block_k']}" for t, c in UP_CONFIGS.items())
        return (f"D={D}, F={F}, TILE={tile}: needs TILE in {sorted(UP_CONFIGS)}, F and D multiples of its "
                f"config's block_n and block_k ({blocks})")
    return None


# GEMM1's partitions take (descs, bufs, bars, ptrs, sizes) (+ which), as the hidden kernel's:
#   descs = (xs, W1 as [E·D, F], h, u (KEEP_U: the pre-activations' output; else h's again)) TMA
#   descriptors;  bufs = (xs, W1 rings; h staging tiles, one a
#   consumer);  bars = (ready, empty, turn);  ptrs = (b1, tile_expert);  sizes = (D, F, NUM_JOBS,
#   has_b1, TILE).


@gluon.jit
def _up_produce(descs, bufs, bars, ptrs, sizes):
    xs_desc, w1_desc, h_desc, u_desc = descs
    xs_bufs, w1_bufs, h_bufs = bufs
    ready, empty, turn = bars
    b1_ptr, tile_expert_ptr = ptrs
    D, F, NUM_JOBS, has_b1, TILE = sizes
    TILE_M: gl.constexpr = xs_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = xs_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w1_desc.block_type.shape[1]
    NBUF: gl.constexpr = xs_bufs.type.shape[0]
    nbytes: gl.constexpr = xs_desc.block_type.nbytes + w1_desc.block_type.nbytes
    pos = 0
    for job in range(gl.program_id(0), NUM_JOBS, gl.num_programs(0)):
        row, t, n = _job(job, F, TILE, TILE_M, BLOCK_N)
        e = gl.load(tile_expert_ptr + t)
        for k in range(D // BLOCK_K):
            stage = pos % NBUF
            mbarrier.wait(empty.index(stage), ((pos // NBUF) & 1) ^ 1)  # fresh barriers pass the first NBUF
            bar = ready.index(stage)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(xs_desc, [row, k * BLOCK_K], bar, xs_bufs.index(stage))
            tma.async_copy_global_to_shared(w1_desc, [e * D + k * BLOCK_K, n * BLOCK_N], bar, w1_bufs.index(stage))
            pos += 1


@gluon.jit
def _up_step(xs_bufs, w1_bufs, ready, stage, phase, acc_a, acc_b, use_acc: gl.constexpr):
    """One K step of a GEMM1 consumer, as _pingpong_step's: wait for the stage, issue the wgmmas of
    both column halves, and wait for the step before's."""
    HALF: gl.constexpr = w1_bufs.type.shape[2] // 2
    mbarrier.wait(ready.index(stage), phase)
    xs, w = xs_bufs.index(stage), w1_bufs.index(stage)
    acc_a = warpgroup_mma(xs, w.slice(0, HALF, 1), acc_a, use_acc=use_acc, is_async=True)
    acc_b = warpgroup_mma(xs, w.slice(HALF, HALF, 1), acc_b, use_acc=use_acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=2, deps=(acc_a, acc_b))


@gluon.jit
def _up_consume(descs, bufs, bars, ptrs, sizes, which, ACT: gl.constexpr, KEEP_U: gl.constexpr = False):
    """This program's jobs i with i % 2 == which: the dots over the ring, then the epilogue, each in
    two halves of the job's columns. KEEP_U: u = xs W1 + b1 is stored first, through the same
    staging tile (whose store must then leave it before h goes in)."""
    xs_desc, w1_desc, h_desc, u_desc = descs
    xs_bufs, w1_bufs, h_bufs = bufs
    ready, empty, turn = bars
    b1_ptr, tile_expert_ptr = ptrs
    D, F, NUM_JOBS, has_b1, TILE = sizes
    TILE_M: gl.constexpr = xs_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = xs_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w1_desc.block_type.shape[1]
    HALF: gl.constexpr = BLOCK_N // 2
    NBUF: gl.constexpr = xs_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HALF, 16])
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    TILES: gl.constexpr = h_bufs.type.shape[0] // 2  # staging tiles a consumer
    ksteps = D // BLOCK_K
    i = 0
    own = 0
    for job in range(gl.program_id(0), NUM_JOBS, gl.num_programs(0)):
        if i % 2 == which:
            row, t, n = _job(job, F, TILE, TILE_M, BLOCK_N)
            e = gl.load(tile_expert_ptr + t)
            bias_a = gl.zeros([HALF], gl.float32, cols_layout)
            bias_b = gl.zeros([HALF], gl.float32, cols_layout)
            if has_b1 != 0:
                cols = e * F + n * BLOCK_N + gl.arange(0, HALF, layout=cols_layout)
                bias_a = gl.load(b1_ptr + cols).to(gl.float32)
                bias_b = gl.load(b1_ptr + cols + HALF).to(gl.float32)
            acc_a = gl.zeros([TILE_M, HALF], gl.float32, acc_layout)
            acc_b = gl.zeros([TILE_M, HALF], gl.float32, acc_layout)
            mbarrier.wait(turn.index(which), (own & 1) ^ (1 - which))  # consumer 0 first, as in _consume
            pos = i * ksteps
            # the first K step from zero accumulators its wgmmas leave out (use_acc=False), as _consume's
            stage = pos % NBUF
            acc_a, acc_b = _up_step(xs_bufs, w1_bufs, ready, stage, (pos // NBUF) & 1, acc_a, acc_b, False)
            prev = stage
            pos += 1
            for k in range(1, ksteps):
                stage = pos % NBUF
                acc_a, acc_b = _up_step(xs_bufs, w1_bufs, ready, stage, (pos // NBUF) & 1, acc_a, acc_b, True)
                mbarrier.arrive(empty.index(prev), count=1)
                prev = stage
                pos += 1
            acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a, acc_b))
            mbarrier.arrive(empty.index(prev), count=1)
            mbarrier.arrive(turn.index(1 - which), count=1)
            # with two staging tiles a consumer, the job before's store may still be reading the
            # other one: only the store before that, from this one, must have left
            h_buf = h_bufs.index(which * TILES + own % TILES)
            own += 1
            tma.store_wait(TILES - 1)
            if KEEP_U:
                h_buf.slice(0, HALF, 1).store((acc_a + bias_a[None, :]).to(u_desc.dtype))
                h_buf.slice(HALF, HALF, 1).store((acc_b + bias_b[None, :]).to(u_desc.dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(u_desc, [row, n * BLOCK_N], h_buf)
                tma.store_wait(0)
            u = acc_a + bias_a[None, :]
            h_buf.slice(0, HALF, 1).store(act_fwd(u, u, ACT).to(h_desc.dtype))
            u = acc_b + bias_b[None, :]
            h_buf.slice(HALF, HALF, 1).store(act_fwd(u, u, ACT).to(h_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(h_desc, [row, n * BLOCK_N], h_buf)
        i += 1
    tma.store_wait(0)


@gluon.jit
def _up_consume_gelu(descs, bufs, bars, ptrs, sizes, which):
    _up_consume(descs, bufs, bars, ptrs, sizes, which, 0)


@gluon.jit
def _up_consume_gelu_tanh(descs, bufs, bars, ptrs, sizes, which):
    _up_consume(descs, bufs, bars, ptrs, sizes, which, 1)


@gluon.jit
def _up_consume_silu(descs, bufs, bars, ptrs, sizes, which):
    _up_consume(descs, bufs, bars, ptrs, sizes, which, 2)


@gluon.jit
def _up_consume_gelu_kept(descs, bufs, bars, ptrs, sizes, which):
    _up_consume(descs, bufs, bars, ptrs, sizes, which, 0, True)


@gluon.jit
def _up_consume_gelu_tanh_kept(descs, bufs, bars, ptrs, sizes, which):
    _up_consume(descs, bufs, bars, ptrs, sizes, which, 1, True)


@gluon.jit
def _up_consume_silu_kept(descs, bufs, bars, ptrs, sizes, which):
    _up_consume(descs, bufs, bars, ptrs, sizes, which, 2, True)


@gluon.jit
def _up_kernel(xs_desc, w1_desc, h_desc, u_desc, b1_ptr, tile_expert_ptr, D, F, NUM_JOBS, has_b1, TILE,
               ACT: gl.constexpr, NBUF: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
               KEEP_U: gl.constexpr = False, STAGE_TILES: gl.constexpr = 1):
    dtype: gl.constexpr = xs_desc.dtype
    xs_bufs = gl.allocate_shared_memory(dtype, [NBUF] + xs_desc.block_type.shape, xs_desc.layout)
    w1_bufs = gl.allocate_shared_memory(dtype, [NBUF] + w1_desc.block_type.shape, w1_desc.layout)
    h_bufs = gl.allocate_shared_memory(dtype, [2 * STAGE_TILES] + h_desc.block_type.shape, h_desc.layout)
    ready, empty, turn = _pingpong_barriers(NBUF)
    args = ((xs_desc, w1_desc, h_desc, u_desc), (xs_bufs, w1_bufs, h_bufs), (ready, empty, turn),
            (b1_ptr, tile_expert_ptr), (D, F, NUM_JOBS, has_b1, TILE))
    zero = gl.program_id(0) * 0  # which consumer, as a runtime value (see the hidden kernel)
    if KEEP_U and ACT == 0:
        gl.warp_specialize([(_up_consume, args + (zero, ACT, KEEP_U)), (_up_consume_gelu_kept, args + (zero + 1,)),
                            (_up_produce, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif KEEP_U and ACT == 1:
        gl.warp_specialize([(_up_consume, args + (zero, ACT, KEEP_U)),
                            (_up_consume_gelu_tanh_kept, args + (zero + 1,)), (_up_produce, args)],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif KEEP_U:
        gl.warp_specialize([(_up_consume, args + (zero, ACT, KEEP_U)), (_up_consume_silu_kept, args + (zero + 1,)),
                            (_up_produce, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif ACT == 0:
        gl.warp_specialize([(_up_consume, args + (zero, ACT)), (_up_consume_gelu, args + (zero + 1,)),
                            (_up_produce, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif ACT == 1:
        gl.warp_specialize([(_up_consume, args + (zero, ACT)), (_up_consume_gelu_tanh, args + (zero + 1,)),
                            (_up_produce, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_up_consume, args + (zero, ACT)), (_up_consume_silu, args + (zero + 1,)),
                            (_up_produce, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def experts_up(xs, groups, w1, b1, act, h, config=None, hidden=None):
    """Writes h [S,F] = act(xs W1[e] + b1[e]) for the slot rows xs [S,D] of `groups`; returns h.
    Callers check `up_unsupported` first. config: UP_CONFIGS[TILE] when None (probes pass others).
    hidden: an [S,F] buffer (h's dtype, contiguous) that u = xs W1[e] + b1[e] is also written into
    (KEEP_U)."""
    E, D, F = w1.shape
    config = config or UP_CONFIGS[groups.tile]
    tile_m, block_n, block_k, nbuf = (config[key] for key in ("tile_m", "block_n", "block_k", "nbuf"))
    if not up_config_fits(config, groups.tile, D, F):
        raise ValueError(f"experts_up: config {config} on TILE {groups.tile}, D={D}, F={F}: tile_m must divide "
                         f"TILE, block_n F and block_k D")
    _check_hidden("experts_up", hidden, h, act)
    jobs = groups.num_tiles * (groups.tile // tile_m) * (F // block_n)
    dtype = _gl_dtype(xs)
    h_desc = _descriptor(h, [tile_m, block_n], dtype)
    launch(_up_kernel, (min(num_sms(xs.device), jobs),),
        _descriptor(xs, [tile_m, block_k], dtype), _descriptor(w1.view(E * D, F), [block_k, block_n], dtype),
        h_desc, h_desc if hidden is None else _descriptor(hidden, [tile_m, block_n], dtype),
        w1 if b1 is None else b1, groups.tile_expert, D, F, jobs, int(b1 is not None), groups.tile,
        ACT=UP_ACTS[act], NBUF=nbuf, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
        KEEP_U=hidden is not None, STAGE_TILES=config.get("stage_tiles", 1), num_warps=4)
    return h


# ---------------------------------------------------------------------------------------------
# The cooperative GEMMs' ring (the weight-gradient GEMM and GEMM2 below): a producer warp fills its
# NBUF stages (ready: the stage's TMA loads have landed), two consumer warpgroups read each stage
# (empty: both are done with it, a barrier of count 2), each issuing one wgmma a K step, left in
# flight until its next one is issued.


@gluon.jit
def _ring_barriers(NBUF: gl.constexpr):
    """(ready, empty): a stage's barriers, "empty" counting both consumers' releases."""
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NBUF):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    return ready, empty


@gluon.jit
def _ring_claim(ready, empty, pos, nbytes: gl.constexpr):
    """The producer's stage for ring position pos, once both consumers are done with its last use,
    set to expect nbytes of TMA loads."""
    NBUF: gl.constexpr = ready.type.shape[0]
    stage = pos % NBUF
    # Barriers start with phase 1 complete: the first NBUF waits on "empty" pass.
    mbarrier.wait(empty.index(stage), ((pos // NBUF) & 1) ^ 1)
    mbarrier.expect(ready.index(stage), nbytes)
    return stage


@gluon.jit
def _ring_dot(a, b, acc, ready, empty, pos, release):
    """A consumer's K step at ring position pos: acc + a b (a, b: views of the stage), issued once
    the stage has landed and left in flight. The step before has then finished reading its stage,
    which is released when `release` (there was a step before in this job)."""
    NBUF: gl.constexpr = ready.type.shape[0]
    mbarrier.wait(ready.index(pos % NBUF), (pos // NBUF) & 1)
    acc = warpgroup_mma(a, b, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    if release:
        mbarrier.arrive(empty.index((pos + NBUF - 1) % NBUF), count=1)
    return acc


@gluon.jit
def _ring_drain(acc, empty, pos, release):
    """acc once a job's last wgmma is done; its stage (ring position pos − 1) released when
    `release` (the job had K steps)."""
    NBUF: gl.constexpr = empty.type.shape[0]
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    if release:
        mbarrier.arrive(empty.index((pos + NBUF - 1) % NBUF), count=1)
    return acc


# ---------------------------------------------------------------------------------------------
# The weight-gradient GEMM: ∂W[e] [I,J] = Σ_{s ∈ e} A[s]ᵀ B[s] over expert e's slots (A [S,I]: xs or
# hw; B [S,J]: ∂u or gs), triton_moe._moe_wgrad_kernel's contract for one B and SPLIT 1: written in
# the output's dtype, or with `accumulate` added into fp32 totals, leaving an expert with no slots
# here untouched (the runs of tiles). One program per SM walks the (e, I block, J block) jobs,
# expert-major (the jobs running together share an expert's K window in L2); a producer warp
# issues TMA loads of A's two [BK, 64] halves of the job's 128 rows and B's [BK, BN] tile; two
# consumer warpgroups each own 64 rows ("cooperative": both wait on a stage, each feeds its half
# of A transposed from shared memory to its wgmma, and the stage is free after both arrive).
# Each expert's slot range is whole tiles (TILE ≥ 64 here), so BK = 64 never crosses into the
# next expert's rows. H200, large, whole layout, bf16 (bench/gluon_wgrad_probe.py): ∂W1 435
# against 575 us, ∂W2 440 against 604.
WGRAD_BK, WGRAD_NBUF = 64, 3


def wgrad_unsupported(a, b, tile, capability=None):
    """Why the weight-gradient kernel cannot take these slot rows, or None when it can."""
    why = _device_reason((a, b), "the slot rows A, B", capability)
    if why is not None:
        return why
    I, J = a.shape[1], b.shape[1]
    if I % 128 or J % 128 or tile % WGRAD_BK:
        return f"I={I}, J={J}, TILE={tile}: needs I and J multiples of 128 and TILE of {WGRAD_BK}"
    return None


@gluon.jit
def _wjob(job, I, J, SPLIT, BM: gl.constexpr, BN: gl.constexpr):
    """(e·SPLIT + c, first row of its ∂W block, first column) of a job, expert-major, then split c."""
    ni = I // BM
    nj = J // BN
    ec = job // (ni * nj)
    rest = job - ec * (ni * nj)
    i = rest // nj
    return ec, i * BM, (rest - i * nj) * BN


@gluon.jit
def _wslots(expert_slots_ptr, E, ec, SPLIT, TILE):
    """[lo, hi): the slots of split c of expert e (ec = e·SPLIT + c), the c-th of SPLIT equal runs
    of whole tiles, as triton_moe._moe_wgrad_kernel cuts them."""
    e = ec // SPLIT
    c = ec - e * SPLIT
    lo = gl.load(expert_slots_ptr + e)
    hi = gl.load(expert_slots_ptr + E + e)
    run = gl.cdiv((hi - lo) // TILE, SPLIT) * TILE
    lo = gl.minimum(lo + c * run, hi)
    return lo, gl.minimum(lo + run, hi)


# STREAM's experts at most: a vector of them in each partition (128 spilled in the producer's 24 registers)
STREAM_EXPERTS = gl.constexpr(32)


@gluon.jit
def _add_i32(a, b):
    return a + b


@gluon.jit
def _stream_experts(expert_slots_ptr, E, tiles, BK: gl.constexpr):
    """STREAM's run as [STREAM_EXPERTS] vectors: each expert's first slot, its K steps n_e =
    (hi − lo)/BK, the first and last + 1 of its tiles' K steps (its `tiles` tiles of n_e steps,
    expert-major), and the last + 1 of its tiles (none for an expert without slots)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    offs = gl.arange(0, STREAM_EXPERTS, layout=layout)
    ok = offs < E
    lo = gl.load(expert_slots_ptr + offs, mask=ok, other=0)
    n = (gl.load(expert_slots_ptr + E + offs, mask=ok, other=0) - lo) // BK
    ends = gl.associative_scan(n * tiles, 0, _add_i32)
    tile_ends = gl.associative_scan((n > 0).to(gl.int32) * tiles, 0, _add_i32)
    return lo, n, ends - n * tiles, ends, tile_ends


@gluon.jit
def _stream_pick(experts, e):
    """(first slot, K steps, first K step, last tile + 1) of expert e."""
    lo, n, begins, ends, tile_ends = experts
    pick = gl.arange(0, lo.shape[0], layout=lo.type.layout) == e
    n_e = gl.sum(gl.where(pick, n, 0), 0)
    return (gl.sum(gl.where(pick, lo, 0), 0), n_e, gl.sum(gl.where(pick, begins, 0), 0),
            gl.sum(gl.where(pick, tile_ends, 0), 0))


@gluon.jit
def _stream_share(experts, tiles):
    """This program's work in the run: the tiles done whole (whole waves of them, the same for every
    program: it takes tiles pid, pid + P, ... below it), then its share [first, last + 1) of the
    rest's K steps, and the program whose share holds the step before its first (the one it waits
    for, if it waits)."""
    lo, n, begins, ends, tile_ends = experts
    programs = gl.num_programs(0)
    count = gl.max(tile_ends, 0)
    whole = count // programs * programs
    e = gl.sum((tile_ends <= whole).to(gl.int32), 0)
    lo_e, n_e, begin_e, end_tile_e = _stream_pick(experts, e)
    total = gl.max(ends, 0)
    rest = gl.where(whole < count, begin_e + (whole - (end_tile_e - tiles)) * n_e, total).to(gl.int64)
    left = total.to(gl.int64) - rest
    pid = gl.program_id(0).to(gl.int64)
    start = pid * left // programs
    before = (start * programs + left - 1) // gl.maximum(left, 1) - 1  # ⌈start·P/T⌉ − 1
    end = rest + (pid + 1) * left // programs
    return whole, (rest + start).to(gl.int32), end.to(gl.int32), before.to(gl.int32)


@gluon.jit
def _stream_tile(experts, t, tiles, ni, BK: gl.constexpr):
    """Tile t of the run, done whole: (e, I block, J block, first slot, slot past the last)."""
    e = gl.sum((experts[4] <= t).to(gl.int32), 0)
    lo_e, n_e, begin_e, end_tile_e = _stream_pick(experts, e)
    q = t - (end_tile_e - tiles)
    return e, q % ni, q // ni, lo_e, lo_e + n_e * BK


@gluon.jit
def _stream_piece(experts, it, start, ni, BK: gl.constexpr):
    """The piece of a program's share [start, it) in the tile of K step it − 1: (e, I block, J block,
    first slot, slot past the last, whether it waits for the program before (not the tile's
    first step), whether it raises its flag (not the tile's last), where the walk goes on)."""
    e = gl.sum((experts[3] < it).to(gl.int32), 0)
    lo_e, n_e, base, end_tile_e = _stream_pick(experts, e)
    q = (it - 1 - base) // n_e
    first = base + q * n_e
    k0 = gl.maximum(start - first, 0)
    k1 = it - first
    return e, q % ni, q // ni, lo_e + k0 * BK, lo_e + k1 * BK, k0 > 0, k1 < n_e, first + k0


# Partitions take (descs, bufs, bars, ptrs, sizes) (+ which, a runtime value, as above):
#   descs = (A, B, S), from which each makes its descriptors (_wgrad_descriptors): A as [S, I] in
#           [BK, 64] blocks, B as [S, J] in [BK, BN] blocks;
#   bufs  = (A ring [2·NBUF, BK, 64] (stage·2 + half), B ring [NBUF, BK, BN]);
#   bars  = (ready, empty) a stage;  ptrs = (out [E·SPLIT·I, J], expert_slots [2E], sums [E·SPLIT·sum_rows, J],
#           flags [programs · 2 · 128], for STREAM; closing, for `finish`: (final [E·I, J], the whole
#           layout's expert_slots [2E], pending [E], this run's first slot S0 in it, its slots S, finish));
#   sizes = (I, J, E, JOBS, accumulate, SPLIT, TILE, has_sums, sum_rows): Σb in sum_rows rows an
#           expert, row i summed by the jobs of row block i over 1/sum_rows of the K steps
#           (_wgrad_summing). Triton builds sum_rows = 1, the default, as a constant: its branches
#           below then fold to the code as it was before the spread (the same SASS, sm_90a).
#
# STREAM (accumulate only: the runs of tiles): one run holds a few experts' slots, so the (e, I
# block, J block) jobs with work were ~1.5 waves of 132 programs (~0.9 in the last run), and the SMs
# were active 56-71% of each call's cycles (ncu, large, session 21: ∂W2 186, 192, 103 us, ∂W1 with Σb
# 246, 253, 133 us for the three runs). Every tile in stream-K (each program an equal share of all
# the run's K steps) kept the SMs 83-93% active but took as long: with every tile of the run in
# flight at its own K step, the experts' slot rows stopped being shared in L2 and DRAM went from
# 30-41% to 64-77% of its peak. So, as CUTLASS's data-parallel + stream-K: the whole waves of tiles
# are done whole (tile pid, pid + P, ...: the tiles running together are a few experts', at the same
# K steps), and only the last, partial wave is spread over every program by K steps: expert-major,
# then its tiles (I block fastest), then the K steps, each program an equal share; so a tile's steps
# can fall to several programs, each adding its part. Determinism: the parts are added in the order
# of their K steps. A program walks its share from the end back, so its piece of a tile that goes on
# into the next program's share is its first, and the next program's piece of that tile its last:
# before adding that last piece a thread waits for the same thread of the program before to have
# added its piece and raised its flag (the same thread holds the same elements of ∂W and Σb in every
# program; a wait that is not already over is rare). Each launch takes fresh flags (zeros: one small
# memset, or its own row of a step's zeroed rows, stream_flags), so launches on other streams or
# graph replays cannot take each other's raises. Waits point
# only to lower programs, which are scheduled first.


@gluon.jit
def _wgrad_descriptors(dptrs, bufs, sizes):
    """The weight-gradient kernel's TMA descriptors, made on the device by the partition that uses
    them (so the fence that makes a new descriptor visible to the TMA unit is that partition's
    own): A [S, I] in [BK, 64] blocks, B [S, J] in [BK, BN] blocks. Why on the device: a host
    descriptor cost a launch ~20 us of host time (built, its layout formatted into the signature
    by Triton's binder, encoded by the launcher), and here the GPU time did not move (161 against
    162 us a large call, session 13); the hidden kernel's did, so its descriptors stay the host's."""
    a_ptr, b_ptr, S = dptrs
    a_bufs, b_bufs = bufs
    I, J, E, JOBS, accumulate, SPLIT, TILE, has_sums, sum_rows = sizes
    BK: gl.constexpr = b_bufs.type.shape[1]
    HALF: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[2]
    return (tma.make_tensor_descriptor(a_ptr, [S, I], [I, 1], [BK, HALF], a_bufs.type.layout),
            tma.make_tensor_descriptor(b_ptr, [S, J], [J, 1], [BK, BN], b_bufs.type.layout))


@gluon.jit
def _wgrad_load(descs, bufs, bars, i0, j0, s0, s1, pos):
    """The producer's TMA loads of slots [s0, s1) of A's rows i0.. and B's columns j0..; the ring
    position after."""
    a_desc, b_desc = descs
    a_bufs, b_bufs = bufs
    ready, empty = bars
    BK: gl.constexpr = a_desc.block_type.shape[0]
    HALF: gl.constexpr = a_desc.block_type.shape[1]
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    for k in range(s0, s1, BK):
        stage = _ring_claim(ready, empty, pos, nbytes)
        bar = ready.index(stage)
        tma.async_copy_global_to_shared(a_desc, [k, i0], bar, a_bufs.index(2 * stage))
        tma.async_copy_global_to_shared(a_desc, [k, i0 + HALF], bar, a_bufs.index(2 * stage + 1))
        tma.async_copy_global_to_shared(b_desc, [k, j0], bar, b_bufs.index(stage))
        pos += 1
    return pos


@gluon.jit
def _wgrad_produce(descs, bufs, bars, ptrs, sizes, STREAM: gl.constexpr):
    descs = _wgrad_descriptors(descs, bufs, sizes)
    a_desc, b_desc = descs
    out_ptr, expert_slots_ptr, sums_ptr, flags_ptr, closing = ptrs
    I, J, E, JOBS, accumulate, SPLIT, TILE, has_sums, sum_rows = sizes
    BK: gl.constexpr = a_desc.block_type.shape[0]
    BM: gl.constexpr = 2 * a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    pos = 0
    if STREAM:
        ni = I // BM
        tiles = ni * (J // BN)
        experts = _stream_experts(expert_slots_ptr, E, tiles, BK)
        whole, start, it, before = _stream_share(experts, tiles)
        for t in range(gl.program_id(0), whole, gl.num_programs(0)):
            e, i, j, s0, s1 = _stream_tile(experts, t, tiles, ni, BK)
            pos = _wgrad_load(descs, bufs, bars, i * BM, j * BN, s0, s1, pos)
        while it > start:
            e, i, j, s0, s1, waits, raises, it = _stream_piece(experts, it, start, ni, BK)
            pos = _wgrad_load(descs, bufs, bars, i * BM, j * BN, s0, s1, pos)
    else:
        for job in range(gl.program_id(0), JOBS, gl.num_programs(0)):
            ec, i0, j0 = _wjob(job, I, J, SPLIT, BM, BN)
            lo, hi = _wslots(expert_slots_ptr, E, ec, SPLIT, TILE)
            pos = _wgrad_load(descs, bufs, bars, i0, j0, lo, hi, pos)


@gluon.jit
def _add_into(ptrs, values):
    """*ptrs += values (fp32), by `red.global.add.v2.f32`: fire and forget, the addition done in L2,
    where a load, add and store held the consumer for the load's round trip while the tensor cores
    idled (the runs' fp32 totals at large: [128, 256] a job, 128 KiB each way; a large step's call
    took 166 -> 157 us on the H200, bench/PERF_NOTES.md v22). One job adds each element once a
    launch, so the totals stay the same sums in the same order (red.add.f32 flushes subnormals).
    pack=2: the accumulator layout holds columns in adjacent pairs, so a pair's first pointer
    addresses both (the PTX's second pointer is the first + 4). Each element must be held by one
    thread only: a replicated layout would add it once a copy."""
    gl.inline_asm_elementwise("red.relaxed.gpu.global.add.v2.f32 [$2], {$4, $5}; mov.b32 $0, 0; mov.b32 $1, 0;",
                              "=r,=r,l,l,r,r", [ptrs.to(gl.int64, bitcast=True), values], dtype=gl.int32,
                              is_pure=False, pack=2)


SUM_ROWS = gl.constexpr(16)  # rows of a stage's B tile summed a load (16 bf16 a thread: 8 registers)


@gluon.jit
def _column_sums(b_buf, layout: gl.constexpr):
    """Σ over the rows of the shared [BK, BN] tile b_buf, fp32 [BN] in SliceLayout(0, layout): each
    thread owns two adjacent columns of SUM_ROWS rows (at BN 256 a warp reads a row's 128 bytes at
    once), so the rows add up in registers, with no barrier (at BN 128 two lanes share a column:
    one shuffle)."""
    BK: gl.constexpr = b_buf.type.shape[0]
    ROWS: gl.constexpr = layout.size_per_thread[0] * layout.threads_per_warp[0]
    total = gl.sum(b_buf.slice(0, ROWS, dim=0).load(layout).to(gl.float32), axis=0)
    for r in gl.static_range(ROWS, BK, ROWS):
        total += gl.sum(b_buf.slice(r, ROWS, dim=0).load(layout).to(gl.float32), axis=0)
    return total


@gluon.jit
def _flag_wait(ptrs):
    """STREAM: each thread waits for its flag, read with acquire (so that what the thread that
    raised it wrote before is seen)."""
    gl.inline_asm_elementwise("{ .reg .pred wait_p; .reg .b32 wait_v; "
                              "WAIT_LOOP: ld.acquire.gpu.global.b32 wait_v, [$1]; setp.eq.b32 wait_p, wait_v, 0; "
                              "@wait_p bra WAIT_LOOP; mov.b32 $0, wait_v; }",
                              "=r,l", [ptrs.to(gl.int64, bitcast=True)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _flag_raise(ptrs):
    """STREAM: each thread raises its flag, with release: after everything it wrote before."""
    gl.inline_asm_elementwise("st.release.gpu.global.b32 [$1], 1; mov.b32 $0, 0;", "=r,l",
                              [ptrs.to(gl.int64, bitcast=True)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _wgrad_steps(bufs, bars, s0, s1, pos, summing, phase, sum_rows, which, acc_layout: gl.constexpr,
                 sums_layout: gl.constexpr):
    """A consumer's K steps over slots [s0, s1) from the ring: (its [64, BN] of Σ Aᵀ B in fp32, and
    when `summing` B's column sums over the steps k with (k / BK) mod sum_rows = phase, from each
    such stage while its wgmma runs; the ring position after)."""
    a_bufs, b_bufs = bufs
    ready, empty = bars
    BK: gl.constexpr = b_bufs.type.shape[1]
    BN: gl.constexpr = b_bufs.type.shape[2]
    NBUF: gl.constexpr = b_bufs.type.shape[0]
    HALF: gl.constexpr = a_bufs.type.shape[2]
    sums = gl.zeros([BN], gl.float32, gl.SliceLayout(0, sums_layout))
    acc = gl.zeros([HALF, BN], gl.float32, acc_layout)
    for k in range(s0, s1, BK):
        stage = pos % NBUF
        acc = _ring_dot(a_bufs.index(2 * stage + which).permute((1, 0)), b_bufs.index(stage), acc, ready, empty, pos,
                        k > s0)
        sum_here = summing
        if sum_rows != 1:
            sum_here = summing & ((k // BK) % sum_rows == phase)
        if sum_here:
            sums += _column_sums(b_bufs.index(stage), sums_layout)
        pos += 1
    acc = _ring_drain(acc, empty, pos, s1 > s0)
    return acc, sums, pos


@gluon.jit
def _wgrad_summing(has_sums, i, sum_rows, which):
    """Whether the first consumer of a tile in row block i sums B's columns (some of its K steps):
    row block 0's, or with sum_rows > 1 the first sum_rows row blocks'."""
    if sum_rows != 1:
        return (has_sums != 0) & (i < sum_rows) & (which == 0)
    else:
        return (has_sums != 0) & (i == 0) & (which == 0)


@gluon.jit
def _wgrad_sums_row(ec, i, sum_rows):
    """The Σb row a summing tile of expert (or expert split) ec in row block i adds to: ec, or with
    sum_rows > 1 its row block's, ec·sum_rows + i."""
    if sum_rows != 1:
        return ec * sum_rows + i
    else:
        return ec


@gluon.jit
def _wgrad_ends(closing, e, E):
    """With `finish` (closing): whether this run opens expert e's sums (the whole layout's first slot
    of e is in it) and whether it closes them (e's last slot is); without: neither."""
    final_ptr, span_ptr, pending_ptr, S0, S, finish = closing
    return ((finish != 0) & (gl.load(span_ptr + e) >= S0),
            (finish != 0) & (gl.load(span_ptr + E + e) <= S0 + S))


@gluon.jit
def _wgrad_put(acc, total_ptrs, final_ptrs, closing, e, ends, first, whole):
    """A consumer's [64, BN] part of a tile of expert e added into ∂W's fp32 totals (red) at
    total_ptrs; final_ptrs: the same elements of the final output. With `finish` (closing; ends =
    _wgrad_ends): where this run opens e's sums and the part is the tile's first (first: no part
    of it before in this launch), it is stored there instead. Where the run opens and closes them
    and `whole` says that every tile of e is made whole by one part in this launch (this one among
    them), it is stored in the final output's dtype and the totals are not touched. Where the run
    closes e's sums otherwise, e is marked pending, and moe_backward's close_totals converts all of
    e's totals after the last run: so no tile of a pending expert may go to final alone (session
    31's first build sent STREAM's whole-wave tiles there while the same expert's last-wave tiles
    went to the totals; close_totals then wrote the unwritten totals over them). The callers make
    both pointer tensors before any branch: made inside one, the red's packed operands failed to
    lower (an LLVM assertion in ConvertTritonGPUToLLVM, jobs schedule, sm_90a)."""
    final_ptr, span_ptr, pending_ptr, S0, S, finish = closing
    opens, closes = ends
    if opens & closes & whole:
        gl.store(final_ptrs, acc.to(final_ptr.dtype.element_ty))
    else:
        if opens & first:
            gl.store(total_ptrs, acc)
        else:
            _add_into(total_ptrs, acc)
        if closes:
            gl.store(pending_ptr + e, 1)


@gluon.jit
def _wgrad_add(acc, sums, out_ptr, sums_ptr, closing, e, i, j, I, J, E, which, summing, sum_rows, first, whole,
               acc_layout: gl.constexpr, sums_layout: gl.constexpr):
    """STREAM: a consumer's [64, BN] of tile (e, i, j) added into ∂W's fp32 totals (_wgrad_put:
    first and whole), and Σb's columns by one thread each (sums_layout) into its row
    e·sum_rows + i when `summing`."""
    HALF: gl.constexpr = acc.shape[0]
    BN: gl.constexpr = acc.shape[1]
    rows = e * I + i * 2 * HALF + which * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
    cols = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    offsets = rows.to(gl.int64)[:, None] * J + cols[None, :]
    _wgrad_put(acc, out_ptr + offsets, closing[0] + offsets, closing, e, _wgrad_ends(closing, e, E), first, whole)
    if summing:
        ptrs = sums_ptr + _wgrad_sums_row(e, i, sum_rows) * J + j * BN + gl.arange(0, BN, layout=sums_layout)
        gl.store(ptrs, gl.load(ptrs) + gl.convert_layout(sums, sums_layout))


@gluon.jit
def _wgrad_consume(descs, bufs, bars, ptrs, sizes, which, STREAM: gl.constexpr):
    """Rows [which·64, which·64 + 64) of every job's 128: the K loop over the ring, then the store."""
    descs = _wgrad_descriptors(descs, bufs, sizes)
    a_desc, b_desc = descs
    out_ptr, expert_slots_ptr, sums_ptr, flags_ptr, closing = ptrs
    I, J, E, JOBS, accumulate, SPLIT, TILE, has_sums, sum_rows = sizes
    BK: gl.constexpr = a_desc.block_type.shape[0]
    HALF: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    # two adjacent columns a thread, the 4 warps side by side: [·, BN] exactly, no load twice
    sums_layout: gl.constexpr = gl.BlockedLayout([SUM_ROWS, 2], [256 // BN, BN // 8], [1, 4], [1, 0])
    # B's column sums (∂b1 = Σ ∂u beside ∂W1 = Σ xsᵀ ∂u) by the first consumer of a column block's
    # first sum_rows row blocks, each over the K steps of its phase (_wgrad_summing, _wgrad_steps)
    pos = 0
    if STREAM:
        # one thread a flag, a column of Σb a thread (not the replicated sums_layout: the thread
        # that adds an element must be the one whose flag says so)
        own_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        sums_own: gl.constexpr = gl.BlockedLayout([BN // 128], [32], [4], [0])
        ni = I // (2 * HALF)
        tiles = ni * (J // BN)
        experts = _stream_experts(expert_slots_ptr, E, tiles, BK)
        whole, start, it, before = _stream_share(experts, tiles)
        thread = gl.arange(0, 128, layout=own_layout)
        mine = flags_ptr + (gl.program_id(0) * 2 + which) * 128 + thread
        theirs = flags_ptr + (before * 2 + which) * 128 + thread
        for t in range(gl.program_id(0), whole, gl.num_programs(0)):
            e, i, j, s0, s1 = _stream_tile(experts, t, tiles, ni, BK)
            summing = _wgrad_summing(has_sums, i, sum_rows, which)
            acc, sums, pos = _wgrad_steps(bufs, bars, s0, s1, pos, summing, i, sum_rows, which, acc_layout,
                                          sums_layout)
            # whole: all of e's tiles in the whole waves, none in the last wave's pieces
            whole_e = _stream_pick(experts, e)[3] <= whole
            _wgrad_add(acc, sums, out_ptr, sums_ptr, closing, e, i, j, I, J, E, which, summing, sum_rows, True, whole_e,
                       acc_layout, sums_own)
        while it > start:
            e, i, j, s0, s1, waits, raises, it = _stream_piece(experts, it, start, ni, BK)
            summing = _wgrad_summing(has_sums, i, sum_rows, which)
            acc, sums, pos = _wgrad_steps(bufs, bars, s0, s1, pos, summing, i, sum_rows, which, acc_layout,
                                          sums_layout)
            if waits:
                _flag_wait(theirs)
            _wgrad_add(acc, sums, out_ptr, sums_ptr, closing, e, i, j, I, J, E, which, summing, sum_rows, ~waits,
                       False, acc_layout, sums_own)
            if raises:
                _flag_raise(mine)
    else:
        for job in range(gl.program_id(0), JOBS, gl.num_programs(0)):
            ec, i0, j0 = _wjob(job, I, J, SPLIT, 2 * HALF, BN)
            lo, hi = _wslots(expert_slots_ptr, E, ec, SPLIT, TILE)
            i = i0 // (2 * HALF)
            summing = _wgrad_summing(has_sums, i, sum_rows, which)
            acc, sums, pos = _wgrad_steps(bufs, bars, lo, hi, pos, summing, i, sum_rows, which, acc_layout,
                                          sums_layout)
            rows = ec * I + i0 + which * HALF + gl.arange(0, HALF, layout=rows_layout)
            cols = j0 + gl.arange(0, BN, layout=cols_layout)
            offsets = rows.to(gl.int64)[:, None] * J + cols[None, :]
            ptrs_out = out_ptr + offsets
            ptrs_final = closing[0] + offsets
            if accumulate == 0:
                gl.store(ptrs_out, acc.to(out_ptr.dtype.element_ty))
            elif hi > lo:  # an expert with no slots in this run is left untouched (SPLIT is 1: ec is e)
                _wgrad_put(acc, ptrs_out, ptrs_final, closing, ec, _wgrad_ends(closing, ec, E), True, True)
            if summing:
                ptrs_sums = (sums_ptr + _wgrad_sums_row(ec, i, sum_rows) * J + j0
                             + gl.arange(0, BN, layout=gl.SliceLayout(0, sums_layout)))
                if accumulate == 0:
                    gl.store(ptrs_sums, sums.to(sums_ptr.dtype.element_ty))
                elif hi > lo:  # not by red: at BN 128 two lanes hold each column (one [BN] a job: no stall worth it)
                    gl.store(ptrs_sums, gl.load(ptrs_sums) + sums)


# Worker partitions take no constexpr arguments: one function each way.
@gluon.jit
def _wgrad_consume_second(descs, bufs, bars, ptrs, sizes, which):
    _wgrad_consume(descs, bufs, bars, ptrs, sizes, which, False)


@gluon.jit
def _wgrad_consume_second_stream(descs, bufs, bars, ptrs, sizes, which):
    _wgrad_consume(descs, bufs, bars, ptrs, sizes, which, True)


@gluon.jit
def _wgrad_produce_jobs(descs, bufs, bars, ptrs, sizes):
    _wgrad_produce(descs, bufs, bars, ptrs, sizes, False)


@gluon.jit
def _wgrad_produce_stream(descs, bufs, bars, ptrs, sizes):
    _wgrad_produce(descs, bufs, bars, ptrs, sizes, True)


@gluon.jit
def _wgrad_kernel(a_ptr, b_ptr, out_ptr, expert_slots_ptr, sums_ptr, flags_ptr, final_ptr, span_ptr, pending_ptr,
                  S, S0, I, J, E, JOBS, accumulate, SPLIT, TILE, has_sums, sum_rows, finish, BK: gl.constexpr,
                  BN: gl.constexpr, NBUF: gl.constexpr, STREAM: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                  PRODUCER_REGS: gl.constexpr):
    # TMA descriptors made on the device, by each partition: see _wgrad_descriptors.
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, 64], dtype)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BN], dtype)
    a_bufs = gl.allocate_shared_memory(dtype, [2 * NBUF, BK, 64], a_layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NBUF, BK, BN], b_layout)
    ready, empty = _ring_barriers(NBUF)
    closing = (final_ptr, span_ptr, pending_ptr, S0, S, finish)
    ptrs = (out_ptr, expert_slots_ptr, sums_ptr, flags_ptr, closing)
    args = ((a_ptr, b_ptr, S), (a_bufs, b_bufs), (ready, empty), ptrs,
            (I, J, E, JOBS, accumulate, SPLIT, TILE, has_sums, sum_rows))
    zero = gl.program_id(0) * 0
    if STREAM:
        gl.warp_specialize([(_wgrad_consume, args + (zero, STREAM)),
                            (_wgrad_consume_second_stream, args + (zero + 1, )), (_wgrad_produce_stream, args)],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_wgrad_consume, args + (zero, STREAM)), (_wgrad_consume_second, args + (zero + 1, )),
                            (_wgrad_produce_jobs, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def stream_flags(device, launches=None):
    """A STREAM launch's flags, one a consumer thread of each program, all down: fresh for each
    launch (a buffer kept across launches, each waiter lowering its flag, could deadlock: a launch
    on another stream, or a replay of a graph that captured it, could take a raise meant for this
    one, and this one's waiter then wait for a raise that has gone). launches: [launches, ...]
    rows of them zeroed at once, one row a launch (a large training step's six weight-gradient
    launches: one memset and torch call, not six)."""
    shape = (_flags_a_launch(device),) if launches is None else (launches, _flags_a_launch(device))
    return torch.zeros(shape, device=device, dtype=torch.int32)


def _flags_a_launch(device):
    """STREAM's flags a launch: one a consumer thread (2 · 128) of each program (one an SM)."""
    return num_sms(device) * 2 * 128


def wgrad_stream(accumulate, experts):
    """Whether weight_grads takes the STREAM schedule by default: adding into totals (one run of
    tiles) of at most STREAM_EXPERTS experts, unless MHA_COMPILE_WGRAD_STREAM=0."""
    return WGRAD_STREAM and bool(accumulate) and experts <= STREAM_EXPERTS.value


def wgrad_sum_rows(I):
    """Σb's rows an expert: one a row block of 128 (each row block's jobs sum 1/R of the K steps),
    or with MHA_COMPILE_WGRAD_SUM_SPREAD=0 one (the jobs of row block 0 sum every K step)."""
    return max(1, I // 128) if WGRAD_SUM_SPREAD else 1


def wgrad_block_n(J):
    """weight_grads' column block by default: 256 where J allows, else 128."""
    return 256 if J % 256 == 0 else 128


def weight_grads(a, b, groups, out, accumulate, split=1, block_k=WGRAD_BK, block_n=None, nbuf=WGRAD_NBUF,
                 sums=None, stream=None, sum_rows=1, final=None, pending=None, flags=None):
    """out [E,I,J] = Σ_{s∈e} A[s]ᵀ B[s] (accumulate: added into out, fp32 totals, experts without
    slots here untouched). final (accumulate only): [E,I,J] in the weights' dtype, and pending [E]
    int32: groups is one run of tiles of a whole layout (groups.whole_slots, groups.first_slot), and
    the sums of an expert whose first slot is in this run are written into out, not added (out
    holds anything before); where its last slot is in this run too and a tile's sum is made whole
    here, it goes to final instead, and where its last slot is in this run but a tile's sum stays in
    out (added up across runs or programs), pending[e] is set to 1 (the caller converts those
    experts' totals; triton_moe.close_totals). split > 1 (not with accumulate): out is
    [E·split, I, J] fp32, row e·split + c the sum over split c of e's slots (as
    triton_moe._moe_wgrad_kernel cuts them), for triton_moe's _sum_splits_kernel to add. sums:
    [E·split, J] to take B's column sums Σ_{s∈e} B[s] the same way (∂b1 beside ∂W1), in out's
    dtype or fp32; with sum_rows R > 1 (at most I's row blocks, wgrad_sum_rows) sums is
    [E·split·R, J]: row (e·split + c)·R + i holds the sum over the K steps k with
    (k / block_k) mod R = i (each summed by the jobs of row block i, not all by block 0's), for
    the caller to add up. Callers check `wgrad_unsupported` first; block_n: 256 where
    J allows. stream: the STREAM schedule (accumulate only, at most STREAM_EXPERTS experts); None:
    WGRAD_STREAM where it applies. flags: STREAM's flags for this launch, zeros that no other launch
    takes (a row of stream_flags(device, launches)); None: fresh ones."""
    E, (I, J) = groups.experts, (a.shape[1], b.shape[1])
    if split > 1 and (accumulate or out.dtype != torch.float32 or out.shape[0] != E * split):
        raise ValueError(f"split={split}: takes fp32 partial sums out [E·split = {E * split}, I, J] and no "
                         f"accumulate; got out {tuple(out.shape)} {out.dtype}, accumulate={accumulate}")
    if not 1 <= sum_rows <= I // 128:
        raise ValueError(f"sum_rows={sum_rows}: takes 1 to I / 128 = {I // 128} (one a row block of 128)")
    if sums is not None and (sums.shape != (E * split * sum_rows, J) or sums.dtype not in (out.dtype, torch.float32)
                             or not sums.is_contiguous()):
        raise ValueError(f"sums: wants a contiguous [E·split·sum_rows, J] = [{E * split * sum_rows}, {J}] "
                         f"{out.dtype} or fp32 tensor, got {tuple(sums.shape)} {sums.dtype}")
    block_n = block_n or wgrad_block_n(J)
    jobs = E * split * (I // 128) * (J // block_n)
    if stream and (not accumulate or E > STREAM_EXPERTS.value):
        raise ValueError(f"stream=True adds into totals of at most {STREAM_EXPERTS.value} experts; got "
                         f"accumulate={accumulate}, E={E}")
    if final is not None and (not accumulate or final.shape != out.shape or pending is None
                              or pending.shape != (E,) or pending.dtype != torch.int32):
        raise ValueError(f"final: takes accumulate, final of out's shape {tuple(out.shape)} and pending, [E = {E}] "
                         f"int32; got accumulate={accumulate}, final {None if final is None else tuple(final.shape)}, "
                         f"pending {None if pending is None else (tuple(pending.shape), pending.dtype)}")
    if stream is None:
        stream = wgrad_stream(accumulate, E)  # split is 1 here (checked above)
    if stream and flags is not None and (flags.shape != (_flags_a_launch(a.device),) or flags.dtype != torch.int32
                                         or not flags.is_contiguous()):
        raise ValueError(f"flags: wants a contiguous [{_flags_a_launch(a.device)}] int32 row of stream_flags, got "
                         f"{tuple(flags.shape)} {flags.dtype}")
    programs = num_sms(a.device) if stream else min(num_sms(a.device), jobs)
    finish = final is not None
    with device_scratch():
        launch(_wgrad_kernel, (programs,),
            a, b, out, groups.expert_slots, out if sums is None else sums,
            (stream_flags(a.device) if flags is None else flags) if stream else groups.expert_slots,
            final if finish else out,
            groups.whole_slots if finish else groups.expert_slots, pending if finish else groups.expert_slots,
            a.shape[0], groups.first_slot if finish else 0, I, J, E, jobs,
            int(accumulate), split, groups.tile, int(sums is not None), sum_rows, int(finish),
            BK=block_k, BN=block_n, NBUF=nbuf, STREAM=stream,
            CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# The forward's GEMM2: out[s] = scale[pair(s)] · (A[s] B[e] + bias[e]) over the tile rows s of
# expert e, 0 on padding slots: triton_moe._moe_slots_gemm_kernel's contract for one operand pair
# and B row-major (A = h [S, K = F], B = W2 [E, K, N = D] read as [E·K, N]; with c's rows of one run
# of tiles as out). One program per SM walks the (tile, column block) jobs, a tile's blocks adjacent
# (the programs running together read its rows from L2); a producer warp issues the TMA loads and
# two consumer warpgroups share each job ("cooperative", on the ring above), each storing its
# [64, BN] through a staging tile and TMA:
#   TILE 128: a job is [128, BN] and each consumer owns 64 of its rows (A's two [64, BK] halves a
#             stage, B's [BK, BN] tile shared);
#   TILE 64:  a job is [64, 2·BN] and each consumer owns BN of its columns (A's [64, BK] tile
#             shared, B's two [BK, BN] halves).
# An all-padding tile skips its K loop (the producer and both consumers read the same slot), as
# the Triton kernel does. bench/gluon_slots_probe.py on the H200 (large, TILE 128, bf16, the
# kernel then in the probe): 448 against the Triton kernel's 552 us at BK 64, BN 256, 3 stages,
# the same error. ∂x (B transposed) tied there and GEMM1 lost, so they stay in Triton. TILE 64
# (the small preset's) has not been timed.
SLOTS_BK, SLOTS_NBUF = 64, 3
SLOTS_TILES = (64, 128)
SLOTS_N_MULTIPLE = 128  # N in whole jobs at either TILE (128 = [128, 128] or [64, 2·64])


def slots_block_n(N, tile):
    """A consumer's columns (BN) for N output columns at TILE: jobs of 256 columns where N allows."""
    wide = N % 256 == 0
    return (256 if wide else 128) if tile == 128 else (128 if wide else 64)


def slots_unsupported(a, b, out, bias, scale, tile, capability=None):
    """Why GEMM2's kernel cannot take these operands (A [S, K], B [E, K, N], out [S, N], bias [E, N],
    scale: one weight a pair), or None when it can."""
    operands = (a, b, out) + (() if bias is None else (bias,))
    why = _device_reason(operands, "A, B, out" + ("" if bias is None else ", bias"), capability)
    if why is not None:
        return why
    (S, K), N = a.shape, out.shape[1]
    if b.dim() != 3 or tuple(b.shape[1:]) != (K, N) or out.shape[0] != S:
        return f"B {tuple(b.shape)}, out {tuple(out.shape)}: takes B [E, K, N] and out [S, N] for A [{S}, {K}]"
    if tile not in SLOTS_TILES or K % SLOTS_BK or N % SLOTS_N_MULTIPLE:
        return (f"K={K}, N={N}, TILE={tile}: needs TILE in {list(SLOTS_TILES)}, K a multiple of {SLOTS_BK}"
                f" and N of {SLOTS_N_MULTIPLE}")
    if scale is not None and (scale.dim() != 1 or not scale.is_contiguous()):
        return "scale must be one contiguous vector (a weight a pair)"
    return None


@gluon.jit
def _slots_job(job, N, COLS: gl.constexpr):
    """(tile, first column) of a job of COLS columns, a tile's column blocks adjacent."""
    blocks = N // COLS
    t = job // blocks
    return t, (job - t * blocks) * COLS


# Partitions take (descs, bufs, bars, ptrs, sizes) (+ which, a runtime value, as above):
#   descs = (A, B, out, S, E, K, N), from which each makes its descriptors (_slots_descriptors): A
#            as [S, K] in [64, BK] blocks, B as [E·K, N] in [BK, BN] blocks, out as [S, N] in
#            [64, BN] blocks;
#   bufs  = (A ring [A_PARTS·NBUF, 64, BK], B ring [B_PARTS·NBUF, BK, BN] (stage·PARTS + part:
#            2 A parts at TILE 128, 2 B parts at 64), out staging [2, 64, BN], one a consumer);
#   bars  = (ready, empty) a stage;  ptrs = (bias, scale, slot_pair, tile_expert);
#   sizes = (PAIRS, K, N, JOBS, has_bias, has_scale).
# TILE = A_PARTS · 64 and a job's columns B_PARTS · BN follow from the rings' shapes.


@gluon.jit
def _slots_descriptors(dptrs, bufs):
    """GEMM2's TMA descriptors, made on the device by the partition that uses them (as
    _wgrad_descriptors; 207 against 210 us a large call, session 13): A [S, K] in [64, BK]
    blocks, B as [E·K, N] in [BK, BN], out [S, N] in [64, BN]."""
    a_ptr, b_ptr, out_ptr, S, E, K, N = dptrs
    a_bufs, b_bufs, out_bufs = bufs
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[2]
    return (tma.make_tensor_descriptor(a_ptr, [S, K], [K, 1], [BM, BK], a_bufs.type.layout),
            tma.make_tensor_descriptor(b_ptr, [E * K, N], [N, 1], [BK, BN], b_bufs.type.layout),
            tma.make_tensor_descriptor(out_ptr, [S, N], [N, 1], [BM, BN], out_bufs.type.layout))


@gluon.jit
def _slots_produce(descs, bufs, bars, ptrs, sizes):
    descs = _slots_descriptors(descs, bufs)
    a_desc, b_desc, out_desc = descs
    a_bufs, b_bufs, out_bufs = bufs
    ready, empty = bars
    bias_ptr, scale_ptr, slot_pair_ptr, tile_expert_ptr = ptrs
    PAIRS, K, N, JOBS, has_bias, has_scale = sizes
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    NBUF: gl.constexpr = ready.type.shape[0]
    A_PARTS: gl.constexpr = a_bufs.type.shape[0] // NBUF
    B_PARTS: gl.constexpr = b_bufs.type.shape[0] // NBUF
    TILE: gl.constexpr = A_PARTS * BM
    nbytes: gl.constexpr = A_PARTS * a_desc.block_type.nbytes + B_PARTS * b_desc.block_type.nbytes
    pos = 0
    for job in range(gl.program_id(0), JOBS, gl.num_programs(0)):
        t, n0 = _slots_job(job, N, B_PARTS * BN)
        e = gl.load(tile_expert_ptr + t)
        k_end = K * (gl.load(slot_pair_ptr + t * TILE) < PAIRS).to(gl.int32)  # 0: an all-padding tile
        for k0 in range(0, k_end, BK):
            stage = _ring_claim(ready, empty, pos, nbytes)
            bar = ready.index(stage)
            for p in gl.static_range(A_PARTS):
                tma.async_copy_global_to_shared(a_desc, [t * TILE + p * BM, k0], bar, a_bufs.index(A_PARTS * stage + p))
            for p in gl.static_range(B_PARTS):
                tma.async_copy_global_to_shared(b_desc, [e * K + k0, n0 + p * BN], bar,
                                                b_bufs.index(B_PARTS * stage + p))
            pos += 1


@gluon.jit
def _slots_consume(descs, bufs, bars, ptrs, sizes, which):
    """This consumer's [64, BN] of every job: the K loop over the ring, then bias (added before it),
    scale, zeros on padding slots, and the store."""
    descs = _slots_descriptors(descs, bufs)
    a_desc, b_desc, out_desc = descs
    a_bufs, b_bufs, out_bufs = bufs
    ready, empty = bars
    bias_ptr, scale_ptr, slot_pair_ptr, tile_expert_ptr = ptrs
    PAIRS, K, N, JOBS, has_bias, has_scale = sizes
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    NBUF: gl.constexpr = ready.type.shape[0]
    A_PARTS: gl.constexpr = a_bufs.type.shape[0] // NBUF
    B_PARTS: gl.constexpr = b_bufs.type.shape[0] // NBUF
    TILE: gl.constexpr = A_PARTS * BM
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    out_buf = out_bufs.index(which)
    a_part = which * (A_PARTS - 1)  # this consumer's part of a stage's A (its rows) or B (its columns)
    b_part = which * (B_PARTS - 1)
    pos = 0
    for job in range(gl.program_id(0), JOBS, gl.num_programs(0)):
        t, n0 = _slots_job(job, N, B_PARTS * BN)
        e = gl.load(tile_expert_ptr + t)
        k_end = K * (gl.load(slot_pair_ptr + t * TILE) < PAIRS).to(gl.int32)
        row = t * TILE + a_part * BM
        col = n0 + b_part * BN
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        if has_bias != 0:  # loaded before the K loop, while the stage lands
            acc = acc + gl.load(bias_ptr + e * N + col + gl.arange(0, BN, layout=cols_layout)).to(gl.float32)[None, :]
        for k0 in range(0, k_end, BK):
            stage = pos % NBUF
            acc = _ring_dot(a_bufs.index(A_PARTS * stage + a_part), b_bufs.index(B_PARTS * stage + b_part), acc,
                            ready, empty, pos, k0 > 0)
            pos += 1
        acc = _ring_drain(acc, empty, pos, k_end > 0)
        pair = gl.load(slot_pair_ptr + row + gl.arange(0, BM, layout=rows_layout))
        valid = pair < PAIRS
        if has_scale != 0:
            acc = acc * gl.load(scale_ptr + pair, mask=valid, other=0.0).to(gl.float32)[:, None]
        tma.store_wait(0)  # this consumer's last store has left its staging tile
        out_buf.store(gl.where(valid[:, None], acc, 0.0).to(out_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [row, col], out_buf)
    tma.store_wait(0)


@gluon.jit
def _slots_consume_second(descs, bufs, bars, ptrs, sizes, which):
    _slots_consume(descs, bufs, bars, ptrs, sizes, which)


@gluon.jit
def _slots_kernel(a_ptr, b_ptr, out_ptr, bias_ptr, scale_ptr, slot_pair_ptr, tile_expert_ptr,
                  S, E, PAIRS, K, N, JOBS, has_bias, has_scale,
                  BK: gl.constexpr, BN: gl.constexpr, SPLIT_ROWS: gl.constexpr, NBUF: gl.constexpr,
                  CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """SPLIT_ROWS: the consumers split a job's rows (TILE 128), else its columns (TILE 64). The TMA
    descriptors are made on the device, by each partition (_slots_descriptors)."""
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    A_PARTS: gl.constexpr = 2 if SPLIT_ROWS else 1
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BK], dtype)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BN], dtype)
    out_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BN], dtype)
    a_bufs = gl.allocate_shared_memory(dtype, [A_PARTS * NBUF, 64, BK], a_layout)
    b_bufs = gl.allocate_shared_memory(dtype, [(3 - A_PARTS) * NBUF, BK, BN], b_layout)
    out_bufs = gl.allocate_shared_memory(dtype, [2, 64, BN], out_layout)
    ready, empty = _ring_barriers(NBUF)
    args = ((a_ptr, b_ptr, out_ptr, S, E, K, N), (a_bufs, b_bufs, out_bufs), (ready, empty),
            (bias_ptr, scale_ptr, slot_pair_ptr, tile_expert_ptr), (PAIRS, K, N, JOBS, has_bias, has_scale))
    zero = gl.program_id(0) * 0
    gl.warp_specialize([(_slots_consume, args + (zero, )), (_slots_consume_second, args + (zero + 1, )),
                        (_slots_produce, args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def slots_kernel_args(a, b, out, bias, scale):
    """_slots_kernel's tensor arguments: A, B, out, then bias and scale (stand-ins where None)."""
    return [a, b, out, out if bias is None else bias, out if scale is None else scale]


def slots_gemm(a, b, groups, out, bias=None, scale=None, block_k=SLOTS_BK, block_n=None, nbuf=SLOTS_NBUF):
    """out [S, N] = scale[pair] · (a[s] b[e] + bias[e]) per slot s of groups' tiles (expert e), 0 on
    padding slots, in out's dtype: a [S, K] slot rows, b [E, K, N], bias [E, N], scale: one weight
    a (row, j) pair (the flat top-k weights). Callers check `slots_unsupported` first. block_n: a
    consumer's columns (slots_block_n when None; bench/gluon_slots_probe.py passes others)."""
    K, N = b.shape[1], b.shape[2]
    block_n = block_n or slots_block_n(N, groups.tile)
    split_rows = groups.tile == 128
    jobs = groups.num_tiles * (N // (block_n * (1 if split_rows else 2)))
    with device_scratch():
        launch(_slots_kernel, (min(num_sms(a.device), jobs),),
            *slots_kernel_args(a, b, out, bias, scale), groups.slot_pair, groups.tile_expert, a.shape[0], b.shape[0],
            groups.pairs, K, N, jobs, int(bias is not None), int(scale is not None), BK=block_k, BN=block_n,
            SPLIT_ROWS=split_rows, NBUF=nbuf, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
            num_warps=4)
    return out
