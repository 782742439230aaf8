"""Host time of options step_graphs=True's own machinery in a training step, on any machine.

    PYTHONPATH=. python bench/step_graphs_host.py [--steps 2000] [--rounds 5]

The tiny block (SPEC §5) on the CPU, compiled with mode="reduce-overhead" and step_graphs=True,
its CUDA graphs replaced by a stub whose replays do nothing (mha_compile/step_graphs.py's
recorder interface), so that a step's time is what the host spends around the graphs: Dynamo's
guards, step_graphs' checks and copies, its autograd node, the loss, the autograd engine and
AccumulateGrad. Beside it, in the same process and interleaved by round, the least any graphed
step pays: the same loss and backward through a bare autograd.Function that returns a copy of a
fixed output and fixed gradients, called without Dynamo. Both are synchronous CPU work, so a host
clock times them. The H200's host runs at its own speed (bench/timing.py's host probe); compare
the difference, not the absolute times, with torch's runtime there (bench/PERF_NOTES.md v48).
"""
import argparse
import statistics
import time
from unittest import mock

import torch

from mha_compile import backend, models, step_graphs


class StubGraphs:
    """step_graphs' recorder with capture run once on the CPU and replays that do nothing
    (counted: a run that replayed nothing measured something else)."""

    replays = 0

    def __init__(self, device):
        pass

    @classmethod
    def replay(cls):
        cls.replays += 1

    @staticmethod
    def takes(t):
        return True

    def warm_up(self, forward, backward):
        pass

    def capture_forward(self, forward):
        return forward(), self.replay

    def capture_backward(self, backward, outputs):
        return backward(outputs), self.replay

    def before_replay(self):
        pass

    def synchronize(self):
        pass


class Bare(torch.autograd.Function):
    """A graphed step's least: a copy of a fixed output; fixed gradients for every parameter."""

    @staticmethod
    def forward(ctx, out, grads, *params):
        ctx.grads = grads
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *ctx.grads)


def step_time(fn, model, ctx, tok, steps):
    """Seconds a step: fn(ctx, tok)'s squared mean, backward, gradients set to None."""
    start = time.perf_counter()
    for _ in range(steps):
        fn(ctx, tok).square().mean().backward()
        for p in model.parameters():
            p.grad = None
    return (time.perf_counter() - start) / steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    size = models.PRESETS["tiny"]
    model = models.MHABlock(size["D"], size["P"], size["F"], size["E"], size["k"], act="gelu", renorm=True)
    ctx, tok = torch.randn(size["B"], size["H"], size["D"]), torch.randn(size["B"], size["N"], size["D"])
    with mock.patch.object(step_graphs, "CudaGraphs", StubGraphs), \
            mock.patch.object(backend, "_whole_graph_captured", lambda opts, mode, inputs: True):
        compiled = torch.compile(model, backend="mha", options={"mode": "reduce-overhead", "step_graphs": True})
        for _ in range(3):  # eager, capture, replay
            step_time(compiled, model, ctx, tok, 1)
        out = model(ctx, tok).detach()
        grads = [torch.randn_like(p) for p in model.parameters()]
        params = list(model.parameters())

        def bare(c, t):
            return Bare.apply(out, grads, *params)

        times = {"step_graphs": [], "bare Function": []}
        for _ in range(args.rounds):
            before = StubGraphs.replays
            times["step_graphs"].append(step_time(compiled, model, ctx, tok, args.steps))
            if StubGraphs.replays - before != 2 * args.steps:
                raise SystemExit(f"{StubGraphs.replays - before} replays in {args.steps} steps: the step did not "
                                 "replay through step_graphs, so this would time something else")
            times["bare Function"].append(step_time(bare, model, ctx, tok, args.steps))
    for name, values in times.items():
        print(f"{name:14s} {statistics.median(values) * 1e6:7.1f} us a step (rounds {min(values) * 1e6:.1f}-"
              f"{max(values) * 1e6:.1f})")
    extra = statistics.median(times["step_graphs"]) - statistics.median(times["bare Function"])
    print(f"step_graphs' own machinery: {extra * 1e6:.1f} us a step over the bare Function "
          f"({len(params)} parameters, torch {torch.__version__})")


if __name__ == "__main__":
    main()
