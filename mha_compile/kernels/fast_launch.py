"""Launching a compiled Triton kernel again without JITFunction.run's per-call work.

Why: on the H200's host a launch through JITFunction.run took ~63 us, ~40 of them before the
driver's launcher runs (binding the arguments, specialising each, the cache key, the launch
metadata), and a large training step launches ~50 times: it issued in 9.5 ms of host time for
6.6 ms of GPU time (bench/host_timers.py, bench/results/host_timers_large.txt).

How: the first call with a given specialisation goes through JITFunction.run, which compiles
(or finds) the kernel and returns it; it is kept under a key at least as fine as Triton's own
cache key. Per parameter: a constexpr's value; a tensor's dtype and whether its address is
16-byte aligned; an int's being 1, its divisibility by 16 and its width; the type of a bool
(and its value), a float or None. Then the launch options (num_warps, num_stages, ...), Triton's
debug and instrumentation settings and the current device. A later call with that key calls
the kernel's launcher directly, with the current stream, the launch hooks and the launch
metadata, as JITFunction.run does. Any other argument (a TMA descriptor, a tuple), the
interpreter, and anything that intercepts JITFunction.run and returns no compiled kernel
(bench/offline_sass.py) take JITFunction.run on every call. Not repeated on the fast path:
JITFunction.run's check that the globals a kernel read when it was compiled still hold the
same values (the kernels here read module constants only). MHA_COMPILE_FAST_LAUNCH=0 sends
every launch through JITFunction.run.
"""
import inspect
import os

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime.jit import JITFunction

ENABLED = os.environ.get("MHA_COMPILE_FAST_LAUNCH", "1") != "0"
_SLOW = object()  # an argument the key cannot describe: JITFunction.run every time
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_INT32 = (-(1 << 31), (1 << 31) - 1)


def _feature(value):
    """What Triton specialises a non-constexpr argument on (or finer), or _SLOW."""
    kind = type(value)
    if kind in _TENSORS:
        return value.dtype, value.data_ptr() % 16 == 0
    if kind is int:
        if value == 1:
            return 1
        return value % 16 == 0, _INT32[0] <= value <= _INT32[1], value >= 1 << 63
    if kind is bool:
        return bool, value
    if kind is float:
        return float
    if value is None:
        return None
    return _SLOW


class FastLaunch:
    """kernel[grid](*args, **kwargs), the compiled kernel kept per specialisation key."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.enabled = ENABLED and type(kernel) is JITFunction  # not the interpreter's, not Gluon's
        params = getattr(kernel, "params", [])
        self.names = [p.name for p in params]
        self.params = set(self.names)
        self.constexpr = [p.is_constexpr for p in params]
        self.defaults = [p.default if p.default is not inspect.Parameter.empty else _SLOW for p in params]
        self.compiled = {}  # key -> CompiledKernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def key(self, args, kwargs):
        """(key, every parameter's value in order), or (None, None) where the key cannot say."""
        values = list(args)
        if len(values) < len(self.names):
            values.extend(kwargs.get(name, default) for name, default in
                          zip(self.names[len(values):], self.defaults[len(values):]))
        features = []
        try:
            for value, constexpr in zip(values, self.constexpr):
                feature = value if constexpr else _feature(value)
                if feature is _SLOW:
                    return None, None
                features.append(feature)
            options = tuple((k, v) for k, v in kwargs.items() if k not in self.params)
            key = (torch.cuda.current_device(), tuple(features), options, knobs.runtime.debug,
                   knobs.compilation.instrumentation_mode)
            hash(key)
        except (TypeError, RuntimeError):  # an unhashable constexpr, a tensor without storage
            return None, None
        return key, values

    def launch(self, grid, args, kwargs):
        fast = self.enabled and not self.kernel.pre_run_hooks
        key, values = self.key(args, kwargs) if fast else (None, None)
        compiled = None if key is None else self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None and isinstance(compiled, CompiledKernel):
                self.compiled[key] = compiled
            return
        if callable(grid):
            grid = grid(dict(zip(self.names, values)))
        stream = torch._C._cuda_getCurrentRawStream(key[0])
        size = len(grid)
        metadata = compiled.launch_metadata(grid, stream, *values)
        compiled.run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, stream, compiled.function,
                     compiled.packed_metadata, metadata, knobs.runtime.launch_enter_hook,
                     knobs.runtime.launch_exit_hook, *values)


_LAUNCHERS = {}


def fast(kernel):
    """The FastLaunch of a @triton.jit kernel (one per kernel): fast(k)[grid](...) launches as
    k[grid](...) does."""
    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        launcher = _LAUNCHERS[kernel] = FastLaunch(kernel)
    return launcher
