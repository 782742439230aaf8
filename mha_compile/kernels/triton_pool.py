"""The inverted attention pool, reassociated (SPEC §1), as Triton kernels.

Forward, per batch row b (one program), reading tok[b] once in BLOCK_N-token chunks:
    s[n,p]   = ⟨tok[b,n], u_p⟩            u_p = Wk_pᵀ q_p / √Dh   (u: [P,D], computed once)
    a[:,p]   = softmax_n(s[:,p])           online (flash-style) over the chunks
    t̄[b,p]   = Σ_n a[n,p] tok[b,n]         [P,D]
This is attention with P queries u_p and keys = values = tok[b]; the key bias bk shifts every
score of a head equally and cancels. The raw scores go to `attn` in the loop and are normalised
in place by a second, tiny pass over [N,P] once the softmax statistics are final, so tok is read
once. The small projections pooled = Wv_p t̄_p + bv, inv = pooled Woᵀ + bo are [B,D]×[D,D]
GEMMs (4·B·D² FLOPs, against the 4·B·N·D² the direct form would need): for bf16 models on
triton_matmul's split tensor-core dots, at the pool kernels' accuracy; otherwise on cuBLAS in fp32.

Backward, given ∂t̄[b,p] = Wv_pᵀ ∂pooled[b,p] (again a small GEMM), in two kernels:
    ∂a[n,p] = ⟨tok[b,n], ∂t̄_p⟩,   c_p = Σ_n a ∂a,   ∂s = a ⊙ (∂a − c)
    ∂tok[b,n] = Σ_p a[n,p] ∂t̄_p + Σ_p ∂s[n,p] u_p
    t̄_p = Σ_n a tok[b,n],   Σ_n ∂s[n,p] tok[b,n]      (→ ∂u, hence ∂q, ∂Wk; t̄ → ∂Wv, ∂Wo)
Pass 1, one program per batch row (∂a needs all of D), reads tok and writes ∂s ([N,P], small).
Pass 2, per batch row and block of D columns, reads tok again and writes ∂tok: the last two
lines are each one dot against [a | ∂s] or the stacked [∂t̄_b ; u]. One program per batch row
for both passes, with [P,D] fp32 accumulators, held 255 registers and one program an SM, and
ran at ~4x the memory floor (1.07 ms at large, H200). Where tok fits in the GPU's L2 (medium
and small), one kernel runs both passes, a program a batch row (bwd_one_kernel): one launch and
tail fewer. The per-b ∂u-partials [B,P,D] are summed by column_sums, a Triton sum in two
launches in a fixed order (bitwise reproducible; torch's sum with MHA_COMPILE_POOL_COLUMN_SUMS=0).
Pass 1 reads tok only for c_p = Σ_n a ∂a = ⟨t̄_p, ∂t̄_p⟩ = ⟨pooled_p − bv_p, ∂pooled_p⟩, which the
forward's heads give without it: where tok exceeds L2 (single_pass, SINGLE_PASS) one kernel a batch
row does both passes in one read of tok (_pool_bwd_single_kernel).

All pool arithmetic accumulates in fp32 to about fp32 accuracy: ieee fp32 dots for fp32 and
fp16 tokens; for bf16 tokens the same products as split bf16 tensor-core dots (triton_util.dot_f32), since
on the FMA units these thin dots, not the one read of tok, set the kernels' time. The forward and
pass 1 put an fp32 operand's hi and lo halves side by side (triton_util.split_pairs): one dot of
2P columns instead of two chained dots of P padded to 16 (the large forward 252 → 140 registers a
thread, sm_90a offline). On the H200 at large (bench/PERF_NOTES.md v14) the three kernels take
0.25, 0.17 and 0.41 ms a step (1.12 before split pairs, t̄ᵀ and the loads one block ahead).
"""
import logging
import os

import torch
import triton
import triton.language as tl

from mha_compile.kernels.reference import empty_rows
from mha_compile.kernels.triton_matmul import SPLIT_HALVES, matmul_f32
from mha_compile.kernels.triton_util import (Launcher, cdiv, dot16, dot_f32, dot_pairs, gpu_options, l2_bytes, launch,
                                             pow2, repeat_pairs, split_pairs, sum_pairs)

log = logging.getLogger("mha_compile")
# A [D, 2P] fp32 accumulator (2P padded to 16) lives in registers: D beyond this spills badly.
MAX_POOL_D = 1024
# The backward's two passes as one kernel, each program pass 1 then pass 2 for its batch row
# (_pool_bwd_one_kernel), where tok fits in the GPU's L2 (bwd_one_kernel); read at launch time
# (bench/flag_ab.py flips it).
BWD_ONE_KERNEL = os.environ.get("MHA_COMPILE_POOL_BWD_ONE_KERNEL", "1") != "0"
# The backward's sums over the batch rows (∂u's partials [B, P·D], ∂inv [B, D]) by column_sums
# rather than torch's sum (torch's took 33 and 12 us a large step, twice and six times their bytes'
# time, bench/PERF_NOTES.md v33). On the H200 (session 32, flag_ab): 8.3 us less a medium training
# step in each of three rounds, within the noise at large (-3 and -25 us by order);
# MHA_COMPILE_POOL_COLUMN_SUMS=0 keeps torch's sum. Read at call time (bench/flag_ab.py flips it).
COLUMN_SUMS = os.environ.get("MHA_COMPILE_POOL_COLUMN_SUMS", "1") != "0"
# The backward in one pass over tok (_pool_bwd_single_kernel) rather than two (pass 1 for ∂s, pass 2
# for ∂tok; or both in one kernel where tok fits in L2): None (auto, the default) runs it where bf16
# tok does not fit in the GPU's L2 and the forward kept its heads (single_pass); True or False always
# or never (MHA_COMPILE_POOL_BWD_SINGLE_PASS=1 or 0). Either way only where a config of it fits the
# GPU's shared memory (attend_bwd_single; the two passes elsewhere). Its sums with D as the dots' M
# (session 58): on an H100 at large 574.7 us against the two passes' 677.7 (bench/results/h100_s58_pool_single.txt;
# the interleaved rows of session 57, 591.1) and the training step faster in 8 of 8 rounds of
# flag_ab (~-95 us with the graph off timed first); at medium 45.6 against the one kernel's 48.4, which stays
# (session 57's layout took a medium step +6.5 us on the H200). On the H200 (session 59, with a pipelined):
# at large 507.7 against 534.9 us and the step -50 us (6 of 6 rounds); at medium -0.4 (the orders
# disagree). Read at call time (bench/flag_ab.py sets it True and False).
_SINGLE_PASS_VALUES = {"auto": None, "1": True, "0": False}
_single_pass_env = os.environ.get("MHA_COMPILE_POOL_BWD_SINGLE_PASS", "auto")
if _single_pass_env not in _SINGLE_PASS_VALUES:
    raise ValueError(f"MHA_COMPILE_POOL_BWD_SINGLE_PASS={_single_pass_env!r}: expected one of "
                     f"{', '.join(_SINGLE_PASS_VALUES)}")
SINGLE_PASS = _SINGLE_PASS_VALUES[_single_pass_env]


@triton.jit
def _pool_fwd_kernel(
    tok_ptr, u_ptr, mask_ptr, attn_ptr, tbar_ptr,
    N, D, P,
    stride_tb, stride_tn,
    HAS_MASK: tl.constexpr, SPLIT_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """tok [B,N,D] (row stride 1), u [P,D] fp32 → attn [B,N,P] fp32, t̄ [B,P,D] fp32."""
    b = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_p = tl.arange(0, BLOCK_P)
    d_ok = offs_d < D
    p_ok = offs_p < P
    u = tl.load(u_ptr + offs_p[:, None] * D + offs_d[None, :], mask=p_ok[:, None] & d_ok[None, :], other=0.0)
    # u's hi and lo halves side by side (split_pairs): one dot takes both. The accumulator is
    # t̄ᵀ [D, 2P] (a column for each half of e, added in pairs at the end): D, not P, is the
    # dot's M, so the e-weighted sum is a wgmma reading the tok tile from shared memory.
    u2 = split_pairs(tl.trans(u), SPLIT_DOT)  # [BLOCK_D, 2·BLOCK_P]
    tok_b = tok_ptr + b * stride_tb
    attn_b = attn_ptr + b * N * P
    m = tl.full([BLOCK_P], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_P], tl.float32)
    acc = tl.zeros([BLOCK_D, u2.shape[1]], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        t = tl.load(tok_b + offs_n[:, None].to(tl.int64) * stride_tn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = dot_pairs(t, u2, SPLIT_DOT)  # [BLOCK_N, BLOCK_P]
        keep = n_ok
        if HAS_MASK:
            ignore = tl.load(mask_ptr + b * N + offs_n, mask=n_ok, other=1)
            keep = keep & (ignore == 0)
        s = tl.where(keep[:, None], s, float("-inf"))
        tl.store(attn_b + offs_n[:, None] * P + offs_p[None, :], s, mask=n_ok[:, None] & p_ok[None, :])
        m_new = tl.maximum(m, tl.max(s, axis=0))
        # A head whose keys so far are all masked has m = -inf: subtract 0 instead (no NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        e = tl.exp(s - m_safe[None, :])
        l = l * alpha + tl.sum(e, axis=0)
        acc = acc * repeat_pairs(alpha, SPLIT_DOT)[None, :] + dot16(tl.trans(t), split_pairs(e, SPLIT_DOT), SPLIT_DOT)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    # Every key masked: l = 0, and the row attends to nothing (t̄ and attn 0, not 0/0; see
    # reference.pool_forward). Elsewhere l ≥ 1 (the largest score's own term), so the same bits.
    l = tl.where(l == 0.0, 1.0, l)
    tl.store(tbar_ptr + b * P * D + offs_p[None, :] * D + offs_d[:, None], sum_pairs(acc, SPLIT_DOT) / l[None, :],
             mask=p_ok[None, :] & d_ok[:, None])
    # Normalise the stored scores; this program wrote them, the barrier orders its threads.
    tl.debug_barrier()
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ptrs = attn_b + offs_n[:, None] * P + offs_p[None, :]
        ok = (offs_n < N)[:, None] & p_ok[None, :]
        s = tl.load(ptrs, mask=ok, other=float("-inf"))
        tl.store(ptrs, tl.exp(s - m_safe[None, :]) / l[None, :], mask=ok)


@triton.jit
def _attn_rows(attn_b, n0, N, P, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
    """a of tokens n0 … n0 + BLOCK_N of one batch row, [BLOCK_N, BLOCK_P] (0 past N and P)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_p = tl.arange(0, BLOCK_P)
    return tl.load(attn_b + offs_n[:, None] * P + offs_p[None, :], mask=(offs_n < N)[:, None] & (offs_p < P)[None, :],
                   other=0.0)


@triton.jit
def _pool_bwd_scores_kernel(
    tok_ptr, attn_ptr, dtbar_ptr, ds_ptr,
    N, D, P,
    stride_tb, stride_tn,
    SPLIT_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Pass 1 of the backward, per batch row b (one program, all of D): tok [B,N,D], attn
    [B,N,P], ∂t̄ [B,P,D] → ∂s [B,N,P] fp32 (_scores_grad)."""
    _scores_grad(tl.program_id(0).to(tl.int64), tok_ptr, attn_ptr, dtbar_ptr, ds_ptr, N, D, P, stride_tb, stride_tn,
                 SPLIT_DOT, BLOCK_N, BLOCK_D, BLOCK_P)


@triton.jit
def _scores_grad(
    b, tok_ptr, attn_ptr, dtbar_ptr, ds_ptr,
    N, D, P,
    stride_tb, stride_tn,
    SPLIT_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Batch row b's ∂s [N,P] fp32 from all of D at once: the scores' gradient ∂s = a ⊙ (∂a − c)
    with ∂a[n,p] = ⟨tok[b,n], ∂t̄_p⟩ and c_p = Σ_n a ∂a. ∂a is parked in ∂s until c is final (a
    second, tiny pass over [N,P], as the forward's)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_p = tl.arange(0, BLOCK_P)
    d_ok = offs_d < D
    p_ok = offs_p < P
    dtbar = tl.load(dtbar_ptr + b * P * D + offs_p[:, None] * D + offs_d[None, :],
                    mask=p_ok[:, None] & d_ok[None, :], other=0.0)
    dtbar2 = split_pairs(tl.trans(dtbar), SPLIT_DOT)  # [BLOCK_D, 2·BLOCK_P], as the forward's u
    tok_b = tok_ptr + b * stride_tb
    attn_b = attn_ptr + b * N * P
    ds_b = ds_ptr + b * N * P
    c = tl.zeros([BLOCK_P], tl.float32)
    # a is loaded one block ahead by hand, as pass 2's [a | ∂s] (see there).
    a_next = _attn_rows(attn_b, 0, N, P, BLOCK_N, BLOCK_P)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        np_ok = n_ok[:, None] & p_ok[None, :]
        a = a_next
        a_next = _attn_rows(attn_b, n0 + BLOCK_N, N, P, BLOCK_N, BLOCK_P)
        t = tl.load(tok_b + offs_n[:, None].to(tl.int64) * stride_tn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        da = dot_pairs(t, dtbar2, SPLIT_DOT)  # [BLOCK_N, BLOCK_P]
        tl.store(ds_b + offs_n[:, None] * P + offs_p[None, :], da, mask=np_ok)
        c += tl.sum(a * da, axis=0)
    # This program wrote the ∂a it now reads; the barrier orders its threads.
    tl.debug_barrier()
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        np_ok = (offs_n < N)[:, None] & p_ok[None, :]
        a = _attn_rows(attn_b, n0, N, P, BLOCK_N, BLOCK_P)
        ptrs = ds_b + offs_n[:, None] * P + offs_p[None, :]
        tl.store(ptrs, a * (tl.load(ptrs, mask=np_ok, other=0.0) - c[None, :]), mask=np_ok)


@triton.jit
def _ads_rows(attn_b, ds_b, n0, N, P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr):
    """[a | ∂s] of tokens n0 … n0 + BLOCK_N of one batch row, [BLOCK_N, BLOCK_Q] (0 past N and 2P)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_q = tl.arange(0, BLOCK_Q)
    n_ok = (offs_n < N)[:, None]
    return (tl.load(attn_b + offs_n[:, None] * P + offs_q[None, :], mask=n_ok & (offs_q < P)[None, :], other=0.0)
            + tl.load(ds_b + offs_n[:, None] * P + (offs_q - P)[None, :],
                      mask=n_ok & ((offs_q >= P) & (offs_q < 2 * P))[None, :], other=0.0))


@triton.jit
def _pool_bwd_kernel(
    tok_ptr, u_ptr, attn_ptr, ds_ptr, dtbar_ptr, tbar_ptr, du_ptr, dtok_ptr,
    N, D, P: tl.constexpr,
    stride_tb, stride_tn,
    SPLIT_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """Pass 2, per batch row b and block of D columns (_grad_columns): one read of tok and one
    write of ∂tok."""
    _grad_columns(tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D), tok_ptr, u_ptr,
                  attn_ptr, ds_ptr, dtbar_ptr, tbar_ptr, du_ptr, dtok_ptr, N, D, P, stride_tb, stride_tn, SPLIT_DOT,
                  BLOCK_N, BLOCK_D, BLOCK_Q)


@triton.jit
def _grad_columns(
    b, offs_d, tok_ptr, u_ptr, attn_ptr, ds_ptr, dtbar_ptr, tbar_ptr, du_ptr, dtok_ptr,
    N, D, P: tl.constexpr,
    stride_tb, stride_tn,
    SPLIT_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """Batch row b's columns offs_d (BLOCK_D of them) of ∂tok, t̄ and the ∂u partials, from ∂s.
    With ads = [a | ∂s] ([N,2P]) and the stacked directions R = [∂t̄_b ; u] ([2P, D]):
        ∂tok[b,n] = ads[n] R = Σ_p a ∂t̄_p + Σ_p ∂s u_p
        adsᵀ tok[b] = [t̄_b ; Σ_n ∂s tok[b,n]] → t̄ [B,P,D] and the ∂u partials [B,P,D]
    (2P is padded to BLOCK_Q ≥ 16 columns, one dot each way). du_ptr may be dtbar_ptr: these
    columns' ∂t̄[b] are read before the loop and their ∂u partials written after it, and no
    other program or call touches them. P is a compile-time constant here: a and ∂s are read as
    [BLOCK_N, P] rows of P contiguous values, which the compiler can then load as vectors.
    """
    offs_q = tl.arange(0, BLOCK_Q)
    d_ok = offs_d < D
    q_a = offs_q < P
    q_s = (offs_q >= P) & (offs_q < 2 * P)
    rows = dtbar_ptr + b * P * D + offs_q[:, None] * D + offs_d[None, :]
    dirs = (tl.load(rows, mask=q_a[:, None] & d_ok[None, :], other=0.0)
            + tl.load(u_ptr + (offs_q - P)[:, None] * D + offs_d[None, :], mask=q_s[:, None] & d_ok[None, :],
                      other=0.0))
    tok_b = tok_ptr + b * stride_tb
    attn_b = attn_ptr + b * N * P
    ds_b = ds_ptr + b * N * P
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    # The rows of [a | ∂s] are loaded one block ahead, by hand: the compiler pipelines only the
    # loads that feed a dot as they are (tok's), and these waited on memory every block (ncu at
    # large: pass 2 stalled on L1TEX scoreboards, 5 of its 10 cycles between instructions).
    ads_next = _ads_rows(attn_b, ds_b, 0, N, P, BLOCK_N, BLOCK_Q)
    for n0 in range(0, N, BLOCK_N):
        ads = ads_next
        ads_next = _ads_rows(attn_b, ds_b, n0 + BLOCK_N, N, P, BLOCK_N, BLOCK_Q)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        nd_off = offs_n[:, None].to(tl.int64) * stride_tn + offs_d[None, :]
        nd_ok = n_ok[:, None] & d_ok[None, :]
        t = tl.load(tok_b + nd_off, mask=nd_ok, other=0.0)
        dtok = dot_f32(ads, dirs, SPLIT_DOT)  # [BLOCK_N, BLOCK_D]
        tl.store(dtok_ptr + b * stride_tb + nd_off, dtok.to(dtok_ptr.dtype.element_ty), mask=nd_ok)
        acc += dot_f32(tl.trans(ads), t, SPLIT_DOT)  # [BLOCK_Q, BLOCK_D]
    out_off = b * P * D + offs_q[:, None] * D + offs_d[None, :]
    tl.store(tbar_ptr + out_off, acc, mask=q_a[:, None] & d_ok[None, :])
    tl.store(du_ptr + out_off - P * D, acc, mask=q_s[:, None] & d_ok[None, :])


@triton.jit
def _pool_bwd_one_kernel(
    tok_ptr, u_ptr, attn_ptr, ds_ptr, dtbar_ptr, tbar_ptr, du_ptr, dtok_ptr,
    N, D, P: tl.constexpr,
    stride_tb, stride_tn,
    SPLIT_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N2: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """Both passes for one batch row b, one program: pass 1's ∂s (all of D, BLOCK_N tokens a
    step), then pass 2 over D in blocks of BLOCK_D2 columns (BLOCK_N2 tokens a step): one launch
    where the two kernels take two. It runs where all of tok fits in L2 (bwd_one_kernel), so pass
    2's read of tok[b] right after pass 1's finds it there."""
    b = tl.program_id(0).to(tl.int64)
    _scores_grad(b, tok_ptr, attn_ptr, dtbar_ptr, ds_ptr, N, D, P, stride_tb, stride_tn, SPLIT_DOT, BLOCK_N, BLOCK_D,
                 BLOCK_P)
    # Pass 2 reads the ∂s this program's threads wrote; the barrier orders them.
    tl.debug_barrier()
    for d0 in range(0, D, BLOCK_D2):
        _grad_columns(b, d0 + tl.arange(0, BLOCK_D2), tok_ptr, u_ptr, attn_ptr, ds_ptr, dtbar_ptr, tbar_ptr, du_ptr,
                      dtok_ptr, N, D, P, stride_tb, stride_tn, SPLIT_DOT, BLOCK_N2, BLOCK_D2, BLOCK_Q)


@triton.jit
def _token_rows(offs_n, stride_tn, WIDE_ROWS: tl.constexpr):
    """offs_n · stride_tn, tokens' offsets within one batch row of tok: int32 products, unless
    WIDE_ROWS (wide_rows: an offset past int32). The single pass's loop at large (sm_90a, offline)
    has 912 SASS instructions at BLOCK_N 32 against int64's 1023, 112 bytes spilled against 280."""
    if WIDE_ROWS:
        return offs_n.to(tl.int64) * stride_tn
    else:
        return offs_n * stride_tn


@triton.jit
def _pool_bwd_single_kernel(
    tok_ptr, u_ptr, attn_ptr, pooled_ptr, bv_ptr, gpooled_ptr, dtbar_ptr, tbar_ptr, du_ptr, dtok_ptr,
    N, D, P: tl.constexpr, Dh,
    stride_tb, stride_tn,
    HAS_BV: tl.constexpr, SPLIT_DOT: tl.constexpr, WIDE_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DH: tl.constexpr,
):
    """The whole backward for one batch row b (one program, all of D) in one read of tok and one
    write of ∂tok. Pass 1 needed its own read of tok only for c_p = Σ_n a ∂a, the softmax's
    correction; c_p = ⟨t̄_p, ∂t̄_p⟩ = ⟨Wv_p t̄_p, ∂pooled_p⟩ = ⟨pooled_p − bv_p, ∂pooled_p⟩ takes
    it from the heads' output the forward kept (pooled [B,D] fp32) and ∂pooled [B,D] fp32 instead.
    Then per block of tokens: ∂a = tok ∂t̄ᵀ, ∂s = a ⊙ (∂a − c), and with ads = [a | ∂s] (a head's
    two columns side by side, 2p and 2p + 1) and the directions Rᵀ = [∂t̄_bᵀ | uᵀ] interleaved alike:
        ∂tokᵀ = Rᵀ adsᵀ,    tokᵀ ads → t̄ᵀ (columns 2p) and the ∂u partials' (columns 2p + 1).
    Both products have D as their M (the forward's t̄ᵀ likewise), so they run as wgmma on Hopper
    with tok's tile read from shared memory, where [BLOCK_N, D] products ran as mma on 16-row
    tiles (session 57's layout: 591 against 575 us at large on an H100, 112 mma instructions a
    block of 16 tokens at 4 warps against 40 wgmma and 32 mma). ∂a, [BLOCK_N, 2P] from all of D,
    stays mma.
    du_ptr may be dtbar_ptr, as in _grad_columns: this program reads its ∂t̄[b] before the loop."""
    b = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_p = tl.arange(0, BLOCK_P)
    d_ok = offs_d < D
    p_ok = offs_p < P
    offs_j = tl.arange(0, BLOCK_DH)
    pj = offs_p[:, None] * Dh + offs_j[None, :]
    pj_ok = p_ok[:, None] & (offs_j < Dh)[None, :]
    heads = tl.load(pooled_ptr + b * D + pj, mask=pj_ok, other=0.0)
    if HAS_BV:
        heads -= tl.load(bv_ptr + pj, mask=pj_ok, other=0.0).to(tl.float32)
    c = tl.sum(heads * tl.load(gpooled_ptr + b * D + pj, mask=pj_ok, other=0.0), axis=1)  # [BLOCK_P]
    dtbar_b = dtbar_ptr + b * P * D
    dtbar = tl.load(dtbar_b + offs_p[:, None] * D + offs_d[None, :], mask=p_ok[:, None] & d_ok[None, :], other=0.0)
    dtbar2 = split_pairs(tl.trans(dtbar), SPLIT_DOT)  # [BLOCK_D, 2·BLOCK_P], as the forward's u
    offs_q = tl.arange(0, 2 * BLOCK_P)
    q_p = offs_q // 2
    q_u = (offs_q % 2) == 1
    cols = offs_d[:, None] + q_p[None, :] * D
    q_ok = d_ok[:, None] & (q_p < P)[None, :]
    dirs_t = (tl.load(dtbar_b + cols, mask=q_ok & ~q_u[None, :], other=0.0)
              + tl.load(u_ptr + cols, mask=q_ok & q_u[None, :], other=0.0))  # [BLOCK_D, 2·BLOCK_P]
    tok_b = tok_ptr + b * stride_tb
    attn_b = attn_ptr + b * N * P
    acc_t = tl.zeros([BLOCK_D, 2 * BLOCK_P], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        # a is loaded in the loop, where the pipeliner fetches it with tok's tile (cp.async, stages
        # ahead). Loaded by hand one block ahead (as _grad_columns does), the shared-memory store of
        # its layout conversion waited on it: 12.6% of ncu's stall samples at large (H100, BLOCK_N 32).
        a = _attn_rows(attn_b, n0, N, P, BLOCK_N, BLOCK_P)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nd_off = _token_rows(offs_n, stride_tn, WIDE_ROWS)[:, None] + offs_d[None, :]
        nd_ok = (offs_n < N)[:, None] & d_ok[None, :]
        t = tl.load(tok_b + nd_off, mask=nd_ok, other=0.0)
        ds = a * (dot_pairs(t, dtbar2, SPLIT_DOT) - c[None, :])
        ads = tl.reshape(tl.join(a, ds), [BLOCK_N, 2 * BLOCK_P])
        dtok_t = dot_f32(dirs_t, tl.trans(ads), SPLIT_DOT)  # [BLOCK_D, BLOCK_N]
        tl.store(dtok_ptr + b * stride_tb + tl.trans(nd_off), dtok_t.to(dtok_ptr.dtype.element_ty),
                 mask=tl.trans(nd_ok))
        acc_t += dot_f32(tl.trans(t), ads, SPLIT_DOT)  # [BLOCK_D, 2·BLOCK_P]
    out_off = b * P * D + cols
    tl.store(tbar_ptr + out_off, acc_t, mask=q_ok & ~q_u[None, :])
    tl.store(du_ptr + out_off, acc_t, mask=q_ok & q_u[None, :])


@triton.jit
def _column_sums_kernel(x_ptr, out_ptr, R, C, ROWS, scale, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[p, c] = scale · Σ x[r, c] over the rows r of part p, [p·ROWS, (p+1)·ROWS) within R, in a
    fixed order: x [R, C] contiguous (any float dtype, summed in fp32), out [⌈R / ROWS⌉, C] fp32.
    Program axis 0 takes a block of BLOCK_C columns, axis 1 a part."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < C
    r0 = tl.program_id(1) * ROWS
    r1 = tl.minimum(r0 + ROWS, R)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for r in range(r0, r1, BLOCK_R):
        rows = r + tl.arange(0, BLOCK_R)
        acc += tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :],
                       mask=(rows < r1)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(1).to(tl.int64) * C + cols, tl.sum(acc, axis=0) * scale, mask=c_ok)


@triton.jit
def _direction_grads_kernel(wk_ptr, q_ptr, du_ptr, dq_ptr, dwk_ptr, Dh, D, BLOCK_J: tl.constexpr,
                            BLOCK_D: tl.constexpr):
    """The gradients through u_p = Wk_pᵀ q_p / √Dh, given ∂u [P,D] fp32 (its 1/√Dh applied), for
    head p (axis 0) and the rows j of one BLOCK_J block of Dh (axis 1):
        ∂q[p,j]        = Σ_d Wk[p·Dh+j, d] ∂u[p,d]   fp32 FMA sums in a fixed order
        ∂Wk[p·Dh+j, d] = q[p,j] ∂u[p,d]              an fp32 product
    each rounded once to its output's dtype as it is stored. Wk [D,D], q [P,Dh] (any float dtype)
    and the outputs contiguous."""
    p = tl.program_id(0)
    js = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    j_ok = js < Dh
    rows = (p * Dh + js).to(tl.int64)
    qj = tl.load(q_ptr + p * Dh + js, mask=j_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_J, BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = j_ok[:, None] & (cols < D)[None, :]
        du = tl.load(du_ptr + p * D + cols, mask=cols < D, other=0.0)
        acc += tl.load(wk_ptr + rows[:, None] * D + cols[None, :], mask=ok, other=0.0).to(tl.float32) * du[None, :]
        tl.store(dwk_ptr + rows[:, None] * D + cols[None, :], (qj[:, None] * du[None, :]).to(dwk_ptr.dtype.element_ty),
                 mask=ok)
    tl.store(dq_ptr + p * Dh + js, tl.sum(acc, axis=1).to(dq_ptr.dtype.element_ty), mask=j_ok)


# Token dtypes whose pool dots run as split 16-bit tensor-core products (see triton_util.dot_f32). fp16
# is left on the ieee path: the lo half of an fp32 value can fall below fp16's normal range.
SPLIT_DOT_DTYPES = {torch.bfloat16: 1}


def split_dot(dtype):
    return SPLIT_DOT_DTYPES.get(dtype, 0)


def block_p(P, split):
    """BLOCK_P, the heads padded for the forward and pass 1: with split dots the 2·BLOCK_P
    columns of split_pairs are a dot's (≥ 16), so P = 8 needs no padding."""
    return pow2(2 * P) // 2 if split else pow2(P)


# Config lists, autotuned per (N, D, P) on the GPU (the first is the interpreter's and
# MHA_COMPILE_NO_AUTOTUNE's). They hold the fixed choice these kernels had before, which was
# BLOCK_N 32 with 4 warps at D ≤ 256 and BLOCK_N 16 with 8 warps above, and the configs that
# bench/offline_sass.py compiles with fewer registers or spills: the backward at medium spills
# 644 bytes with BLOCK_N 32 and 4 warps, none with 16 and 8; the forward at medium needs 214
# registers with 32 and 4, 148 with 16 and 8 (sm_90a, bench/PERF_NOTES.md v8).
_POOL_CONFIGS = [
    dict(BLOCK_N=16, num_warps=8, num_stages=3),
    dict(BLOCK_N=16, num_warps=4, num_stages=3),
    dict(BLOCK_N=32, num_warps=4, num_stages=3),
    dict(BLOCK_N=16, num_warps=16, num_stages=2),
    dict(BLOCK_N=32, num_warps=8, num_stages=3),
    dict(BLOCK_N=16, num_warps=4, num_stages=4),
    # The forward at large: 222 against 239 us with 3 stages (bench/small_kernels_probe.py, H200).
    dict(BLOCK_N=32, num_warps=4, num_stages=2),
]
# No BLOCK_N 64 here: there both of the forward's dots are wgmma, and Triton 3.6 fails to build
# that (TritonGPUOptimizeDotOperands) at many shapes (D = 100, 40, 24; D = 16 and 32 at some
# warps), though it took medium's to 20 us a call; a build failure inside autotuning is not
# skipped but raised. The seven configs above build at every N in (5, 37, 128), D in (8 … 1024)
# and P dividing D tried offline (sm_90a).
_attend = Launcher(_pool_fwd_kernel, _POOL_CONFIGS, key=["N", "D", "P", "HAS_MASK", "SPLIT_DOT"])
_attend_bwd_scores = Launcher(_pool_bwd_scores_kernel, _POOL_CONFIGS, key=["N", "D", "P", "SPLIT_DOT"])
# Pass 2 by blocks of D: the first config (32 columns) gives the interpreter's tests more than
# one block at their D of 33-40. pool_backward passes ∂t̄ as du_ptr too: autotuning's trial
# runs must each see it restored.
_attend_bwd = Launcher(_pool_bwd_kernel, [
    dict(BLOCK_N=16, BLOCK_D=32, num_warps=4, num_stages=3),
    dict(BLOCK_N=32, BLOCK_D=128, num_warps=4, num_stages=3),
    dict(BLOCK_N=64, BLOCK_D=128, num_warps=8, num_stages=3),
    dict(BLOCK_N=32, BLOCK_D=256, num_warps=8, num_stages=3),
    dict(BLOCK_N=64, BLOCK_D=64, num_warps=4, num_stages=4),
    # At large: 371 against the [32, 128] blocks' 408 us, 3.5 TB/s (bench/small_kernels_probe.py, H200)
    dict(BLOCK_N=16, BLOCK_D=256, num_warps=4, num_stages=4),
], key=["N", "D", "P", "SPLIT_DOT"], restore=["dtbar_ptr"])
# The single pass (single_pass): all of D a program, as the forward; the first config is the
# interpreter's. On an H100 (session 58, bench/results/h100_s58_pool_single.txt): at large 574.7, 581.4
# (58 bytes spilled) and 648.4 us; at medium 52.0, 45.6 and 50.3; BLOCK_N 16 at 8 and 16 warps (fewer
# registers, for D up to MAX_POOL_D) 807.6 and 1515.4 at large. Not BLOCK_N 64 (582.6 at large at 8
# warps, 255 registers and 188 KB of shared memory): there ∂a is a wgmma too, which Triton 3.6 fails to
# build at some D (see _POOL_CONFIGS). On the H200 (session 59, bench/results/h200_s59_pool_single.txt),
# with a pipelined as it is now: at large BLOCK_N 32 at 4 warps 507.7 us (522.0 with a loaded by hand),
# BLOCK_N 16 586.0 (581.6), the two passes 534.9.
_attend_bwd_single = Launcher(_pool_bwd_single_kernel, [
    dict(BLOCK_N=16, num_warps=4, num_stages=3),
    dict(BLOCK_N=32, num_warps=4, num_stages=2),
    dict(BLOCK_N=32, num_warps=8, num_stages=3),
    dict(BLOCK_N=16, num_warps=8, num_stages=3),
    dict(BLOCK_N=16, num_warps=16, num_stages=2),
], key=["N", "D", "P", "HAS_BV", "SPLIT_DOT", "WIDE_ROWS"], restore=["dtbar_ptr"])
# Both passes in one kernel (bwd_one_kernel): pass 1's BLOCK_N, pass 2's BLOCK_N2 × BLOCK_D2, warps and
# stages shared. The first config gives the interpreter's tests more than one block of D, as _attend_bwd's;
# the rest are the fastest five of 20 at medium on the H200 (41.9-49.7 us; pool_bwd_one_probe.txt), 92-230
# registers without spills (offline, sm_90a): the two phases' registers and shared memory are not added,
# but pass 2's [16, 256] blocks at 4 warps take 230 where pass 2 alone takes 168.
_attend_bwd_one = Launcher(_pool_bwd_one_kernel, [
    dict(BLOCK_N=16, BLOCK_N2=16, BLOCK_D2=32, num_warps=4, num_stages=3),
    dict(BLOCK_N=32, BLOCK_N2=16, BLOCK_D2=128, num_warps=4, num_stages=2),
    dict(BLOCK_N=16, BLOCK_N2=16, BLOCK_D2=128, num_warps=4, num_stages=3),
    dict(BLOCK_N=16, BLOCK_N2=16, BLOCK_D2=256, num_warps=4, num_stages=3),
    dict(BLOCK_N=32, BLOCK_N2=16, BLOCK_D2=256, num_warps=8, num_stages=3),
    dict(BLOCK_N=32, BLOCK_N2=16, BLOCK_D2=64, num_warps=4, num_stages=2),
], key=["N", "D", "P", "SPLIT_DOT"], restore=["dtbar_ptr"])


# The pool's two products of q and Wk, u and ∂q ([P,D] and [P,Dh], D² multiply-adds each), run on
# triton_matmul, not torch.bmm: they were the fused path's only cuBLAS calls for 16-bit models,
# and a thread's first cuBLAS call on a stream allocates a workspace that stays allocated (32 MiB
# on the H200; a training step's forward and its autograd thread: 64 MiB, where the small
# preset's model and inputs take 5; session 28, bench/results/mem_diag.txt). Elementwise products
# summed by torch did that until session 35; with a bf16 model's q and Wk no longer cast to fp32,
# their mixed-dtype products took 3.4 and 5.1 us at medium (H200,
# bench/results/kernel_times_pool_dtype.txt), and each took a sum and a cast more.
def _operands(tensors, split):
    """(tensors, split) as matmul_f32 takes them with `split` (None: split_dot of their one 16-bit
    dtype, else 0): a 16-bit tensor as it is where it is split's dtype (its own high half), the
    rest in fp32."""
    if split is None:
        half = {t.dtype for t in tensors} - {torch.float32}
        split = split_dot(half.pop()) if len(half) == 1 else 0
    keep = SPLIT_HALVES.get(split)
    return [t if t.dtype in (torch.float32, keep) else t.float() for t in tensors], split


def pool_directions(q, wk, out=None, split=None):
    """u [P,D] fp32 = reference.pool_directions(q, wk): u_p = Wk_pᵀ q_p / √Dh, without cuBLAS,
    into out (contiguous) where given, with the pool's split dots (split_dot of the tokens' dtype;
    None: of the weights'). The reference keeps its bmm: tests/test_cost.py holds its forward to
    the modelled FLOPs through torch's FlopCounter, which counts a bmm and not a Triton kernel."""
    P, Dh = q.shape
    (q, wk), split = _operands((q, wk), split)
    u = torch.empty(P, wk.shape[1], device=q.device, dtype=torch.float32) if out is None else out
    matmul_f32(q.view(P, 1, Dh), wk.view(P, Dh, -1), u.view(P, 1, -1), split)
    return u.mul_(Dh**-0.5)


# column_sums' blocks, and the programs its first pass aims at (~4 an SM of the H200's 132, each
# with a few loads in flight: session 22's one load a program kept too few bytes in flight for
# DRAM). [32, 256] blocks, not [16, 256]: the pool backward's ∂inv sum 12.6 → 8.1 us at large and
# 5.0 → 4.3 at medium, its ∂u sum 20.7 → 20.8 and 6.4 → 5.2 (session 33's sweep, H200,
# bench/results/small_kernels_probe.txt); the fastest of each call's sweep was within 1.6 us of it.
COLUMN_BLOCK_R, COLUMN_BLOCK_C, COLUMN_PROGRAMS = 32, 256, 512


def column_sums(x, scale=1.0, dtype=torch.float32, block_r=COLUMN_BLOCK_R, block_c=COLUMN_BLOCK_C,
                programs=COLUMN_PROGRAMS, num_warps=4):
    """scale · x.sum(0) [C] in `dtype` (the fp32 sum rounded once) for x [R, C] (contiguous): parts
    of rows summed by ~`programs` programs of [block_r, block_c] loads into [parts, C], then the
    parts by a second launch of the same kernel (one launch where the rows make one part: few
    rows, or `programs` no more than the column blocks); each sum in a fixed order (bitwise
    reproducible). The launch options are for bench/small_kernels_probe.py's sweep."""
    R, C = x.shape
    blocks = cdiv(C, block_c)
    rows = min(256, pow2(R * blocks // programs, lo=block_r))
    parts = cdiv(R, rows)
    out = torch.empty(C, device=x.device, dtype=dtype)
    options = gpu_options(x, num_warps=num_warps)
    if parts > 1:
        part = torch.empty(parts, C, device=x.device, dtype=torch.float32)
        launch(_column_sums_kernel, (blocks, parts), x, part, R, C, rows, 1.0, BLOCK_R=block_r, BLOCK_C=block_c,
               **options)
        x, R = part, parts
    launch(_column_sums_kernel, (blocks, 1), x, out, R, C, R, scale, BLOCK_R=block_r, BLOCK_C=block_c, **options)
    return out


# direction_grads' blocks: [16, 256] fp32 products a program (32 registers a thread at 4 warps);
# P × ⌈Dh / 16⌉ programs (32 at large and medium).
DIRECTION_BLOCK_J, DIRECTION_BLOCK_D = 16, 256


def direction_grads(q, wk, grad_u):
    """(∂q [P,Dh] in q's dtype, ∂Wk [D,D] in Wk's dtype) from ∂u [P,D] fp32 (_direction_grads_kernel):
    one launch, where ∂q's product (matmul_f32) and ∂Wk's outer product (torch's mixed-dtype mul)
    took two, 4.2 us for the mul alone at medium on the H200 (bench/results/kernel_times_s37.txt)."""
    P, Dh = q.shape
    D = wk.shape[1]
    q, wk, grad_u = q.contiguous(), wk.contiguous(), grad_u.float().contiguous()
    grad_q = torch.empty_like(q)
    grad_wk = torch.empty_like(wk)
    launch(_direction_grads_kernel, (P, cdiv(Dh, DIRECTION_BLOCK_J)),
        wk, q, grad_u, grad_q, grad_wk, Dh, D, BLOCK_J=DIRECTION_BLOCK_J,
        BLOCK_D=min(DIRECTION_BLOCK_D, pow2(D)), **gpu_options(q, num_warps=4))
    return grad_q, grad_wk


def pool_attend(tok, u, mask=None):
    """attn [B,N,P] and t̄ [B,P,D] (fp32) from tok [B,N,D] and the directions u [P,D]: by
    _pool_fwd_kernel, or attend_by_products where none of its configs fits the GPU."""
    B, N, D = tok.shape
    P = u.shape[0]
    torch._check(D <= MAX_POOL_D, lambda: f"pool kernel takes D ≤ {MAX_POOL_D}, got {D}")
    tok = tok.contiguous()
    u = u.float().contiguous()
    attn = torch.empty(B, N, P, device=tok.device, dtype=torch.float32)
    tbar = torch.empty(B, P, D, device=tok.device, dtype=torch.float32)
    mask_u8 = mask.to(torch.uint8).contiguous() if mask is not None else attn
    split = split_dot(tok.dtype)
    if not _attend.launch_where_fits(lambda m: (B,), tok, u, mask_u8, attn, tbar, N, D, P, tok.stride(0),
                                     tok.stride(1), HAS_MASK=mask is not None, SPLIT_DOT=split, BLOCK_D=pow2(D),
                                     BLOCK_P=block_p(P, split)):
        attend_by_products(tok, u, mask, attn, tbar, split)
    return attn, tbar


# Where no config of the forward's or pass 1's kernel fits the GPU's shared memory, which holds
# their [D, 2P] operands (bench/offline_sass.py --arch sm_86, bf16: the forward at D 768 with 12
# heads and D 1024 with 16 needs 112 KB at the least, 176 with 32 heads, and pass 1 162 KB at D
# 1024 with 32, against the 99 KB a block of sm_86 and sm_89), the same sums run as _bmm's fp32
# products (split dots for bf16 tokens, the kernels' accuracy) and torch's elementwise ops, a
# chunk of batch rows at a time. They read tok twice where the kernels read it once.
# A chunk's rows: fp32 or fp16 tokens (ieee fp32 products) are copied to fp32 a chunk at a time, at
# most this many bytes; bf16 ones are read as they are, all rows at once.
PRODUCTS_CHUNK_BYTES = 64 * 2**20


def _row_chunks(tok, split):
    """(rows, tok[rows]) over the batch rows of tok, each chunk in fp32 where the products are
    torch.bmm's (split 0: its operands share a dtype) and tok is not."""
    B, N, D = tok.shape
    step = B if split else max(1, PRODUCTS_CHUNK_BYTES // max(1, N * D * 4))
    for b0 in range(0, B, step):
        rows = slice(b0, min(B, b0 + step))
        yield rows, tok[rows] if split or tok.dtype == torch.float32 else tok[rows].float()


def attend_by_products(tok, u, mask, attn, tbar, split):
    """attn and t̄ as _pool_fwd_kernel writes them, where no config of it fits: the scores
    normalised by softmax over n, a row whose keys are all masked attending to nothing (attn and t̄
    0)."""
    D, P = tok.shape[2], u.shape[0]
    for rows, t in _row_chunks(tok, split):
        s = _bmm(t, u.t().expand(t.shape[0], D, P), split, out=attn[rows])
        if mask is not None:
            s.masked_fill_(mask[rows, :, None].bool(), float("-inf"))
        top = s.amax(1, keepdim=True)
        s.sub_(top.masked_fill_(top == float("-inf"), 0.0)).exp_()
        total = s.sum(1, keepdim=True)
        s.div_(total.masked_fill_(total == 0.0, 1.0))
        _bmm(s.transpose(1, 2), t, split, out=tbar[rows])


def scores_grad_by_products(tok, attn, dtbar, ds, split):
    """∂s as _pool_bwd_scores_kernel writes it, where no config of it fits: ∂s = a ⊙ (∂a − c) with
    ∂a = tok ∂t̄ᵀ and c_p = Σ_n a ∂a."""
    for rows, t in _row_chunks(tok, split):
        da = _bmm(t, dtbar[rows].transpose(1, 2), split, out=ds[rows])
        a = attn[rows]
        da.sub_((a * da).sum(1, keepdim=True)).mul_(a)


def _bmm(a, b, split, out=None, bias=None, dtype=torch.float32):
    """a @ b (+ bias: [N] or [Bt,N], on every row) with fp32 sums, batched, into out if given (any
    strides), else a new tensor of `dtype`: the split tensor-core dots of triton_matmul for 16-bit
    models, with the bias in their epilogue and the rounding to out's dtype in their store;
    cuBLAS's fp32 otherwise."""
    if out is None:
        out = torch.empty(a.shape[0], a.shape[1], b.shape[2], device=a.device, dtype=dtype)
    if split:
        return matmul_f32(a, b, out, split, bias)
    torch._check(out.dtype == torch.float32, lambda: f"_bmm: fp32 operands (split 0) into {out.dtype}")
    torch.bmm(a, b, out=out)
    return out if bias is None else out.add_(bias if bias.dim() == 1 else bias[:, None])


def _mm(a, b, split, bias=None, dtype=torch.float32):
    return _bmm(a[None], b[None], split, bias=bias, dtype=dtype)[0]


def _heads(tbar, wv, bv, split, out=None):
    """pooled [B,D] from t̄ [B,P,D]: pooled_p = Wv_p t̄_p + bv_p (reference.pool_heads), one
    batched product over the heads written straight into [B,P,Dh] (of `out`, a contiguous [B,D]
    fp32, where given), bv in its epilogue."""
    B, P, D = tbar.shape
    pooled = torch.empty(B, D, device=tbar.device, dtype=torch.float32) if out is None else out
    _bmm(tbar.transpose(0, 1), wv.view(P, D // P, D).transpose(1, 2), split,
         out=pooled.view(B, P, D // P).transpose(0, 1), bias=None if bv is None else bv.view(P, D // P))
    return pooled


def pool_forward(tok, q, wk, wv, bv, wo, bo, mask=None, u=None, pooled=None):
    """inv [B,D] and attn [B,N,P] (fp32), as reference.pool_forward; weights are fp32 here, or in
    tok's dtype where it is split_dot's (triton_matmul takes them as they are, pool_directions too).
    u: pool_directions(q, wk), where the caller has it; pooled: a contiguous [B,D] fp32 buffer
    the heads' output (Wv t̄ + bv, which pool_backward's ∂Wo reads) is written into, where the
    caller keeps it for the backward."""
    split = split_dot(tok.dtype)
    attn, tbar = pool_attend(tok, pool_directions(q, wk, split=split) if u is None else u, mask)
    return _mm(_emptied(_heads(tbar, wv, bv, split, out=pooled), empty_rows(mask)), wo.T, split, bias=bo), attn


def _emptied(pooled, empty):
    """pooled with the empty rows (reference.empty_rows: every key masked; None: none) set to 0 in
    place: they attend to nothing (reference.pool_forward), where the heads' epilogue added bv."""
    if empty is not None:
        pooled.masked_fill_(empty[:, None], 0.0)
    return pooled


def _kept(grad, empty):
    """A gradient [B,D] times 0 on the empty rows (in place): their heads' output is 0 whatever its
    inputs, so they pass nothing back, and a NaN there stays NaN, as 0·NaN does in the user's graph
    (reference.pool_backward)."""
    if empty is not None:
        grad.mul_((~empty)[:, None].to(grad.dtype))
    return grad


def attend_bwd_scores(tok, attn, dtbar, ds):
    """The backward's pass 1 (_pool_bwd_scores_kernel, or scores_grad_by_products where none of its
    configs fits the GPU) into ds [B,N,P] fp32, returned: ∂s from tok [B,N,D] (row stride 1), attn
    [B,N,P] and ∂t̄ [B,P,D] fp32."""
    B, N, D = tok.shape
    P = attn.shape[2]
    split = split_dot(tok.dtype)
    if not _attend_bwd_scores.launch_where_fits(lambda m: (B,), tok, attn, dtbar, ds, N, D, P, tok.stride(0),
                                                tok.stride(1), SPLIT_DOT=split, BLOCK_D=pow2(D),
                                                BLOCK_P=block_p(P, split)):
        scores_grad_by_products(tok, attn, dtbar, ds, split)
    return ds


def attend_bwd(tok, u, attn, ds, dtbar, tbar, du, grad_tok):
    """The backward's pass 2 (_pool_bwd_kernel): ∂tok into grad_tok (tok's dtype), t̄ and the
    ∂u partials into tbar and du [B,P,D] fp32, from tok, u [P,D] fp32, attn and pass 1's ds [B,N,P]
    and ∂t̄ [B,P,D]. du may be dtbar (see the kernel)."""
    B, N, D = tok.shape
    P = attn.shape[2]
    _attend_bwd(lambda m: (B, cdiv(D, m["BLOCK_D"])), tok, u, attn, ds, dtbar, tbar, du, grad_tok,
                N, D, P, tok.stride(0), tok.stride(1), SPLIT_DOT=split_dot(tok.dtype), BLOCK_Q=pow2(2 * P))


def attend_bwd_single(tok, u, attn, pooled, bv, grad_pooled, dtbar, tbar, du, grad_tok):
    """The backward in one pass (_pool_bwd_single_kernel): ∂tok into grad_tok, t̄ and the ∂u
    partials into tbar and du [B,P,D] fp32, from tok, u [P,D] fp32, attn [B,N,P], the forward's
    heads pooled [B,D] fp32, bv (or None), ∂pooled [B,D] fp32 and ∂t̄ [B,P,D] fp32. du may be dtbar.
    Returns whether it ran: not where none of its configs fits the GPU's shared memory, which holds
    the directions' [D, 2P] operands three times over (on sm_90, bf16 tok of D 1024 with 16 heads,
    or 768 with 12: 241 KB at the least against 227; fp32 or fp16 tok of D 1024 with 8, offline)."""
    B, N, D = tok.shape
    P = attn.shape[2]
    split = split_dot(tok.dtype)
    return _attend_bwd_single.launch_where_fits(
        lambda m: (B,), tok, u, attn, pooled, grad_pooled if bv is None else bv, grad_pooled, dtbar, tbar, du, grad_tok,
        N, D, P, D // P, tok.stride(0), tok.stride(1), HAS_BV=bv is not None, SPLIT_DOT=split,
        WIDE_ROWS=wide_rows(tok), BLOCK_D=pow2(D), BLOCK_P=block_p(P, split), BLOCK_DH=pow2(D // P))


def wide_rows(tok):
    """Whether an offset within a batch row of tok [B,N,D] (contiguous; ∂tok has its strides) can
    pass int32's range (_token_rows): the offsets of a last block's masked tokens too, up to 64
    tokens past N (no config's BLOCK_N is larger)."""
    return (tok.shape[1] + 64) * tok.stride(1) - 1 > 2 ** 31 - 1  # the largest offset past int32


def bwd_one_kernel(tok):
    """Whether pool_backward runs its two passes as one kernel: BWD_ONE_KERNEL, where tok's bytes
    fit in the GPU's L2 (always off the GPU). On the H200 (60 MiB of L2; session 28,
    bench/results/pool_bwd_one_probe.txt, flag_ab_pool_bwd_one.txt) at medium (tok 32 MiB) the one
    kernel took 41.9 us against the two kernels' 46.7 and the training step 4.8 us less in 6 of 6
    rounds; at large (tok 512 MiB) 576 us at its best config against 534: pass 2's second read of
    tok[b] follows pass 1's within a program, but ~500 programs at once hold more of tok than L2,
    and the two kernels read it from memory faster (4.2 and 3.5 TB/s)."""
    return BWD_ONE_KERNEL and fits_l2(tok)


def fits_l2(tok):
    """Whether tok's bytes fit in its GPU's L2 (always off the GPU): where they do, a second read of
    tok[b] right after the first finds it there (bwd_one_kernel); where not, each read is a read of
    memory (single_pass)."""
    l2 = l2_bytes(tok.device)
    return l2 is None or tok.numel() * tok.element_size() <= l2


def single_pass(tok, pooled):
    """Whether pool_backward runs the single pass (_pool_bwd_single_kernel): SINGLE_PASS where it is
    True or False; by default (None) where the forward kept its heads (pooled; without them the pass
    would first run the forward's kernel again, a read of tok more than it saves), tok's bytes
    exceed the GPU's L2, where the two passes read tok from memory twice (never off the GPU), and
    its dots are split_dot's tensor-core ones (bf16 tokens): the single pass was timed with those
    only, and fp32 or fp16 tokens keep the two passes' FMA dots as before."""
    if SINGLE_PASS is not None:
        return SINGLE_PASS
    return pooled is not None and split_dot(tok.dtype) != 0 and not fits_l2(tok)


def attend_bwd_one(tok, u, attn, ds, dtbar, tbar, du, grad_tok):
    """Both passes of the backward in one kernel (_pool_bwd_one_kernel), with attend_bwd_scores' and
    attend_bwd's arguments: ds [B,N,P] fp32 is its scratch for ∂s. Returns whether it ran: not where
    none of its configs fits the GPU's shared memory (on sm_90, fp32 tok of D 1024 with 32 heads:
    257 KB at the least against 227, offline)."""
    B, N, D = tok.shape
    P = attn.shape[2]
    split = split_dot(tok.dtype)
    return _attend_bwd_one.launch_where_fits(
        lambda m: (B,), tok, u, attn, ds, dtbar, tbar, du, grad_tok, N, D, P, tok.stride(0), tok.stride(1),
        SPLIT_DOT=split, BLOCK_D=pow2(D), BLOCK_P=block_p(P, split), BLOCK_Q=pow2(2 * P))


def two_passes(tok, u, attn, dtbar, tbar, du, grad_tok):
    """The backward's two passes, attend_bwd_scores' and attend_bwd's, or both in one kernel where
    tok fits in L2 (bwd_one_kernel) and the kernel fits the GPU, with attend_bwd's arguments."""
    ds = torch.empty_like(attn)
    if not (bwd_one_kernel(tok) and attend_bwd_one(tok, u, attn, ds, dtbar, tbar, du, grad_tok)):
        attend_bwd(tok, u, attn, attend_bwd_scores(tok, attn, dtbar, ds), dtbar, tbar, du, grad_tok)


_UNFIT_SAID = set()  # (D, P, dtype) where a single pass asked for did not fit: warned once


def pool_backward(grad_inv, tok, q, wk, wv, bv, wo, attn, u=None, pooled=None, mask=None):
    """(∂tok in tok's dtype, ∂q, ∂Wk, ∂Wv, ∂bv, ∂Wo in their weights' dtypes (∂bv fp32 where bv is
    None), ∂bo fp32), each from fp32 sums rounded once; weights as pool_forward takes them. u:
    pool_directions(q, wk), and pooled [B,D] fp32: the forward's heads (pool_forward's), where the
    caller kept them; else computed again. The returned gradients are written in their dtypes by
    the kernels that sum them (triton_matmul's store, direction_grads'), where a cast after each was a
    launch (five a step, ~11 us at medium on the H200, bench/results/kernel_times_gluon_up.txt).
    mask: the forward's, whose empty rows (every key masked) give bo its ∂inv and nothing else a
    gradient (reference.pool_backward)."""
    P, Dh = q.shape
    B, N, D = tok.shape
    split = split_dot(tok.dtype)
    empty = empty_rows(mask)
    grad_pooled = _kept(_mm(grad_inv, wo, split), empty)  # [B,D]
    # The einsums of the math as the batched products they become (einsum's parsing costs host
    # time, see reference.pool_directions). grad_heads [P,B,Dh]: ∂pooled per head.
    grad_heads = grad_pooled.view(B, P, Dh).transpose(0, 1)
    grad_tbar = torch.empty(B, P, D, device=tok.device, dtype=torch.float32)
    _bmm(grad_heads, wv.view(P, Dh, D), split, out=grad_tbar.transpose(0, 1))  # "bpj,pjd->bpd"
    # The kernel writes the ∂u-partials over ∂t̄ (see _pool_bwd_kernel), and they are summed
    # and dropped before t̄'s projections: at the large preset with the two passes this is where
    # training peaks, with ∂tok (512 MiB) live, and three [B,P,D] fp32 buffers (64 MiB each)
    # became two there and one after (bench/offline_memory.py; the single pass peaks lower).
    du_part = grad_tbar
    u = (pool_directions(q, wk, split=split) if u is None else u).float().contiguous()
    tok = tok.contiguous()
    attn = attn.contiguous()
    grad_tok = torch.empty_like(tok)
    tbar = torch.empty(B, P, D, device=tok.device, dtype=torch.float32)
    single = single_pass(tok, pooled)
    if single and pooled is None:  # the heads' output, which the single pass's c needs before it starts
        pooled = _emptied(_heads(pool_attend(tok, u, mask)[1], wv, bv, split), empty)
    if not (single and attend_bwd_single(tok, u, attn, pooled.contiguous(), bv, grad_pooled, grad_tbar, tbar, du_part,
                                         grad_tok)):
        if single and SINGLE_PASS and (D, P, tok.dtype) not in _UNFIT_SAID:
            _UNFIT_SAID.add((D, P, tok.dtype))
            log.warning("mha_compile: MHA_COMPILE_POOL_BWD_SINGLE_PASS=1, but the single pass does not fit the "
                        "GPU's shared memory at D=%d with %d heads in %s: the two passes run", D, P, tok.dtype)
        two_passes(tok, u, attn, grad_tbar, tbar, du_part, grad_tok)
    if COLUMN_SUMS:
        grad_u = column_sums(du_part.view(B, P * D), Dh**-0.5).view(P, D)
    else:
        grad_u = du_part.sum(0) * (Dh**-0.5)
    del grad_tbar, du_part
    grad_bo = column_sums(grad_inv.contiguous()).to(grad_inv.dtype) if COLUMN_SUMS else grad_inv.sum(0)
    grad_wo = _mm(grad_inv.T, _emptied(_heads(tbar, wv, bv, split), empty) if pooled is None else pooled, split,
                  dtype=wo.dtype)
    # ∂bv = Σ_b ∂pooled[b] = (Σ_b ∂inv[b]) Wo: a [D]·[D,D] product, where torch's sum over the B
    # rows of ∂pooled took 12 us at large and 8 at medium (session 22's profile, H200); with a
    # mask, over the rows that attend to something
    kept_inv = grad_bo if empty is None else _kept(grad_inv.clone(), empty).sum(0)
    grad_bv = _mm(kept_inv[None], wo, split, dtype=torch.float32 if bv is None else bv.dtype)[0]
    grad_wv = _bmm(grad_heads.transpose(1, 2), tbar.transpose(0, 1), split,  # "bpj,bpd->pjd"
                   dtype=wv.dtype).reshape(D, D)
    grad_q, grad_wk = direction_grads(q, wk, grad_u)
    return grad_tok, grad_q, grad_wk, grad_wv, grad_bv, grad_wo, grad_bo
