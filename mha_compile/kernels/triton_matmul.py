"""fp32 GEMMs at about fp32 accuracy on the 16-bit tensor cores: the pool's small projections.

Around the pool kernels sit [B,D]×[D,D]-sized fp32 products (pooled = Wv t̄ per head, inv =
pooled Woᵀ, and their gradients): 4·B·D² FLOPs each. On cuBLAS in fp32 they ran on the FMA
units, 32×32-tile kernels among them, ~0.49 ms of a large training step and ~80 µs of a medium
one (H200, bench/results/kernel_times.txt). Here each tile's product is triton_util.dot_f32:
the fp32 operands split into 16-bit hi + lo halves, three tensor-core dots (~2⁻¹⁶ relative),
accumulated in fp32, which is the accuracy the pool kernels already keep.

    matmul_f32(a [Bt,M,K], b [Bt,K,N], out [Bt,M,N], split_dot, bias=[N] or [Bt,N])    any strides, fp32

An operand may come in the split's 16-bit dtype instead (the pool's Wv and Wo of a bf16 model): it
is its own high half, its low half is zero, so its tiles go to the tensor cores as they are, two
dots in place of three, the same sums in the same order, and half its bytes read. The bias may
come in that dtype too (read exactly into the fp32 sums), and out too (the pool's weight
gradients, returned in the weights' dtype): the fp32 sums are rounded to it once, as they are
stored, where a cast after the product was a kernel of its own (3 us a [256, 256] at medium).

The bias is added in the epilogue: a separate `+ bias` over [B,D] cost 7 us a call at large
(three a step, H200, session 22's profile), for a read and write of what the product just wrote.

When M×N gives too few tiles to fill the GPU (∂Wo, ∂Wv: a [D,D] output summed over K = B),
K is cut into SPLIT equal runs whose fp32 partials [SPLIT,Bt,M,N] triton_util.sum_runs adds up
in run order (reproducible run to run), rounding once to out's dtype.
"""
import torch
import triton
import triton.language as tl

from mha_compile.kernels.triton_util import Launcher, cdiv, dot_f32, split_runs, sum_runs


@triton.jit
def _matmul_f32_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K, K_RUN,
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn, stride_cs, stride_cb, stride_cm, stride_cn,
    stride_biasb, stride_biasn,
    HAS_BIAS: tl.constexpr, SPLIT_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[s, bt] = a[bt, :, ks] @ b[bt, ks, :] over the s-th run ks of K_RUN columns of K
    (program axes: (m, n) tile, bt, s), + bias[bt] on every row in run 0 with HAS_BIAS."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // n_tiles
    pid_n = tl.program_id(0) % n_tiles
    bt = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = s * K_RUN
    k_hi = tl.minimum(k_lo + K_RUN, K)
    a_bt = a_ptr + bt * stride_ab
    b_bt = b_ptr + bt * stride_bb
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        a = tl.load(a_bt + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :].to(tl.int64) * stride_ak,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_bt + offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += dot_f32(a, b, SPLIT_DOT)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + bt * stride_biasb + offs_n.to(tl.int64) * stride_biasn, mask=n_ok & (s == 0),
                       other=0.0).to(tl.float32)[None, :]
    c = c_ptr + s.to(tl.int64) * stride_cs + bt * stride_cb
    tl.store(c + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# The first config is the interpreter's (and MHA_COMPILE_NO_AUTOTUNE's). BLOCK_K ≤ RUN_ALIGN.
_matmul = Launcher(_matmul_f32_kernel, [
    dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
], key=["M", "N", "K", "K_RUN", "HAS_BIAS", "SPLIT_DOT"])

RUN_ALIGN = 64  # K runs are whole multiples of every config's BLOCK_K
SPLIT_HALVES = {1: torch.bfloat16, 2: torch.float16}  # split_dot's 16-bit dtype (triton_util.dot_f32)
# No run shorter than this: each costs a [Bt,M,N] fp32 partial. At 512, medium's ∂Wo and ∂Wv
# (K = B = 1024, [256, 256] out) took two runs: 32 programs on 132 SMs, 15.8 and 15.6 us a call
# (bench/results/small_kernels_probe.txt); at 128 they take eight (partials of 2 MiB).
MIN_RUN = 128
SPLIT_TILE = 128  # the tile the split count assumes (the largest config's)


def k_runs(batch, M, N, K, device):
    """(SPLIT, K_RUN): runs of K so that (tiles of SPLIT_TILE²) × runs reach ~2 programs an SM,
    where K is the long side (the weight gradients, K = B); the projections (K = D ≤ M = B) have
    tiles enough, and a split there would only add a partial and its sum."""
    if K <= max(M, N):
        return 1, K
    tiles = batch * cdiv(M, SPLIT_TILE) * cdiv(N, SPLIT_TILE)
    return split_runs(K, tiles, MIN_RUN, RUN_ALIGN, device)


def matmul_f32(a, b, out, split_dot, bias=None):
    """out [Bt,M,N] (any strides, written) = a [Bt,M,K] @ b [Bt,K,N] (any strides) + bias ([N],
    or [Bt,N]: one a batch; any strides) on every row, with split_dot as in triton_util.dot_f32 (0:
    ieee fp32). Each of a, b, bias and out is fp32 or split_dot's 16-bit dtype; the sums are fp32.
    Returns out."""
    Bt, M, K = a.shape
    N = b.shape[2]
    torch._check(b.shape == (Bt, K, N) and out.shape == (Bt, M, N),
                 lambda: f"matmul_f32: a {tuple(a.shape)} @ b {tuple(b.shape)} into out {tuple(out.shape)}")
    torch._check(bias is None or tuple(bias.shape) in ((N,), (Bt, N)),
                 lambda: f"matmul_f32: bias {tuple(bias.shape)} for out {tuple(out.shape)}: wants [{N}] or [{Bt}, {N}]")
    half = SPLIT_HALVES.get(split_dot)
    torch._check(all(t is None or t.dtype in (torch.float32, half) for t in (a, b, bias, out)),
                 lambda: f"matmul_f32 takes fp32 (or {half} with split_dot={split_dot}), got a {a.dtype}, "
                         f"b {b.dtype}, out {out.dtype}" + ("" if bias is None else f", bias {bias.dtype}"))
    bias_strides = (0, 0) if bias is None else (0, bias.stride(0)) if bias.dim() == 1 else bias.stride()
    split, run = k_runs(Bt, M, N, K, a.device)
    dest = out if split == 1 else torch.empty(split, Bt, M, N, device=a.device, dtype=torch.float32)
    cs = 0 if split == 1 else dest.stride(0)
    cb, cm, cn = dest.stride()[-3:]
    _matmul(lambda m: (cdiv(M, m["BLOCK_M"]) * cdiv(N, m["BLOCK_N"]), Bt, split),
            a, b, dest, a if bias is None else bias, M, N, K, run, *a.stride(), *b.stride(), cs, cb, cm, cn,
            *bias_strides, HAS_BIAS=bias is not None, SPLIT_DOT=split_dot)
    if split > 1:  # one kernel, rounding once to out's dtype
        if out.is_contiguous():
            sum_runs(dest, out)
        else:
            out.copy_(sum_runs(dest, torch.empty(out.shape, device=out.device, dtype=torch.float32)))
    return out
