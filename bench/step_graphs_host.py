"""Host time of options step_graphs=True's own machinery in a training step, on any machine.

    PYTHONPATH=. python bench/step_graphs_host.py [--steps 2000] [--rounds 5]

The tiny block (SPEC §5) on the CPU, compiled with mode="reduce-overhead" and step_graphs=True,
its CUDA graphs replaced by a stub whose replays do nothing (mha_compile/step_graphs.py's
recorder interface), so that a step's time is what the host spends around the graphs: Dynamo's
guards, step_graphs' checks and copies, its autograd node, the loss, the autograd engine and
AccumulateGrad. Beside it, in the same process and interleaved by round: the step graphs called
directly with the inputs Dynamo handed them (no Dynamo frame), their autograd node applied
directly (no checks before it), and the least any graphed step pays: the same loss and backward
through a bare autograd.Function that returns a copy of a fixed output and fixed gradients,
called without Dynamo. The differences split the step: Dynamo's frame, step_graphs' checks, its
node's forward and backward. All are synchronous CPU work, so a host clock times them. Session
53 on this project's 2-core CPU: 61, 19 and 28 us, over 134 of the bare Function. The H200's host
runs at its own speed (bench/timing.py's host probe); compare the difference, not the absolute
times, with torch's runtime there (bench/PERF_NOTES.md v48).
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
    """A graphed step's least: a copy of a fixed output; fixed gradients for every parameter, as
    views (detached) that AccumulateGrad takes as .grad with no copy, as it takes step_graphs'."""

    @staticmethod
    def forward(ctx, out, grads, *params):
        ctx.grads = grads
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *[g.detach() for g in ctx.grads])


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
    seen = {}
    called = step_graphs.StepGraphs.__call__

    def spy(self, *flat):  # the step graphs and the inputs Dynamo hands them, for the direct calls
        seen["graphs"], seen["args"] = self, flat
        return called(self, *flat)

    with mock.patch.object(step_graphs, "CudaGraphs", StubGraphs), \
            mock.patch.object(backend, "_whole_graph_captured", lambda opts, mode, inputs: True):
        compiled = torch.compile(model, backend="mha", options={"mode": "reduce-overhead", "step_graphs": True})
        with mock.patch.object(step_graphs.StepGraphs, "__call__", spy):
            for _ in range(3):  # eager, capture, replay
                step_time(compiled, model, ctx, tok, 1)
        out = model(ctx, tok).detach()
        grads = [torch.randn_like(p) for p in model.parameters()]
        params = list(model.parameters())
        if "graphs" not in seen:
            raise SystemExit("0 replays: the step did not replay through step_graphs, so this would time "
                             "something else")
        graphs, flat = seen["graphs"], seen["args"]
        entry = graphs.entries.get(True, [None])[0]
        # each way's callable and whether it replays (2 replays a step)
        ways = {"compiled": (compiled, True),
                "step graphs called": (lambda c, t: graphs(*flat)[0], True),
                "_Replay.apply": (lambda c, t: step_graphs._Replay.apply(entry, *flat)[0], True),
                "bare Function": (lambda c, t: Bare.apply(out, grads, *params), False)}
        times = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, (fn, replays) in ways.items():
                before = StubGraphs.replays
                times[name].append(step_time(fn, model, ctx, tok, args.steps))
                if replays and StubGraphs.replays - before != 2 * args.steps:
                    raise SystemExit(f"{StubGraphs.replays - before} replays in {args.steps} steps ({name}): the step "
                                     "did not replay through step_graphs, so this would time something else")
    medians = {name: statistics.median(values) * 1e6 for name, values in times.items()}
    for name, values in times.items():
        print(f"{name:19s} {medians[name]:7.1f} us a step (rounds {min(values) * 1e6:.1f}-{max(values) * 1e6:.1f})")
    print(f"Dynamo's frame (compiled - step graphs called): {medians['compiled'] - medians['step graphs called']:.1f} "
          f"us; step_graphs' checks (called - _Replay.apply): "
          f"{medians['step graphs called'] - medians['_Replay.apply']:.1f} us; its autograd node over the bare "
          f"Function: {medians['_Replay.apply'] - medians['bare Function']:.1f} us")
    print(f"step_graphs' own machinery: {medians['step graphs called'] - medians['bare Function']:.1f} us a step over "
          f"the bare Function ({len(params)} parameters, torch {torch.__version__})")


if __name__ == "__main__":
    main()
