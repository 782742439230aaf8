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
import functools

from mha_compile.kernels import triton_region
# kernels="fused" takes what the Triton path takes (triton_region.why_unsupported, reuse_size)
from mha_compile.kernels.triton_region import reuse_size, why_unsupported

__all__ = ["why_unsupported", "reuse_size", "region_forward", "region_backward"]

region_forward = functools.partial(triton_region.region_forward, "on_load")
region_backward = functools.partial(triton_region.region_backward, "on_load")
