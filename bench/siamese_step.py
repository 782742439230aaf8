"""A training step with two forwards before one backward (a siamese pair, two micro-batches),
under mode="reduce-overhead": the step graphs at two depths, the step graphs with MAX_PENDING = 1
(the second forward eager, as every such call was before session 53) and torch's CUDA-graph trees.

    PYTHONPATH=. python bench/siamese_step.py [--presets small,medium] [--rounds 3]

bf16 on CUDA, the dense spelling. A step: both forwards on inputs of their own, then one backward
of both outputs (a fixed ∂out), gradients set to None first; timed as the bench times a row
(triton.testing.do_bench's median), the ways interleaved by round; peak memory over one step as
the bench reads it (bench/timing.peak_memory_call: CUDA-graph pools' free space included). Each
way's step-graph forward replays are counted during its timing: 2 a step at two depths, 1 with
MAX_PENDING = 1, 0 on the trees, or the script stops (a fallback would time something else).
"""
import argparse
import statistics
from unittest import mock

import torch
import triton.testing

from bench import cases, timing
from mha_compile import step_graphs

WAYS = {"step graphs, 2 depths": ({}, 4, 2), "step graphs, MAX_PENDING=1": ({}, 1, 1),
        "trees": ({"step_graphs": False}, 4, 0)}  # name: (options, MAX_PENDING, forward replays a step)


def needs_gpu():
    if not torch.cuda.is_available():
        raise SystemExit("bench/siamese_step.py times CUDA graphs: it needs a GPU")


def siamese_step(fn, inputs, grad_out, params):
    def step():
        torch.compiler.cudagraph_mark_step_begin()
        for p in params:
            p.grad = None
        outs = [fn(ctx, tok) for ctx, tok in inputs]
        torch.autograd.backward(outs, [grad_out] * len(outs))
    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="small,medium")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    needs_gpu()
    replays = {"n": 0}
    real_forward = step_graphs._Step.forward

    def counted(self, *a, **k):
        replays["n"] += 1
        return real_forward(self, *a, **k)

    for preset in args.presets.split(","):
        torch.manual_seed(0)
        model = cases.make_model(preset, "dense", "bf16", "cuda")
        ctx, tok, grad_out = cases.make_inputs(preset, "bf16", "cuda")
        inputs = [(ctx, tok), (torch.randn_like(ctx), torch.randn_like(tok))]  # the pair's second, its own values
        params = list(model.parameters())
        torch._dynamo.reset()
        steps = {}
        for name, (options, _, _) in WAYS.items():
            # a compiled object a way, each with its own options: Dynamo keeps a graph for each
            steps[name] = siamese_step(torch.compile(model, backend="mha", dynamic=False,
                                                     options={"mode": "reduce-overhead", **options}),
                                       inputs, grad_out, params)
        times, peaks = {name: [] for name in WAYS}, {}
        with mock.patch.object(step_graphs._Step, "forward", counted):
            for _ in range(args.rounds):
                for name, (_, max_pending, per_step) in WAYS.items():
                    with mock.patch.object(step_graphs, "MAX_PENDING", max_pending):
                        for _ in range(3):  # eager, capture, replay
                            steps[name]()
                        torch.cuda.synchronize()
                        replays["n"], calls = 0, {"n": 0}

                        def counted_step(step=steps[name]):
                            calls["n"] += 1
                            step()

                        times[name].append(triton.testing.do_bench(counted_step, warmup=25, rep=200,
                                                                   return_mode="median"))
                        if replays["n"] != per_step * calls["n"]:
                            raise SystemExit(f"{preset} {name}: {replays['n']} forward replays in {calls['n']} "
                                             f"steps, not {per_step} a step: it timed another path")
                        _, peak, _, pools = timing.peak_memory_call(steps[name], "cuda")
                        peaks[name] = peak, pools
        for name, values in times.items():
            print(f"{preset:7s} {name:28s} {statistics.median(values):7.3f} ms (rounds {min(values):.3f}-"
                  f"{max(values):.3f})  peak {peaks[name][0]:7.0f} MiB ({peaks[name][1]:.0f} of it CUDA-graph pools)")


if __name__ == "__main__":
    main()
