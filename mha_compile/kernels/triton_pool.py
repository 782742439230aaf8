"""The inverted attention pool, reassociated (SPEC §1), as one Triton kernel each way.

Forward, per batch row b (one program), reading tok[b] once in BLOCK_N-token chunks:
    s[n,p]   = ⟨tok[b,n], u_p⟩            u_p = Wk_pᵀ q_p / √Dh   (u: [P,D], computed once)
    a[:,p]   = softmax_n(s[:,p])           online (flash-style) over the chunks
    t̄[b,p]   = Σ_n a[n,p] tok[b,n]         [P,D]
This is attention with P queries u_p and keys = values = tok[b]; the key bias bk shifts every
score of a head equally and cancels. The raw scores go to `attn` in the loop and are normalised
in place by a second, tiny pass over [N,P] once the softmax statistics are final, so tok is read
once. The small projections pooled = Wv_p t̄_p + bv, inv = pooled Woᵀ + bo are [B,D]×[D,D]
GEMMs (4·B·D² FLOPs, against the 4·B·N·D² the direct form would need) and run on cuBLAS.

Backward, given ∂t̄[b,p] = Wv_pᵀ ∂pooled[b,p] (again a small GEMM), per batch row:
    ∂a[n,p] = ⟨tok[b,n], ∂t̄_p⟩,   c_p = Σ_n a ∂a,   ∂s = a ⊙ (∂a − c)
    ∂tok[b,n] = Σ_p a[n,p] ∂t̄_p + Σ_p ∂s[n,p] u_p
    Σ_n ∂s[n,p] tok[b,n] = Σ_n (a ∂a)[n,p] tok[b,n] − c_p t̄_p      (→ ∂u, hence ∂q, ∂Wk)
Pass 1 reads tok once and accumulates t̄, Σ(a ∂a) tok and c, storing ∂a ([N,P], small);
pass 2 needs only a, ∂a, ∂t̄ and u to write ∂tok. Per-b partial ∂u [B,P,D] is summed on the
host side of the launch by torch (a fixed-order reduction: bitwise reproducible).

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
def _pool_bwd_kernel(
    tok_ptr, u_ptr, attn_ptr, dtbar_ptr, da_ptr, tbar_ptr, du_ptr, dtok_ptr,
    N, D, P,
    stride_tb, stride_tn,
    SPLIT_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """tok [B,N,D], u [P,D], attn [B,N,P], ∂t̄ [B,P,D] → ∂tok [B,N,D], t̄ and ∂u-partials [B,P,D].

    du_ptr may be dtbar_ptr: program b reads its ∂t̄[b] whole before its loops and writes the
    ∂u-partials[b] after the first, and no other program touches row b.
    """
    b = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_p = tl.arange(0, BLOCK_P)
    d_ok = offs_d < D
    p_ok = offs_p < P
    pd_ok = p_ok[:, None] & d_ok[None, :]
    pd_off = offs_p[:, None] * D + offs_d[None, :]
    u = tl.load(u_ptr + pd_off, mask=pd_ok, other=0.0)
    dtbar = tl.load(dtbar_ptr + b * P * D + pd_off, mask=pd_ok, other=0.0)
    dtbar_t = tl.trans(dtbar)
    tok_b = tok_ptr + b * stride_tb
    attn_b = attn_ptr + b * N * P
    da_b = da_ptr + b * N * P
    c = tl.zeros([BLOCK_P], tl.float32)
    tbar = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
    w = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        np_ok = n_ok[:, None] & p_ok[None, :]
        t = tl.load(tok_b + offs_n[:, None].to(tl.int64) * stride_tn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        a = tl.load(attn_b + offs_n[:, None] * P + offs_p[None, :], mask=np_ok, other=0.0)
        da = _dot_f32(t, dtbar_t, SPLIT_DOT)  # [BLOCK_N, BLOCK_P]
        tl.store(da_b + offs_n[:, None] * P + offs_p[None, :], da, mask=np_ok)
        c += tl.sum(a * da, axis=0)
        tbar += _dot_f32(tl.trans(a), t, SPLIT_DOT)
        w += _dot_f32(tl.trans(a * da), t, SPLIT_DOT)
    tl.store(tbar_ptr + b * P * D + pd_off, tbar, mask=pd_ok)
    tl.store(du_ptr + b * P * D + pd_off, w - c[:, None] * tbar, mask=pd_ok)
    tl.debug_barrier()
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        np_ok = n_ok[:, None] & p_ok[None, :]
        a = tl.load(attn_b + offs_n[:, None] * P + offs_p[None, :], mask=np_ok, other=0.0)
        da = tl.load(da_b + offs_n[:, None] * P + offs_p[None, :], mask=np_ok, other=0.0)
        ds = a * (da - c[None, :])
        dtok = _dot_f32(a, dtbar, SPLIT_DOT) + _dot_f32(ds, u, SPLIT_DOT)
        tl.store(dtok_ptr + b * stride_tb + offs_n[:, None].to(tl.int64) * stride_tn + offs_d[None, :],
                 dtok.to(dtok_ptr.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])


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
# pool_backward passes ∂t̄ as du_ptr too: autotuning's trial runs must each see it restored.
_attend_bwd = Launcher(_pool_bwd_kernel, _POOL_CONFIGS, key=["N", "D", "P", "SPLIT_DOT"], restore=["dtbar_ptr"])


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
    da = torch.empty_like(attn)
    _attend_bwd(lambda m: (B,), tok, u, attn, grad_tbar, da, tbar, du_part, grad_tok, N, D, P,
                tok.stride(0), tok.stride(1), SPLIT_DOT=split_dot(tok.dtype), BLOCK_D=pow2(D), BLOCK_P=pow2(P))
    grad_u = du_part.sum(0) * (Dh**-0.5)
    del grad_tbar, du_part, da
    pooled = pool_heads(tbar, wv, bv)
    grad_bo = grad_inv.sum(0)
    grad_wo = grad_inv.T @ pooled
    grad_bv = grad_pooled.sum(0)
    grad_wv = torch.bmm(grad_heads.transpose(1, 2), tbar.transpose(0, 1)).reshape(D, D)  # "bpj,bpd->pjd"
    grad_q = torch.bmm(wk.view(P, Dh, D), grad_u.unsqueeze(2)).squeeze(2)  # "pd,pjd->pj"
    grad_wk = (q[:, :, None] * grad_u[:, None, :]).reshape(D, D)  # "pj,pd->pjd"
    return grad_tok, grad_q, grad_wk, grad_wv, grad_bv, grad_wo, grad_bo
