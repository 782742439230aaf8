"""The host's share of one fused forward and backward at a preset, counted without a GPU: every
torch op the region calls and every Triton or Gluon kernel it launches, torch's ops named by the
line of mha_compile that called them.

    PYTHONPATH=. python bench/offline_calls.py [--presets large] [--act gelu] [--no-gluon] [--views] [--out calls.json]

Each torch call costs ~10-25 us of the H200's host and each launch ~15-25 (bench/PERF_NOTES.md
v15, v16), and the plain large rows are host-bound on a slow host (v35): this says what a change
adds or takes away, call by call, before any device time is spent on timing it. It runs as
bench/offline_memory.py does, on meta tensors taken for an H200's (offline_sass.as_h200: launches
recorded, not run), with the Gluon kernels taken where the H200 takes them (--no-gluon: the
Triton ones). Views (view, slice, select, transpose, ...: a few us each, no kernel) are counted
apart and listed only with --views.
"""
import argparse
import collections
import json

import torch
from tabulate import tabulate
from torch.utils._python_dispatch import TorchDispatchMode

from bench.offline_memory import call_site
from bench.offline_sass import as_h200, meta_case
from mha_compile.kernels import triton_region, triton_util


def is_view(func):
    """Whether an aten op only makes views: every return aliases an input without writing it
    (in-place ops such as add_ write theirs, and count as calls)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class CallCount(TorchDispatchMode):
    """Torch's calls as the dispatcher sees them: [(op, site, view)] in order."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func.__name__, call_site(func), is_view(func)))
        return func(*args, **(kwargs or {}))


def step_calls(preset, act, gluon=True):
    """{"forward": (torch calls, launches), "backward": (...)} of one fused forward and backward at
    `preset`: torch calls as CallCount's, launches as kernel names in order."""
    launches = []
    with as_h200(launches, gluon):
        ctx, tok, params, k, renorm = meta_case(preset, act)
        with CallCount() as forward:
            out, *saved = triton_region.region_forward("on_load", ctx, tok, *params, None, k, renorm, act)
        n = len(launches)
        with CallCount() as backward:
            triton_region.region_backward("on_load", torch.empty_like(out), ctx, tok, *params, None, *saved, k,
                                          renorm, act)
    names = [kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__ for kernel, *_ in launches]
    return {"forward": (forward.calls, names[:n]), "backward": (backward.calls, names[n:])}


def report(preset, steps, views=False):
    """The per-pass totals, then each site's calls (and each kernel's launches), most first."""
    lines = []
    for name, (calls, launches) in steps.items():
        n_views = sum(view for *_, view in calls)
        lines.append(f"{preset} {name}: {len(launches)} launches, {len(calls) - n_views} torch calls, "
                     f"{n_views} views")
    rows = collections.Counter((name, site) for name, (calls, _) in steps.items()
                               for _, site, view in calls if views or not view)
    rows.update((name, f"launch {kernel}") for name, (_, launches) in steps.items() for kernel in launches)
    table = [(count, name, site) for (name, site), count in sorted(rows.items(), key=lambda item: -item[1])]
    return "\n".join(lines) + "\n" + tabulate(table, headers=["calls", "pass", "what (torch op at the line of "
                                                                             "mha_compile, or a launch)"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="large")
    parser.add_argument("--act", default="gelu")
    parser.add_argument("--no-gluon", action="store_true", help="the Triton kernels where the H200 takes Gluon")
    parser.add_argument("--views", action="store_true", help="list the views too (counted either way)")
    parser.add_argument("--out", default=None, help="JSON: per preset and pass, the calls and the launches")
    args = parser.parse_args()
    if triton_util.interpreting():
        raise SystemExit("bench/offline_calls.py records GPU launches: run it without TRITON_INTERPRET=1")
    found = {}
    for preset in args.presets.split(","):
        steps = step_calls(preset, args.act, gluon=not args.no_gluon)
        print(report(preset, steps, args.views))
        found[preset] = {name: {"calls": [list(c) for c in calls], "launches": launches}
                         for name, (calls, launches) in steps.items()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
