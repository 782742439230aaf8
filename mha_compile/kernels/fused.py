"""kernels="fused": the region with the merge folded into the kernels that read y.

What runs (see triton_region, triton_pool, triton_router, triton_moe):
- pool: a forward kernel that reads tok once (reassociated: scores against u_p, softmax
  online, t̄ = Σ a tok) and a backward that reads it twice (one kernel where tok fits in L2,
  else two); the small [B,D]×[D,D] projections on triton_matmul's split tensor-core dots for
  bf16 models, on cuBLAS in fp32 otherwise;
- router + softmax + top-k in fp32, with y = ctx + inv[b] formed in the tile load;
- sync-free grouping by expert (device sort, grid from a host-known bound);
- the slot rows of y gathered (and merged) once in expert order, then grouped GEMM1 on those
  contiguous rows with the activation in its epilogue, grouped GEMM2 with bias and routing
  weight in its epilogue, token-order combine (no atomics);
- backward: one grouped kernel recomputes u and forms g = G W2ᵀ in a single K loop and writes
  h, ∂u and the ∂w partials; ∂x and ∂W1/∂W2/∂W3/∂b as grouped GEMMs; the router gradient,
  Σ_j, ∂ctx and ∂inv = Σ_h ∂y in two token-order kernels; then the pool backward.
On Hopper in 16-bit, GEMM1, GEMM2, the backward's grouped kernel and the weight gradients run as
gluon_moe's warp-specialised kernels where it takes the shape and activation (triton_moe says
where); ∂x's grouped GEMM and everything elsewhere as their Triton twins.
Not fused (yet): the combine is its own pass after GEMM2; ∂Wg = ∂logitsᵀ x and the pool's
projections are kernels of their own (triton_router.router_weight_grad, triton_matmul).
"""
from mha_compile.kernels import triton_region


def why_unsupported(ctx, tok, w1, top_k, act, mask):
    """None when kernels="fused" takes these inputs; else why not (they run on the reference)."""
    return triton_region.why_unsupported(ctx, tok, w1, top_k, act, mask)


def reuse_size(ctx, tok, q, w1, top_k, act, mask, keep_hidden=False):
    """Elements of the `reuse` region_forward returns (triton_region.reuse_size)."""
    return triton_region.reuse_size(ctx, tok, q, w1, top_k, act, mask, keep_hidden)


def region_forward(ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3, mask, top_k, renorm, act,
                   keep_hidden=False, kept=None):
    """keep_hidden, kept: see triton_region (what the forward leaves for region_backward, beside the
    `reuse` it returns)."""
    return triton_region.region_forward("on_load", ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2,
                                        w3, mask, top_k, renorm, act, keep_hidden, kept)


def region_backward(grad_out, ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3, mask,
                    inv, attn, weight, index, probs, reuse, top_k, renorm, act, keep_hidden=False, kept=None):
    return triton_region.region_backward("on_load", grad_out, ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1,
                                         w2, b2, w3, mask, inv, attn, weight, index, probs, reuse, top_k, renorm, act,
                                         keep_hidden, kept)
