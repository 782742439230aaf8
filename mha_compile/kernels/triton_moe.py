"""The top-k experts as grouped GEMMs over expert-sorted tiles, forward and backward.

Grouping (`Groups`: three small Triton launches, no host sync): the R·k (row, slot j)
pairs are stable-sorted by expert and laid out in tiles of TILE slots, each tile owned by one
expert, each expert's run padded to a whole number of tiles. The tile count has the host-known
bound T = ceil((R·k + E·(TILE−1)) / TILE), so every grid below is sized from shapes alone and
the whole path can be captured in a CUDA graph. A padding slot holds pair id R·k; the programs
of an all-padding tile skip their K loop and write zeros ("padding rows zero-filled").

Both directions first gather the slot rows once, in one memory-bound pass
(_gather_rows_kernel), so that every GEMM below reads plain contiguous rows: gathered and
merged A tiles made the dots 2-3x slower (measured on the H200: GEMM1 merging x on its A-tile
load at 172 TFLOP/s, GEMM2 on contiguous rows at 416). Contiguous rows also let GEMM1 load
and store through TMA descriptors on Hopper, one program per SM (experts_up).

Past SLOT_CHUNK_BYTES of slot buffers (the large preset) both directions walk runs of whole
tiles (Groups.tiles), each run with buffers of its own; the rows that the token-order
passes read (c, ∂x_slot) stay whole, and the weight gradients are summed over runs in fp32:
an expert's first run writes its sums, its last stores them in the weights' dtype where they are
whole (moe_backward, weight_grads' `final`), and close_totals converts the rest.

c and ∂x_slot, each one GEMM's fp32 accumulator per slot, are stored in the weights' dtype (as
a grouped GEMM such as torch._grouped_mm stores them) and summed over j in fp32: in bf16 at the
large preset each was 256 MiB in fp32, read and written once a step.

Forward, per tile t (expert e) and output block:
    gather  xs[s] = x[row(s)] (+ inv[row // H]), in the weights' dtype: with kernels="fused"
            y = ctx + inv[b] is formed here and its slot rows are written once (k copies of
            each row, plus zero padding rows), never in token order
    GEMM1   h[s] = act(xs[s] W1[e] + b1[e])     (swiglu: silu(u) ⊙ xs W3[e])
    GEMM2   c[s] = w[s] · (h[s] W2[e] + b2[e])   the routing weight in the epilogue
            (on Hopper, bf16/fp16, TILE 64 or 128: gluon_moe's warp-specialised GEMM)
    combine out[r] = Σ_j c[slot(r, j)]           token order, fixed j order: no atomics
Backward (recomputing u = x W1 + b1 rather than storing it; with KEEP_HIDDEN, staged, reading
the forward's):
    gather  xs[s] as in the forward, and gs[s] = G[row(s)]
    hidden  per (tile, F block), one K loop over D for both u = xs W1[e] and g = gs W2[e]ᵀ:
            hw = w · act(u); ∂u = (w · g) ⊙ act′(u); per-F-block partial ∂w = Σ_f h g (+ ⟨G, b2[e]⟩)
            and per tile the bias gradients' column sums Σ ∂u, Σ w·gs (fp32)
            (on Hopper, in bf16/fp16 with gelu, silu or swiglu: gluon_moe's warp-specialised kernel)
    dX      ∂x[s] = ∂u W1[e]ᵀ (+ ∂u3 W3[e]ᵀ)        the GEMM2 kernel with other strides
    dW      ∂W2[e] = Σ_{s∈e} hw[s]ᵀ gs[s], ∂W1[e] = Σ xs[s]ᵀ ∂u[s] (∂W3 likewise): per
            (e, block, run of slots) a fixed-order loop, runs summed in order (on Hopper, one
            B: gluon_moe's warp-specialised GEMM, same runs and order); ∂b1, ∂b2 as
            each expert's tile sums added in tile order
The router gradient, the per-row sums over j and ∂inv = Σ_h ∂y happen in
triton_router.router_combine_backward. All accumulation is fp32; row offsets are int64.
"""
import fractions
import functools
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mha_compile.kernels.triton_util import (ACT_CODE, GW_BLOCK, SUM_BLOCK, Launcher, _sum_splits_kernel, act_bwd,
                                             act_fwd, cdiv, dot_precision, gpu_options, launch, load_x, log, num_sms,
                                             pow2, stamp, sum_splits, tma_ok)
from mha_compile.options import env_mib

try:  # the Gluon kernels for Hopper, where this Triton has Gluon (3.6 has)
    from mha_compile.kernels import gluon_moe
    GLUON_MISSING = None
except ImportError as error:  # pragma: no cover - a Triton without Gluon's Hopper API
    gluon_moe, GLUON_MISSING = None, f"this Triton ({triton.__version__}) has no Gluon: {error}"


# ---------------------------------------------------------------------------------------------
# Kernels.


@triton.jit
def _tile_of_job(job, N, BLOCK_N: tl.constexpr):
    """(tile t, index of its block of N columns) of a linear job index, a tile's blocks adjacent:
    programs running together then read the same slot rows (from L2, where the order with tiles
    adjacent reads them from DRAM once per block: at large a run's rows are ~90 MB, past the
    H200's 50 MB L2)."""
    n_blocks = tl.cdiv(N, BLOCK_N)
    return job // n_blocks, job % n_blocks


@triton.jit
def _tile_and_block(N, BLOCK_N: tl.constexpr, N_INNER: tl.constexpr):
    """(tile t, index of its block of N columns) of this program. N_INNER: a 1-D grid in
    _tile_of_job's order. Else the 2-D grid (tiles, blocks), whose programs running together
    share one block of the weights instead."""
    if N_INNER:
        return _tile_of_job(tl.program_id(0), N, BLOCK_N)
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _bias_rows(bias_ptr, offset, offs_n, n_ok, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A GEMM's fp32 accumulator [ROWS, len(offs_n)] starting at the bias row bias[offset + offs_n]
    (zeros without one). Added before the K loop rather than after it: added after, at 255
    registers, ptxas issued the bias loads one at a time through one register among the
    epilogue's math, and a bias cost 12% of the hidden kernel at large (2208 against 1950 us a
    call, bench/gemm_probe.py on the H200; 16 serial loads a job in its SASS). Here it still
    costs ~9% there (2125 against 1940 us): the loads wait on the expert index before the
    first dot can start."""
    acc = tl.zeros([ROWS, offs_n.shape[0]], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offset + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _moe_up_kernel(
    xs, slot_pair_ptr, tile_expert_ptr, w1, b1_ptr, w3, h, u,
    PAIRS, D, F, NUM_TILES,
    HAS_B1: tl.constexpr, ACT: tl.constexpr, KEEP_U: tl.constexpr,
    PRECISION: tl.constexpr, TILE: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
    TMA: tl.constexpr, SM_PROGRAMS: tl.constexpr = 1,
):
    """h [S,F] = act(xs[s] W1[e] + b1[e]) per slot; xs [S,D] the slot rows (_gather_rows_kernel,
    0 on padding slots, whose h rows are then act(b1[e]): GEMM2 zeroes its padding rows itself,
    and a select here cost 296 of the [128, 256] config's 2840 SASS instructions, sm_90a
    offline), W1 [E,D,F]. One job per (tile, F block), in _tile_of_job's order.

    TMA (Hopper): xs, w1 (w3) and h are tensor descriptors (blocks [TILE, BLOCK_K],
    [1, BLOCK_K, BLOCK_F], [TILE, BLOCK_F]) and SM_PROGRAMS programs per SM walk the jobs, each
    loading its next tile while the activation epilogue of this one runs. Else pointers, a
    program per job. SM_PROGRAMS only sizes the grid (experts_up).

    KEEP_U (not swiglu): also u [S,F] = xs[s] W1[e] + b1[e], in h's dtype, for the backward
    (KEEP_HIDDEN); a descriptor like h's with TMA.
    """
    for job in tl.range(tl.program_id(0), NUM_TILES * tl.cdiv(F, BLOCK_F), tl.num_programs(0), flatten=TMA):
        t, f_block = _tile_of_job(job, F, BLOCK_F)
        f0 = f_block * BLOCK_F
        offs_f = f0 + tl.arange(0, BLOCK_F)
        f_ok = offs_f < F
        offs_s = t.to(tl.int64) * TILE + tl.arange(0, TILE)
        e = tl.load(tile_expert_ptr + t)
        # An all-padding tile (its first slot is padding) skips the K loop.
        k_end = tl.where(tl.load(slot_pair_ptr + t.to(tl.int64) * TILE) < PAIRS, D, 0)
        acc = _bias_rows(b1_ptr, e.to(tl.int64) * F, offs_f, f_ok, TILE, HAS_B1)
        acc3 = tl.zeros([TILE, BLOCK_F], tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            if TMA:
                a = xs.load([t * TILE, k0])
                b = w1.load([e, k0, f0]).reshape(BLOCK_K, BLOCK_F)
                if ACT == 3:
                    b3 = w3.load([e, k0, f0]).reshape(BLOCK_K, BLOCK_F)
            else:
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < D
                a = tl.load(xs + offs_s[:, None] * D + offs_k[None, :], mask=k_ok[None, :], other=0.0)
                w_off = e.to(tl.int64) * D * F + offs_k[:, None].to(tl.int64) * F + offs_f[None, :]
                w_ok = k_ok[:, None] & f_ok[None, :]
                b = tl.load(w1 + w_off, mask=w_ok, other=0.0)
                if ACT == 3:
                    b3 = tl.load(w3 + w_off, mask=w_ok, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if ACT == 3:
                acc3 = tl.dot(a, b3, acc3, input_precision=PRECISION)
        out = act_fwd(acc, acc3, ACT)
        if TMA:
            h.store([t * TILE, f0], out.to(h.dtype))
            if KEEP_U:
                u.store([t * TILE, f0], acc.to(u.dtype))
        else:
            tl.store(h + offs_s[:, None] * F + offs_f[None, :], out.to(h.dtype.element_ty), mask=f_ok[None, :])
            if KEEP_U:
                tl.store(u + offs_s[:, None] * F + offs_f[None, :], acc.to(u.dtype.element_ty), mask=f_ok[None, :])


@triton.jit
def _moe_slots_gemm_kernel(
    a_ptr, b_ptr, a2_ptr, b2_ptr, bias_ptr, scale_ptr, slot_pair_ptr, tile_expert_ptr, out_ptr,
    PAIRS, K, NOUT,
    stride_be, stride_bk, stride_bn,
    HAS_A2: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr,
    PRECISION: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    N_INNER: tl.constexpr,
):
    """out [S,NOUT] = scale[pair] · (a[s] B[e] (+ a2[s] B2[e]) + bias[e]); 0 on padding.
    Accumulated in fp32, stored in out's dtype; ACCUMULATE: added to what out holds, fp32 (∂x over
    the backward's passes of F columns).

    a, a2 [S,K] per slot; B, B2 [E, K, NOUT] addressed through strides, so the GEMM2 of the
    forward (B = W2) and ∂x of the backward (B = W1ᵀ, W3ᵀ) are the same kernel.
    """
    t, pid_n = _tile_and_block(NOUT, BLOCK_N, N_INNER)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < NOUT
    offs_s = t.to(tl.int64) * TILE + tl.arange(0, TILE)
    pair = tl.load(slot_pair_ptr + offs_s)
    valid = pair < PAIRS
    e = tl.load(tile_expert_ptr + t).to(tl.int64)
    k_end = tl.where(tl.load(slot_pair_ptr + t.to(tl.int64) * TILE) < PAIRS, K, 0)
    acc = _bias_rows(bias_ptr, e * NOUT, offs_n, n_ok, TILE, HAS_BIAS)
    b_e = b_ptr + e * stride_be
    b2_e = b2_ptr + e * stride_be
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a_off = offs_s[:, None] * K + offs_k[None, :]
        b_off = offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :] * stride_bn
        b_ok = k_ok[:, None] & n_ok[None, :]
        a = tl.load(a_ptr + a_off, mask=k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.load(b_e + b_off, mask=b_ok, other=0.0), acc, input_precision=PRECISION)
        if HAS_A2:
            a2 = tl.load(a2_ptr + a_off, mask=k_ok[None, :], other=0.0)
            acc = tl.dot(a2, tl.load(b2_e + b_off, mask=b_ok, other=0.0), acc, input_precision=PRECISION)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + pair, mask=valid, other=0.0)[:, None]
    acc = tl.where(valid[:, None], acc, 0.0)
    out_off = offs_s[:, None] * NOUT + offs_n[None, :]
    if ACCUMULATE:
        # One program owns each element, so the reduction (REDG.ADD.F32, no value back) is one
        # add in a fixed order, as a load, add and store would be (but for fp32 subnormals, which
        # it flushes to zero: FTZ in its SASS). That load held a second fp32 tile in registers:
        # 255 registers and up to 452 bytes spilled at medium's [128, 128] and [128, 256]
        # configs (bench/offline_sass.py), 108-218 and none this way.
        tl.atomic_add(out_ptr + out_off, acc, mask=n_ok[None, :], sem="relaxed")
    else:
        tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _combine_fwd_kernel(
    c_ptr, pair_slot_ptr, out_ptr, R, D,
    TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out [R,D] = Σ_j c[slot(r, j)] in j order (deterministic; no atomics)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    r_ok = rows < R
    ok = r_ok[:, None] & (offs_d < D)[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.load(pair_slot_ptr + rows.to(tl.int64) * TOP_K + j, mask=r_ok, other=0).to(tl.int64)
        acc += tl.load(c_ptr + slot[:, None] * D + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + offs_d[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gather_rows_kernel(
    x_ptr, inv_ptr, g_ptr, slot_pair_ptr, xs_ptr, gs_ptr,
    tile_expert_ptr, weight_ptr, b2_ptr, gw_ptr, db2_ptr,
    PAIRS, H, D, GW_COLS, GB2_COL,
    TOP_K: tl.constexpr, HAS_INV: tl.constexpr, HAS_G: tl.constexpr, HAS_B2: tl.constexpr,
    TILE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Per slot s: xs[s] = x[row] (+ inv[row // H]) in xs's dtype, and gs[s] = G[row] when
    HAS_G (the backward); 0 on padding. The GEMMs then read whole slot rows with plain,
    contiguous loads.
    HAS_B2 (backward, experts with b2): gw[s, GB2_COL + D block] = ⟨G[row], b2[e]⟩ over this D
    block (∂w's b2 part, beside the hidden kernel's columns), and db2 [S/BLOCK_S, D] fp32 =
    Σ_{s ∈ BLOCK_S slots} w[s] G[row] (∂b2's partial sums): here, where G is in registers
    anyway, rather than beside the hidden kernel's dots (bench/gemm_probe.py, H200)."""
    pid_s = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_s = pid_s.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    pair = tl.load(slot_pair_ptr + offs_s)
    valid = pair < PAIRS
    rows = pair // TOP_K
    x = load_x(x_ptr, inv_ptr, rows, valid, offs_d, d_ok, H, D, HAS_INV)
    out = offs_s[:, None] * D + offs_d[None, :]
    tl.store(xs_ptr + out, x.to(xs_ptr.dtype.element_ty), mask=d_ok[None, :])
    if HAS_G:
        g = tl.load(g_ptr + rows.to(tl.int64)[:, None] * D + offs_d[None, :],
                    mask=valid[:, None] & d_ok[None, :], other=0.0)
        tl.store(gs_ptr + out, g.to(gs_ptr.dtype.element_ty), mask=d_ok[None, :])
        if HAS_B2:
            g = g.to(tl.float32)
            e = tl.load(tile_expert_ptr + offs_s // TILE).to(tl.int64)
            b2 = tl.load(b2_ptr + e[:, None] * D + offs_d[None, :], mask=d_ok[None, :], other=0.0).to(tl.float32)
            tl.store(gw_ptr + offs_s * GW_COLS + GB2_COL + pid_d, tl.sum(g * b2, axis=1))
            w = tl.load(weight_ptr + pair, mask=valid, other=0.0)
            tl.store(db2_ptr + pid_s.to(tl.int64) * D + offs_d, tl.sum(g * w[:, None], axis=0), mask=d_ok)


@triton.jit
def _up_step(xs_ptr, w1_ptr, w3_ptr, acc_u, acc_u3, row_off, offs_k, offs_f, f_ok, e, D, F,
             ACT: tl.constexpr, PRECISION: tl.constexpr):
    """One K step of u = xs W1[e] (and u3 = xs W3[e] for swiglu) over columns offs_f; row_off:
    the slot rows' offsets at columns offs_k of xs."""
    k_ok = offs_k < D
    w_ok = k_ok[:, None] & f_ok[None, :]
    a = tl.load(xs_ptr + row_off, mask=k_ok[None, :], other=0.0)
    w_off = e * D * F + offs_k[:, None].to(tl.int64) * F + offs_f[None, :]
    acc_u = tl.dot(a, tl.load(w1_ptr + w_off, mask=w_ok, other=0.0), acc_u, input_precision=PRECISION)
    if ACT == 3:
        acc_u3 = tl.dot(a, tl.load(w3_ptr + w_off, mask=w_ok, other=0.0), acc_u3, input_precision=PRECISION)
    return acc_u, acc_u3


@triton.jit
def _down_t_step(gs_ptr, w2_ptr, acc_g, row_off, offs_k, offs_f, f_ok, e, D, F, PRECISION: tl.constexpr):
    """One K step of g = gs W2[e]ᵀ over columns offs_f. W2[e] is [F,D]: its [BLOCK_K, BLOCK_F]
    transpose is read through strides (a contiguous W2ᵀ copy read like W1 was slower: H200,
    large preset, 3.57 -> 4.06 ms)."""
    k_ok = offs_k < D
    w_ok = k_ok[:, None] & f_ok[None, :]
    g = tl.load(gs_ptr + row_off, mask=k_ok[None, :], other=0.0)
    w2t = tl.load(w2_ptr + e * F * D + offs_f[None, :].to(tl.int64) * D + offs_k[:, None], mask=w_ok, other=0.0)
    return tl.dot(g.to(w2_ptr.dtype.element_ty), w2t, acc_g, input_precision=PRECISION)


@triton.jit
def _moe_bwd_hidden_kernel(
    xs_ptr, gs_ptr, slot_pair_ptr, tile_expert_ptr, weight_ptr,
    w1_ptr, b1_ptr, w3_ptr, w2_ptr, u_ptr,
    hw_ptr, du_ptr, du3_ptr, gw_ptr,
    PAIRS, D, F, GW_COLS,
    HAS_B1: tl.constexpr, KEEP_U: tl.constexpr,
    ACT: tl.constexpr, PRECISION: tl.constexpr, TILE: tl.constexpr, GW_BLOCK: tl.constexpr,
    BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, TWO_LOOPS: tl.constexpr, N_INNER: tl.constexpr,
):
    """Per slot s and F block: u = xs[s] W1[e] + b1, g = gs[s] W2[e]ᵀ (one K loop over D, or
    one for each with TWO_LOOPS: a meta-parameter, the better depends on the sizes);
    hw = w · act(u) [S,F] (∂W2's left operand); ∂u = (w g) ⊙ act′(u) [S,F] (∂u3 for swiglu);
    gw[s, c] = Σ_f h g over the c-th GW_BLOCK columns of F (c < cdiv(F, GW_BLOCK); the gather
    kernel writes ⟨G[row], b2[e]⟩ in columns after these), so that ∂w = Σ_c gw = ⟨G, h W2 + b2⟩
    whatever BLOCK_F the autotuner picks. xs, gs: the slot rows of x and G (_gather_rows_kernel).
    ∂b1 is not summed here (_tile_sums_kernel reads ∂u again): a column sum of the accumulator
    in this epilogue cost ~130 us of a ~2.2 ms call at large, what the re-read costs.
    Reductions of the dots' operands inside the K loop, or a branch after it, cost 10-15% here
    and 2-3x in the weight-gradient kernel (bench/gemm_probe.py on the H200).
    KEEP_U (not swiglu): u is read from u_ptr [S,F] (GEMM1's, b1 in it) and only g's dots run.
    """
    t, pid_f = _tile_and_block(F, BLOCK_F, N_INNER)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = offs_f < F
    offs_s = t.to(tl.int64) * TILE + tl.arange(0, TILE)
    pair = tl.load(slot_pair_ptr + offs_s)
    valid = pair < PAIRS
    w = tl.load(weight_ptr + pair, mask=valid, other=0.0)
    e = tl.load(tile_expert_ptr + t).to(tl.int64)
    k_end = tl.where(tl.load(slot_pair_ptr + t.to(tl.int64) * TILE) < PAIRS, D, 0)
    acc_u3 = tl.zeros([TILE, BLOCK_F], tl.float32)
    acc_g = tl.zeros([TILE, BLOCK_F], tl.float32)
    if KEEP_U:
        acc_u = tl.load(u_ptr + offs_s[:, None] * F + offs_f[None, :], mask=f_ok[None, :], other=0.0).to(tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            acc_g = _down_t_step(gs_ptr, w2_ptr, acc_g, offs_s[:, None] * D + offs_k[None, :], offs_k, offs_f, f_ok,
                                 e, D, F, PRECISION)
    elif TWO_LOOPS:
        acc_u = _bias_rows(b1_ptr, e * F, offs_f, f_ok, TILE, HAS_B1)
        for k0 in range(0, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            acc_u, acc_u3 = _up_step(xs_ptr, w1_ptr, w3_ptr, acc_u, acc_u3, offs_s[:, None] * D + offs_k[None, :],
                                     offs_k, offs_f, f_ok, e, D, F, ACT, PRECISION)
        for k0 in range(0, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            acc_g = _down_t_step(gs_ptr, w2_ptr, acc_g, offs_s[:, None] * D + offs_k[None, :], offs_k, offs_f, f_ok,
                                 e, D, F, PRECISION)
    else:
        acc_u = _bias_rows(b1_ptr, e * F, offs_f, f_ok, TILE, HAS_B1)
        for k0 in range(0, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            row_off = offs_s[:, None] * D + offs_k[None, :]
            acc_u, acc_u3 = _up_step(xs_ptr, w1_ptr, w3_ptr, acc_u, acc_u3, row_off, offs_k, offs_f, f_ok, e, D, F,
                                     ACT, PRECISION)
            acc_g = _down_t_step(gs_ptr, w2_ptr, acc_g, row_off, offs_k, offs_f, f_ok, e, D, F, PRECISION)
    h = act_fwd(acc_u, acc_u3, ACT)
    # ∂w partials, one column per GW_BLOCK of F (BLOCK_F is a multiple of it).
    NB: tl.constexpr = BLOCK_F // GW_BLOCK
    gw = tl.sum(tl.reshape(tl.where(f_ok[None, :], h * acc_g, 0.0), [TILE, NB, GW_BLOCK]), axis=2)
    offs_c = pid_f * NB + tl.arange(0, NB)
    tl.store(gw_ptr + offs_s[:, None] * GW_COLS + offs_c[None, :], tl.where(valid[:, None], gw, 0.0),
             mask=(offs_c < tl.cdiv(F, GW_BLOCK))[None, :])
    du, du3 = act_bwd(w[:, None] * acc_g, acc_u, acc_u3, ACT)
    keep = valid[:, None]
    du = tl.where(keep, du, 0.0)
    out_off = offs_s[:, None] * F + offs_f[None, :]
    tl.store(hw_ptr + out_off, tl.where(keep, w[:, None] * h, 0.0).to(hw_ptr.dtype.element_ty), mask=f_ok[None, :])
    tl.store(du_ptr + out_off, du.to(du_ptr.dtype.element_ty), mask=f_ok[None, :])
    if ACT == 3:
        tl.store(du3_ptr + out_off, tl.where(keep, du3, 0.0).to(du3_ptr.dtype.element_ty), mask=f_ok[None, :])


@triton.jit
def _moe_wgrad_kernel(
    a_ptr, b_ptr, b2_ptr, expert_slots_ptr, dw_ptr, dw2_ptr, final_ptr, final2_ptr, whole_slots_ptr,
    I, J, E, SPLIT, S0, S,
    HAS_B2: tl.constexpr, ACCUMULATE: tl.constexpr, FINISH: tl.constexpr,
    TILE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """∂W[e] [I,J] = Σ_{s ∈ e} A[s]ᵀ B[s] over expert e's slots, in slot order (deterministic).

    A [S,I], B [S,J]: slot rows, zero on padding slots, read with plain contiguous loads.
    HAS_B2: also ∂W2[e] = Σ A[s]ᵀ B2[s]. (The bias gradients come from the hidden kernel's
    per-tile sums: a row sum of B here, beside the dot, made this kernel 2-3x slower.)
    SPLIT > 1: program axis 0 is (e, c); split c takes the c-th of SPLIT equal runs of whole
    tiles of e's slots and writes fp32 partial sums to dw [E·SPLIT, I, J], row e·SPLIT + c,
    which _sum_splits_kernel adds in c order: the boundaries depend only on the layout, so
    the result is reproducible run to run.
    ACCUMULATE (SPLIT = 1, fp32 outputs): add into dw (dw2) instead of writing, and leave an
    expert with no slots here untouched: the runs of tiles (moe_backward) sum their weight
    gradients in place, in run order, and each run holds only a few experts.
    FINISH (with ACCUMULATE): this is the run of slots [S0, S0 + S) of a whole layout whose expert
    ranges are whole_slots [2E]: an expert whose first slot is in it starts from zeros, not from
    dw (which holds anything before), and one whose last slot is in it is stored in final
    (final2), in their dtype, not in dw (gluon_moe.weight_grads' `final`; here never pending).
    """
    e = tl.program_id(0) // SPLIT
    c = tl.program_id(0) % SPLIT
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    i_ok = offs_i < I
    j_ok = offs_j < J
    lo = tl.load(expert_slots_ptr + e)
    hi = tl.load(expert_slots_ptr + E + e)
    run = tl.cdiv((hi - lo) // TILE, SPLIT) * TILE
    lo = tl.minimum(lo + c * run, hi)
    hi = tl.minimum(lo + run, hi)
    # This program's block of ∂W (row e·SPLIT + c; = e when SPLIT = 1) as block pointers: their
    # element offsets are made at each use from scalars, so none stay live across the K loop
    # (with pointer tensors, ACCUMULATE took 128x256 tiles from 164 to 255 registers, spilling;
    # sm_90a offline). H200, large: 1.47 -> 1.39 ms of this kernel a training step.
    row = tl.program_id(0).to(tl.int64) * I * J
    blocks = [tl.make_block_ptr(p + row, (I, J), (J, 1), (tl.program_id(1) * BLOCK_I, tl.program_id(2) * BLOCK_J),
                                (BLOCK_I, BLOCK_J), (1, 0)) for p in (dw_ptr, dw2_ptr)]
    acc = tl.zeros([BLOCK_I, BLOCK_J], tl.float32)
    acc2 = tl.zeros([BLOCK_I, BLOCK_J], tl.float32)
    opens = False
    closes = False
    if FINISH:
        opens = tl.load(whole_slots_ptr + e) >= S0
        closes = tl.load(whole_slots_ptr + E + e) <= S0 + S
    if ACCUMULATE and hi > lo and not opens:  # the sums so far start the accumulators
        acc = tl.load(blocks[0], boundary_check=(0, 1), padding_option="zero")
        if HAS_B2:
            acc2 = tl.load(blocks[1], boundary_check=(0, 1), padding_option="zero")
    for s0 in range(lo, hi, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S).to(tl.int64)
        s_ok = offs_s < hi
        a = tl.load(a_ptr + offs_s[:, None] * I + offs_i[None, :], mask=s_ok[:, None] & i_ok[None, :], other=0.0)
        sj_ok = s_ok[:, None] & j_ok[None, :]
        b = tl.load(b_ptr + offs_s[:, None] * J + offs_j[None, :], mask=sj_ok, other=0.0)
        at = tl.trans(a)
        acc = tl.dot(at, b, acc, input_precision=PRECISION)
        if HAS_B2:
            b2 = tl.load(b2_ptr + offs_s[:, None] * J + offs_j[None, :], mask=sj_ok, other=0.0)
            acc2 = tl.dot(at, b2, acc2, input_precision=PRECISION)
    if closes and hi > lo:
        # (not `p` again: Triton's front end takes a comprehension's name as the kernel's variable,
        # and a pointer of another dtype under the same name does not build)
        finals = [tl.make_block_ptr(f + row, (I, J), (J, 1), (tl.program_id(1) * BLOCK_I, tl.program_id(2) * BLOCK_J),
                                    (BLOCK_I, BLOCK_J), (1, 0)) for f in (final_ptr, final2_ptr)]
        tl.store(finals[0], acc.to(final_ptr.dtype.element_ty), boundary_check=(0, 1))
        if HAS_B2:
            tl.store(finals[1], acc2.to(final2_ptr.dtype.element_ty), boundary_check=(0, 1))
    elif hi > lo or not ACCUMULATE:  # an expert with no slots in this run is left untouched
        tl.store(blocks[0], acc.to(dw_ptr.dtype.element_ty), boundary_check=(0, 1))
        if HAS_B2:
            tl.store(blocks[1], acc2.to(dw2_ptr.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def _sum_tiles_kernel(part_ptr, out_ptr, part2_ptr, out2_ptr, expert_slots_ptr, E, N1, N2,
                      ROWS1: tl.constexpr, ROWS2: tl.constexpr, ACCUMULATE: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    """out[e, :] = Σ part[i, :] over the parts i of expert e's slots, where part i sums slots
    [i·ROWS, (i+1)·ROWS) (+= with ACCUMULATE, experts with no slots untouched); for two
    (part [S/ROWS, N], out [E,N]) pairs: program axis 1's first cdiv(N1, BLOCK) blocks take the
    first. The bias gradients from the hidden kernel's tile sums and the gather kernel's.
    BLOCK_R parts a step, in a fixed order: one part a step was a chain of ~500 dependent loads
    an expert at large (+0.8 ms, H200); at BLOCK 256 it still took 33 us a medium step (40
    programs), hence BLOCK is tuned."""
    e = tl.program_id(0)
    pid = tl.program_id(1)
    NB1 = tl.cdiv(N1, BLOCK)
    if pid < NB1:
        src, dst, n, blk, rows = part_ptr, out_ptr, N1, pid, ROWS1
    else:
        src, dst, n, blk, rows = part2_ptr, out2_ptr, N2, pid - NB1, ROWS2
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    i0 = tl.load(expert_slots_ptr + e) // rows
    i1 = tl.load(expert_slots_ptr + E + e) // rows
    acc = tl.zeros([BLOCK_R, BLOCK], tl.float32)
    for r0 in range(i0, i1, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        acc += tl.load(src + offs_r.to(tl.int64)[:, None] * n + offs[None, :],
                       mask=(offs_r < i1)[:, None] & ok[None, :], other=0.0)
    total = tl.sum(acc, axis=0)
    out = dst + e.to(tl.int64) * n + offs
    if ACCUMULATE:
        ok = ok & (i1 > i0)
        total += tl.load(out, mask=ok, other=0.0)
    tl.store(out, total.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _tile_sums_kernel(src_ptr, dst_ptr, N, TILE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    """dst[t, :] = Σ_{r < TILE} src[t·TILE + r, :] in fp32, rows in order: src [T·TILE, N] (slot
    rows), dst [T, N]. ∂b1's per-tile sums of ∂u, which _sum_tiles_kernel then adds per expert,
    where the Gluon weight-gradient kernel does not sum ∂u beside ∂W1 (swiglu, off Hopper).
    In the hidden kernel's epilogue this column sum of the accumulator cost ~130 us a call at
    large; here a read of ∂u at memory speed costs about the same (155 us, bench/gemm_probe.py
    on the H200), and the epilogue is simpler."""
    # A block of rows is at most a tile (TILE and BLOCK_R are powers of two): a config's BLOCK_R
    # may pass the smaller TILEs, whose tiles would otherwise take the next tile's rows.
    ROWS: tl.constexpr = BLOCK_R if BLOCK_R <= TILE else TILE
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros([ROWS, BLOCK], tl.float32)
    for r0 in range(0, TILE, ROWS):
        rows = t * TILE + r0 + tl.arange(0, ROWS)
        acc += tl.load(src_ptr + rows[:, None] * N + offs[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
    tl.store(dst_ptr + t * N + offs, tl.sum(acc, axis=0), mask=ok)


@triton.jit
def _close_totals_kernel(total_ptr, final_ptr, total2_ptr, final2_ptr, total3_ptr, final3_ptr, expert_slots_ptr,
                         pending_ptr, E, N, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """The weight gradients summed over runs of tiles, closed (close_totals): final[e] = total[e]
    ([E, N] each, final in its dtype) for an expert left pending (pending[w, e]: its sums are still
    in the fp32 totals), zeros for an expert with no slots (no run wrote it); every other expert's
    final is written already. Program axis 2 picks the pair w; axis 1 a part of STEPS·BLOCK elements."""
    w = tl.program_id(2)
    if w == 0:
        src, dst = total_ptr, final_ptr
    elif w == 1:
        src, dst = total2_ptr, final2_ptr
    else:
        src, dst = total3_ptr, final3_ptr
    e = tl.program_id(0)
    pending = tl.load(pending_ptr + w * E + e) != 0
    empty = tl.load(expert_slots_ptr + e) == tl.load(expert_slots_ptr + E + e)
    if pending or empty:
        for step in range(STEPS):
            offs = (tl.program_id(1) * STEPS + step) * BLOCK + tl.arange(0, BLOCK)
            ok = offs < N
            at = e.to(tl.int64) * N + offs
            value = tl.load(src + at, mask=ok & pending, other=0.0)
            tl.store(dst + at, value.to(dst.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# Config lists. The first entry is the default (interpreter, MHA_COMPILE_NO_AUTOTUNE=1).
# Keys: the GEMM's K and N extents, TILE and the flags that change the work per program;
# Launcher adds the tensors' dtypes. TILE comes from the grouping, not from tuning.

# Lists pruned and widened by bench/gemm_probe.py on the H200 (bf16, medium and large): BLOCK
# 256 won GEMM2 and ∂x everywhere (∂x at large 728 -> 592 us, 472 TFLOP/s) and GEMM1 at large.
# TMA (experts_up): GEMM1's gelu epilogue costs about what its dots do (TMA at large: 547 us a
# call without it, 970 with it, bench/tma_probe.py on the H200). With pointer loads the [TILE,
# BLOCK_K] addresses take the registers a persistent loop would need, and it gained nothing
# (1080-1108 against 1100 us, 8d08dd7); with TMA loads and one program per SM, 1000 -> 853
# (BLOCK_F 128, BLOCK_K 64, 4 stages) at large. At medium, 98 us a step before, 103 with TMA.
_up = Launcher(_moe_up_kernel, [
    dict(BLOCK_F=64, BLOCK_K=64, num_warps=4, num_stages=3),
    dict(BLOCK_F=128, BLOCK_K=32, num_warps=4, num_stages=4),
    dict(BLOCK_F=256, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_F=128, BLOCK_K=64, num_warps=8, num_stages=4),
    dict(BLOCK_F=128, BLOCK_K=128, num_warps=8, num_stages=3),
    # Two persistent programs an SM (TMA only; one's dots beside the other's epilogue, 168
    # registers and 98 KiB each): medium 75.6 against 80.3 us for [128, 256] at one an SM, large
    # 758.8 against 734.5 (bench/results/gemm_probe_up.txt, session 19, H200).
    dict(BLOCK_F=128, BLOCK_K=32, num_warps=4, num_stages=4, SM_PROGRAMS=2),
], key=["D", "F", "TILE", "ACT", "TMA", "HAS_B1", "KEEP_U"], blocks=lambda m: dict(
    xs=(m["TILE"], m["BLOCK_K"]), w1=(1, m["BLOCK_K"], m["BLOCK_F"]), w3=(1, m["BLOCK_K"], m["BLOCK_F"]),
    h=(m["TILE"], m["BLOCK_F"]), u=(m["TILE"], m["BLOCK_F"])))
# TWO_LOOPS (u's K loop, then g's) won with BLOCK_F 64 at medium (223 against 260 us), one loop
# with both dots with BLOCK_F 128 at large (2.51 against 2.99 ms): bench/gemm_probe.py, H200.
# N_INNER (_tile_and_block): the programs' order, not their work. In the 2-D order the ~132
# programs running at once are 132 tiles in one column block, so a tile's slot rows are read
# again for every block, from DRAM at large; with N_INNER a tile's blocks run one after another
# and read them from L2. Measured (bench/gemm_probe.py, H200, f67cd9b, large, ∂b1 still summed
# here): 2546 -> 2324 us a call (BLOCK_F 128, BLOCK_K 64), TWO_LOOPS 2847 -> 2590. With the
# bias in the accumulator and ∂b1 in _tile_sums_kernel (5008a42) BLOCK_F 128 takes 2125-2154
# us (BLOCK_K 32 or 64), 225-229 at medium. The 2-D order lost every pair: out of the list.
_hidden = Launcher(_moe_bwd_hidden_kernel, [
    dict(BLOCK_F=64, BLOCK_K=32, TWO_LOOPS=False, N_INNER=True, num_warps=4, num_stages=3),
    dict(BLOCK_F=64, BLOCK_K=64, TWO_LOOPS=True, N_INNER=True, num_warps=8, num_stages=4),
    dict(BLOCK_F=64, BLOCK_K=64, TWO_LOOPS=False, N_INNER=True, num_warps=8, num_stages=4),
    dict(BLOCK_F=128, BLOCK_K=64, TWO_LOOPS=False, N_INNER=True, num_warps=8, num_stages=3),
    dict(BLOCK_F=128, BLOCK_K=32, TWO_LOOPS=False, N_INNER=True, num_warps=8, num_stages=4),
], key=["D", "F", "TILE", "ACT", "HAS_B1", "KEEP_U"])
# The slots GEMM at large (same run): N_INNER with BLOCK_N 256, GEMM2 576 -> 545 us, ∂x 537 ->
# 514; equal at medium. BLOCK_N 128 with N_INNER (∂x 534) replaces its 2-D twin (654).
_SLOTS_CONFIGS = [
    dict(BLOCK_N=64, BLOCK_K=64, N_INNER=True, num_warps=4, num_stages=3),
    dict(BLOCK_N=128, BLOCK_K=64, N_INNER=True, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BLOCK_K=64, N_INNER=False, num_warps=4, num_stages=3),
    dict(BLOCK_N=256, BLOCK_K=64, N_INNER=False, num_warps=8, num_stages=3),
    dict(BLOCK_N=256, BLOCK_K=64, N_INNER=True, num_warps=8, num_stages=3),
]
_SLOTS_KEY = ["K", "NOUT", "TILE", "HAS_A2", "HAS_BIAS", "HAS_SCALE", "ACCUMULATE"]
_slots_gemm = Launcher(_moe_slots_gemm_kernel, _SLOTS_CONFIGS, key=_SLOTS_KEY)
# ∂x added into fp32 rows over the backward's column passes (ACCUMULATE): the autotuner's trials
# must not add into them, so it restores the rows after each (a copy of them a trial); the
# launches that write (GEMM2, ∂x in one pass) skip that copy.
_slots_gemm_into = Launcher(_moe_slots_gemm_kernel, _SLOTS_CONFIGS, key=_SLOTS_KEY, restore=["out_ptr"])
_wgrad = Launcher(_moe_wgrad_kernel, [
    dict(BLOCK_I=64, BLOCK_J=64, BLOCK_S=32, num_warps=4, num_stages=3),
    dict(BLOCK_I=128, BLOCK_J=128, BLOCK_S=64, num_warps=8, num_stages=3),
    dict(BLOCK_I=128, BLOCK_J=128, BLOCK_S=32, num_warps=8, num_stages=4),
    dict(BLOCK_I=128, BLOCK_J=256, BLOCK_S=64, num_warps=8, num_stages=3),
    # Inside a run of tiles (large) only the run's experts have programs with work: with runs
    # of 256 MiB ~3 of 16, 96 programs at 128x256 for 132 SMs, 384 at 64x128 (runs took 0.99 ms
    # a GEMM against 0.60 over the whole layout, gemm_probe.txt); the autotuner kept 128x256.
    # Runs of 512 MiB (~6 experts) took the two GEMMs 1.98 -> 1.48 ms a step (7863c64).
    dict(BLOCK_I=64, BLOCK_J=128, BLOCK_S=64, num_warps=4, num_stages=4),
], key=["I", "J", "E", "SPLIT", "TILE", "HAS_B2", "ACCUMULATE", "FINISH"], restore=["dw_ptr", "dw2_ptr"])
# BLOCK_R is clipped to TILE in the kernel. [64, 64] blocks at 4 warps: 145 against 154 us a large
# whole-layout call (the autotuner's pick before, [64, 16] at 2 warps), 20.5 against 24.9 at
# medium (bench/small_kernels_probe.py, H200).
_tile_sums = Launcher(_tile_sums_kernel, [
    dict(BLOCK=64, BLOCK_R=64, num_warps=4, num_stages=3),
    dict(BLOCK=128, BLOCK_R=16, num_warps=4, num_stages=3),
    dict(BLOCK=256, BLOCK_R=16, num_warps=4, num_stages=3),
    dict(BLOCK=64, BLOCK_R=16, num_warps=2, num_stages=3),
], key=["N", "TILE"])
# One config, not autotuned: the autotuner's picks among four moved a large step's three calls
# from 17.9 (session 23, [64, 32]) to 32.6 us each (session 24, [128, 16]; kernel_times.txt).
# Narrow column blocks and long row blocks give many programs and few dependent loads each; of
# 18 configs (bench/small_kernels_probe.py's bias_sums, H200, session 24) [16, 256] at 4 warps was
# the fastest at both presets: 2.6 us at medium against 6.8 for the autotuner's pick there ([32,
# 64] at 2 warps), 4.3 at large (one run of tiles) against 7.8 ([64, 64]) and 16.1 ([128, 16]).
_sum_tiles = Launcher(_sum_tiles_kernel, [
    dict(BLOCK=16, BLOCK_R=256, num_warps=4, num_stages=3),
], key=["E", "N1", "N2", "ROWS1", "ROWS2", "ACCUMULATE"], restore=["out_ptr", "out2_ptr"])


# ---------------------------------------------------------------------------------------------
# Grouping and launchers.


def tile_rows(pairs, experts):
    """TILE, the slots per tile (the grouped GEMMs' BLOCK_M): ~mean slots per expert, 16..128."""
    mean = pairs // max(1, experts)
    return 128 if mean >= 1024 else 64 if mean >= 128 else 32 if mean >= 32 else 16


def tile_count(pairs, experts, tile):
    """Tiles of the slot layout: every pair, and each expert's last tile padded."""
    return -(-(pairs + experts * (tile - 1)) // tile)


def slot_count(pairs, experts):
    """S, the slot rows of the layout of `pairs` (row, expert) pairs: a function of the sizes alone."""
    tile = tile_rows(pairs, experts)
    return tile_count(pairs, experts, tile) * tile


# Grouping in three launches (it was ~14 torch ops, each a launch and ~10 µs of host work):
#   count    per chunk of GROUP_CHUNK pairs, how many pairs go to each expert    [C, E]
#   scan     one program: expert totals, padded starts, each chunk's first slot per expert
#   scatter  per chunk: a pair's slot = its chunk's base + its rank among the chunk's pairs of
#            its expert (a one-hot cumsum: stable, so slots follow pair order within an expert);
#            per tile: the tile's expert and the padding slots (pair id = PAIRS).
# Every slot is written exactly once (by its pair's chunk or as padding by its tile), so
# nothing needs a fill first, and the layout is a pure function of `index`.
GROUP_CHUNK = 256


@triton.jit
def _onehot(index_ptr, c, PAIRS, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < PAIRS
    ex = tl.load(index_ptr + offs, mask=ok, other=0)
    hot = ((ex[:, None] == tl.arange(0, BLOCK_E)[None, :]) & ok[:, None]).to(tl.int32)
    return offs, ok, ex, hot


@triton.jit
def _group_count_kernel(index_ptr, counts_ptr, PAIRS, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts [C, BLOCK_E] int32: pairs of chunk c per expert."""
    c = tl.program_id(0)
    _, _, _, hot = _onehot(index_ptr, c, PAIRS, BLOCK, BLOCK_E)
    tl.store(counts_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), tl.sum(hot, axis=0))


@triton.jit
def _group_scan_kernel(counts_ptr, base_ptr, meta_ptr, C, E,
                       TILE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program. meta [3E] = (padded start, padded end, count) per expert;
    base [C, BLOCK_E] = the first slot of chunk c's pairs of expert e."""
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    total = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        cnt = tl.load(counts_ptr + offs_c[:, None] * BLOCK_E + offs_e[None, :], mask=(offs_c < C)[:, None], other=0)
        total += tl.sum(cnt, axis=0)
    padded = (total + TILE - 1) // TILE * TILE
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    tl.store(meta_ptr + offs_e, start, mask=e_ok)
    tl.store(meta_ptr + E + offs_e, end, mask=e_ok)
    tl.store(meta_ptr + 2 * E + offs_e, total, mask=e_ok)
    run = start
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_ok = (offs_c < C)[:, None]
        cnt = tl.load(counts_ptr + offs_c[:, None] * BLOCK_E + offs_e[None, :], mask=c_ok, other=0)
        incl = tl.cumsum(cnt, axis=0)
        tl.store(base_ptr + offs_c[:, None] * BLOCK_E + offs_e[None, :], run[None, :] + incl - cnt, mask=c_ok)
        run += tl.sum(cnt, axis=0)


@triton.jit
def _group_scatter_kernel(index_ptr, base_ptr, meta_ptr, slot_pair_ptr, pair_slot_ptr, tile_expert_ptr,
                          PAIRS, C, E,
                          TILE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Programs [0, C): place chunk c's pairs. Programs [C, C + T): tile t's expert and padding."""
    pid = tl.program_id(0)
    if pid < C:
        offs, ok, ex, hot = _onehot(index_ptr, pid, PAIRS, BLOCK, BLOCK_E)
        rank = tl.sum(hot * (tl.cumsum(hot, axis=0) - 1), axis=1)
        slot = tl.load(base_ptr + pid * BLOCK_E + ex, mask=ok, other=0) + rank
        tl.store(slot_pair_ptr + slot, offs, mask=ok)
        tl.store(pair_slot_ptr + offs, slot, mask=ok)
    else:
        t = pid - C
        offs_e = tl.arange(0, BLOCK_E)
        e_ok = offs_e < E
        end = tl.load(meta_ptr + E + offs_e, mask=e_ok, other=0)
        # searchsorted(end, t·TILE, right=True), clamped: tiles past the last expert's run are
        # all padding and take expert E−1.
        e = tl.minimum(tl.sum((e_ok & (end <= t * TILE)).to(tl.int32), axis=0), E - 1)
        tl.store(tile_expert_ptr + t, e)
        fill_end = tl.load(meta_ptr + e) + tl.load(meta_ptr + 2 * E + e)
        offs_s = t * TILE + tl.arange(0, TILE)
        tl.store(slot_pair_ptr + offs_s, tl.full([TILE], PAIRS, tl.int32), mask=offs_s >= fill_end)


class Groups:
    """The expert-sorted slot layout of one index [R,k] (see the module docstring)."""

    def __init__(self, index, experts, tile, into=None):
        """into: an int32 buffer of layout_size(index.numel(), experts, tile) elements that the
        layout is written into (from_buffer reads it back), else buffers of its own."""
        pairs = index.numel()
        device = index.device
        flat = index.reshape(-1).to(torch.int32).contiguous()
        chunks = cdiv(pairs, GROUP_CHUNK)
        block_e = pow2(experts)
        counts = torch.empty(chunks, block_e, dtype=torch.int32, device=device)
        base = torch.empty_like(counts)
        if into is None:
            into = torch.empty(layout_size(pairs, experts, tile), dtype=torch.int32, device=device)
        meta = self._views(into, pairs, experts, tile)
        warps = gpu_options(index, num_warps=8)
        launch(_group_count_kernel, (chunks,), flat, counts, pairs, BLOCK=GROUP_CHUNK, BLOCK_E=block_e, **warps)
        launch(_group_scan_kernel, (1,), counts, base, meta, chunks, experts, TILE=tile, BLOCK_C=64,
               BLOCK_E=block_e, **warps)
        launch(_group_scatter_kernel, (chunks + self.num_tiles,), flat, base, meta, self.slot_pair, self.pair_slot,
               self.tile_expert, pairs, chunks, experts, TILE=tile, BLOCK=GROUP_CHUNK, BLOCK_E=block_e, **warps)
        # What built_from compares; holding `index` keeps its memory from passing to another tensor.
        self.index, self.index_stamp = index, stamp(index)

    @classmethod
    def from_buffer(cls, buffer, index, experts):
        """The layout of `index` that Groups(index, experts, tile_rows(...), into=buffer) wrote
        into `buffer`, read back with no launch (the op's backward: region_forward's `reuse`)."""
        groups = object.__new__(cls)
        groups._views(buffer, index.numel(), experts, tile_rows(index.numel(), experts))
        groups.index, groups.index_stamp = index, stamp(index)
        return groups

    def _views(self, buffer, pairs, experts, tile):
        """Sets the sizes and the layout's tensors as views of `buffer` (layout_size's order);
        returns meta [3E]: the padded starts, padded ends and counts the kernels write."""
        size = layout_size(pairs, experts, tile)
        torch._check(buffer.dtype == torch.int32 and buffer.dim() == 1 and buffer.numel() == size,
                     lambda: f"Groups: a layout buffer of {tuple(buffer.shape)} {buffer.dtype} for {pairs} pairs "
                             f"over {experts} experts in tiles of {tile}, which take [{size}] int32")
        self.pairs, self.tile, self.experts = pairs, tile, experts
        self.num_tiles = tile_count(pairs, experts, tile)
        self.slots = self.num_tiles * tile
        self.slot_pair, self.pair_slot, self.tile_expert, meta = (
            buffer.narrow(0, start, size) for start, size in _layout_parts(pairs, experts, tile))
        self.expert_slots = meta[:2 * experts]  # [2E]: padded start, padded end
        # A whole layout is its own one run (see tiles)
        self.whole_slots, self.first_slot = self.expert_slots, 0
        return meta

    def built_from(self, index):
        """Whether this is the layout of `index`: the tensor it was built from (or a view of the
        same elements), not written to since (its version counter, which views share). Never for
        an inference tensor's layout (no version counter, and no backward to keep it for)."""
        held = self.index_stamp
        return held is not None and held[0][-1] is not None and stamp(index) == held

    def tiles(self, t0, t1):
        """Tiles [t0, t1) as a layout of their own: a slot buffer made for it starts at slot
        t0·TILE (its row 0). Pair ids stay global, and with them padding and the routing
        weights; each expert's slot range is clipped to these tiles (empty for the experts
        outside them) where first read (expert_slots). No pair_slot: the token-order passes
        read the whole layout."""
        part = object.__new__(Groups)
        s0, s1 = t0 * self.tile, t1 * self.tile
        part.pairs, part.tile, part.num_tiles, part.experts = self.pairs, self.tile, t1 - t0, self.experts
        part.slots, part.pair_slot = s1 - s0, None
        part.slot_pair = self.slot_pair[s0:s1]
        part.tile_expert = self.tile_expert[t0:t1]
        part.index = part.index_stamp = None  # built from no index of its own
        # the whole layout's expert ranges and where this run starts in it: the weight gradients
        # summed over runs tell from them which run holds an expert's first and last slot
        part.whole_slots, part.first_slot = self.expert_slots, s0
        return part

    @functools.cached_property
    def expert_slots(self):
        """[2E] int32: each expert's padded start and end slot in this layout. __init__ sets it for
        a whole layout; a run of tiles (`tiles`) clips the whole layout's here, on first read. Only
        the backward's weight and bias gradients read it, so the forward's runs skip these two
        torch ops (two runs at large; a torch call costs ~10-20 us of the H200's host, PERF_NOTES v15)."""
        return (self.whole_slots - self.first_slot).clamp_(0, self.slots)


def _layout_parts(pairs, experts, tile):
    """[(start, size)] of slot_pair [S], pair_slot [pairs], tile_expert [tiles] and meta [3E] in a
    layout's buffer: end to end, so that the kernels write every element (an op's output holds no
    uninitialised bits), in this order so that at the presets each piece starts 16-byte aligned
    as its own allocation would (S is whole tiles of ≥ 16 slots; pairs and tiles are multiples of
    4 there; a misaligned piece elsewhere only takes Triton's unaligned build)."""
    tiles = tile_count(pairs, experts, tile)
    parts, start = [], 0
    for size in (tiles * tile, pairs, tiles, 3 * experts):
        parts.append((start, size))
        start += size
    return parts


def layout_size(pairs, experts, tile):
    """int32 elements of a layout's buffer (Groups' `into`, from_buffer)."""
    start, size = _layout_parts(pairs, experts, tile)[-1]
    return start + size


def group(index, experts, into=None):
    return Groups(index, experts, tile_rows(index.numel(), experts), into)


# The slot buffers (xs, gs [S,D]; h, hw, ∂u [S,F]) are S ≈ R·k rows each: at the large preset
# the backward's came to ~1.3 GB at once. Past this many bytes the forward and the backward
# run over runs of whole tiles, each with buffers of its own; only the fp32 rows the
# token-order passes read (c, ∂x_slot [S,D]) and the ∂w partials stay whole. The weight
# gradients are then summed over runs in fp32, in run order (reproducible).
# 512 MiB: three runs at large, whose weight gradients each span ~6 of 16 experts (with six
# runs of 256 MiB, ~3: 0.99 ms a GEMM against 0.60 over the whole layout, gemm_probe.txt).
# bench/offline_memory.py puts the MoE backward's peak at 1592 MiB with it (1327 with 256),
# still under the pool backward's 1603, which sets the step's peak; 768 would set it at 1846.
# (Session 31: the weight gradients' final outputs, +64 MiB through the runs, and runs of equal
# size, −70 at the largest run: the step's peak stays the pool backward's, 1605 offline.)
# MHA_COMPILE_SLOT_CHUNK_MB sets it (read at import): smaller runs lower the training peak at
# medium (offline: 267 MiB of live tensors with one run, 199 with runs of 128 MiB, 169 with 64),
# for more, smaller launches (graphs="auto" keeps its sizes: region_graphs.AUTO_SLOT_BYTES). On
# the H200 (session 44, bench/PERF_NOTES.md v47) runs of 64 MiB cost a medium step +256 us (+45%),
# a large one +1.14 ms: a run's weight-gradient launch has ~24 output tiles for 132 SMs (stream-K
# throughout), 74 -> 251 us a medium step. So 512 stays the default.
SLOT_CHUNK_ENV = "MHA_COMPILE_SLOT_CHUNK_MB"


def slot_chunk_bytes(text):
    """SLOT_CHUNK_BYTES from MHA_COMPILE_SLOT_CHUNK_MB's text (None: 512 MiB); a clear error for a
    value that is not a positive number of MiB."""
    return max(1, env_mib(SLOT_CHUNK_ENV, text, 512, "the slot buffers a run of the MoE's tiles may take"))


SLOT_CHUNK_BYTES = slot_chunk_bytes(os.environ.get(SLOT_CHUNK_ENV))


# KEEP_HIDDEN (off by default: options["keep_hidden"], or MHA_COMPILE_KEEP_HIDDEN=1 for every
# region): the forward's GEMM1 also writes u = xs W1[e] + b1[e] [S,F] in the weights' dtype, the
# region keeps it (triton_region's `reuse`), and the backward's hidden kernel reads it instead of
# computing it again: half the hidden kernel's dots (~0.35 ms of FLOPs a large step at 790
# TFLOP/s), for S·F more bytes kept from the forward to the backward (520 MiB at large in bf16, 66
# at medium). Not swiglu (its u3 would be kept too). Both GEMM1s and both hidden kernels take it
# (gluon_moe's: KEEP_U variants; on the H200, bench/PERF_NOTES.md v39-v40: GEMM1 +84 us a large
# step, the hidden kernel −359; the step's GPU time 5.419 → 4.992 ms at large). Read when the
# region's forward runs; its backward finds what the forward kept in `reuse` (a flip in between
# is refused there).
KEEP_HIDDEN = os.environ.get("MHA_COMPILE_KEEP_HIDDEN", "0") == "1"


def keeps_hidden(act, keep=False):
    """Whether the forward keeps u for the backward: asked for (keep: the op's keep_hidden) or
    KEEP_HIDDEN, and not swiglu."""
    return (keep or KEEP_HIDDEN) and act != "swiglu"


# The backward's hidden layer in passes of F columns (MHA_COMPILE_HIDDEN_COLUMNS=c, read at import;
# off by default): its [S,F] buffers (hw, ∂u, and ∂u3 with swiglu: two thirds of the backward's
# slot buffers at medium, 66 MiB each in bf16) are made c columns at a time, so they take c/F of
# their memory. The expert function is a sum over its hidden columns, f_e(x) = Σ_f act(u_f)
# W2[e, f] + b2[e], so each pass's ∂W2 rows, ∂W1 (∂W3) columns and ∂b1 columns are whole within
# the pass: no sums across passes but ∂x = Σ_f ∂u_f W1[e, :, f]ᵀ, which the passes add into fp32
# slot rows (_backward_columns). Unlike runs of slot tiles (SLOT_CHUNK_BYTES: +45% a medium step
# on the H200, its weight gradients on 3 of 8 experts a launch, bench/PERF_NOTES.md v47), every
# weight-gradient launch still covers every expert. Not timed on a GPU yet (session 46): the
# passes' extra launches and the weights' column copies are the cost (bench/PERF_NOTES.md v49).
# With it, the backward walks all slots at once (SLOT_CHUNK_BYTES then bounds the forward's
# runs only), and a region that keeps the forward's u (keep_hidden, holding [S,F] anyway) takes
# the whole of F in one pass.
HIDDEN_COLUMNS_ENV = "MHA_COMPILE_HIDDEN_COLUMNS"


def hidden_columns(text):
    """HIDDEN_COLUMNS from MHA_COMPILE_HIDDEN_COLUMNS's text: None, "" or "0": 0 (all of F in one
    pass); else a positive multiple of GW_BLOCK (the ∂w partials' column block, which a pass must
    not cut), with a clear error for anything else."""
    if text is None or text.strip() in ("", "0"):
        return 0
    try:
        columns = int(text)
    except ValueError:
        columns = -1
    if columns <= 0 or columns % GW_BLOCK:
        raise ValueError(f"{HIDDEN_COLUMNS_ENV}={text!r}: expected 0 (the experts' hidden columns in one pass, "
                         f"the default) or a positive multiple of {GW_BLOCK}, the most columns a backward pass takes "
                         "(multiples of 128 keep the Gluon kernels)")
    return columns


HIDDEN_COLUMNS = hidden_columns(os.environ.get(HIDDEN_COLUMNS_ENV))


def column_passes(F, columns=None):
    """[(c0, c1)]: the backward's passes over F's columns, at most `columns` each (None:
    HIDDEN_COLUMNS; 0: one pass), as few as that allows and of about equal width, each a multiple
    of GW_BLOCK but the last."""
    columns = HIDDEN_COLUMNS if columns is None else columns
    if not columns or F <= columns:
        return [(0, F)]
    width = cdiv(cdiv(F, cdiv(F, columns)), GW_BLOCK) * GW_BLOCK
    return [(c0, min(F, c0 + width)) for c0 in range(0, F, width)]


def tiles_per_run(tile, bytes_per_slot, chunk=None):
    """Whole tiles a run takes: as many as fit `chunk` bytes (None: SLOT_CHUNK_BYTES), a multiple
    of 8 from 8 on."""
    per = max(1, (SLOT_CHUNK_BYTES if chunk is None else chunk) // (bytes_per_slot * tile))
    if per >= 8:
        per -= per % 8  # tile_expert views at 32-byte boundaries
    return per


def tile_runs(groups, bytes_per_slot, chunk=None):
    """[(t0, t1)]: consecutive runs of whole tiles whose slot buffers fit `chunk` bytes (None:
    SLOT_CHUNK_BYTES; one run when everything fits): as few runs as fit, of about equal size (a
    multiple of 8 tiles but the last), so that the largest run's buffers, which set the MoE's peak,
    are as small as that many runs allow. Large's backward: 352, 352 and 336 tiles, not 408, 408
    and 224 (−70 MiB at the peak, where the runs' weight gradients' final outputs (moe_backward)
    added 64)."""
    per = tiles_per_run(groups.tile, bytes_per_slot, chunk)
    count = cdiv(groups.num_tiles, per)
    if count > 1 and per >= 8:  # ⌈T / count⌉ rounded up to 8 is still at most per (a multiple of 8)
        per = cdiv(cdiv(groups.num_tiles, count), 8) * 8
    return [(t0, min(t0 + per, groups.num_tiles)) for t0 in range(0, groups.num_tiles, per)]


def _act(act):
    return ACT_CODE[act]


# The gather kernel's blocks: BLOCK_S slots (also the rows of each ∂b2 partial sum) by up to
# GATHER_BLOCK_D columns (one ∂w column of ⟨G, b2⟩ each).
GATHER_BLOCK_S = 16
GATHER_BLOCK_D = 128
# With b2 (the backward's second gather: ⟨G, b2⟩ and ∂b2's partial sums beside the copies), 2
# warps a program: 169 against 228 us a large whole-layout call at Triton's default 4, 22 against
# 32 at medium (bench/small_kernels_probe.py, H200). The plain copies are fastest at 4.
GATHER_B2_WARPS = 2


def gather_blocks_d(D):
    block_d = min(GATHER_BLOCK_D, pow2(D))
    return block_d, cdiv(D, block_d)


def gather_rows(x, inv, groups, horizons, dtype, grad_out=None, weight=None, b2=None, gw=None, gb2_col=0,
                block_s=GATHER_BLOCK_S, block_d=None, num_warps=None):
    """(xs [S,D] in `dtype`, gs [S,D] in grad_out's dtype or None, db2 partials [S/16, D] fp32
    or None): the slot rows of x (+ inv[r // H]) and of grad_out, zero on padding slots; with b2
    (the backward), ⟨G, b2[e]⟩ into gw's columns from gb2_col on, and ∂b2's partial sums; see
    _gather_rows_kernel.
    block_s, block_d, num_warps: the launch (bench/small_kernels_probe.py sweeps them); by default
    GATHER_BLOCK_S, gather_blocks_d(D) and Triton's default warps (4), or GATHER_B2_WARPS with b2.
    block_s divides the slot count, and stays GATHER_BLOCK_S with b2 (bias_grads reads ∂b2's
    partials as sums of that many slots); gw has one ⟨G, b2⟩ column a D block after gb2_col, and
    no more (the router's backward adds up every column of a row)."""
    D = x.shape[1]
    xs = torch.empty(groups.slots, D, device=x.device, dtype=dtype)
    gs = None if grad_out is None else torch.empty(groups.slots, D, device=x.device, dtype=grad_out.dtype)
    has_b2 = b2 is not None
    block_d, n_d = gather_blocks_d(D) if block_d is None else (block_d, cdiv(D, block_d))
    if num_warps is None and has_b2:
        num_warps = GATHER_B2_WARPS
    # plain ifs, not torch._check (~1.5 us of host a check, 5 calls a large step)
    if groups.slots % block_s or (has_b2 and block_s != GATHER_BLOCK_S):
        raise ValueError(f"gather_rows: BLOCK_S {block_s} for {groups.slots} slots"
                         + (f" with b2 (which takes {GATHER_BLOCK_S})" if has_b2 else ""))
    if has_b2 and gw.shape[1] != gb2_col + n_d:
        raise ValueError(f"gather_rows: gw has {gw.shape[1]} columns, not {gb2_col} + {n_d} D blocks of {block_d}")
    db2 = (torch.empty(groups.slots // GATHER_BLOCK_S, D, device=x.device, dtype=torch.float32)
           if has_b2 else None)
    launch(_gather_rows_kernel, (groups.slots // block_s, n_d),
        x, x if inv is None else inv, x if gs is None else grad_out, groups.slot_pair, xs,
        xs if gs is None else gs, groups.tile_expert, weight if has_b2 else x, b2 if has_b2 else x,
        gw if has_b2 else x, db2 if has_b2 else x,
        groups.pairs, horizons, D, gw.shape[1] if has_b2 else 0, gb2_col,
        TOP_K=groups.pairs // x.shape[0], HAS_INV=inv is not None, HAS_G=gs is not None, HAS_B2=has_b2,
        TILE=groups.tile, BLOCK_S=block_s, BLOCK_D=block_d,
        **({} if num_warps is None else gpu_options(x, num_warps=num_warps)))
    return xs, gs, db2


def experts_up(xs, groups, w1, b1, w3, act, hidden=None):
    """h [S,F] in the weights' dtype from the slot rows xs [S,D]. A padding slot's row is act(b1[e])
    (xs is 0 there), not 0: GEMM2 (slots_gemm) writes 0 on padding slots whatever h holds. With
    gluon_moe.GLUON_UP (the default), gluon_moe's GEMM1 where up_kernel says so. hidden: an [S,F]
    buffer in h's dtype (not swiglu) that u = xs W1[e] + b1[e] is also written into (KEEP_HIDDEN)."""
    D = xs.shape[1]
    F = w1.shape[2]
    h = torch.empty(groups.slots, F, device=xs.device, dtype=w1.dtype)
    staged = gluon_moe is not None and gluon_moe.GLUON_UP and w3 is None
    if staged and up_kernel(xs, w1, b1, h, act, groups.tile, hidden) == "gluon" and _gluon_launch(
            "GEMM1", up_key(xs, act, groups.tile, b1, hidden),
            functools.partial(gluon_moe.experts_up, xs, groups, w1, b1, act, h, hidden=hidden)):
        return h
    w3 = w1 if w3 is None else w3
    u = h if hidden is None else hidden  # KEEP_U's output (h's again, never written, without it)
    tma = tma_ok(xs, w1, w3, h, u)
    jobs = lambda m: groups.num_tiles * cdiv(F, m["BLOCK_F"])  # noqa: E731
    grid = ((lambda m: (min(jobs(m), m.get("SM_PROGRAMS", 1) * num_sms(xs.device)),)) if tma
            else (lambda m: (jobs(m),)))
    # the descriptors' block shapes are set per config (_up's `blocks`)
    xs_, w1_, w3_, h_, u_ = ((TensorDescriptor.from_tensor(t, [1] * t.dim()) for t in (xs, w1, w3, h, u)) if tma
                             else (xs, w1, w3, h, u))
    _up(grid, xs_, groups.slot_pair, groups.tile_expert, w1_, w1 if b1 is None else b1, w3_, h_, u_,
        groups.pairs, D, F, groups.num_tiles,
        HAS_B1=b1 is not None, ACT=_act(act), KEEP_U=hidden is not None, PRECISION=dot_precision(w1.dtype),
        TILE=groups.tile, TMA=tma)
    return h


def tile_grid(groups, n, block):
    """The launch grid, given a config, of a kernel with a program per (tile, `block` of n
    columns), in the config's order (_tile_and_block)."""
    def grid(meta):
        blocks = cdiv(n, meta[block])
        return (groups.num_tiles * blocks,) if meta["N_INNER"] else (groups.num_tiles, blocks)
    return grid


def slots_gemm(a, b, strides, nout, groups, a2=None, b2=None, bias=None, scale=None, out=None, accumulate=False):
    """[S, nout] in b's dtype: scale · (a B[e] (+ a2 B2[e]) + bias[e]); `strides` = (e, k, n)
    of B. out: rows to write into (a contiguous [S, nout] view), else allocated; accumulate: added
    to what out holds, fp32 (the Triton kernel). One operand pair with B row-major (GEMM2, B = W2)
    runs gluon_moe's GEMM where gemm2_kernel says so."""
    K = a.shape[1]
    if out is None:
        out = torch.empty(groups.slots, nout, device=a.device, dtype=b.dtype)
    if accumulate and out.dtype != torch.float32:
        raise ValueError(f"slots_gemm: accumulate adds into fp32 rows; got out {out.dtype}")
    if a2 is None and not accumulate and tuple(strides) == (K * nout, nout, 1) and gemm2_kernel(
            a, b, out, bias, scale, groups.tile) == "gluon" and _gluon_launch(
            "GEMM2", gemm2_key(a, out, bias, scale, groups.tile),
            functools.partial(gluon_moe.slots_gemm, a, b, groups, out, bias, scale)):
        return out
    launcher = _slots_gemm_into if accumulate else _slots_gemm
    launcher(tile_grid(groups, nout, "BLOCK_N"),
             a, b, a if a2 is None else a2, b if b2 is None else b2, b if bias is None else bias,
             out if scale is None else scale, groups.slot_pair, groups.tile_expert, out,
             groups.pairs, K, nout, *strides,
             HAS_A2=a2 is not None, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
             ACCUMULATE=accumulate, PRECISION=dot_precision(b.dtype), TILE=groups.tile)
    return out


def combine(c, groups, rows, out_dtype):
    """out [R,D] = Σ_j c[slot(r,j)]."""
    D = c.shape[1]
    out = torch.empty(rows, D, device=c.device, dtype=out_dtype)
    block_d = min(128, pow2(D))
    launch(_combine_fwd_kernel, (cdiv(rows, 16), cdiv(D, block_d)),
        c, groups.pair_slot, out, rows, D, TOP_K=groups.pairs // rows, BLOCK_R=16, BLOCK_D=block_d)
    return out


def moe_forward(x, inv, weight, groups, w1, b1, w2, b2, w3, act, horizons, out_dtype, hidden=None):
    """out [R,D] = Σ_j w_j f_{idx_j}(x), x = x (+ inv[r // H], merged by the slot-row gather).
    hidden: an [S,F] buffer (groups.slots rows, the weights' dtype; not swiglu) that GEMM1 also
    writes u = xs W1[e] + b1[e] into, for moe_backward's `hidden` (KEEP_HIDDEN)."""
    E, F, D = w2.shape
    c = torch.empty(groups.slots, D, device=x.device, dtype=w2.dtype)
    runs = tile_runs(groups, (D + F) * w1.element_size())  # xs and h
    scale = weight.reshape(-1)
    for t0, t1 in runs:
        part = groups if len(runs) == 1 else groups.tiles(t0, t1)
        rows = slice(t0 * groups.tile, t1 * groups.tile)
        xs, _, _ = gather_rows(x, inv, part, horizons, w1.dtype)
        h = experts_up(xs, part, w1, b1, w3, act, None if hidden is None else hidden[rows])
        del xs  # each run's buffers go before the next run's come
        slots_gemm(h, w2, (F * D, D, 1), D, part, bias=b2, scale=scale, out=c[rows])
        del h
    return combine(c, groups, x.shape[0], out_dtype)


# The weight-gradient kernel splits each expert's slots into SPLIT runs when (e, I, J) tiles
# alone would leave the SMs idle (medium preset: 8 experts × 2 × 8 tiles of 128² = 128
# programs on 132 SMs, each walking 4096 slots). A split needs at least this many slots a run.
WGRAD_SPLIT_MIN_SLOTS = 512
WGRAD_MAX_SPLIT = 8


def _most_splits(slots, experts):
    return max(1, min(WGRAD_MAX_SPLIT, slots // max(1, experts) // WGRAD_SPLIT_MIN_SLOTS))


def wgrad_splits(slots, experts, I, J, device):
    """SPLIT for the Triton weight-gradient kernel: enough programs for two waves at 128² tiles."""
    tiles = experts * cdiv(I, 128) * cdiv(J, 128)
    return min(_most_splits(slots, experts), cdiv(2 * num_sms(device), tiles))


def gluon_wgrad_splits(slots, experts, I, J, device):
    """SPLIT for the Gluon weight-gradient kernel, one program an SM walking jobs of [128,
    wgrad_block_n(J)]: of the splits allowed, the fewest whose ⌈jobs / SMs⌉ waves, each job 1/SPLIT
    of an expert's slots, take least time. The Triton kernel's rule (two waves of 128² tiles) gave
    the medium preset 3: 192 jobs of [128, 256] on 132 SMs, a wave and a half (the second half of
    the call with a third of the SMs idle), where 2 makes 128 jobs, one wave of jobs 1.5x as long:
    47.3 -> 37.8 us a call on the H200 (session 22, op replay 0.727 -> 0.698 ms a medium step)."""
    tiles = experts * cdiv(I, 128) * cdiv(J, gluon_moe.wgrad_block_n(J))
    sms = num_sms(device)
    return min(range(1, _most_splits(slots, experts) + 1),
               key=lambda s: (fractions.Fraction(cdiv(tiles * s, sms), s), s))


def sum_rows(I):
    """Σb's fp32 rows an expert that the Gluon weight-gradient kernel leaves for an I-row ∂W
    (gluon_moe.wgrad_sum_rows; 1 where gluon_moe cannot be imported)."""
    return 1 if gluon_moe is None else gluon_moe.wgrad_sum_rows(I)


def weight_grads(a, b, b2, groups, into=None, sums=False, final=None, pending=None, flags=None):
    """(∂W [E,I,J], ∂W' [E,I,J] or None, Σb [E,J] or None) in a's dtype from slot rows a [S,I], b
    [S,J] (b2 [S,J]); see _moe_wgrad_kernel. into: fp32 (∂W, ∂W', Σb's rows [E·R, J], R =
    sum_rows(I)) to add these slots' sums to (one run of tiles), returned; Σb's R rows an expert are
    left for the caller to add up once after the last run (sum_splits). final: with `into`, (∂W,
    ∂W' or None) in the weights' dtype and pending [E] int32 (None, or ∂W's None: no finishing):
    ∂W and ∂W' are then summed over the runs as gluon_moe.weight_grads' `final` says (an expert's
    first run writes its totals, its last stores them final where it can, else marks it pending),
    for close_totals to finish after the last run; Σb is added into as without.
    sums: also Σ_{s∈e} b[s] (∂b1 beside ∂W1 = Σ xsᵀ ∂u), where the Gluon kernel runs (its first
    consumer sums each B stage while the stage's wgmmas run: one pass over ∂u fewer than
    tile_sums); Σb is None where it does not, and the caller sums b itself.
    With gluon_moe.wgrad_sum_rows R > 1 the kernel leaves Σb in R fp32 rows an expert (each row
    block's jobs summing 1/R of the K steps), added up here where not `into`. flags: where the
    Gluon kernel takes STREAM, its flags for this launch (a row of gluon_moe.stream_flags, zeros no
    other launch takes); None: fresh ones."""
    E = groups.experts
    I, J = a.shape[1], b.shape[1]
    dev, dtype = a.device, a.dtype
    accumulate = into is not None
    split = 1 if accumulate or gluon_moe is None else gluon_wgrad_splits(groups.slots, E, I, J, dev)
    stream = gluon_moe is not None and gluon_moe.wgrad_stream(accumulate, E)
    rows = sum_rows(I) if sums else 1
    fw, fw2 = final or (None, None)
    gluon = b2 is None and wgrad_kernel(a, b, groups.tile, accumulate, split, sums, stream, rows,
                                        fw is not None) == "gluon"
    if not gluon and not accumulate:
        split = wgrad_splits(groups.slots, E, I, J, dev)
    sums = sums and gluon  # the Triton kernel has no Σb: allocate none for it
    if accumulate:
        dw, dw2, db = into
        torch._check(not sums or (db.dtype == torch.float32 and db.shape == (E * rows, J)),
                     lambda: f"weight_grads: into's Σb wants fp32 rows [E·R, J] = [{E * rows}, {J}], "
                             f"got {db.dtype} {tuple(db.shape)}")
    else:
        dw = torch.empty(E, I, J, device=dev, dtype=dtype)
        dw2 = torch.empty_like(dw) if b2 is not None else None
        db = torch.empty(E, J, device=dev, dtype=dtype) if sums else None
    if split > 1:  # fp32 partial sums, row e·SPLIT + c
        outs = [t for t in (dw, dw2) if t is not None]
        parts = [torch.empty(E * split, I, J, device=dev, dtype=torch.float32) for _ in outs]
        p_dw, p_dw2 = parts[0], parts[-1]
        p_db = torch.empty(E * split * rows, J, device=dev, dtype=torch.float32) if sums else None
    else:
        p_dw, p_dw2, p_db = dw, dw if dw2 is None else dw2, db if sums else None
        if sums and rows > 1 and not accumulate:  # fp32 rows, each written by one job
            p_db = torch.empty(E * rows, J, device=dev, dtype=torch.float32)
    ran = gluon and _gluon_launch(
        "weight-gradient GEMM", wgrad_key(a, b, accumulate, split, sums, stream, rows, fw is not None),
        functools.partial(gluon_moe.weight_grads, a, b, groups, p_dw, accumulate, split, sums=p_db, stream=stream,
                          sum_rows=rows, final=fw, pending=pending, flags=flags))
    if not ran:
        _wgrad(lambda m: (E * split, cdiv(I, m["BLOCK_I"]), cdiv(J, m["BLOCK_J"])),
               a, b, b if b2 is None else b2, groups.expert_slots, p_dw, p_dw2, p_dw if fw is None else fw,
               p_dw2 if fw2 is None else fw2, groups.whole_slots, I, J, E, split, groups.first_slot, groups.slots,
               HAS_B2=b2 is not None, ACCUMULATE=accumulate, FINISH=fw is not None, TILE=groups.tile,
               PRECISION=dot_precision(dtype))
    if split > 1:
        launch(_sum_splits_kernel, (cdiv(E * I * J, SUM_BLOCK), len(outs)),
            parts[0], outs[0], parts[-1], outs[-1], parts[0], E, I * J, split, HAS_BASE=False, BLOCK=SUM_BLOCK)
        if ran and sums:
            sum_splits(p_db, db, split * rows)
    elif ran and sums and rows > 1 and not accumulate:
        sum_splits(p_db, db, rows)
    return dw, dw2, (db if ran and sums else None)


def tile_sums(rows, groups):
    """[T, N] fp32: each tile's sum of the slot rows [S, N] (padding slots hold zeros)."""
    T, N = groups.num_tiles, rows.shape[1]
    out = torch.empty(T, N, device=rows.device, dtype=torch.float32)
    _tile_sums(lambda m: (T, cdiv(N, m["BLOCK"])), rows, out, N, TILE=groups.tile)
    return out


def bias_grads(db1_part, db2_part, groups, dtype, into=None):
    """(∂b1 [E,F] or None, ∂b2 [E,D] or None) in `dtype`: each expert's sum of the per-tile sums
    db1_part [T,F] (tile_sums of ∂u) and of the per-GATHER_BLOCK_S sums db2_part [S/16, D] (gather
    kernel), None where there is no such bias, in slot order. into: fp32 (∂b1, ∂b2) to add to
    (one run of tiles), returned."""
    E = groups.experts
    outs = [None if part is None else (torch.empty(E, part.shape[1], device=part.device, dtype=dtype)
                                       if into is None else into[i])
            for i, part in enumerate((db1_part, db2_part))]
    live = [(part, out, rows) for part, out, rows in zip((db1_part, db2_part), outs, (groups.tile, GATHER_BLOCK_S))
            if part is not None]
    if live:
        (p1, o1, r1), (p2, o2, r2) = live[0], live[-1]
        n1, n2 = p1.shape[1], (p2.shape[1] if len(live) == 2 else 0)
        _sum_tiles(lambda m: (E, cdiv(n1, m["BLOCK"]) + cdiv(n2, m["BLOCK"])),
                   p1, o1, p2, o2, groups.expert_slots, E, n1, n2,
                   ROWS1=r1, ROWS2=r2, ACCUMULATE=into is not None)
    return tuple(outs)


def moe_backward(grad_out, x, inv, weight, groups, w1, b1, w2, b2, w3, act, horizons, hidden=None):
    """(∂x_slot [S,D], gw_part [S, F blocks] fp32, ∂W1, ∂b1, ∂W2, ∂b2, ∂W3) — weights' dtypes,
    but ∂x_slot's fp32 where the hidden layer takes more than one pass of columns (column_passes).
    hidden: moe_forward's u [S,F] (KEEP_HIDDEN), which the hidden kernel then reads rather than
    computing again (in one pass)."""
    E, D, F = w1.shape
    dev, wdt = x.device, w1.dtype
    # ∂w's partial sums: the hidden kernel's F columns, then the gather kernel's ⟨G, b2⟩ columns
    gw = torch.empty(groups.slots, gw_columns(D, F, b2 is not None), device=dev, dtype=torch.float32)
    passes = column_passes(F)
    if len(passes) > 1 and hidden is None:
        dx_slot, grads = _backward_columns(grad_out, x, inv, weight, groups, w1, b1, w2, b2, w3, act, horizons,
                                           gw, passes)
        return (dx_slot, gw, *grads)
    runs = tile_runs(groups, backward_slot_bytes(D, F, w3 is not None, w1.element_size()))
    if len(runs) == 1:
        dx_slot, grads = _backward_tiles(grad_out, x, inv, weight, groups, w1, b1, w2, b2, w3, act, horizons,
                                         gw, None, None, hidden=hidden)
        return (dx_slot, gw, *grads)
    dx_slot = torch.empty(groups.slots, D, device=dev, dtype=wdt)
    # fp32 sums over the runs: the bias gradients' from zeros, added to in place by the weight-gradient
    # and tile-sum kernels; the weight gradients' written by each expert's first run, then added to,
    # and stored final in the weights' dtype by its last where it can (weight_grads' `final`), the
    # rest by close_totals. No zero fills nor copies of the [E, D, F] totals: at large, 2 · (15 +
    # 24) us a step of torch's fill_ and copy_ (bench/PERF_NOTES.md v33).
    # ∂b1 where the Gluon kernel sums ∂u beside ∂W1 is in R rows an expert (sum_rows), added into
    # across the runs and added up once, with the tile sums' total (swiglu's, off Hopper), after
    # the last: each run's own rows zeroed, summed and added took 9 of torch's kernels, ~60 us a
    # large step (bench/PERF_NOTES.md v33's shapes).
    fp32 = lambda t, *shape, fill=torch.empty: None if t is None else fill(*shape, device=dev, dtype=torch.float32)
    rows_b1 = sum_rows(D)
    total = (fp32(w1, E, D, F), fp32(b1, E, F, fill=torch.zeros), fp32(w2, E, F, D), fp32(b2, E, D, fill=torch.zeros),
             fp32(w3, E, D, F), fp32(b1, E * rows_b1, F, fill=torch.zeros))
    # fp32 weights: the totals are the final outputs (one buffer, as `.to` of an fp32 total was)
    final = [total[i] if wdt == torch.float32 or w is None
             else torch.empty_like(w, memory_format=torch.contiguous_format) for w, i in ((w1, 0), (w2, 2), (w3, 4))]
    pending = torch.zeros(3, E, device=dev, dtype=torch.int32)  # [∂W1, ∂W2, ∂W3] a row
    # STREAM's flags for every run's two weight-gradient launches, zeroed at once (a row a launch)
    flags = (gluon_moe.stream_flags(dev, 2 * len(runs)).unbind(0)
             if gluon_moe is not None and gluon_moe.wgrad_stream(True, E) else [None] * (2 * len(runs)))
    for i, (t0, t1) in enumerate(runs):
        rows = slice(t0 * groups.tile, t1 * groups.tile)
        _backward_tiles(grad_out, x, inv, weight, groups.tiles(t0, t1), w1, b1, w2, b2, w3, act,
                        horizons, gw[rows], dx_slot[rows], total, (final, pending), flags[2 * i:2 * i + 2],
                        None if hidden is None else hidden[rows])
    close_totals([(total[i], final[w]) for w, i in enumerate((0, 2, 4)) if final[w] is not None], groups, pending)
    db1 = None if b1 is None else sum_splits(total[5], torch.empty(E, F, device=dev, dtype=wdt), rows_b1, total[1])
    return dx_slot, gw, final[0], db1, final[1], None if b2 is None else total[3].to(wdt), final[2]


def close_totals(pairs, groups, pending):
    """Each (fp32 totals [E, ...], final [E, ...]) pair of the weight gradients summed over runs
    (weight_grads' `final`), closed: the experts left pending (their row of pending [3, E] set, in
    the pairs' order) converted into final, the experts with no slots in the whole layout (which no
    run wrote) zeroed; one launch whose programs for the other experts return at once."""
    E, n = groups.experts, pairs[0][0][0].numel()
    padded = pairs + pairs[-1:] * (3 - len(pairs))  # grid axis 2 reads only the first len(pairs)
    launch(_close_totals_kernel, (E, cdiv(n, CLOSE_BLOCK * CLOSE_STEPS), len(pairs)),
        *padded[0], *padded[1], *padded[2], groups.expert_slots, pending, E, n, STEPS=CLOSE_STEPS, BLOCK=CLOSE_BLOCK)


CLOSE_BLOCK, CLOSE_STEPS = 2048, 4


def gw_columns(D, F, has_b2):
    return cdiv(F, GW_BLOCK) + (gather_blocks_d(D)[1] if has_b2 else 0)


def backward_slot_bytes(D, F, swiglu, element_size):
    """Bytes of the backward's slot buffers per slot: xs, gs [S,D]; hw, ∂u (and ∂u3) [S,F]."""
    return (2 * D + (3 if swiglu else 2) * F) * element_size


def _choose(kernel, key, device, unsupported):
    """"gluon" when nothing keeps `kernel` off its Gluon version: gluon_moe imports, its build for
    the compile `key` has not failed (_gluon_launch), and unsupported() (its operand checks) says
    None; else "triton", the reason logged once on the "mha_compile" logger where a CUDA GPU runs
    the Triton one."""
    why = GLUON_MISSING if gluon_moe is None else _GLUON_FAILED.get((kernel, key)) or unsupported()
    if why is None:
        return "gluon"
    if device.type == "cuda" and (kernel, why) not in _GLUON_DECLINED:
        _GLUON_DECLINED.add((kernel, why))
        log.info("mha_compile: the MoE's %s runs in Triton, not Gluon: %s", kernel, why)
    return "triton"


_GLUON_DECLINED = set()
_GLUON_LAUNCHED = set()  # (kernel, compile key) launched once without error
_GLUON_FAILED = {}  # (kernel, compile key) -> why its first launch failed


def _gluon_launch(kernel, key, launch):
    """launch() a Gluon kernel; True when it ran. Its first launch for a compile `key` builds it: if
    that raises (a Triton whose Gluon cannot build it, say), the error is logged as a warning, the
    key takes the Triton kernel from then on, and this returns False so that the caller runs it
    now. Later launches are not guarded: a failure there is not a build's (Triton may still build
    another variant of a key for its integer arguments' divisibility by 16; that would be the same
    code, built the same way)."""
    if (kernel, key) in _GLUON_LAUNCHED:
        launch()
        return True
    try:
        launch()
    except Exception as error:  # noqa: BLE001 - any build failure: the Triton kernel computes the same
        why = f"its first launch failed ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
        _GLUON_FAILED[kernel, key] = why
        log.warning("mha_compile: the MoE's Gluon %s for %s %s; the Triton kernel runs instead",
                    kernel, key, why)
        return False
    _GLUON_LAUNCHED.add((kernel, key))
    return True


def up_key(xs, act, tile, b1, hidden=None):
    """What the Gluon GEMM1 is compiled for (beside the shapes, which it takes at run time): with
    KEEP_HIDDEN's u output or not, so that a failed build of one leaves the other."""
    return act, xs.dtype, tile, b1 is not None, hidden is not None


def up_kernel(xs, w1, b1, h, act, tile, hidden=None):
    """Which GEMM1 the forward runs on these operands with gluon_moe.GLUON_UP: "gluon"
    (gluon_moe.experts_up: Hopper, bf16/fp16, gelu, gelu_tanh or silu, sizes its blocks divide;
    and it has built) or "triton"."""
    return _choose("GEMM1", up_key(xs, act, tile, b1, hidden), xs.device,
                   lambda: gluon_moe.up_unsupported(xs, w1, h, act, tile))


def hidden_key(xs, act, tile, b1, hidden=None):
    """What the Gluon hidden kernel is compiled for (beside the shapes, which it takes at run time),
    with which of its two kernels runs (gluon_moe.default_config: the cooperative one from
    COOP_MIN_D on) and whether it reads KEEP_HIDDEN's u, so that a failed build of one does not send
    another to Triton, nor its first launch go unguarded because another has launched."""
    wide = gluon_moe is not None and xs.shape[1] >= gluon_moe.COOP_MIN_D
    return act, xs.dtype, tile, b1 is not None, wide, hidden is not None


def hidden_kernel(xs, gs, w1, w2, w3, b1, act, tile, hidden=None):
    """Which hidden kernel the backward runs on these operands: "gluon" (gluon_moe's warp-specialised
    kernel: Hopper, bf16/fp16, gelu, silu or swiglu, sizes its blocks divide; and it has built) or
    "triton"."""
    return _choose("hidden kernel", hidden_key(xs, act, tile, b1, hidden), xs.device,
                   lambda: gluon_moe.unsupported(xs, gs, w1, w2, w3, act, tile))


def wgrad_key(a, b, accumulate, split=1, sums=False, stream=False, sum_rows=1, finish=False):
    """What the Gluon weight-gradient GEMM is compiled for: the rows' dtype, written or added into
    fp32 totals, its column block (256 where J allows), whether it splits the slots, whether it
    sums B's columns and in more than one row an expert (Triton builds an integer argument equal to
    1 apart, as a constant), its schedule (STREAM or jobs: a failed STREAM build must not send
    the jobs' launches to Triton) and whether it finishes the runs' sums (`final`)."""
    return (a.dtype, bool(accumulate), b.shape[1] % 256 == 0, split > 1, bool(sums), bool(stream),
            bool(sums) and sum_rows > 1, bool(finish))


def wgrad_kernel(a, b, tile, accumulate, split=1, sums=False, stream=False, sum_rows=1, finish=False):
    """Which weight-gradient kernel weight_grads runs (one B) on these slot rows; by the same key
    its launch records a failed build under."""
    return _choose("weight-gradient GEMM", wgrad_key(a, b, accumulate, split, sums, stream, sum_rows, finish),
                   a.device, lambda: gluon_moe.wgrad_unsupported(a, b, tile))


def gemm2_key(a, out, bias, scale, tile):
    """What the Gluon GEMM2 is compiled for: the dtype, TILE (which splits a job's rows, or its
    columns), its column block (slots_block_n), whether it adds a bias, and the scale's dtype (None:
    no scale; the kernel loads the scale in its own dtype)."""
    return a.dtype, tile, out.shape[1] % 256 == 0, bias is not None, None if scale is None else scale.dtype


def gemm2_kernel(a, b, out, bias, scale, tile):
    """Which kernel the forward's GEMM2 runs (slots_gemm with one operand pair, B row-major):
    "gluon" (gluon_moe.slots_gemm: Hopper, bf16/fp16, TILE 64 or 128, sizes its blocks divide;
    and it has built) or "triton"."""
    return _choose("GEMM2", gemm2_key(a, out, bias, scale, tile), a.device,
                   lambda: gluon_moe.slots_unsupported(a, b, out, bias, scale, tile))


def _hidden_layer(xs, gs, weight, groups, w1, b1, w2, w3, act, gw, hidden=None):
    """(hw, ∂u, ∂u3) [S,F] in the weights' dtype (∂u3 is ∂u without swiglu) for the slot rows xs,
    gs [S,D] of `groups` and F = W1's columns, and their ∂w partials in gw's first cdiv(F,
    GW_BLOCK) columns (gw: fp32 rows, or a view of some of a wider buffer's columns): the Gluon
    hidden kernel where hidden_kernel says so, else the Triton one. hidden: the forward's u [S,F]
    to read (KEEP_HIDDEN)."""
    D, F = w1.shape[1], w1.shape[2]
    hw = torch.empty(groups.slots, F, device=xs.device, dtype=w1.dtype)
    du = torch.empty_like(hw)
    du3 = torch.empty_like(hw) if w3 is not None else du
    if not (hidden_kernel(xs, gs, w1, w2, w3, b1, act, groups.tile, hidden) == "gluon" and _gluon_launch(
            "hidden kernel", hidden_key(xs, act, groups.tile, b1, hidden),
            functools.partial(gluon_moe.backward_hidden, xs, gs, groups, w1, b1, w2, weight, act, hw, du, gw,
                              w3, None if w3 is None else du3, hidden=hidden))):
        _hidden(tile_grid(groups, F, "BLOCK_F"),
                xs, gs, groups.slot_pair, groups.tile_expert, weight,
                w1, w1 if b1 is None else b1, w1 if w3 is None else w3, w2, hw if hidden is None else hidden,
                hw, du, du3, gw, groups.pairs, D, F, gw.stride(0),
                HAS_B1=b1 is not None, KEEP_U=hidden is not None, ACT=_act(act), PRECISION=dot_precision(w1.dtype),
                TILE=groups.tile, GW_BLOCK=GW_BLOCK)
    return hw, du, du3


def _backward_columns(grad_out, x, inv, weight, groups, w1, b1, w2, b2, w3, act, horizons, gw, passes):
    """The backward over the whole layout with the hidden layer in passes of F columns (`passes`,
    column_passes; HIDDEN_COLUMNS): each pass takes contiguous copies of its columns of W1, b1,
    W2's rows and W3, makes their hw, ∂u (∂u3) [S, c1 - c0] and ∂w partials (in its own gw
    columns), and from them its rows of ∂W2 and its columns of ∂W1, ∂b1, ∂W3, whole, and adds its
    share of ∂x_slot = Σ_f ∂u W1ᵀ into fp32 rows (ACCUMULATE), so the passes' roundings are not
    added up in bf16. Returns (∂x_slot [S,D] fp32, (∂W1, ∂b1, ∂W2, ∂b2, ∂W3)) in the weights'
    dtype, as _backward_tiles does over the whole layout but for ∂x_slot's dtype."""
    _, D, F = w1.shape
    dev, wdt = x.device, w1.dtype
    xs, gs, db2_part = gather_rows(x, inv, groups, horizons, wdt, grad_out, weight, b2, gw,
                                   gb2_col=cdiv(F, GW_BLOCK))
    gs = gs.to(wdt)
    dx_slot = torch.empty(groups.slots, D, device=dev, dtype=torch.float32)
    parts = []  # each pass's (∂W1, ∂b1, ∂W2, ∂W3) columns
    for i, (c0, c1) in enumerate(passes):
        cols = slice(c0, c1)
        w1c, w2c = w1[:, :, cols].contiguous(), w2[:, cols].contiguous()
        b1c = None if b1 is None else b1[:, cols].contiguous()
        w3c = None if w3 is None else w3[:, :, cols].contiguous()
        hw, du, du3 = _hidden_layer(xs, gs, weight, groups, w1c, b1c, w2c, w3c, act, gw[:, c0 // GW_BLOCK:])
        dw2, _, _ = weight_grads(hw, gs, None, groups)
        del hw  # before ∂W1's partial sums allocate
        width = c1 - c0
        slots_gemm(du, w1c, (D * width, 1, width), D, groups, a2=None if w3 is None else du3, b2=w3c,
                   out=dx_slot, accumulate=i > 0)
        dw1, dw3, db1 = weight_grads(xs, du, du3 if w3 is not None else None, groups, sums=b1 is not None)
        if b1 is not None and db1 is None:
            db1, _ = bias_grads(tile_sums(du, groups), None, groups, wdt)
        parts.append((dw1, db1, dw2, dw3))
        del du, du3
    whole = [None if part[0] is None else torch.cat(part, dim=axis)
             for part, axis in zip(zip(*parts), (2, 1, 1, 2))]
    _, db2 = bias_grads(None, db2_part, groups, wdt)
    return dx_slot, (whole[0], whole[1], whole[2], db2, whole[3])


def _backward_tiles(grad_out, x, inv, weight, groups, w1, b1, w2, b2, w3, act, horizons, gw, dx_slot, total,
                    closing=None, flags=(None, None), hidden=None):
    """The backward over `groups`' slots (the whole layout, or one run of tiles): writes their rows
    of gw and ∂x_slot (None: allocated here) and returns (∂x_slot, (∂W1, ∂b1, ∂W2, ∂b2, ∂W3)), the
    weight gradients summed over these slots, in the weights' dtype; or, given `total` (fp32 sums
    in that order, then ∂b1's rows as weight_grads' into takes them), adds them there, the weight
    gradients' as weight_grads' `final` says with closing = ([∂W1, ∂W2, ∂W3] finals, pending [3, E]);
    flags: STREAM's flags for ∂W2's and ∂W1's launches (weight_grads' `flags`); hidden: these
    slots' rows of moe_forward's u (KEEP_HIDDEN: the Triton hidden kernel reads it)."""
    E, D, F = w1.shape
    wdt = w1.dtype
    # The slot rows of x (merged, in the weights' dtype, as in the forward) and of G, once:
    # every backward GEMM below then reads plain contiguous rows.
    xs, gs, db2_part = gather_rows(x, inv, groups, horizons, wdt, grad_out, weight, b2, gw,
                                   gb2_col=cdiv(F, GW_BLOCK))
    hw, du, du3 = _hidden_layer(xs, gs, weight, groups, w1, b1, w2, w3, act, gw, hidden)
    # ∂W2 = Σ (w h)ᵀ G first, so that hw and gs [S,F] + [S,D] are freed before ∂x allocates its
    # [S,D] (large preset, computed: slot buffers alive at once 1.61 -> 1.34 GB; same
    # kernels, same results). Then ∂W1 = Σ xᵀ ∂u (∂W3 = Σ xᵀ ∂u3), with ∂b1 = Σ ∂u beside it
    # where the Gluon kernel runs; elsewhere ∂u's tile sums give ∂b1.
    final, pending = closing or ([None] * 3, [None] * 3)
    dw2, _, _ = weight_grads(hw, gs.to(wdt), None, groups, into=None if total is None else (total[2], None, None),
                             final=(final[1], None), pending=pending[1], flags=flags[0])
    del hw, gs
    if w3 is None:
        dx_slot = slots_gemm(du, w1, (D * F, 1, F), D, groups, out=dx_slot)
    else:
        dx_slot = slots_gemm(du, w1, (D * F, 1, F), D, groups, a2=du3, b2=w3, out=dx_slot)
    dw1, dw3, db1 = weight_grads(xs, du, du3 if w3 is not None else None, groups,
                                 into=None if total is None else (total[0], total[4], total[5]), sums=b1 is not None,
                                 final=(final[0], final[2]), pending=pending[0], flags=flags[1])
    db1_part = tile_sums(du, groups) if b1 is not None and db1 is None else None
    db1_summed, db2 = bias_grads(db1_part, db2_part, groups, wdt, into=None if total is None else (total[1], total[3]))
    return dx_slot, (dw1, db1_summed if db1 is None else db1, dw2, db2, dw3)
