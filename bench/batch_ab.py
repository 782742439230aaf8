"""What the batch's copy-in costs our reduce-overhead rows: one batch every step against two at
different addresses taken in turn (what the bench times since session 55), side by side.

    PYTHONPATH=. python bench/batch_ab.py [--presets medium,large] [--modes mha-fused-cudagraphs,mha-fused-keep]

mha_compile's step graphs read an input in place where it sits where the first call had it, and
copy it into their own memory otherwise. On one batch every step they skipped the copy that
torch's CUDA-graph trees pay on every replay, so every table before session 55 timed our rows a
little fast; session 55 estimated the difference from bytes (~20 us a medium step, ~35 at
large). This measures it, per (preset, mode), bf16 on CUDA (fp32 on the CPU), with the bench's
model, inputs and step (bench/measure.timed_step): one way on the batch alone, the other
alternating it with a copy, each its own model and compiled step (a step graph that met a
moved input captures again with it copied, and would copy for the one-batch way too after),
interleaved by round. On CUDA each time is triton.testing.do_bench's median and mean over the
calls (alternating calls mix two kinds: the median the bench reads and the mean can differ); on
the CPU bench/timing's median. Each way's bytes copied into the step graphs a step are counted
(`copied in`): the two ways must differ by the inputs the graphs take, or the gap measured
something else.
"""
import argparse
import statistics
from unittest import mock

import torch

from bench import cases, modes, timing
from bench.measure import timed_step
from mha_compile.kernels import region_graphs

WAYS = ("one batch", "two batches")


def _times_ms(step, device, leaves):
    """(median, mean) in ms: do_bench's over its calls on CUDA, the CPU timer's median twice."""
    if device != "cuda":
        median = timing.median_ms(step, device, grad_to_none=leaves)
        return median, median
    import triton.testing

    times = triton.testing.do_bench(step, warmup=timing.CUDA_WARMUP_MS, rep=timing.CUDA_REP_MS,
                                    grad_to_none=leaves, return_mode="all")
    return statistics.median(times), statistics.fmean(times)


def copied_in_bytes(step):
    """Bytes one call of step() copies through region_graphs.copy_pairs (the step graphs' inputs
    and ∂out; torch's trees copy their own way and count 0 here)."""
    copied = []
    copy_pairs = region_graphs.copy_pairs

    def counted(pairs):
        copied.extend(src.numel() * src.element_size() for _, src in pairs)
        copy_pairs(pairs)
    with mock.patch.object(region_graphs, "copy_pairs", counted):
        step()
    return sum(copied)


def measure(preset, mode, device, rounds):
    """({way: [(median, mean) per round]}, {way: bytes copied in a step}) for `mode`'s training
    step at `preset`, each way on a model and a compiled step of its own."""
    dtype = "bf16" if device == "cuda" else "fp32"
    torch._dynamo.reset()
    steps, leaves = {}, []
    for way in WAYS:
        model = cases.make_model(preset, "dense", dtype, device)
        # A class of its own a way: Dynamo serves one compiled graph (so one set of step graphs)
        # to every instance of a class, and the first call of the two-batch way, parameters at
        # other addresses, would capture it again with everything copied for both ways.
        model.__class__ = type(f"{type(model).__name__}_{way.replace(' ', '_')}", (type(model),), {})
        ctx, tok, grad_out = cases.make_inputs(preset, dtype, device)
        other = (ctx.clone(), tok.clone()) if way == WAYS[1] else None
        for t in (ctx, tok, *(other or ())):
            t.requires_grad_(True)
        way_leaves = [ctx, tok, *(other or ()), *model.parameters()]
        steps[way] = timed_step(modes.build(mode, model), ctx, tok, grad_out, way_leaves, True, other)
        leaves += way_leaves
        for _ in range(4):  # the compile and first call (eager), the capture, a replay of each batch
            steps[way]()
    copied = {way: copied_in_bytes(step) for way, step in steps.items()}
    timing.synchronize(device)
    times = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way, step in steps.items():
            times[way].append(_times_ms(step, device, leaves))
    return times, copied


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="medium,large")
    parser.add_argument("--modes", default="mha-fused-cudagraphs,mha-fused-keep")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    print(f"{'preset':<8} {'mode':<22} {'way':<12} {'copied in':>10}  {'median ms by round':<28} "
          f"{'mean ms by round':<28}")
    for preset in args.presets.split(","):
        for mode in args.modes.split(","):
            times, copied = measure(preset, mode, device, args.rounds)
            for way in WAYS:
                medians = " ".join(f"{m:.4f}" for m, _ in times[way])
                means = " ".join(f"{m:.4f}" for _, m in times[way])
                print(f"{preset:<8} {mode:<22} {way:<12} {copied[way] / 2**20:>6.2f} MiB  {medians:<28} {means:<28}",
                      flush=True)
            gap = [1e3 * (two[0] - one[0]) for one, two in zip(times[WAYS[0]], times[WAYS[1]])]
            print(f"{preset:<8} {mode:<22} two − one, median: {statistics.median(gap):+.1f} us "
                  f"(rounds {' '.join(f'{g:+.1f}' for g in gap)})", flush=True)


if __name__ == "__main__":
    main()
