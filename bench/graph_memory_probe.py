"""Why memory_allocated grows across captured-then-cleared signatures (a diagnosis, H200).

    PYTHONPATH=.:tests/kernels python bench/graph_memory_probe.py

Runs test_captures_do_not_grow_memory_once_cleared's loop over more batch sizes, printing
memory_allocated after each, and the allocation stacks of the blocks alive at the end that were
not alive after the first signature (torch.cuda.memory._record_memory_history).
"""
import torch

from kernel_cases import make_case
from mha_compile import ops
from mha_compile.kernels import region_graphs

SHAPE = (33, 7, 47, 128, 4, 96, 5, 2)


def live_blocks():
    out = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                out[block["address"]] = block
    return out


def main():
    torch.cuda.memory._record_memory_history(max_entries=200000)
    _, _, params = make_case(*SHAPE, act="gelu", dtype=torch.bfloat16, device="cuda", seed=6)
    params = [None if p is None else p.requires_grad_() for p in params]
    base = None
    for batch in range(33, 43):
        ctx, tok, _ = make_case(batch, *SHAPE[1:], dtype=torch.bfloat16, device="cuda", seed=batch)
        for _ in range(3):
            c, t = ctx.clone().requires_grad_(), tok.clone().requires_grad_()
            out = ops.region_call(c, t, *params, None, 2, True, "gelu", "fused", False, graphs="on")[0]
            torch.autograd.grad(out, [c, t, *[p for p in params if p is not None]], torch.randn_like(out))
        del ctx, tok, c, t, out, _
        region_graphs.clear()
        torch.cuda.synchronize()
        print(f"batch {batch}: allocated {torch.cuda.memory_allocated()}", flush=True)
        if base is None:
            base = live_blocks()
    now = live_blocks()
    for addr, block in now.items():
        if addr not in base:
            frames = [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in block.get("frames", [])
                      if "python" in f["filename"] or f["filename"].endswith(".py")][:8]
            print(f"new live block {block['size']} B:", " <- ".join(frames) or block.get("frames", [])[:6])


if __name__ == "__main__":
    main()
