"""kernels="staged": one simple kernel per stage, the baseline the fused set must beat.

pool (triton_pool) → merge y = ctx + inv[b] written to memory in fp32 by a handwritten CUDA
C++ kernel (merge_cuda, built with load_inline on first use; its Triton twin on CPU or without
nvcc) → router on y (triton_router) → expert GEMM1, GEMM2 and combine (triton_moe), each
reading y from memory. Backward: y is rebuilt by the same merge, the expert and router
gradients run as in the fused set but write ∂y in fp32, and the CUDA merge's backward turns
it into ∂ctx and ∂inv = Σ_h ∂y (in h order, reproducible) before the pool backward.
"""
import functools

from mha_compile.kernels import triton_region
# kernels="staged" takes what the Triton path takes (triton_region.why_unsupported, reuse_size)
from mha_compile.kernels.triton_region import reuse_size, why_unsupported

__all__ = ["why_unsupported", "reuse_size", "region_forward", "region_backward"]

region_forward = functools.partial(triton_region.region_forward, "cuda")
region_backward = functools.partial(triton_region.region_backward, "cuda")
