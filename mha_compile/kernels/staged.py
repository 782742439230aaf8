"""kernels="staged": one simple kernel per stage, the baseline the fused set must beat.

pool (triton_pool) → merge y = ctx + inv[b] written to memory in fp32 by a handwritten CUDA
C++ kernel (merge_cuda, built with load_inline on first use; its Triton twin on CPU or without
nvcc) → router on y (triton_router) → expert GEMM1, GEMM2 and combine (triton_moe), each
reading y from memory. Backward: y is rebuilt by the same merge, the expert and router
gradients run as in the fused set but write ∂y in fp32, and the CUDA merge's backward turns
it into ∂ctx and ∂inv = Σ_h ∂y (in h order, reproducible) before the pool backward.
"""
from mha_compile.kernels import triton_region


def why_unsupported(ctx, tok, w1, top_k, act, mask):
    """None when kernels="staged" takes these inputs; else why not (they run on the reference)."""
    return triton_region.why_unsupported(ctx, tok, w1, top_k, act, mask)


def reuse_size(ctx, tok, q, w1, top_k, act, mask, keep_hidden=False):
    """Elements of the `reuse` region_forward returns (triton_region.reuse_size)."""
    return triton_region.reuse_size(ctx, tok, q, w1, top_k, act, mask, keep_hidden)


def region_forward(ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3, mask, top_k, renorm, act,
                   keep_hidden=False, kept=None):
    """keep_hidden, kept: see triton_region (what the forward leaves for region_backward, beside the
    `reuse` it returns)."""
    return triton_region.region_forward("cuda", ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2,
                                        w3, mask, top_k, renorm, act, keep_hidden, kept)


def region_backward(grad_out, ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3, mask,
                    inv, attn, weight, index, probs, reuse, top_k, renorm, act, keep_hidden=False, kept=None):
    return triton_region.region_backward("cuda", grad_out, ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1,
                                         w2, b2, w3, mask, inv, attn, weight, index, probs, reuse, top_k, renorm, act,
                                         keep_hidden, kept)
