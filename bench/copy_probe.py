"""What the step graphs' input copies cost alone: a moved ctx [B,H,D] (and ∂out, the same shape)
copied into the graphs' static inputs, by copy_ against _foreach_copy_ (region_graphs.copy_pairs,
which the replays call). Session 59's batch-ab on the H200 read +88-102 us a large step for the
second batch's ctx (64 MiB), where its bytes alone take ~30 us at 4.3 TB/s.

    PYTHONPATH=. python bench/copy_probe.py [--presets large,medium]

Each time is triton.testing.do_bench's median on random (not zero) values; GB/s counts the read
and the write."""
import argparse

import torch
import triton

from mha_compile.kernels import region_graphs
from mha_compile.models import PRESETS


def probe(preset):
    p = PRESETS[preset]
    shape = (p["B"], p["H"], p["D"])
    srcs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    dsts = [torch.empty_like(s) for s in srcs]
    nbytes = srcs[0].numel() * srcs[0].element_size()
    ways = {
        "copy_, one tensor": (lambda: dsts[0].copy_(srcs[0]), 1),
        "_foreach_copy_, one tensor": (lambda: torch._foreach_copy_(dsts[:1], srcs[:1]), 1),
        "copy_pairs, one tensor (the replays')": (lambda: region_graphs.copy_pairs([(dsts[0], srcs[0])]), 1),
        "copy_pairs, two tensors": (lambda: region_graphs.copy_pairs(list(zip(dsts, srcs))), 2),
        "copy_ each of two tensors": (lambda: [d.copy_(s) for d, s in zip(dsts, srcs)], 2),
    }
    print(f"\n{preset}: ctx {list(shape)} bf16, {nbytes / 2 ** 20:.0f} MiB a tensor", flush=True)
    for name, (run, count) in ways.items():
        ms = triton.testing.do_bench(run, warmup=25, rep=200)
        print(f"  {name:<40} {ms * 1e3:8.1f} us  {2 * count * nbytes / ms / 1e6:7.0f} GB/s", flush=True)
        for d, s in zip(dsts[:count], srcs[:count]):
            if not torch.equal(d, s):
                raise SystemExit(f"copy_probe: {name} left a copy unequal to its source")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="large,medium")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("copy_probe: needs a CUDA device")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for preset in args.presets.split(","):
        probe(preset)


if __name__ == "__main__":
    main()
