"""The region's kernel calls replayed as per-signature CUDA graphs inside the op (options graphs=).

Why: without CUDA graphs a medium training step spends ~2.5 ms of host time issuing the kernel
set's 21 Triton launches and ~50 torch ops for ~1.3 ms of GPU work (bench/PERF_NOTES.md v4),
so the GPU waits on Python. mode="reduce-overhead" graphs the whole compiled graph; this graphs
only the region, so it also serves a plain `torch.compile(m, backend="mha")`.

How, per call signature (every tensor's shape, strides, dtype and device, and the static
arguments):
1. the first call runs eagerly: it compiles and autotunes every kernel it launches;
2. the second is captured: tensor arguments found at the same address as in the first call
   (parameters, typically) are read where they are; every other one is copied into a static
   input of the graph;
3. later calls copy their arguments into the static inputs and replay. An argument read in
   place that has moved makes the call be captured again, with that argument copied from then
   on (so what is read in place only shrinks).
Every output is copied out of the graph into fresh memory, so a tensor the backward saved
survives the next replay (gradient accumulation, activation checkpointing). The kernels and
their order are the eager call's, so the results are the eager call's, bit for bit
(tests/kernels/test_region_graphs_cuda.py).

All graphs of a device share one memory pool: they never run at once (one lock, and a replay
on another stream than the device's last replay waits for it) and hold nothing live in the pool
between replays but their static outputs, which stay allocated. A graph is dropped (clear, or
the least recently used past MAX_GRAPHS) only after its device has finished its work.
The pool is the price: memory the eager path frees after each call stays held, which is why
graphs="auto" graphs only sizes whose slot buffers would take one run of 512 MiB (`auto_wanted`).
"""
import collections
import logging
import threading
import types

import torch

from mha_compile.kernels import triton_moe, triton_region
from mha_compile.options import GRAPHS
# Per-signature graphs kept (least recently used dropped first): each holds static inputs and
# outputs, and dynamic shapes would otherwise capture without end.
MAX_GRAPHS = 16

log = logging.getLogger("mha_compile")
_lock = threading.RLock()
_entries = collections.OrderedDict()  # signature -> _Seen | _Graph | _EAGER
_pools = {}  # device -> the shared graph memory pool
# device -> the one side stream every warm-up and capture runs on. One, not one per capture:
# cuBLAS keeps a workspace for each stream it has run on until the process ends. (On the H200
# at 7a84a28, which took a new stream per capture, benchmark rows that followed graphed ones
# started 64-128 MiB higher; with one stream, at 27c4aa0, they no longer did and the medium
# row's pools went 286 -> 158 MiB.)
_streams = {}
_EAGER = "eager"  # a signature whose capture failed: it runs eagerly from then on
# device -> the stream of the last replay there. The graphs share a pool, so any replay may
# write where the last one (of any graph) kept its intermediates: on another stream it waits.
_last_stream = {}


def wanted(graphs, kernels, ctx, tok, w1, top_k, act, mask):
    """Whether this call replays through a graph: graphs="on" or "auto" (see auto_wanted), a
    Triton kernel set on CUDA that takes these inputs, and no capture already running (under
    mode="reduce-overhead" the whole graph is being captured, this call with it)."""
    if graphs not in GRAPHS:
        raise ValueError(f"graphs={graphs!r}: expected one of {GRAPHS}")
    if graphs == "off" or kernels not in ("fused", "staged") or not ctx.is_cuda:
        return False
    if torch.cuda.is_current_stream_capturing():
        return False
    # The size rule first: where it says no (the large preset), the kernel set's own
    # why_unsupported check is then the call's only one.
    if graphs == "auto" and not auto_wanted(ctx, w1, top_k, act):
        return False
    return triton_region.why_unsupported(ctx, tok, w1, top_k, act, mask) is None


# graphs="auto"'s bound on the backward's slot buffers: the default run size
# (triton_moe.SLOT_CHUNK_BYTES), fixed here so that MHA_COMPILE_SLOT_CHUNK_MB, set lower for
# memory, does not also take the graphs from medium's plain step (3-6 ms a step without them
# against ~1). Smaller runs shrink a graph's pool as they shrink the step's peak: cudagraph trees'
# pool at medium held 200 MiB with runs of 64 MiB against 308 with one (bench/PERF_NOTES.md v46).
AUTO_SLOT_BYTES = 512 << 20


def auto_wanted(ctx, w1, top_k, act):
    """graphs="auto": the sizes where the backward's slot buffers would take one run of
    AUTO_SLOT_BYTES (tile_runs' rule at the default run size). Medium and small do (host-bound:
    at medium 6.4 ms a step with the graphs off against 0.985 with them, for 0.89 ms of GPU
    time, session 13's table, bench/PERF_NOTES.md); large does not: the pool would hold ~1 GB,
    and the training peak would pass half the best peer's (issue 4's memory target). A large
    step issues in 6.3-10 ms of host, depending on the host, for 6.6 ms of GPU time
    (bench/PERF_NOTES.md v15, v16): on a slow host graphs="on" trades the memory for that time."""
    return len(slot_runs(ctx, w1, top_k, act, AUTO_SLOT_BYTES)) <= 1


def slot_runs(ctx, w1, top_k, act, chunk=None):
    """triton_moe.tile_runs of the slot layout for ctx [B,H,D] and W1 [E,D,F], runs of `chunk`
    bytes of the backward's slot buffers (None: SLOT_CHUNK_BYTES), from shapes alone."""
    pairs, experts, per_slot = _slot_sizes(ctx, w1, top_k, act)
    tile = triton_moe.tile_rows(pairs, experts)
    layout = types.SimpleNamespace(tile=tile, num_tiles=triton_moe.tile_count(pairs, experts, tile))
    return triton_moe.tile_runs(layout, per_slot, chunk)


def slot_buffer_bytes(ctx, w1, top_k, act):
    """Bytes of the backward's slot buffers for ctx [B,H,D] and W1 [E,D,F], in ctx's dtype."""
    pairs, experts, per_slot = _slot_sizes(ctx, w1, top_k, act)
    return triton_moe.slot_count(pairs, experts) * per_slot


def _slot_sizes(ctx, w1, top_k, act):
    """(row-expert pairs, experts, the backward's slot buffer bytes a slot) for ctx [B,H,D], W1 [E,D,F]."""
    B, H, D = ctx.shape
    E, _, F = w1.shape
    return B * H * top_k, E, triton_moe.backward_slot_bytes(D, F, act == "swiglu", ctx.element_size())


def call(fn, args, statics):
    """fn(*args, *statics), through this signature's CUDA graph once it has one. args: tensors
    or None; statics: hashable. Returns fn's output structure (a tuple or list of tensors or
    None), every tensor in fresh memory."""
    # Inference mode is part of the signature: static inputs made under it are inference
    # tensors, which a call outside it could not copy into.
    key = (fn, statics, torch.is_inference_mode_enabled(), tuple(_signature(a) for a in args))
    device = next(a.device for a in args if a is not None)
    # The inputs' device current: capture and replay use the current device's streams.
    with _lock, torch.cuda.device(device):
        entry = _entries.get(key)
        if entry is _EAGER:
            return fn(*args, *statics)
        if entry is None:
            _remember(key, _Seen(args))
            return fn(*args, *statics)
        if isinstance(entry, _Seen) or not entry.addresses_hold(args):
            in_place = entry.in_place(args)
            try:
                entry = _Graph(fn, args, statics, in_place, *_pool_and_stream(device))
            except Exception as error:  # noqa: BLE001 (any capture failure: run eagerly instead)
                log.warning("mha_compile: capturing the region as a CUDA graph failed (%s: %s); "
                            "this signature runs without one", type(error).__name__, error)
                _remember(key, _EAGER)
                return fn(*args, *statics)
            _remember(key, entry)
        _entries.move_to_end(key)
        return entry.replay(args)


def graphs_held():
    """How many captured graphs are held (tests, reports)."""
    with _lock:
        return sum(isinstance(entry, _Graph) for entry in _entries.values())


def clear():
    """Drop every graph (their static buffers and, once unused, the pool's memory). The side
    streams stay: a new one would cost cuBLAS another workspace."""
    with _lock:
        for device in _pools:
            torch.cuda.synchronize(device)  # no replay may still be using what is freed
        _entries.clear()
        _pools.clear()
        _last_stream.clear()


def _signature(t):
    if t is None:
        return None
    return tuple(t.shape), t.stride(), t.dtype, t.device


def _remember(key, entry):
    _entries[key] = entry
    while len(_entries) > MAX_GRAPHS:
        _, dropped = _entries.popitem(last=False)
        if isinstance(dropped, _Graph):
            torch.cuda.synchronize(dropped.device)  # its last replay may still be running


def _pool_and_stream(device):
    if device not in _pools:
        _pools[device] = torch.cuda.graph_pool_handle()
    return _pools[device], side_stream(device)


def side_stream(device):
    """The one side stream of `device` that warm-ups and captures run on (here and in
    step_graphs): a new stream would cost cuBLAS another workspace."""
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device=device)
    return _streams[device]


def _address(t):
    return None if t is None else t.data_ptr()


class _Seen:
    """A signature called once (eagerly): where its arguments were."""

    def __init__(self, args):
        self.addresses = [_address(a) for a in args]

    def in_place(self, args):
        return [a is not None and _address(a) == seen for a, seen in zip(args, self.addresses)]


class _Graph:
    """One captured call: static inputs for the copied arguments, static outputs to copy out."""

    def __init__(self, fn, args, statics, in_place, pool, stream):
        self.read_in_place = in_place
        self.addresses = [_address(a) if keep else None for a, keep in zip(args, in_place)]
        self.inputs = [a if keep or a is None else static_copy(a) for a, keep in zip(args, in_place)]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on the static inputs: any kernel specialisation
            fn(*self.inputs, *statics)  # they need is compiled now, not inside the capture
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            self.outputs = fn(*self.inputs, *statics)
        # The in-place arguments are read at their addresses; holding them would keep them alive.
        self.inputs = [None if keep else t for t, keep in zip(self.inputs, in_place)]
        self.device = next(o.device for o in self.outputs if o is not None)

    def addresses_hold(self, args):
        return all(not keep or _address(a) == at for a, keep, at in zip(args, self.read_in_place, self.addresses))

    def in_place(self, args):
        """What stays read in place when this call is captured again (an argument moved)."""
        return [keep and _address(a) == at for a, keep, at in zip(args, self.read_in_place, self.addresses)]

    def replay(self, args):
        _last_stream[self.device] = after_last_replay(_last_stream.get(self.device), self.device)
        copy_pairs([(s, a) for s, a in zip(self.inputs, args) if s is not None])
        self.graph.replay()
        fresh = iter(fresh_copies([o for o in self.outputs if o is not None]))
        return type(self.outputs)(None if o is None else next(fresh) for o in self.outputs)


def after_last_replay(last, device):
    """The current stream of `device`, made to wait for `last` (the stream of the last replay of
    graphs sharing a pool, None: none yet) where it is another: that replay's reads and writes
    come first."""
    current = torch.cuda.current_stream(device)
    if last is not None and last != current:
        current.wait_stream(last)
    return current


# Where copy_pairs copies a tensor with copy_ of its own rather than in its group's _foreach_copy_: one
# block a 64K-element chunk leaves the GPU part idle (H100, bench/copy_probe.py, session 59: 64 MiB of
# bf16 50.1 us by copy_ against 66.1, 8 MiB 10.4 against 21.6, 1 MiB 5.7 against 18.2; four of 1 MiB
# 16.0 against 20.1, four of 8 MiB 37.0 against 35.3: even where a group has several). Large's ctx and
# ∂out and medium's tok are copied in before each replay; a step's time with it is not yet measured.
COPY_ALONE_BYTES = 1 << 20


def copy_pairs(pairs):
    """dst.copy_(src) for each (dst, src): a pair of COPY_ALONE_BYTES or more by copy_ of its own,
    the rest by one _foreach_copy_ a group of one dtype whose pairs share strides: only such a group
    takes its one-launch path (ATen's can_use_fast_route); a mixed list (the saved tensors mix
    bf16, fp32 and int32) is copied one tensor at a time, a launch and host time each
    (bench/results/host_timers_small.txt: 136 us for a step's three)."""
    groups = collections.defaultdict(lambda: ([], []))
    for dst, src in pairs:
        if dst.numel() * dst.element_size() >= COPY_ALONE_BYTES:
            dst.copy_(src)
            continue
        dsts, srcs = groups[dst.dtype, dst.stride() == src.stride()]
        dsts.append(dst)
        srcs.append(src)
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs)


def fresh_copies(tensors):
    """Copies of `tensors` in fresh memory (a graph's static outputs handed out: the next replay
    overwrites the static ones)."""
    fresh = [torch.empty_like(t) for t in tensors]
    copy_pairs(list(zip(fresh, tensors)))
    return fresh


def static_copy(t):
    """A graph input holding t's values, with t's strides where t is dense (so the captured
    kernels see the layout the eager call saw), else contiguous."""
    static = torch.empty_like(t, memory_format=torch.preserve_format)
    static.copy_(t)
    return static
