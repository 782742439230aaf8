"""A launch switch of triton_util off against on, in one process: a plain compiled training step (no
CUDA graphs, the region's own off too), host time and do_bench alternating.

    PYTHONPATH=. python bench/launch_ab.py [--flag FAST_LAUNCH] [--preset large] [--spelling loop] [--rounds 6] [--keep]

--flag: FAST_LAUNCH (launches keyed and their compiled kernels kept) or DIRECT_LAUNCH (a kept
launch calling Triton's launch function directly, with FAST_LAUNCH on).

Each round times both settings in turn (the order alternating, as bench/flag_ab.py does): the
host's time to issue `--steps` steps with no sync between them, then do_bench's median of the
step (what a table row reads). Host-bound rows move by up to 0.4 ms between processes (bench/
PERF_NOTES.md v29), so the switch is read within one process. The gradients of both settings are
compared first: the same kernels run, so they must be the same bits.
"""
import argparse
import statistics
import time

import torch
import triton.testing

from bench import cases, measure
from bench.flag_ab import summary
from mha_compile.kernels import triton_util

FLAGS = ("FAST_LAUNCH", "DIRECT_LAUNCH")  # triton_util's switches, read at launch time


def host_issue(step, steps):
    """ms of host time a step to issue `steps` steps back to back (the device drained first)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    issued = (time.perf_counter() - start) / steps * 1e3
    torch.cuda.synchronize()
    return issued


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--flag", default="FAST_LAUNCH", choices=FLAGS)
    parser.add_argument("--preset", default="large")
    parser.add_argument("--spelling", default="loop", choices=("dense", "loop"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="steps a host-time sample issues")
    parser.add_argument("--keep", action="store_true", help="compile with options keep_hidden=True")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/launch_ab.py times CUDA launches: it needs a CUDA GPU")
    model = cases.make_model(args.preset, args.spelling, "bf16", "cuda")
    ctx, tok, grad_out = cases.make_inputs(args.preset, "bf16", "cuda")
    ctx.requires_grad_(True)
    tok.requires_grad_(True)
    leaves = [ctx, tok, *model.parameters()]
    options = {"kernels": "fused", "graphs": "off", "keep_hidden": args.keep}
    fn = torch.compile(model, backend="mha", options=options, dynamic=False)
    step = measure.timed_step(fn, ctx, tok, grad_out, leaves, True)
    grads = {}
    for value in (False, True):
        setattr(triton_util, args.flag, value)
        for _ in range(3):
            step()
        grads[value] = [t.grad.clone() for t in leaves if t.grad is not None]
    same = len(grads[False]) == len(grads[True]) and all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    print(f"{args.preset} {args.spelling}{' keep_hidden' if args.keep else ''}: {args.flag} on against off, "
          f"{len(grads[True])} gradients, bitwise the same: {same}; launches kept: {len(triton_util._launches)}",
          flush=True)
    host, bench = {False: [], True: []}, {False: [], True: []}
    for r in range(args.rounds):
        for value in ((False, True) if r % 2 == 0 else (True, False)):
            setattr(triton_util, args.flag, value)
            host[value].append(host_issue(step, args.steps))
            bench[value].append(triton.testing.do_bench(step, warmup=10, rep=100, return_mode="median"))
        print(f"round {r}: off host {host[False][-1]:.3f} ms, do_bench {bench[False][-1]:.3f}; "
              f"on host {host[True][-1]:.3f}, do_bench {bench[True][-1]:.3f}", flush=True)
    print(f"host issue a step: {summary(host[False], host[True])}")
    print(f"do_bench: {summary(bench[False], bench[True])}")
    print(f"medians: host off {statistics.median(host[False]):.3f} on {statistics.median(host[True]):.3f} ms")


if __name__ == "__main__":
    main()
