"""The inverted attention pool, reassociated (SPEC §1), as Triton kernels.

Forward, per batch row b (one program), reading tok[b] once in BLOCK_N-token chunks:
    s[n,p]   = ⟨tok[b,n], u_p⟩            u_p = Wk_pᵀ q_p / √Dh   (u: [P,D], computed once)
    a[:,p]   = softmax_n(s[:,p])           online (flash-style) over the chunks
    t̄[b,p]   = Σ_n a[n,p] tok[b,n]         [P,D]
This is attention with P queries u_p and keys = values = tok[b]; the key bias bk shifts every
score of a head equally and cancels. The raw scores go to `attn` in the loop and are normalised
in place by a second, tiny pass over [N,P] once the softmax statistics are final, so tok is read
once. The small projections pooled = Wv_p t̄_p + bv, inv = pooled Woᵀ + bo are [B,D]×[D,D]
GEMMs (4·B·D² FLOPs, against the 4·B·N·D² the direct form would need) and run on cuBLAS.

Backward, given ∂t̄[b,p] = Wv_pᵀ ∂pooled[b,p] (again a small GEMM), in two kernels:
    ∂a[n,p] = ⟨tok[b,n], ∂t̄_p⟩,   c_p = Σ_n a ∂a,   ∂s = a ⊙ (∂a − c)
    ∂tok[b,n] = Σ_p a[n,p] ∂t̄_p + Σ_p ∂s[n,p] u_p
    t̄_p = Σ_n a tok[b,n],   Σ_n ∂s[n,p] tok[b,n]      (→ ∂u, hence ∂q, ∂Wk; t̄ → ∂Wv, ∂Wo)
Pass 1, one program per batch row (∂a needs all of D), reads tok and writes [a | ∂s] ([N,2P],
small). Pass 2, per batch row and block of D columns, reads tok again and writes ∂tok: each
line above is then one dot against [a | ∂s] or the stacked [∂t̄_b ; u]. One program per batch
row for both, with [P,D] fp32 accumulators, held 255 registers and one program an SM, and ran at
~4x the memory floor (1.07 ms at large, H200). The per-b ∂u-partials [B,P,D] are summed by
torch (a fixed-order reduction: bitwise reproducible).

All pool arithmetic accumulates in fp32 to about fp32 accuracy: ieee fp32 dots for fp32 and
fp16 tokens; for bf16 tokens the same products as split bf16 tensor-core dots (_dot_f32), since
on the FMA units these thin dots, not the one read of tok, set the kernels' time.
"""
import torch
import triton
import triton.language as tl

from mha_compile.kernels.reference import pool_directions, pool_heads, pool_project
from mha_compile.kernels.triton_util import Launcher, pow2

# A [P,D] fp32 accumulator (P padded to 16) lives in registers: D beyond this spills badly.
MAX_POOL_D = 1024


@triton.jit
def _split(x, DT: tl.constexpr):
    """x (fp32) = hi + lo, both in DT: hi + lo carries ~16 of fp32's 24 mantissa bits."""
    hi = x.to(DT)
    return hi, (x - hi.to(tl.float32)).to(DT)


@triton.jit
def _dot_f32(a, b, SPLIT_DOT: tl.constexpr):
    """a @ b with fp32 accumulation to about fp32 accuracy. SPLIT_DOT = 0: ieee fp32 dot (FMA
    units). Otherwise SPLIT_DOT is the 16-bit dtype of the tokens (1 = bf16, 2 = fp16): an
    operand already in it is used as is, an fp32 one is split into hi + lo halves, and the
    products of the halves (lo · lo dropped) run on the tensor cores. The pool's dots are thin
    ([N, D] × [D, P] with P ≤ 16): on the FMA path they, not the bytes of tok, set its time."""
    if SPLIT_DOT == 0:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        DT: tl.constexpr = tl.bfloat16 if SPLIT_DOT == 1 else tl.float16
        if a.dtype == DT:
            b_hi, b_lo = _split(b, DT)
            return tl.dot(a, b_lo, tl.dot(a, b_hi))
        elif b.dtype == DT:
            a_hi, a_lo = _split(a, DT)
            return tl.dot(a_lo, b, tl.dot(a_hi, b))
        else:
            a_hi, a_lo = _split(a, DT)
            b_hi, b_lo = _split(b, DT)
            return tl.dot(a_lo, b_hi, tl.dot(a_hi, b_lo, tl.dot(a_hi, b_hi)))


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
    ut = tl.trans(u)
    tok_b = tok_ptr + b * stride_tb
    attn_b = attn_ptr + b * N * P
    m = tl.full([BLOCK_P], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_P], tl.float32)
    acc = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        t = tl.load(tok_b + offs_n[:, None].to(tl.int64) * stride_tn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = _dot_f32(t, ut, SPLIT_DOT)  # [BLOCK_N, BLOCK_P]
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
        acc = acc * alpha[:, None] + _dot_f32(tl.trans(e), t, SPLIT_DOT)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tl.store(tbar_ptr + b * P * D + offs_p[:, None] * D + offs_d[None, :], acc / l[:, None],
             mask=p_ok[:, None] & d_ok[None, :])
    # Normalise the stored scores; this program wrote them, the barrier orders its threads.
    tl.debug_barrier()
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ptrs = attn_b + offs_n[:, None] * P + offs_p[None, :]
        ok = (offs_n < N)[:, None] & p_ok[None, :]
        s = tl.load(ptrs, mask=ok, other=float("-inf"))
        tl.store(ptrs, tl.exp(s - m_safe[None, :]) / l[None, :], mask=ok)


@triton.jit
def _pool_bwd_scores_kernel(
    tok_ptr, attn_ptr, dtbar_ptr, ads_ptr,
    N, D, P,
    stride_tb, stride_tn,
    SPLIT_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Pass 1 of the backward, per batch row b (one program, all of D): tok [B,N,D], attn
    [B,N,P], ∂t̄ [B,P,D] → ads [B,N,2P] fp32 = [a | ∂s], the scores' gradient
    ∂s = a ⊙ (∂a − c) beside a, with ∂a[n,p] = ⟨tok[b,n], ∂t̄_p⟩ and c_p = Σ_n a ∂a. ∂a is parked
    in ∂s's columns until c is final (a second, tiny pass over [N,P], as the forward's)."""
    b = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_p = tl.arange(0, BLOCK_P)
    d_ok = offs_d < D
    p_ok = offs_p < P
    dtbar = tl.load(dtbar_ptr + b * P * D + offs_p[:, None] * D + offs_d[None, :],
                    mask=p_ok[:, None] & d_ok[None, :], other=0.0)
    dtbar_t = tl.trans(dtbar)
    tok_b = tok_ptr + b * stride_tb
    attn_b = attn_ptr + b * N * P
    ads_b = ads_ptr + b * N * 2 * P
    c = tl.zeros([BLOCK_P], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        np_ok = n_ok[:, None] & p_ok[None, :]
        t = tl.load(tok_b + offs_n[:, None].to(tl.int64) * stride_tn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        a = tl.load(attn_b + offs_n[:, None] * P + offs_p[None, :], mask=np_ok, other=0.0)
        da = _dot_f32(t, dtbar_t, SPLIT_DOT)  # [BLOCK_N, BLOCK_P]
        tl.store(ads_b + offs_n[:, None] * 2 * P + P + offs_p[None, :], da, mask=np_ok)
        c += tl.sum(a * da, axis=0)
    # This program wrote the ∂a it now reads; the barrier orders its threads.
    tl.debug_barrier()
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        np_ok = (offs_n < N)[:, None] & p_ok[None, :]
        a = tl.load(attn_b + offs_n[:, None] * P + offs_p[None, :], mask=np_ok, other=0.0)
        row = ads_b + offs_n[:, None] * 2 * P + offs_p[None, :]
        da = tl.load(row + P, mask=np_ok, other=0.0)
        tl.store(row, a, mask=np_ok)
        tl.store(row + P, a * (da - c[None, :]), mask=np_ok)


@triton.jit
def _pool_bwd_kernel(
    tok_ptr, u_ptr, ads_ptr, dtbar_ptr, tbar_ptr, du_ptr, dtok_ptr,
    N, D, P,
    stride_tb, stride_tn,
    SPLIT_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """Pass 2, per batch row b and block of D columns, one read of tok and one write of ∂tok.
    With ads = [a | ∂s] (pass 1) and the stacked directions R = [∂t̄_b ; u] ([2P, D]):
        ∂tok[b,n] = ads[n] R = Σ_p a ∂t̄_p + Σ_p ∂s u_p
        adsᵀ tok[b] = [t̄_b ; Σ_n ∂s tok[b,n]] → t̄ [B,P,D] and the ∂u-partials [B,P,D]
    (2P is padded to BLOCK_Q ≥ 16 columns, one dot each way). du_ptr may be dtbar_ptr: a
    program reads its block of ∂t̄[b] before its loop and writes the same block after it, and
    no other program touches that block.
    """
    b = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_q = tl.arange(0, BLOCK_Q)
    d_ok = offs_d < D
    q_a = offs_q < P
    q_s = (offs_q >= P) & (offs_q < 2 * P)
    rows = dtbar_ptr + b * P * D + offs_q[:, None] * D + offs_d[None, :]
    dirs = (tl.load(rows, mask=q_a[:, None] & d_ok[None, :], other=0.0)
            + tl.load(u_ptr + (offs_q - P)[:, None] * D + offs_d[None, :], mask=q_s[:, None] & d_ok[None, :],
                      other=0.0))
    tok_b = tok_ptr + b * stride_tb
    ads_b = ads_ptr + b * N * 2 * P
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        nd_off = offs_n[:, None].to(tl.int64) * stride_tn + offs_d[None, :]
        nd_ok = n_ok[:, None] & d_ok[None, :]
        t = tl.load(tok_b + nd_off, mask=nd_ok, other=0.0)
        ads = tl.load(ads_b + offs_n[:, None] * 2 * P + offs_q[None, :], mask=n_ok[:, None] & (q_a | q_s)[None, :],
                      other=0.0)
        dtok = _dot_f32(ads, dirs, SPLIT_DOT)  # [BLOCK_N, BLOCK_D]
        tl.store(dtok_ptr + b * stride_tb + nd_off, dtok.to(dtok_ptr.dtype.element_ty), mask=nd_ok)
        acc += _dot_f32(tl.trans(ads), t, SPLIT_DOT)  # [BLOCK_Q, BLOCK_D]
    out_off = b * P * D + offs_q[:, None] * D + offs_d[None, :]
    tl.store(tbar_ptr + out_off, acc, mask=q_a[:, None] & d_ok[None, :])
    tl.store(du_ptr + out_off - P * D, acc, mask=q_s[:, None] & d_ok[None, :])


# Token dtypes whose pool dots run as split 16-bit tensor-core products (see _dot_f32). fp16
# is left on the ieee path: the lo half of an fp32 value can fall below fp16's normal range.
SPLIT_DOT_DTYPES = {torch.bfloat16: 1}


def split_dot(dtype):
    return SPLIT_DOT_DTYPES.get(dtype, 0)


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
]
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
], key=["N", "D", "P", "SPLIT_DOT"], restore=["dtbar_ptr"])


def pool_attend(tok, u, mask=None):
    """attn [B,N,P] and t̄ [B,P,D] (fp32) from tok [B,N,D] and the directions u [P,D]."""
    B, N, D = tok.shape
    P = u.shape[0]
    torch._check(D <= MAX_POOL_D, lambda: f"pool kernel takes D ≤ {MAX_POOL_D}, got {D}")
    tok = tok.contiguous()
    u = u.float().contiguous()
    attn = torch.empty(B, N, P, device=tok.device, dtype=torch.float32)
    tbar = torch.empty(B, P, D, device=tok.device, dtype=torch.float32)
    mask_u8 = mask.to(torch.uint8).contiguous() if mask is not None else attn
    _attend(lambda m: (B,), tok, u, mask_u8, attn, tbar, N, D, P, tok.stride(0), tok.stride(1),
            HAS_MASK=mask is not None, SPLIT_DOT=split_dot(tok.dtype), BLOCK_D=pow2(D), BLOCK_P=pow2(P))
    return attn, tbar


def pool_forward(tok, q, wk, wv, bv, wo, bo, mask=None):
    """inv [B,D] and attn [B,N,P] (fp32), as reference.pool_forward; weights are fp32 here."""
    attn, tbar = pool_attend(tok, pool_directions(q, wk), mask)
    return pool_project(tbar, wv, bv, wo, bo), attn


def pool_backward(grad_inv, tok, q, wk, wv, bv, wo, attn):
    """(∂tok in tok's dtype, ∂q, ∂Wk, ∂Wv, ∂bv, ∂Wo, ∂bo) in fp32; weights given in fp32."""
    P, Dh = q.shape
    B, N, D = tok.shape
    wv_heads = wv.view(P, Dh, D)
    grad_pooled = grad_inv @ wo  # [B,D]
    # The einsums of the math as the bmms they become (einsum's parsing costs host time, see
    # reference.pool_directions). grad_heads [P,B,Dh]: ∂pooled per head.
    grad_heads = grad_pooled.view(B, P, Dh).transpose(0, 1)
    grad_tbar = torch.bmm(grad_heads, wv_heads).transpose(0, 1).contiguous()  # "bpj,pjd->bpd"
    # The kernel writes the ∂u-partials over ∂t̄ (see _pool_bwd_kernel), and they are summed
    # and dropped before t̄'s projections: at the large preset this is where training peaks,
    # with ∂tok (512 MiB) live, and three [B,P,D] fp32 buffers (64 MiB each) became two there
    # and one after (bench/offline_memory.py).
    du_part = grad_tbar
    u = pool_directions(q, wk).float().contiguous()
    tok = tok.contiguous()
    attn = attn.contiguous()
    grad_tok = torch.empty_like(tok)
    tbar = torch.empty(B, P, D, device=tok.device, dtype=torch.float32)
    ads = torch.empty(B, N, 2 * P, device=tok.device, dtype=torch.float32)
    strides = tok.stride(0), tok.stride(1)
    _attend_bwd_scores(lambda m: (B,), tok, attn, grad_tbar, ads, N, D, P, *strides,
                       SPLIT_DOT=split_dot(tok.dtype), BLOCK_D=pow2(D), BLOCK_P=pow2(P))
    _attend_bwd(lambda m: (B, triton.cdiv(D, m["BLOCK_D"])), tok, u, ads, grad_tbar, tbar, du_part, grad_tok,
                N, D, P, *strides, SPLIT_DOT=split_dot(tok.dtype), BLOCK_Q=pow2(2 * P))
    grad_u = du_part.sum(0) * (Dh**-0.5)
    del grad_tbar, du_part, ads
    pooled = pool_heads(tbar, wv, bv)
    grad_bo = grad_inv.sum(0)
    grad_wo = grad_inv.T @ pooled
    grad_bv = grad_pooled.sum(0)
    grad_wv = torch.bmm(grad_heads.transpose(1, 2), tbar.transpose(0, 1)).reshape(D, D)  # "bpj,bpd->pjd"
    grad_q = torch.bmm(wk.view(P, Dh, D), grad_u.unsqueeze(2)).squeeze(2)  # "pd,pjd->pj"
    grad_wk = (q[:, :, None] * grad_u[:, None, :]).reshape(D, D)  # "pj,pd->pjd"
    return grad_tok, grad_q, grad_wk, grad_wv, grad_bv, grad_wo, grad_bo
