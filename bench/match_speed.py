"""Compile time the mha backend adds: python -m bench.match_speed

Method: capture each model's FX graph once with Dynamo (a backend that only records the graph),
then time `mha_compile.backend.lower` on it, which is all the backend adds before running the
graph (find_regions on the original, copy, find_regions on the copy, choose kernels, rewrite).
Median of 5 runs, time.perf_counter, CPU, one thread of Python. Also reported: the end-to-end
first-call time with backend="mha" minus backend="eager" (noisier: it includes Dynamo's own
tracing, which both pay).

Models: the forecaster (mha_compile.models.Forecaster) and a graph of about 5,000 nodes: a stack
of MHA blocks in several spellings with filler layers (linear, layer norm, gelu) between them.
Budget (issue 5): 0.5 s for the forecaster, 2 s for 5,000 nodes.
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "lowering"))
from spellings import SpelledBlock  # noqa: E402

from mha_compile import backend, models  # noqa: E402
from mha_compile.debug.report import GraphReport  # noqa: E402
from mha_compile.options import Options  # noqa: E402


class Deep(nn.Module):
    """Blocks in a row, `filler` small layers between them, to reach a target node count."""

    def __init__(self, blocks, filler):
        super().__init__()
        spellings = [dict(pool="einsum", moe="loop"), dict(pool="sdpa", moe="dense_onehot"),
                     dict(pool="mha", moe="loop", experts="modules"), dict(pool="matmul", moe="gathered")]
        self.blocks = nn.ModuleList(SpelledBlock(**spellings[i % len(spellings)]) for i in range(blocks))
        self.filler = nn.ModuleList(nn.ModuleList(nn.Linear(32, 32) for _ in range(filler)) for _ in range(blocks))
        self.norm = nn.LayerNorm(32)

    def forward(self, ctx, tok):
        for block, layers in zip(self.blocks, self.filler):
            for layer in layers:
                ctx = self.norm(torch.nn.functional.gelu(layer(ctx))) + ctx
            ctx = block(ctx, tok)
        return ctx


def capture(model, *inputs):
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(cache_size_limit=64):
        torch.compile(model, backend=grab)(*inputs)
    return graphs


def time_lower(graphs, repeats=5):
    opts = Options.parse(None)
    times, matches = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        matches = 0
        for gm in graphs:
            report = GraphReport(0)
            backend.lower(gm, opts, report)
            matches += len(report.matches)
        times.append(time.perf_counter() - start)
    return statistics.median(times), matches


def time_end_to_end(model, inputs):
    out = {}
    for name in ("eager", "mha"):
        torch._dynamo.reset()
        start = time.perf_counter()
        torch.compile(model, backend=name)(*inputs)
        out[name] = time.perf_counter() - start
    return out["mha"] - out["eager"]


def main():
    rows = []
    forecaster = models.Forecaster(window=12, variates=5, horizons=3)
    cases = [("forecaster", forecaster, (torch.randn(4, 12, 5),), 0.5),
             ("deep-5000", Deep(blocks=16, filler=50), (torch.randn(4, 3, 32), torch.randn(4, 5, 32)), 2.0)]
    for name, model, inputs, budget in cases:
        graphs = capture(model, *inputs)
        nodes = sum(len(gm.graph.nodes) for gm in graphs)
        seconds, matches = time_lower(graphs)
        added = time_end_to_end(model, inputs)
        rows.append({"model": name, "graphs": len(graphs), "nodes": nodes, "matches": matches,
                     "lower_s": round(seconds, 4), "end_to_end_added_s": round(added, 3), "budget_s": budget,
                     "ok": seconds < budget})
    for row in rows:
        print(json.dumps(row))
    print(f"\n{'model':<12} {'nodes':>6} {'matches':>7} {'lower (s)':>10} {'e2e added (s)':>14} {'budget':>7}")
    for r in rows:
        print(f"{r['model']:<12} {r['nodes']:>6} {r['matches']:>7} {r['lower_s']:>10.4f} {r['end_to_end_added_s']:>14.3f} {r['budget_s']:>7}")


if __name__ == "__main__":
    main()
