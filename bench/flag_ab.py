"""A kernel switch's worth, off against on, in one process: the fused op's training step as CUDA
graph replays, the two graphs timed in turn.

    PYTHONPATH=. python bench/flag_ab.py --flag mha_compile.kernels.gluon_moe:WGRAD_STREAM \
        [--preset large] [--rounds 6]

The flag is a module attribute read at launch time (the kernel choice it makes is captured in
each graph). The same switch timed in two processes differed in sign from its kernels' sum
(session 22: STREAM's kernels −56 us a large step under the profiler, the replays +18 us apart in
two processes), so the replays alternate here, each round timing both, and the table gives every
round's medians and their median difference. Both graphs' gradients are compared first: a switch
must not change what the step computes beyond summation order.

A number (an int or float attribute, such as triton_moe.SLOT_CHUNK_BYTES) takes two values with
--values A,B, timed A against B as off against on:

    PYTHONPATH=. python bench/flag_ab.py --flag mha_compile.kernels.triton_moe:SLOT_CHUNK_BYTES \
        --values 536870912,67108864 --preset medium

Each value's line also gives the step's peak memory over what was allocated before it (its
eager warm-up and capture: torch.cuda.max_memory_allocated), which a run size moves.
"""
import argparse
import importlib
import statistics

import torch
import triton.testing

from kernel_times import graphed
from mha_compile import models, ops  # noqa: F401  (ops registers torch.ops.mha)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--flag", required=True, help="module:ATTRIBUTE, a bool (or with --values a number) "
                                                      "read at launch time")
    parser.add_argument("--values", default=None, help="A,B: two values of a number attribute, A timed as off, B as on")
    parser.add_argument("--preset", default="large")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    module_name, attr = args.flag.split(":")
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise SystemExit(f"--flag {args.flag}: {module_name} has no attribute {attr}")
    values = flag_values(args.flag, getattr(module, attr), args.values)
    p = models.PRESETS[args.preset]
    torch.manual_seed(0)
    block = models.MHABlock.from_preset(args.preset, spelling="dense").to("cuda", torch.bfloat16)
    params = list(models.block_parameters(block))
    ctx = torch.randn(p["B"], p["H"], p["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tok = torch.randn(p["B"], p["N"], p["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(ctx)
    leaves = [ctx, tok] + [t for t in params if t is not None]
    moe = block.moe

    def step():
        out = torch.ops.mha.region(ctx, tok, *params, None, moe.top_k, moe.renorm, moe.act, "fused")[0]
        out.backward(grad)

    graphs, grads = {}, {}
    for switch, value in zip((False, True), values):
        setattr(module, attr, value)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        graphs[switch] = graphed(step, leaves)
        if not isinstance(graphs[switch], torch.cuda.CUDAGraph):
            raise SystemExit(f"{attr}={value}: capture failed: {graphs[switch]}")
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        print(f"{args.preset}: {attr}={value} ({'on' if switch else 'off'}): the step's peak {peak:.0f} MiB "
              "over what was allocated before it (eager warm-up and capture)", flush=True)
        graphs[switch].replay()  # the capture left each .grad on this graph's output
        grads[switch] = [t.grad.float().clone() for t in leaves]
    worst = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(grads[True], grads[False]))
    print(f"{args.preset}: {attr} on against off, worst relative gradient difference {worst:.1e}", flush=True)
    times = {False: [], True: []}
    for r in range(args.rounds):
        for value in ((False, True) if r % 2 == 0 else (True, False)):
            times[value].append(triton.testing.do_bench(graphs[value].replay, warmup=25, rep=200,
                                                        return_mode="median"))
        print(f"round {r}: off {times[False][-1]:.4f} ms, on {times[True][-1]:.4f} ms", flush=True)
    print(f"{args.preset} {attr}: {summary(times[False], times[True])}")


def flag_values(flag, current, values):
    """(off, on): False, True for a bool attribute, or a switch whose None chooses by itself (such as
    triton_pool.SINGLE_PASS, by L2): its two ways forced; for an int or float one, the two values of
    `values` ("A,B") in its type. A clear error for anything else."""
    name = flag.replace(":", ".")
    if values is None:
        if current is not None and not isinstance(current, bool):
            raise SystemExit(f"--flag {flag}: {name} is not a bool attribute (a number takes --values A,B)")
        return False, True
    if isinstance(current, bool) or not isinstance(current, (int, float)):
        raise SystemExit(f"--values {values}: {name} is {type(current).__name__}, not an int or float attribute")
    parts = values.split(",")
    try:
        parsed = tuple(type(current)(part) for part in parts)
    except ValueError:
        parsed = ()
    if len(parsed) != 2 or len(parts) != 2:
        raise SystemExit(f"--values {values}: expected two {type(current).__name__} values A,B for {name}")
    return parsed


def summary(off, on):
    """The rounds' medians and differences (ms lists, round r timed off first when r is even), in
    words. The median of the differences is given for each order as well: in session 26 the graph
    timed second after the other one ran slower by up to 0.5 ms in some rounds, for one graph and
    not the other (bench/results/flag_ab_split_*.txt), so where the two orders disagree the
    smaller difference is the one to trust and the line says so."""
    diffs = [(b - a) * 1e3 for a, b in zip(off, on)]
    first, second = statistics.median(diffs[0::2]), statistics.median(diffs[1::2] or diffs[0::2])
    text = (f"off {statistics.median(off):.4f} ms, on {statistics.median(on):.4f} ms, median of rounds' "
            f"on − off {statistics.median(diffs):+.1f} us (off timed first {first:+.1f}, on first {second:+.1f})")
    if abs(first - second) > max(abs(first), abs(second)) / 2:
        text += f"; the orders disagree: read {min(first, second, key=abs):+.1f} us"
    return text


if __name__ == "__main__":
    main()
