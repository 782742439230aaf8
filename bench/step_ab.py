"""Two trees' training steps, side by side on one host: what a host-time change is worth.

    python bench/step_ab.py --trees /tmp/old,/tmp/new [--preset large] [--rounds 3] [--options graphs=off]

A plain compiled step at large is host-bound, and the H200s' hosts differ by up to 30% (the same
kernels' plain large step: 6.35 ms on one, 7.77 on another, session 16), so a change to host
time can be read only against the tree before it on the same host. Each round runs every tree
once, in turn, each in a fresh process (one package name per process) that imports mha_compile
from its tree, compiles `torch.compile(block, backend="mha")` (dense spelling, bf16 on CUDA,
fp32 on the CPU) and prints the median time of a forward+backward (bench/timing.median_ms:
triton.testing.do_bench on CUDA). Rounds alternate the trees so that a drift of the host (clocks,
other tenants) falls on both. A tree is a directory holding mha_compile/ (a checkout, or a tar
of one extracted: the device copies' .git can lag the tree).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

STEP = """
import json, sys
tree, preset, options, device = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
sys.path[:0] = [tree, tree + "/bench"]
import torch
import mha_compile
from mha_compile import models
from timing import median_ms
assert mha_compile.__file__.startswith(tree), f"mha_compile came from {mha_compile.__file__}, not {tree}"
torch.manual_seed(0)
p = models.PRESETS[preset]
dtype = torch.bfloat16 if device == "cuda" else torch.float32
block = models.MHABlock.from_preset(preset, spelling="dense").to(device, dtype)
ctx = torch.randn(p["B"], p["H"], p["D"], device=device, dtype=dtype, requires_grad=True)
tok = torch.randn(p["B"], p["N"], p["D"], device=device, dtype=dtype, requires_grad=True)
grad = torch.randn(p["B"], p["H"], p["D"], device=device, dtype=dtype)
leaves = [ctx, tok, *block.parameters()]
compiled = torch.compile(block, backend="mha", options={"kernels": "fused", **options})
step = lambda: compiled(ctx, tok).backward(grad)
for _ in range(3):
    step()
print(json.dumps({"ms": median_ms(step, device, grad_to_none=leaves)}))
"""


def run_step(tree, preset, options, device, python=sys.executable):
    """One fresh process's median step time (ms) for the tree."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([python, "-c", STEP, os.path.abspath(tree), preset, json.dumps(options), device],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"step_ab: the step in {tree} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["ms"]


def compare(trees, preset, rounds, options, device):
    """{tree: [ms a round]}, the trees run in turn each round."""
    times = {tree: [] for tree in trees}
    for r in range(rounds):
        for tree in trees:
            times[tree].append(run_step(tree, preset, options, device))
            print(f"round {r + 1}: {tree} {times[tree][-1]:.3f} ms", flush=True)
    return times


def parse_options(items):
    """["graphs=off"] -> {"graphs": "off"} (the backend's options; values as strings)."""
    pairs = [item.split("=", 1) for item in items]
    bad = [item for item, pair in zip(items, pairs) if len(pair) != 2]
    if bad:
        raise SystemExit(f"step_ab: --options takes key=value, got {bad}")
    return dict(pairs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", required=True, help="comma-separated directories, each holding mha_compile/")
    parser.add_argument("--preset", default="large")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--options", nargs="*", default=[], help="backend options, key=value")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    trees = args.trees.split(",")
    missing = [t for t in trees if not os.path.isdir(os.path.join(t, "mha_compile"))]
    if missing or len(trees) < 2 or args.rounds < 1:
        raise SystemExit(f"step_ab: needs two or more trees holding mha_compile/ and rounds ≥ 1; "
                         f"not trees: {missing}, rounds {args.rounds}")
    times = compare(trees, args.preset, args.rounds, parse_options(args.options), args.device)
    base = statistics.median(times[trees[0]])
    for tree in trees:
        mid = statistics.median(times[tree])
        print(f"{tree}: median {mid:.3f} ms over {args.rounds} rounds ({mid / base:.3f}x the first tree); "
              f"rounds {' '.join(f'{t:.3f}' for t in times[tree])}")


if __name__ == "__main__":
    main()
