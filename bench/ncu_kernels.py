"""One fused training step's Triton kernels under Nsight Compute: what limits each (throughput
against the SM's and memory's peaks, L2 and DRAM traffic, warp stalls, occupancy).

    PYTHONPATH=. ncu --clock-control none --profile-from-start off -k regex:_moe_ \\
        --section SpeedOfLight ... python bench/ncu_kernels.py [--preset large]

(`bash bench/h200_session.sh ncu` runs it with its sections). The step (the fused kernel set's
region_forward and region_backward, bf16, gelu, the preset's block with random inputs) runs
twice first, which compiles and autotunes every kernel; the third step runs between
cudaProfilerStart and cudaProfilerStop, so ncu profiles each launch of that step once, with the
configs the autotuner chose. Off the GPU (TRITON_INTERPRET=1) it runs the same steps at the
tiny preset, without the profiler calls.
"""
import argparse

import torch

from mha_compile import models
from mha_compile.kernels import fused


def step_inputs(preset, device, dtype):
    """(region_forward's arguments, the block's top_k, renorm and act, ∂out) for a preset."""
    torch.manual_seed(0)
    p = models.PRESETS[preset]
    block = models.MHABlock.from_preset(preset, spelling="dense").to(device, dtype)
    params = [None if t is None else t.detach() for t in models.block_parameters(block)]
    ctx = torch.randn(p["B"], p["H"], p["D"], device=device, dtype=dtype)
    tok = torch.randn(p["B"], p["N"], p["D"], device=device, dtype=dtype)
    grad = torch.randn_like(ctx)
    moe = block.moe
    return [ctx, tok, *params, None], (moe.top_k, moe.renorm, moe.act), grad


def step(args, statics, grad):
    out, *saved = fused.region_forward(*args, *statics)
    return fused.region_backward(grad, *args, *saved, *statics)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="large")
    opts = parser.parse_args()
    cuda = torch.cuda.is_available()
    preset = opts.preset if cuda else "tiny"
    args, statics, grad = step_inputs(preset, "cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
    for _ in range(2):  # compile and autotune everything outside the profiled range
        step(args, statics, grad)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    grads = step(args, statics, grad)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"ncu_kernels: one {preset} step profiled, {sum(g is not None for g in grads)} gradients")
    return grads


if __name__ == "__main__":
    main()
