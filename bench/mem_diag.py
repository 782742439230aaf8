"""What a compiled training step leaves allocated on the GPU once its steps are done, by allocation
site (torch.cuda.memory's history) and in all, for backend="mha" with its graphs off and for
Inductor, on the dense block. GPU only.

    PYTHONPATH=. python bench/mem_diag.py [--presets small,medium] [--modes mha-fused-nographs,inductor]

Session 28 (bench/results/mem_diag.txt): the table's small and medium rows of ours started from
~64 MiB more allocated than the peers'; this named them: two cuBLAS workspaces (32 MiB each, the
first torch.bmm of the forward's thread and of the autograd thread), which stay for the process.
Session 53 found the bench's own fp32 reference making two more (bench/measure.py now frees them
between rows); C++ frames are recorded, so a site in cuBLAS shows as `setWorkspaceForHandle`.
"""
import argparse
import collections
import gc

import torch

from bench import cases, measure, modes

FRAMES = ("mha_compile", "triton", "bench", "_inductor", "_dynamo")  # the frames a site is named by


def left_allocated(preset, mode, steps=3):
    """Prints what stays allocated after `steps` training steps of `mode` at `preset` (gradients
    dropped), by allocation site, largest first."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="all")  # C++ frames: cuBLAS's
    start = torch.cuda.memory_allocated()
    model = cases.make_model(preset, "dense", "bf16", "cuda")
    ctx, tok, grad = cases.make_inputs(preset, "bf16", "cuda")
    leaves = [ctx.requires_grad_(True), tok.requires_grad_(True), *model.parameters()]
    made = torch.cuda.memory_allocated()
    step = measure.timed_step(modes.build(mode, model), ctx, tok, grad, leaves, True)
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    gc.collect()
    after = torch.cuda.memory_allocated()
    print(f"\n{preset} {mode}: allocated at start {start / 2**20:.1f} MiB, with the model and inputs "
          f"{made / 2**20:.1f}, after {steps} steps (grads dropped) {after / 2**20:.1f}", flush=True)
    sites = collections.Counter()
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                frames = block.get("frames") or []
                ours = [f"{f['name'][:60]}:{f['filename'].split('/')[-1]}:{f['line']}" for f in frames
                        if any(k in f["filename"] for k in FRAMES) or "Blas" in f["name"]]
                sites[" < ".join(ours[:6]) or (frames[0]["name"] if frames else "?")] += block["size"]
    for site, size in sites.most_common(12):
        print(f"  {size / 2**20:8.2f} MiB  {site[:400]}", flush=True)
    torch.cuda.memory._record_memory_history(enabled=None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="small,medium")
    parser.add_argument("--modes", default="mha-fused-nographs,inductor")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/mem_diag.py reads the CUDA allocator: it needs a GPU")
    for preset in args.presets.split(","):
        for mode in args.modes.split(","):
            left_allocated(preset, mode)


if __name__ == "__main__":
    main()
