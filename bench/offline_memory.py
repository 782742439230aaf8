"""Where the fused region's training step peaks in memory at a preset, from shapes alone (no GPU).

    PYTHONPATH=. python bench/offline_memory.py [--presets large] [--act gelu] [--top 12] [--out peaks.json]
        [--slot-chunk-mb 512,64] [--hidden-columns 0,256]

The step is the benchmark's (bench/measure.py): inputs, parameters and ∂out allocated, the
forward kept until the backward has run, and the gradients kept as .grad. It runs on meta
tensors taken for an H200's (offline_sass.as_h200: Triton launches are recorded, not run), and
every aten op's output that owns new memory (not a view, not an in-place result) is counted
from its allocation until Python frees it. The report gives the peak, the op that reached it,
and the tensors alive there, each named by the op and the line of mha_compile that made it.

--slot-chunk-mb gives the MoE's run sizes to try (triton_moe.SLOT_CHUNK_BYTES, as
MHA_COMPILE_SLOT_CHUNK_MB sets it): each preset's peak at each, keyed "preset/MB" in --out
(session 43: medium's 267 MiB with one run, 169 with runs of 64). --hidden-columns likewise the
backward's hidden columns a pass (triton_moe.HIDDEN_COLUMNS, MHA_COMPILE_HIDDEN_COLUMNS), keyed
"preset/columnsC" (after "/MB" where both are given).

What this leaves out: the caching allocator's rounding and fragmentation, cuBLAS workspaces,
and CUDA-graph pools (the large preset runs without region graphs). So it reads a little below
torch.cuda.max_memory_allocated; what it is for is which tensors make the peak.
"""
import argparse
import itertools
import json
import os
import traceback
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.offline_sass import as_h200, meta_case
from mha_compile.kernels import triton_moe, triton_region, triton_util

PACKAGE = os.path.join("mha_compile", "")
MIB = 2**20


def call_site(func):
    """'op at file:line (function)' of the innermost mha_compile frame, else 'op (step)'."""
    frames = [f for f in traceback.extract_stack()[:-3] if PACKAGE in f.filename]
    if not frames:
        return f"{func.__name__} (step)"
    f = frames[-1]
    return f"{func.__name__} at {os.path.basename(f.filename)}:{f.lineno} ({f.name})"


class LiveBytes(TorchDispatchMode):
    """Bytes held by live tensors, and what was alive at the highest point."""

    def __init__(self):
        super().__init__()
        self.live = {}  # key -> (bytes, site)
        self.now = self.peak = 0
        self.peak_site, self.at_peak = None, []
        self._next = 0

    def _free(self, key):
        self.now -= self.live.pop(key)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, t in zip(func._schema.returns, outs):
            if isinstance(t, torch.Tensor) and ret.alias_info is None:
                site = call_site(func)
                self._next += 1
                self.live[self._next] = (t.untyped_storage().nbytes(), site)
                self.now += self.live[self._next][0]
                weakref.finalize(t, self._free, self._next)
                if self.now > self.peak:
                    self.peak, self.peak_site = self.now, site
                    self.at_peak = sorted(self.live.values(), key=lambda v: -v[0])
        return out


def training_step_peak(preset, act, dtype=torch.bfloat16):
    """LiveBytes after one fused forward and backward at `preset`, as the benchmark steps."""
    with as_h200(), LiveBytes() as mem:
        ctx, tok, params, k, renorm = meta_case(preset, act, dtype)
        grad_out = torch.empty_like(ctx)
        out, *saved = triton_region.region_forward("on_load", ctx, tok, *params, None, k, renorm, act)
        grads = triton_region.region_backward("on_load", grad_out, ctx, tok, *params, None, *saved, k, renorm, act)
        del out, saved, grads
    return mem


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="large")
    parser.add_argument("--act", default="gelu")
    parser.add_argument("--top", type=int, default=12, help="how many of the tensors alive at the peak to list")
    parser.add_argument("--out", default=None, help="JSON: per preset, the peak's bytes and site and what was alive")
    parser.add_argument("--slot-chunk-mb", default=None,
                        help="comma list of MoE run sizes in MiB to try (default: the one in effect)")
    parser.add_argument("--hidden-columns", default=None,
                        help="comma list of the backward's hidden columns a pass to try (0: all of F in one; "
                             "default: the one in effect)")
    args = parser.parse_args()
    if triton_util.interpreting():
        raise SystemExit("bench/offline_memory.py records GPU launches: run it without TRITON_INTERPRET=1")
    chunks = [None] if args.slot_chunk_mb is None else [
        (text, triton_moe.slot_chunk_bytes(text)) for text in args.slot_chunk_mb.split(",")]
    columns = [None] if args.hidden_columns is None else [
        (text, triton_moe.hidden_columns(text)) for text in args.hidden_columns.split(",")]
    found = {}
    for preset in args.presets.split(","):
        for chunk, column in itertools.product(chunks, columns):
            key, runs = preset, ""
            if chunk is not None:
                key, runs = f"{key}/{chunk[0]}", f", runs within {chunk[0]} MiB"
                triton_moe.SLOT_CHUNK_BYTES = chunk[1]
            if column is not None:
                key, runs = f"{key}/columns{column[0]}", f"{runs}, hidden columns a pass {column[1] or 'all'}"
                triton_moe.HIDDEN_COLUMNS = column[1]
            mem = training_step_peak(preset, args.act)
            found[key] = dict(peak_bytes=mem.peak, peak_site=mem.peak_site, at_peak=mem.at_peak)
            print(f"{preset}{runs}: peak {mem.peak / MIB:.0f} MiB of live tensors, reached by {mem.peak_site}")
            for nbytes, site in mem.at_peak[:args.top]:
                print(f"  {nbytes / MIB:8.1f} MiB  {site}")
            rest = mem.at_peak[args.top:]
            print(f"  {sum(n for n, _ in rest) / MIB:8.1f} MiB  {len(rest)} smaller tensors")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
