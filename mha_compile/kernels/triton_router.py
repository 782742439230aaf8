"""The router in fp32: logits, softmax, top-k (forward), and its gradient (backward).

Forward, BLOCK_R rows a program:
    logits = x Wgᵀ          x = ctx + inv[b] (merge on load) or the staged y; fp32 dots;
                            or, in a 16-bit model, ctx Wgᵀ + inv[b] Wgᵀ (SPLIT_CTX, below)
    π = softmax(logits);   (w, idx) = top-k of π (k rounds of argmax, lowest index first);
    w ← w / Σw if renorm.
The top-k is k rounds of "take the largest, mask it": E ≤ 64 fits one [BLOCK_R, BLOCK_E] tile.

Backward (`router_combine_backward`), in two kernels, in token order and without atomics, so it
is bitwise reproducible:
  pass 1, BLOCK_R rows a program, from the forward's π (route returns it, [R,E] fp32: 4 MiB at the
  large preset; recomputing it from x read 64 MiB, and pass 1 took 78.7 us of a step against 16.4):
    ∂w_j = Σ_c gw_part[slot(r,j), c]     (per-F-block partials from the experts' backward)
    ∂π   = (∂w − Σ_i ∂w_i w_i) / Σ_i π_i on the chosen j (renorm), else ∂w; 0 elsewhere
    ∂logits = π ⊙ (∂π − ⟨∂π, π⟩)
  pass 2, one (batch row b, block of D columns) a program, its H rows:
    ∂y[r] = Σ_j ∂x_slot[slot(r,j)] + ∂logits Wg
    ∂inv[b] = Σ_h ∂y[b,h]     (the seed's fix; only when SUM_H, i.e. kernels="fused")
One program a batch row doing both (one warp, the logits' D blocks then ∂y's) took 167.8 us at
the large preset against 145 for the two passes (bench/results/router_probe.txt, session 24), and
a large training step replayed 82 us faster with the two (flag_ab, 8 rounds), medium 7 us.
∂Wg = ∂logitsᵀ x (`router_weight_grad`): per (run of rows, D block) partial sums [SPLIT, E, D]
of x merged on load, added over the runs in order. As a cuBLAS fp32 GEMM on x.float() it took
0.17 ms at the large preset, plus the cast (K = R = 65536, M = E = 16). With SPLIT_WGRAD (the default)
x is taken apart as the forward's SPLIT_CTX does: ∂logitsᵀ ctx on the bf16 ctx + (Σ_h ∂logits)ᵀ inv.

The thin dots (x Wgᵀ in the forward, ∂logits Wg in pass 2, N or K = E) set those kernels' time:
on the FMA units the forward took 0.34 ms at the large preset and the backward 0.57 ms, for
64 MiB of x each (~200 GB/s). For 16-bit models they run as tf32x3 (three TF32 tensor-core
products of hi/lo splits, ~2⁻²¹ relative: fp32 to within a few ulps), or, where ctx is taken
apart from inv (SPLIT_CTX, SPLIT_WGRAD), as 16-bit dots whose products are exact; fp32 models
keep ieee fp32 dots, which their 1e-5 bound is checked at. The tensor cores' fp32 accumulation
drifts over long chains (the ∂Wg split, chained over thousands of rows: 1.29e-5 off float64; the
forward split over D = 8192, 6.4e-6), so the ∂Wg split sums each row block's dots apart and adds
the blocks in fp32, and the forward split does so for each D block past D = 1024.
"""
import os

import torch
import triton
import triton.language as tl

from mha_compile.kernels.triton_pool import COLUMN_BLOCK_C, column_sums
from mha_compile.kernels.triton_util import (Launcher, cdiv, cut_runs, gpu_options, launch, load_rows, load_x, pow2,
                                             split_runs)

MAX_EXPERTS = 64
# The forward's logits as ctx Wgᵀ (one 16-bit dot of exact products) + inv[b] Wgᵀ (once a batch row)
# where ctx and Wg share a 16-bit dtype and inv is merged on load, instead of tf32x3 dots on
# x = ctx + inv[b] merged in fp32 (hi/lo splits of x and Wg every K step). Offline (sm_90a, large,
# 64 rows at 4 warps): 40 registers and 4 wgmmas a program where the merged form takes 152 and 24.
# On the H200 (session 26, bench/flag_ab.py --flag mha_compile.kernels.triton_router:SPLIT_CTX,
# 8 rounds, bf16): a large training step (D·E = 8192) −67.8 us as the median of the rounds that
# timed the merged graph first (−195.6 in the others, where the graph timed second ran slow: see
# flag_ab.summary), the route and _inv_logits_kernel 25.3 + 7.3 us against 48.3 in a step's
# profile; a medium one (D·E = 2048) +2.1 us, where the merged kernel is latency-bound
# (9 us for 8 MiB) and the extra launch costs more than the dots save. So the split is taken from
# SPLIT_CTX_MIN_WORK = D·E up (between the two measured shapes; nothing between them was timed).
# MHA_COMPILE_ROUTER_SPLIT_CTX=0 turns it off.
SPLIT_CTX = os.environ.get("MHA_COMPILE_ROUTER_SPLIT_CTX", "1") != "0"
SPLIT_CTX_MIN_WORK = 4096
# Its dots chained over all of D into one accumulator drift off float64 with D, as if the tensor
# cores' fp32 accumulation truncated (H200, bf16, 4096 x 16 rows, session 27,
# bench/results/router_split_drift.txt): π 3.6e-7 at D = 512, 1.5e-6 at 2048, 3.2e-6 at 4096,
# 6.4e-6 at 8192, against 1.8e-7 to 3.4e-7 for the merged form. Summing each D block's dots apart
# (two dots of half a block) and adding the blocks in fp32 held it at 1.6e-7 to 3.0e-7 at every
# D, but took the route at large from 30.7-32.7 us to 34.3-38.2 (bench/router_probe.py, each
# config, one machine: router_probe_split_sums_ab.txt). So the chain is kept up to D = 1024
# (~7e-7 by the measured trend) and the block sums taken above.
SPLIT_CTX_CHAIN_MAX_D = 1024
# ∂Wg the same way, where the forward splits and ctx is bf16: ∂logitsᵀ ctx as three bf16 dots of
# ∂logits' hi/mid/lo parts against the exact ctx, plus (Σ_h ∂logits[b,h])ᵀ inv[b] over B rows,
# instead of tf32x3 dots on x merged in fp32. Offline (sm_90a, large): 128 registers and 40 KiB of
# shared memory a program against 216 and 104. On the H200 (session 26, large, bf16): 22.6 us a
# call, two calls a step (ctx's rows; inv's B rows with Σ_h ∂logits summed in the kernel), against
# 57.8 us for the merged one; bench/flag_ab.py --flag mha_compile.kernels.triton_router:SPLIT_WGRAD,
# 8 rounds, with an earlier form (Σ_h ∂logits stored by pass 2): −29.1 us a step as the median of
# the rounds that timed the merged graph first (−170.9 in the others). Not fp16: ∂logits' parts
# would fall below fp16's range. MHA_COMPILE_ROUTER_SPLIT_WGRAD=0 turns it off.
SPLIT_WGRAD = os.environ.get("MHA_COMPILE_ROUTER_SPLIT_WGRAD", "1") != "0"


@triton.jit
def _wg_tile(wg_ptr, offs_e, e_ok, offs_d, d_ok, D):
    """Wg[offs_e, offs_d] in Wg's dtype (0 where masked); int32 offsets (E·D is small), which
    load_rows' int64 ones would cost 8 SASS instructions more in the route (sm_90a, large)."""
    return tl.load(wg_ptr + offs_e[:, None] * D + offs_d[None, :], mask=e_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _logits(x_ptr, inv_ptr, wg_ptr, inv_logits_ptr, rows, r_ok, H, D, E, HAS_INV: tl.constexpr,
            SPLIT_CTX: tl.constexpr, SUM_BLOCKS: tl.constexpr, PRECISION: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr):
    """x Wgᵀ [BLOCK_R, BLOCK_E] fp32 for the given rows (padding experts 0). SPLIT_CTX: x = ctx +
    inv[b] taken apart, ctx Wgᵀ as 16-bit dots of ctx and Wg (exact products, fp32 sums; with
    SUM_BLOCKS each D block's apart, see split_ctx_sums_blocks) plus inv_logits[b] = inv[b] Wgᵀ
    (_inv_logits_kernel, once a batch row); else x merged on load in fp32, dots at PRECISION."""
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    logits = tl.zeros([BLOCK_R, BLOCK_E], tl.float32)
    if SPLIT_CTX:
        for d0 in range(0, D, BLOCK_D):
            if SUM_BLOCKS:
                # The block's second dot takes the first's sum as its accumulator, which keeps
                # Triton's combine pass from folding `logits + dot(a, b, 0)` into dot(a, b, logits).
                block = tl.zeros([BLOCK_R, BLOCK_E], tl.float32)
                for half in tl.static_range(2):
                    offs_d = d0 + half * (BLOCK_D // 2) + tl.arange(0, BLOCK_D // 2)
                    d_ok = offs_d < D
                    block = tl.dot(load_rows(x_ptr, rows, r_ok, offs_d, d_ok, D),
                                   tl.trans(_wg_tile(wg_ptr, offs_e, e_ok, offs_d, d_ok, D)), block)
                logits += block
            else:
                offs_d = d0 + tl.arange(0, BLOCK_D)
                d_ok = offs_d < D
                logits = tl.dot(load_rows(x_ptr, rows, r_ok, offs_d, d_ok, D),
                                tl.trans(_wg_tile(wg_ptr, offs_e, e_ok, offs_d, d_ok, D)), logits)
        logits += tl.load(inv_logits_ptr + (rows.to(tl.int64) // H)[:, None] * E + offs_e[None, :],
                          mask=r_ok[:, None] & e_ok[None, :], other=0.0)
    else:
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            wg = _wg_tile(wg_ptr, offs_e, e_ok, offs_d, d_ok, D).to(tl.float32)
            x = load_x(x_ptr, inv_ptr, rows, r_ok, offs_d, d_ok, H, D, HAS_INV)
            logits = tl.dot(x, tl.trans(wg), logits, input_precision=PRECISION)
    return logits


@triton.jit
def _inv_logits_kernel(inv_ptr, wg_ptr, out_ptr, B, D, E, PRECISION: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr):
    """inv_logits [B,E] fp32 = inv [B,D] fp32 · Wg [E,D]ᵀ, the forward's SPLIT_CTX term."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < B
    logits = _logits(inv_ptr, inv_ptr, wg_ptr, out_ptr, rows, r_ok, 1, D, E, False, False, False, PRECISION,
                     BLOCK_D, BLOCK_E, BLOCK_R)
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * E + offs_e[None, :], logits,
             mask=r_ok[:, None] & (offs_e < E)[None, :])


@triton.jit
def _router_fwd_kernel(
    x_ptr, inv_ptr, wg_ptr, inv_logits_ptr, weight_ptr, index_ptr, probs_ptr,
    R, H, D, E,
    TOP_K: tl.constexpr, HAS_INV: tl.constexpr, SPLIT_CTX: tl.constexpr, SUM_BLOCKS: tl.constexpr,
    RENORM: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """x [R,D] (+ inv [R/H,D], or with SPLIT_CTX inv_logits [R/H,E]), Wg [E,D] → weight [R,k] fp32,
    index [R,k] int32, π [R,E] fp32."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < R
    offs_e = tl.arange(0, BLOCK_E)
    logits = _logits(x_ptr, inv_ptr, wg_ptr, inv_logits_ptr, rows, r_ok, H, D, E, HAS_INV, SPLIT_CTX, SUM_BLOCKS,
                     PRECISION, BLOCK_D, BLOCK_E, BLOCK_R)
    logits = tl.where((offs_e < E)[None, :], logits, float("-inf"))
    z = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = z / tl.sum(z, axis=1)[:, None]
    tl.store(probs_ptr + rows.to(tl.int64)[:, None] * E + offs_e[None, :], probs,
             mask=r_ok[:, None] & (offs_e < E)[None, :])
    # The choice reads `rank`: padding experts -1, never chosen (real probabilities are ≥ 0), and a
    # NaN probability (a NaN or inf in x, Wg or the pool) 2, above every number, as torch.topk
    # ranks NaN. argmax over NaN is the backend's choice (the GPU's NaN-ignoring max could pick a
    # padding lane, an expert past E for every kernel after it); over `rank` it is always an
    # expert < E. The weights are read from π itself, so a NaN row's are NaN and its output too.
    real = (offs_e < E)[None, :]
    rank = tl.where(real, tl.where(probs != probs, 2.0, probs), -1.0)
    total = tl.full([BLOCK_R], 1.0, tl.float32)
    if RENORM:
        total = tl.zeros([BLOCK_R], tl.float32)
        left = rank
        for j in tl.static_range(TOP_K):
            best = tl.argmax(left, axis=1)
            hit = offs_e[None, :] == best[:, None]
            total += tl.sum(tl.where(hit, probs, 0.0), axis=1)
            left = tl.where(hit, -1.0, left)
        total = tl.where(r_ok, total, 1.0)  # rows past R: no 0/0
    left = rank
    out = rows.to(tl.int64) * TOP_K
    for j in tl.static_range(TOP_K):
        best = tl.argmax(left, axis=1)
        hit = offs_e[None, :] == best[:, None]
        # Round-to-nearest division: with k = 1 and renorm the weight is exactly 1, as in the
        # reference (Triton's default fp32 "/" is approximate on the GPU).
        tl.store(weight_ptr + out + j, tl.div_rn(tl.sum(tl.where(hit, probs, 0.0), axis=1), total), mask=r_ok)
        tl.store(index_ptr + out + j, best.to(tl.int32), mask=r_ok)
        left = tl.where(hit, -1.0, left)


@triton.jit
def _router_dlogits_kernel(
    probs_ptr, weight_ptr, index_ptr, pair_slot_ptr, gw_part_ptr, dlogits_ptr,
    R, E, N_FBLK,
    TOP_K: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Pass 1, BLOCK_R rows a program: ∂logits [R,E] fp32 from the forward's π [R,E] and the
    experts' ∂w partials (module docstring)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < R
    offs_e = tl.arange(0, BLOCK_E)
    probs = tl.load(probs_ptr + rows[:, None] * E + offs_e[None, :], mask=r_ok[:, None] & (offs_e < E)[None, :],
                    other=0.0)  # padding experts and rows 0, as the forward's softmax gives them
    dwv = tl.zeros([BLOCK_R, BLOCK_E], tl.float32)  # ∂w_j at the chosen experts, 0 elsewhere
    wv = tl.zeros([BLOCK_R, BLOCK_E], tl.float32)
    chosen = tl.zeros([BLOCK_R, BLOCK_E], tl.int1)
    for j in tl.static_range(TOP_K):
        pair = rows * TOP_K + j
        slot = tl.load(pair_slot_ptr + pair, mask=r_ok, other=0).to(tl.int64)
        # The F blocks' partials in chunks as wide as the expert tile, so that every [BLOCK_R, ·]
        # tile shares one layout: one [BLOCK_R, pow2(N_FBLK)] load took 255 registers and spilled
        # 1440 bytes at large, against 64 and none (sm_90a, offline).
        part = tl.zeros([BLOCK_R, BLOCK_E], tl.float32)
        for c0 in range(0, N_FBLK, BLOCK_E):
            part += tl.load(gw_part_ptr + slot[:, None] * N_FBLK + c0 + offs_e[None, :],
                            mask=r_ok[:, None] & (c0 + offs_e < N_FBLK)[None, :], other=0.0)
        hit = offs_e[None, :] == tl.load(index_ptr + pair, mask=r_ok, other=-1)[:, None]
        dwv = tl.where(hit, tl.sum(part, axis=1)[:, None], dwv)  # a fixed order over the F blocks
        wv = tl.where(hit, tl.load(weight_ptr + pair, mask=r_ok, other=0.0)[:, None], wv)
        chosen = chosen | hit
    # Differences like ∂w_j − Σ_i ∂w_i w_i and ∂π_j − ⟨∂π, π⟩ cancel when one expert dominates;
    # they are evaluated as sums over the *other* experts (1 − π_j = Σ_{i≠j} π_i), which keeps
    # fp32 at ~1e-7 of the float64 reference instead of 1e-7 / (1 − π_j).
    dpi = dwv
    if RENORM:
        probs_c = tl.where(chosen, probs, 0.0)
        total = tl.where(r_ok, tl.sum(probs_c, axis=1), 1.0)
        for j in tl.static_range(TOP_K):
            hit = offs_e[None, :] == tl.load(index_ptr + rows * TOP_K + j, mask=r_ok, other=-1)[:, None]
            other_p = tl.sum(tl.where(hit, 0.0, probs_c), axis=1)
            other_dw = tl.sum(tl.where(hit, 0.0, dwv * wv), axis=1)
            dw_j = tl.sum(tl.where(hit, dwv, 0.0), axis=1)
            dpi = tl.where(hit, ((dw_j * other_p / total - other_dw) / total)[:, None], dpi)
        dpi = tl.where(chosen, dpi, 0.0)
    inner = -tl.sum(dpi * probs, axis=1)[:, None] + tl.zeros([BLOCK_R, BLOCK_E], tl.float32)
    for j in tl.static_range(TOP_K):
        hit = offs_e[None, :] == tl.load(index_ptr + rows * TOP_K + j, mask=r_ok, other=-1)[:, None]
        other_all = tl.sum(tl.where(hit, 0.0, probs), axis=1)
        other_c = tl.sum(tl.where(hit, 0.0, dpi * probs), axis=1)
        dpi_j = tl.sum(tl.where(hit, dpi, 0.0), axis=1)
        inner = tl.where(hit, (dpi_j * other_all - other_c)[:, None], inner)
    dlogits = tl.where(r_ok[:, None], probs * inner, 0.0)
    tl.store(dlogits_ptr + rows[:, None] * E + offs_e[None, :], dlogits, mask=r_ok[:, None] & (offs_e < E)[None, :])


@triton.jit
def _router_dy_kernel(
    wg_ptr, pair_slot_ptr, dx_slot_ptr, dlogits_ptr, dy_ptr, dinv_ptr,
    H, D, E,
    TOP_K: tl.constexpr, SUM_H: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Pass 2, per batch row b and block of D columns, its H rows: ∂y = ∂logits Wg + Σ_j
    ∂x_slot[slot(r,j)] [B,H,D] (dy_ptr's dtype) and with SUM_H ∂inv[b] = Σ_h ∂y [B,D] fp32, from
    pass 1's ∂logits."""
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    rows = b * H + offs_h
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    d_ok = offs_d < D
    hd_ok = h_ok[:, None] & d_ok[None, :]
    dlogits = tl.load(dlogits_ptr + rows[:, None] * E + offs_e[None, :], mask=h_ok[:, None] & (offs_e < E)[None, :],
                      other=0.0)
    wg = tl.load(wg_ptr + offs_e[:, None] * D + offs_d[None, :], mask=(offs_e < E)[:, None] & d_ok[None, :],
                 other=0.0).to(tl.float32)
    dy = tl.dot(dlogits, wg, input_precision=PRECISION)
    for j in tl.static_range(TOP_K):
        slot = tl.load(pair_slot_ptr + rows * TOP_K + j, mask=h_ok, other=0).to(tl.int64)
        dy += tl.load(dx_slot_ptr + slot[:, None] * D + offs_d[None, :], mask=hd_ok, other=0.0).to(tl.float32)
    tl.store(dy_ptr + rows[:, None] * D + offs_d[None, :], dy.to(dy_ptr.dtype.element_ty), mask=hd_ok)
    if SUM_H:
        tl.store(dinv_ptr + b * D + offs_d, tl.sum(tl.where(hd_ok, dy, 0.0), axis=0), mask=d_ok)


@triton.jit
def _router_wgrad_kernel(
    dlogits_ptr, x_ptr, inv_ptr, part_ptr,
    R, H, D, E, ROWS,
    HAS_INV: tl.constexpr, SPLIT16: tl.constexpr, SUM_H: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """part[c] [E,D] fp32 = Σ_{r in run c} ∂logits[r]ᵀ x[r], runs of ROWS rows (a multiple of BLOCK_R).
    SPLIT16: x is 16-bit and read as it is; ∂logits is cut into three parts of x's dtype (hi, mid,
    lo: 24 bits or more of its mantissa, exact to fp32's rounding), each a 16-bit dot of exact
    products against x with fp32 sums. SUM_H: x is inv [B,D] and row b's ∂logits is
    Σ_h ∂logits[b·H + h] (the split's inv term)."""
    c = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    acc = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)
    r_end = tl.minimum(c * ROWS + ROWS, R)
    for r0 in range(c * ROWS, r_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        r_ok = rows < r_end
        if SUM_H:
            dl = tl.zeros([BLOCK_R, BLOCK_E], tl.float32)
            for h in range(H):
                dl += tl.load(dlogits_ptr + (rows.to(tl.int64) * H + h)[:, None] * E + offs_e[None, :],
                              mask=r_ok[:, None] & e_ok[None, :], other=0.0)
        else:
            dl = tl.load(dlogits_ptr + rows.to(tl.int64)[:, None] * E + offs_e[None, :],
                         mask=r_ok[:, None] & e_ok[None, :], other=0.0)
        if SPLIT16:
            x = load_rows(x_ptr, rows, r_ok, offs_d, d_ok, D)
            dlt = tl.trans(dl)
            hi = dlt.to(x.dtype)
            rest = dlt - hi.to(tl.float32)
            mid = rest.to(x.dtype)
            lo = (rest - mid.to(tl.float32)).to(x.dtype)
            # Each block's dots start from zero and the run's sum is an fp32 add (round to nearest):
            # chained into one accumulator over a run of 5461 rows, the split was 1.29e-5 off
            # float64 on the H200 against 2.7e-7 for the merged form (session 26,
            # out/wgrad_rounding.py), as if the tensor cores' accumulation truncated.
            block = tl.dot(lo, x)
            block = tl.dot(mid, x, block)
            acc += tl.dot(hi, x, block)
        else:
            x = load_x(x_ptr, inv_ptr, rows, r_ok, offs_d, d_ok, H, D, HAS_INV)
            acc = tl.dot(tl.trans(dl), x, acc, input_precision=PRECISION)
    tl.store(part_ptr + (c * E + offs_e[:, None]).to(tl.int64) * D + offs_d[None, :], acc,
             mask=e_ok[:, None] & d_ok[None, :])


# Config lists, autotuned on the GPU (the first is the interpreter's and MHA_COMPILE_NO_AUTOTUNE's:
# the fastest measured at the medium and large presets). Both kernels are latency-bound, so
# fewer warps a program, which leave room for more programs an SM, won.
# The forward, bench/router_probe.py on the H200 (dd3c430, bf16): 64 rows at 4 warps 45.7 us at
# large, 9.0 at medium, against 76 and 14 for 32 rows at 4 warps (the first config before);
# 128 rows at 4 warps 48.0 and 10.7, 32 rows at 2 warps 55 and 10.4; 8 warps 1.2-4x as long.
_route = Launcher(_router_fwd_kernel, [
    dict(BLOCK_R=64, num_warps=4, num_stages=3),
    dict(BLOCK_R=128, num_warps=4, num_stages=3),
    dict(BLOCK_R=32, num_warps=2, num_stages=3),
], key=["D", "E", "TOP_K", "HAS_INV", "SPLIT_CTX", "SUM_BLOCKS", "RENORM", "PRECISION"])
# The backward's pass 1 reads π, the ∂w partials and the routing and writes ∂logits, no dot.
# bench/router_probe.py on the H200 (session 25, bf16, the whole backward with pass 2 at its pick):
# 32 rows at 2 warps 86.1 us at large and 17.6 at medium, 64 at 4 warps 86.4 and 19.3; 128 at 4
# and 256 at 8 no faster (87.5-87.9, 21.1-22.7). Recomputing π from x, the whole call took 145 us
# at large (session 24); in a step pass 1 went 78.7 → 16.4 us at large, 18.3 → 7.2 at medium.
_dlogits = Launcher(_router_dlogits_kernel, [
    dict(BLOCK_R=32, num_warps=2, num_stages=3),
    dict(BLOCK_R=64, num_warps=4, num_stages=3),
], key=["E", "N_FBLK", "TOP_K", "RENORM"])
# Pass 2 streams ∂x_slot's rows in and ∂y out (55-96 registers, offline): 64 columns at 1 warp
# 145.0 us, 32 at 1 warp 165.1, 128 at 2 warps 163.9, 4 warps 211-214 (the same probe). The first
# config (32 columns) gives the interpreter's tests more than one block of D.
_combine_dy = Launcher(_router_dy_kernel, [
    dict(BLOCK_D=32, num_warps=1, num_stages=3),
    dict(BLOCK_D=64, num_warps=2, num_stages=3),
    dict(BLOCK_D=128, num_warps=4, num_stages=3),
    dict(BLOCK_D=64, num_warps=1, num_stages=3),
    dict(BLOCK_D=128, num_warps=2, num_stages=3),
    dict(BLOCK_D=256, num_warps=4, num_stages=3),
], key=["H", "D", "E", "TOP_K", "SUM_H", "PRECISION"])

# ∂Wg's kernel is not autotuned (router_weight_grad sizes its blocks and runs): its num_stages, 3
# where the GPU's shared memory takes them, else fewer. At 3, fp32 x needs 168 KB and bf16 104 KB
# (medium and large, bench/offline_sass.py --arch sm_86), past the A100's 163 KB a block and the
# 99 KB of sm_86 and sm_89.
_router_wgrad = Launcher(_router_wgrad_kernel, [dict(num_stages=3), dict(num_stages=2), dict(num_stages=1)],
                         key=["HAS_INV", "SPLIT16", "SUM_H", "PRECISION", "BLOCK_R", "BLOCK_D", "BLOCK_E", "num_warps"],
                         tune=False)


def _logits_block_d(block_e):
    """The D block of the logits' dot x Wgᵀ, by blocks of rows (the forward, _inv_logits_kernel)."""
    return 64 if block_e <= 32 else 32


def router_precision(dtype):
    """The router dots' input_precision for inputs x of `dtype` (see the module docstring)."""
    return "ieee" if dtype == torch.float32 else "tf32x3"


INV_LOGITS_BLOCK_R = 64


def split_ctx(x, inv, wg):
    """Whether route takes x = ctx + inv[b] apart (SPLIT_CTX): inv merged on load, ctx and Wg in
    one 16-bit dtype, whose products a 16-bit dot takes exactly, and D·E at least
    SPLIT_CTX_MIN_WORK (below it the extra launch costs more than the dots save)."""
    return (SPLIT_CTX and inv is not None and x.dtype in (torch.bfloat16, torch.float16) and wg.dtype == x.dtype
            and x.shape[1] * wg.shape[0] >= SPLIT_CTX_MIN_WORK)


def split_ctx_sums_blocks(D):
    """Whether the split forward sums each D block's dots apart and adds the blocks in fp32
    (SUM_BLOCKS), past SPLIT_CTX_CHAIN_MAX_D."""
    return D > SPLIT_CTX_CHAIN_MAX_D


def split_wgrad(x, inv, wg):
    """Whether ∂Wg takes x = ctx + inv[b] apart (SPLIT_WGRAD): where the forward does (split_ctx)
    and ctx is bf16."""
    return SPLIT_WGRAD and split_ctx(x, inv, wg) and x.dtype == torch.bfloat16


def inv_logits(inv, wg, block_r=INV_LOGITS_BLOCK_R, num_warps=4):
    """inv [B,D] fp32 · Wgᵀ → [B,E] fp32, at the router's fp32 accuracy (tf32x3 dots). block_r,
    num_warps: the launch (bench/small_kernels_probe.py sweeps them)."""
    B, D = inv.shape
    E = wg.shape[0]
    out = torch.empty(B, E, device=inv.device, dtype=torch.float32)
    block_e = pow2(E)
    launch(_inv_logits_kernel, (cdiv(B, block_r),),
        inv, wg, out, B, D, E, PRECISION=router_precision(wg.dtype), BLOCK_R=block_r,
        BLOCK_D=_logits_block_d(block_e), BLOCK_E=block_e, **gpu_options(inv, num_warps=num_warps, num_stages=3))
    return out


def route(x, inv, wg, top_k, renorm, horizons):
    """weight [R,k] fp32, index [R,k] int32 and π [R,E] fp32 (the softmax, kept for the
    backward's pass 1) for x [R,D] (+ inv [R/H,D] when given)."""
    R, D = x.shape
    E = wg.shape[0]
    weight = torch.empty(R, top_k, device=x.device, dtype=torch.float32)
    index = torch.empty(R, top_k, device=x.device, dtype=torch.int32)
    probs = torch.empty(R, E, device=x.device, dtype=torch.float32)
    block_e = pow2(E)
    split = split_ctx(x, inv, wg)
    _route(lambda m: (cdiv(R, m["BLOCK_R"]),),
           x, x if inv is None else inv, wg, inv_logits(inv, wg) if split else x, weight, index, probs,
           R, horizons, D, E, TOP_K=top_k, HAS_INV=inv is not None, SPLIT_CTX=split,
           SUM_BLOCKS=split and split_ctx_sums_blocks(D), RENORM=renorm,
           PRECISION=router_precision(x.dtype), BLOCK_D=_logits_block_d(block_e), BLOCK_E=block_e)
    return weight, index, probs


def router_combine_backward(probs, wg, weight, index, pair_slot, dx_slot, gw_part, horizons, renorm, dy_dtype,
                            precision, sum_h):
    """(∂y [R,D] in dy_dtype, ∂inv [B,D] fp32 when sum_h else None, ∂logits [R,E] fp32) from the
    forward's π [R,E] fp32, weight and index; precision: router_precision of x's dtype."""
    R, E = probs.shape
    D = wg.shape[1]
    top_k = index.shape[1]
    B = R // horizons
    dy = torch.empty(R, D, device=probs.device, dtype=dy_dtype)
    dinv = torch.empty(B, D, device=probs.device, dtype=torch.float32) if sum_h else None
    dlogits = torch.empty(R, E, device=probs.device, dtype=torch.float32)
    block_e = pow2(E)
    n_fblk = gw_part.shape[1]
    _dlogits(lambda m: (cdiv(R, m["BLOCK_R"]),),
             probs, weight, index, pair_slot, gw_part, dlogits, R, E, n_fblk,
             TOP_K=top_k, RENORM=renorm, BLOCK_E=block_e)
    _combine_dy(lambda m: (B, cdiv(D, m["BLOCK_D"])),
                wg, pair_slot, dx_slot, dlogits, dy, dy if dinv is None else dinv, horizons, D, E,
                TOP_K=top_k, SUM_H=sum_h, PRECISION=precision, BLOCK_H=pow2(horizons), BLOCK_E=block_e)
    return dy, dinv, dlogits


# ∂Wg's runs of rows: enough (run, D block) programs for two waves of the SMs, each run at
# least this many rows; the partials are then [runs, E, D] fp32 (2 MiB at the large preset).
WGRAD_MIN_ROWS = 256
WGRAD_BLOCK_R = 64


def _wgrad_block_d(D):
    return min(128, pow2(D))


def router_runs(R, D, device):
    """(runs of rows, rows a run) for router_weight_grad."""
    return split_runs(R, cdiv(D, _wgrad_block_d(D)), WGRAD_MIN_ROWS, WGRAD_BLOCK_R, device)


def router_weight_grad(dlogits, x, inv, horizons, block_d=None, block_r=WGRAD_BLOCK_R, runs=None, num_warps=4,
                       split=False, dtype=torch.float32):
    """∂Wg [E,D] in `dtype` = Σ_r ∂logits[r]ᵀ (x[r] + inv[r // H]), in a fixed order: each run's
    fp32 part, then the parts summed in fp32 and rounded once by one launch of
    triton_pool.column_sums (where torch's sum and a cast to Wg's dtype took two). split (split_wgrad's
    case: x 16-bit, inv given): as Σ_r ∂logits[r]ᵀ x[r] on x read as it is (SPLIT16) +
    Σ_b (Σ_h ∂logits[b·H + h])ᵀ inv[b] (SUM_H). block_d, block_r, runs, num_warps: the launch
    (bench/small_kernels_probe.py sweeps them; by default _wgrad_block_d(D), and router_runs' runs)."""
    R, D = x.shape
    E = dlogits.shape[1]
    if split and (inv is None or x.dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError(f"router_weight_grad: split=True takes a 16-bit x and an inv; got x {x.dtype}, "
                         f"inv {None if inv is None else tuple(inv.shape)}")
    block_d = block_d or _wgrad_block_d(D)
    n_d = cdiv(D, block_d)
    if runs is None:
        runs, rows = router_runs(R, D, x.device)
    else:
        runs, rows = cut_runs(R, runs, block_r)
    inv_runs, inv_rows = router_runs(inv.shape[0], D, x.device) if split else (0, 0)
    part = torch.empty(runs + inv_runs, E, D, device=x.device, dtype=torch.float32)
    options = gpu_options(x, num_warps=num_warps)
    precision = router_precision(x.dtype)
    _router_wgrad(lambda m: (runs, n_d),
                  dlogits, x, x if inv is None else inv, part, R, horizons, D, E, rows,
                  HAS_INV=inv is not None and not split, SPLIT16=split, SUM_H=False, PRECISION=precision,
                  BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_E=pow2(E), **options)
    if split:
        _router_wgrad(lambda m: (inv_runs, n_d),
                      dlogits, inv, inv, part[runs:], inv.shape[0], horizons, D, E, inv_rows, HAS_INV=False,
                      SPLIT16=False, SUM_H=True, PRECISION=precision, BLOCK_R=WGRAD_BLOCK_R, BLOCK_D=block_d,
                      BLOCK_E=pow2(E), **options)
    # programs = its column blocks: one part of all the runs (a few to ~100 rows), so one launch
    return column_sums(part.view(runs + inv_runs, E * D), dtype=dtype,
                       programs=cdiv(E * D, COLUMN_BLOCK_C)).view(E, D)
