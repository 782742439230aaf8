"""The merge of kernels="staged": a handwritten CUDA C++ kernel and its Triton twin.

    forward   y[b,h,:] = ctx[b,h,:] + inv[b,:]              y in fp32 (the router reads it)
    backward  ∂ctx[b,h,:] = ∂y[b,h,:] (in ctx's dtype);  ∂inv[b,:] = Σ_h ∂y[b,h,:]
The backward sums h in order, one thread per (b, d), so ∂inv is bitwise reproducible (the
seed's fix: the pool's upstream gradient is this sum and nothing else).

The CUDA source is built on first use with torch.utils.cpp_extension.load_inline and cached
for the process (torch caches the build on disk too). Where that cannot happen (CPU tensors,
no nvcc or no host compiler) one warning on the "mha_compile" logger says why, and the Triton
twin below runs instead: same math, same order.
"""
import functools
import logging

import torch
import triton
import triton.language as tl

from mha_compile.kernels.triton_util import cdiv, launch, pow2

log = logging.getLogger("mha_compile")

_CPP_DECLS = """
torch::Tensor merge_forward(torch::Tensor ctx, torch::Tensor inv);
std::vector<torch::Tensor> merge_backward(torch::Tensor dy, torch::Tensor ctx_like);
"""

_CUDA_SRC = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

// y[b,h,d] = ctx[b,h,d] + inv[b,d]; a grid-stride loop over B·H·D with 64-bit indices.
template <typename T>
__global__ void merge_forward_kernel(const T* __restrict__ ctx, const float* __restrict__ inv,
                                     float* __restrict__ y, int64_t H, int64_t D, int64_t total) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t d = i % D;
    const int64_t b = i / (H * D);
    y[i] = static_cast<float>(ctx[i]) + inv[b * D + d];
  }
}

// One thread per (b, d): walks h = 0..H-1 in order, so the sum is reproducible; neighbouring
// threads take neighbouring d, so every load and store is coalesced.
template <typename T>
__global__ void merge_backward_kernel(const float* __restrict__ dy, T* __restrict__ dctx,
                                      float* __restrict__ dinv, int64_t H, int64_t D, int64_t BD) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < BD;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = i / D;
    const int64_t d = i % D;
    const int64_t base = b * H * D + d;
    float s = 0.f;
    for (int64_t h = 0; h < H; ++h) {
      const float v = dy[base + h * D];
      s += v;
      dctx[base + h * D] = static_cast<T>(v);
    }
    dinv[i] = s;
  }
}

static int blocks_for(int64_t n) {
  const int64_t b = (n + 255) / 256;
  return (int)std::min<int64_t>(b, 65535 * 8);
}

torch::Tensor merge_forward(torch::Tensor ctx, torch::Tensor inv) {
  TORCH_CHECK(ctx.is_cuda() && ctx.is_contiguous() && ctx.dim() == 3, "ctx: contiguous CUDA [B,H,D]");
  TORCH_CHECK(inv.scalar_type() == at::kFloat && inv.is_contiguous(), "inv: contiguous fp32 [B,D]");
  const c10::cuda::CUDAGuard guard(ctx.device());
  auto y = torch::empty(ctx.sizes(), ctx.options().dtype(at::kFloat));
  const int64_t H = ctx.size(1), D = ctx.size(2), total = ctx.numel();
  if (total == 0) return y;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ctx.scalar_type(), "merge_forward", [&] {
    merge_forward_kernel<scalar_t><<<blocks_for(total), 256, 0, stream>>>(
        ctx.data_ptr<scalar_t>(), inv.data_ptr<float>(), y.data_ptr<float>(), H, D, total);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

std::vector<torch::Tensor> merge_backward(torch::Tensor dy, torch::Tensor ctx_like) {
  TORCH_CHECK(dy.is_cuda() && dy.is_contiguous() && dy.dim() == 3 && dy.scalar_type() == at::kFloat,
              "dy: contiguous fp32 CUDA [B,H,D]");
  const c10::cuda::CUDAGuard guard(dy.device());
  const int64_t B = dy.size(0), H = dy.size(1), D = dy.size(2);
  auto dctx = torch::empty(dy.sizes(), dy.options().dtype(ctx_like.scalar_type()));
  auto dinv = torch::empty({B, D}, dy.options());
  if (B * D == 0) return {dctx, dinv};
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ctx_like.scalar_type(), "merge_backward", [&] {
    merge_backward_kernel<scalar_t><<<blocks_for(B * D), 256, 0, stream>>>(
        dy.data_ptr<float>(), dctx.data_ptr<scalar_t>(), dinv.data_ptr<float>(), H, D, B * D);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dctx, dinv};
}
"""


@functools.cache
def _extension():
    """The built CUDA module, or None (after one warning) when it cannot be built here."""
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        log.warning("mha_compile: no CUDA toolkit (nvcc) found; the staged merge uses its Triton twin")
        return None
    try:
        return cpp_extension.load_inline(
            name="mha_compile_merge", cpp_sources=_CPP_DECLS, cuda_sources=_CUDA_SRC,
            functions=["merge_forward", "merge_backward"], extra_cuda_cflags=["-O3"], verbose=False)
    except Exception as error:  # a missing host compiler, ninja, or a failed build
        log.warning("mha_compile: building the CUDA merge failed (%s); the staged merge uses its "
                    "Triton twin", str(error).splitlines()[0] if str(error) else type(error).__name__)
        return None


@functools.cache
def _warn_cpu_once():
    log.warning("mha_compile: the CUDA merge needs a CUDA device; on CPU the staged merge uses its "
                "Triton twin")


def cuda_merge_available(device):
    if device.type != "cuda":
        _warn_cpu_once()
        return False
    return _extension() is not None


# ---------------------------------------------------------------------------------------------
# The Triton twin.


@triton.jit
def _merge_fwd_kernel(ctx_ptr, inv_ptr, y_ptr, H, D, BLOCK_D: tl.constexpr):
    """One program per (row b·H+h, D block): y = ctx + inv[b] in fp32."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    x = tl.load(ctx_ptr + r * D + offs, mask=ok, other=0.0).to(tl.float32)
    x += tl.load(inv_ptr + (r // H) * D + offs, mask=ok, other=0.0)
    tl.store(y_ptr + r * D + offs, x, mask=ok)


@triton.jit
def _merge_bwd_kernel(dy_ptr, dctx_ptr, dinv_ptr, H, D, BLOCK_D: tl.constexpr):
    """One program per (b, D block): walks h in order, as the CUDA kernel does."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    s = tl.zeros([BLOCK_D], tl.float32)
    for h in range(0, H):
        p = (b * H + h) * D + offs
        v = tl.load(dy_ptr + p, mask=ok, other=0.0)
        s += v
        tl.store(dctx_ptr + p, v.to(dctx_ptr.dtype.element_ty), mask=ok)
    tl.store(dinv_ptr + b * D + offs, s, mask=ok)


def merge_forward(ctx, inv):
    """y [B,H,D] fp32 = ctx + inv[:, None]."""
    ctx = ctx.contiguous()
    inv = inv.float().contiguous()
    if cuda_merge_available(ctx.device):
        return _extension().merge_forward(ctx, inv)
    B, H, D = ctx.shape
    y = torch.empty(B, H, D, device=ctx.device, dtype=torch.float32)
    block = min(1024, pow2(D, lo=1))
    launch(_merge_fwd_kernel, (B * H, cdiv(D, block)), ctx, inv, y, H, D, BLOCK_D=block)
    return y


def merge_backward(dy, ctx_dtype):
    """(∂ctx [B,H,D] in ctx_dtype, ∂inv [B,D] fp32) from ∂y [B,H,D] fp32."""
    dy = dy.float().contiguous()
    if cuda_merge_available(dy.device):
        dctx, dinv = _extension().merge_backward(dy, torch.empty(0, dtype=ctx_dtype))
        return dctx, dinv
    B, H, D = dy.shape
    dctx = torch.empty(B, H, D, device=dy.device, dtype=ctx_dtype)
    dinv = torch.empty(B, D, device=dy.device, dtype=torch.float32)
    block = min(1024, pow2(D, lo=1))
    launch(_merge_bwd_kernel, (B, cdiv(D, block)), dy, dctx, dinv, H, D, BLOCK_D=block)
    return dctx, dinv
