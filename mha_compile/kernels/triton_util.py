"""Shared pieces of the Triton kernel families: activations, dtype rules, launching.

Nothing here launches work on its own. The kernel files (triton_pool, triton_router,
triton_moe, merge_cuda) import these helpers; fused.py and staged.py assemble the kernels.

Launching: on CUDA a kernel runs through `triton.autotune` over a short config list (at most
seven configs a kernel, so a first training step spends seconds, not minutes, tuning), and
the first launch of each new key logs two info lines on the "mha_compile" logger (what it
tunes, then the config it chose). The chosen
config is kept per key, and later calls launch the kernel with it directly (the autotuner's
own per-call path costs host time on every launch). Every launch goes through `launch`, which
keeps each call signature's compiled kernel and hands later launches straight to it, skipping
Triton's per-call work in JITFunction.run (MHA_COMPILE_FAST_LAUNCH=0: not), through Triton's C
launch function itself while no Triton launch hook is set (_direct_launch). Under
TRITON_INTERPRET=1 (CPU tensors, how CI runs these kernels) a kernel runs once with its
first config: the interpreter would otherwise "benchmark" every config in Python.
"""
import functools
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.nvidia.driver import CudaLauncher
from triton.runtime.errors import OutOfResources
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from mha_compile.kernels.reference import ACTIVATIONS

log = logging.getLogger("mha_compile")

# Activation codes, constexpr in the kernels; the order of reference.ACTIVATIONS.
ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
GELU, GELU_TANH, SILU, SWIGLU = (ACT_CODE[a] for a in ACTIVATIONS)

# The MoE backward's ∂w partials [S, F/GW_BLOCK + ...] have one column per GW_BLOCK of F, written
# by the hidden kernel (triton_moe's or gluon_moe's) whatever its block of F (a config tried while
# tuning must not leave a different layout behind).
GW_BLOCK = 64

# Set MHA_COMPILE_NO_AUTOTUNE=1 to launch every kernel with its first config on CUDA too
# (used by the GPU tests to keep compile time down; the configs compute the same function).
NO_AUTOTUNE = os.environ.get("MHA_COMPILE_NO_AUTOTUNE", "0") == "1"

DOT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def on_gpu(t):
    """Whether `t` is on a GPU, where launches take num_warps and num_stages (the interpreter
    takes neither). One place, so that bench/offline_sass.py can record the GPU's launches from
    shapes alone (meta tensors)."""
    return t.is_cuda


def capturing():
    """Whether the current CUDA stream is capturing a CUDA graph (False where there is no CUDA: the
    tests' stand-ins for GPU launches, on_gpu, run on CPU builds)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# launch(): a call signature's compiled kernel kept, so that its later launches skip Triton's
# per-call work in JITFunction.run. Read at launch time; MHA_COMPILE_FAST_LAUNCH=0 sends every
# launch through JITFunction.run.
FAST_LAUNCH = os.environ.get("MHA_COMPILE_FAST_LAUNCH", "1") != "0"
# The TMA descriptors kernels take on the host: Triton's, and Gluon's (with a shared-memory layout).
DESCRIPTORS = (TensorDescriptor, GluonTensorDescriptor)
MAX_LAUNCHES = 4096  # call signatures kept (all of them dropped past this: dynamic shapes)
# launch_key -> (the compiled kernel, its parameters past the positional ones with defaults, its
# direct launch or None: _direct_launch)
_launches = {}
# Whether a kept launch calls Triton's launch function directly (_direct_launch), read at launch
# time: bench/launch_ab.py --flag DIRECT_LAUNCH times it off against on.
DIRECT_LAUNCH = True
# A CUDA device's current stream, as Triton's launcher takes it (absent from CPU builds of torch).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def launch_key(kernel, args, kwargs):
    """What selects `kernel`'s compiled binary for this call, at least as finely as Triton does,
    or None where this cannot say (a tensor off the GPU, an argument of another kind). Triton
    specialises a tensor on its dtype and on whether its address is a multiple of 16, an int on
    its value's range, on being 1 and on divisibility by 16, a TMA descriptor on its dtype, block
    shape and layout, and compiles a binary per value of each constexpr and launch option. Here:
    a tensor's dtype and 16-byte alignment, an int's or a bool's type and exact value (finer than
    Triton's: a new value only costs one slow launch), a float's type (Triton does not specialise
    floats), every field of a descriptor but its base's address (whose alignment it asserts),
    every keyword's exact value, and the current device."""
    # One flat list, each entry led by what tells it apart (a type, a dtype, a keyword's name):
    # tuples of tuples cost twice the host time (8 against 4 us for matmul_f32's 26 arguments).
    key = [id(kernel)]
    append = key.append
    for a in args:
        kind = type(a)
        if kind is int or kind is bool or a is None:  # the type keeps True apart from 1
            append(kind)
            append(a)
        elif isinstance(a, torch.Tensor):
            if not on_gpu(a):
                return None
            append(a.dtype)
            append(a.data_ptr() % 16 == 0)
        elif kind is float:
            append(float)
        elif isinstance(a, DESCRIPTORS):
            if not on_gpu(a.base):
                return None
            append(kind)
            append((a.base.dtype, a.base.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides),
                    tuple(a.block_shape), getattr(a, "layout", None), a.padding))
        else:
            return None
    for name, value in kwargs.items():
        append(name)
        append(type(value))
        append(value)
    append(torch.cuda.current_device())  # Triton keeps a cache per device
    key = tuple(key)
    try:
        hash(key)
    except TypeError:  # an unhashable keyword value
        return None
    return key


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs) for a grid tuple, with the compiled kernel of this call's
    launch_key kept from its first launch, which goes through JITFunction.run (compiling where
    needed) as every launch did before: later launches with the same key hand the arguments to
    the compiled kernel directly (CompiledKernel[grid], Triton's own launcher). JITFunction.run
    spends its host time binding the arguments, working out their specialisation and cache key,
    and checking the kernel's globals (~33 us a launch on the H200's host in session 37's timers
    of a large step, 55 launches, bench/results/host_timers_large_s37.txt); this builds a key
    and looks it up; Triton's launch hooks run as they do there. The globals check is skipped: the
    kernels' globals are constants. Launches in the interpreter, or with an argument launch_key
    cannot key, go through JITFunction.run every time."""
    launch_keyed(kernel, launch_key(kernel, args, kwargs) if fast_launches() else None, grid, args, kwargs)


def fast_launches():
    """Whether launches are keyed (launch_key) and kept: FAST_LAUNCH, and not the interpreter."""
    return FAST_LAUNCH and not interpreting()


def launch_keyed(kernel, key, grid, args, kwargs):
    """launch() with the call's key worked out by the caller (None: through JITFunction.run)."""
    kept = _launches.get(key) if key is not None else None
    if kept is None:
        compiled = kernel[grid](*args, **kwargs)
        # Kept where it is a compiled kernel (not a future) of a kernel with Triton's parameter list
        # (not a stand-in that wraps one: the tests' spies see every launch).
        params = getattr(kernel, "params", None)
        if key is not None and params is not None and compiled is not None and not hasattr(compiled, "result"):
            if len(_launches) >= MAX_LAUNCHES:
                _launches.clear()
            _launches[key] = (compiled, [(p.name, p.default) for p in params[len(args):]], _direct_launch(compiled))
        return
    compiled, rest, direct = kept
    values = [kwargs[name] if name in kwargs else default for name, default in rest]
    x, y, z = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
    if direct is None or not DIRECT_LAUNCH or _hooked(knobs.runtime.launch_enter_hook) or _hooked(
            knobs.runtime.launch_exit_hook):
        compiled[(x, y, z)](*args, *values)
        return
    c_launch, device, function, cooperative, pdl, metadata = direct
    # What CompiledKernel[grid] and CudaLauncher pass with no launch hook and no scratch memory.
    c_launch(x, y, z, _raw_stream(device), function, cooperative, pdl, None, None, metadata, None, None, None,
             *args, *values)


def _hooked(hook):
    """Whether a Triton launch hook is set: Triton 3.6's HookChain with a hook in it, or a hook
    assigned in its place."""
    return getattr(hook, "calls", hook is not None)


def _direct_launch(compiled):
    """(Triton's launch function, the current device, the kernel's handle, cooperative, pdl, its
    packed metadata) of a compiled kernel just launched, or None where the kernel needs what only
    Triton's own path does (global or profile scratch memory, allocated a launch) or its launcher
    is not Triton 3.6's CudaLauncher.

    CompiledKernel[grid](*args) builds a closure, looks the device and stream up through
    Triton's driver proxy, builds the launch hooks' metadata (a LazyDict) and calls the hook
    chains even when they are empty, and CudaLauncher.__call__ builds two more closures; the
    launch function itself takes Python None for an absent hook or scratch buffer. launch_keyed
    calls it directly while no launch hook is set (a profiler like Proton sets them: then every
    launch goes through CompiledKernel[grid] again). The device is the one the kernel was just
    launched on: launch_key holds it, so a launch kept here is on it."""
    launcher = getattr(compiled, "run", None)
    if not isinstance(launcher, CudaLauncher) or launcher.global_scratch_size or launcher.profile_scratch_size:
        return None
    return (launcher.launch, torch.cuda.current_device(), compiled.function, launcher.launch_cooperative_grid,
            launcher.launch_pdl, compiled.packed_metadata)


def num_sms(device):
    """The device's SM count, which sizes split grids; 4 off the GPU (the interpreter: any small
    number). bench/offline_sass.py patches it to the H200's where it is imported."""
    if device.type == "cuda":
        return _cuda_properties(_index(device)).multi_processor_count
    return 4


def l2_bytes(device):
    """A CUDA device's L2 cache in bytes, read once per device; None off the GPU.
    bench/offline_sass.py patches it to the H200's where it is imported."""
    if device.type == "cuda":
        return _cuda_properties(_index(device)).L2_cache_size
    return None


def capability(device):
    """A CUDA device's (major, minor), read once per device: the Gluon choosers, TMA checks and
    split grids ask on every launch (the choosers went 30 -> 23 us a call on the H200's host,
    bench/host_timers.py)."""
    properties = _cuda_properties(_index(device))
    return properties.major, properties.minor


def _index(device):
    return torch.cuda.current_device() if device.index is None else device.index


@functools.lru_cache(maxsize=None)
def _cuda_properties(index):
    return torch.cuda.get_device_properties(index)


def tma_device(device):
    """Whether launches on `device` may take TMA tensor descriptors: a GPU with TMA (Hopper or
    later), or the CPU (the interpreter). bench/offline_sass.py patches it for meta tensors taken
    for an H200's."""
    if device.type == "cuda":
        return capability(device)[0] >= 9
    return device.type == "cpu"


def tma_ok(*tensors):
    """Whether TMA tensor descriptors may address these tensors: a device that takes them, and
    each tensor with its last dimension contiguous and its base and other strides 16-byte
    aligned (an odd F in bf16 is not)."""
    return tma_device(tensors[0].device) and all(
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
        for t in tensors)


def split_runs(length, programs, min_run, align, device):
    """(runs, run): a reduction of `length` cut into runs of `run` (a multiple of `align`, the
    last one shorter), enough of them that `programs` × runs reach two waves of the device's
    SMs, and none shorter than `min_run` unless the whole is."""
    return cut_runs(length, max(1, min(cdiv(2 * num_sms(device), programs), length // min_run)), align)


def cut_runs(length, runs, align):
    """(runs, run): `length` cut into about `runs` runs of `run`, a multiple of `align` (the last
    one shorter; fewer runs where rounding up to `align` leaves the last ones empty)."""
    run = cdiv(cdiv(length, runs), align) * align
    return cdiv(length, run), run


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, part2_ptr, out2_ptr, base_ptr, E, N, SPLIT, HAS_BASE: tl.constexpr,
                       BLOCK: tl.constexpr):
    """out[e, :] = Σ_{c < SPLIT} part[e·SPLIT + c, :] in c order, N per-expert elements, after
    base[e, :] with HAS_BASE (one pair only); program axis 1 picks the pair: 0 (part, out), 1
    (part2, out2)."""
    if tl.program_id(1) == 0:
        src, dst = part_ptr, out_ptr
    else:
        src, dst = part2_ptr, out2_ptr
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < E * N
    e = offs // N
    within = offs - e * N
    acc = tl.zeros([BLOCK], tl.float32)
    if HAS_BASE:
        acc += tl.load(base_ptr + offs, mask=ok, other=0.0)
    for c in range(0, SPLIT):
        acc += tl.load(src + (e * SPLIT + c) * N + within, mask=ok, other=0.0)
    tl.store(dst + offs, acc.to(dst.dtype.element_ty), mask=ok)


SUM_BLOCK = 1024


def sum_splits(parts, out, split, base=None, block=SUM_BLOCK):
    """out [E, N] = Σ_{c < split} parts[e·split + c] ([E·split, N] fp32) in c order, after base
    [E, N] fp32 where given, in out's dtype, by programs of `block` elements; out returned."""
    E, N = out.shape
    launch(_sum_splits_kernel, (cdiv(E * N, block), 1), parts, out, parts, out, parts if base is None else base,
           E, N, split, HAS_BASE=base is not None, BLOCK=block)
    return out


# sum_runs' block: a [256, 256] sum (matmul_f32's ∂Wo at medium, 8 runs) then takes 256
# programs, not the 64 of SUM_BLOCK, each of whose runs' loads waits on the one before.
RUNS_BLOCK = 256


def sum_runs(parts, out):
    """out = Σ_c parts[c] for parts [runs, *out.shape] (fp32, contiguous) in run order, into out
    (contiguous) in its dtype: fp32 sums, rounded once to out's dtype; out returned. (torch.sum(parts,
    0, out=out) would cast fp32 parts to a 16-bit out before it summed them.)"""
    runs = parts.shape[0]
    torch._check(parts.shape[1:] == out.shape and parts.is_contiguous() and out.is_contiguous(),
                 lambda: f"sum_runs: parts {tuple(parts.shape)} into out {tuple(out.shape)}, both contiguous")
    sum_splits(parts.view(runs, -1), out.view(1, -1), runs, block=RUNS_BLOCK)
    return out


def gpu_options(t, **options):
    """Launch options (num_warps, num_stages) when `t` is on a GPU, none for the interpreter."""
    return options if on_gpu(t) else {}


# The oldest NVIDIA GPU the Triton kernels take: bf16 tensor-core dots, cp.async and 99 KB or more of
# shared memory a block start at sm_80 (Triton 3.6 builds no bf16 dot below it; a T4's sm_75 has 64 KB).
MIN_CAPABILITY = (8, 0)


def device_reason(t):
    """None when Triton kernels can run on `t`'s device, else why not."""
    if on_gpu(t):
        return _gpu_reason(t.device) if t.device.type == "cuda" else None
    if t.device.type == "cpu" and interpreting():
        return None
    if t.device.type == "cpu":
        return "device cpu needs TRITON_INTERPRET=1"
    return f"device {t.device.type} has no Triton kernels here"


@functools.lru_cache(maxsize=None)
def _gpu_reason(device):
    """device_reason for a CUDA device, once a device (the region asks on every call): an NVIDIA GPU
    older than MIN_CAPABILITY. A fake CUDA tensor on a machine without CUDA (compiling for one) has
    no properties to read, and ROCm's are no NVIDIA architecture: None."""
    if torch.version.hip is not None or not torch.cuda.is_available():
        return None
    major, minor = capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return (f"a GPU of sm_{major}{minor} runs on the reference path (the Triton kernels need "
                f"sm_{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]} or newer)")
    return None


def dtype_reason(t):
    if t.dtype == torch.float64:
        return "float64 runs on the reference path"
    if t.dtype not in DOT_DTYPES:
        return f"dtype {t.dtype} runs on the reference path (kernels take bf16, fp16, fp32)"
    return None


def cdiv(a, b):
    """⌈a / b⌉ for host ints. Not triton.cdiv: in Triton 3.6 that is a ConstexprFunction, ~6 us a
    call on the host (0.06 here), and the grids and runs of a large step take dozens."""
    return -(-a // b)


def pow2(n, lo=16):
    """The next power of two ≥ max(n, lo): block sizes of masked tails."""
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


def dot_precision(dtype):
    """Triton's fp32 dot defaults to tf32 (≈3e-4 relative error): fp32 inputs ask for ieee."""
    return "ieee" if dtype == torch.float32 else "tf32"


def tl_dtype(dtype):
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def contiguous(*tensors):
    return tuple(None if t is None else t.contiguous() for t in tensors)


def stamp(*tensors):
    """Which tensors these are (memory, device, dtype, shape, strides) and their version counters,
    which every in-place write bumps (None for an inference tensor, which has none; None for an
    absent tensor): what a value kept from a forward for its backward is checked against."""
    return tuple(None if t is None else (t.data_ptr(), t.device, t.dtype, t.shape, t.stride(),
                                         None if t.is_inference() else t._version) for t in tensors)


# A config's options for the GPU's compiler, not meta-parameters of the kernel (the interpreter takes none).
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")


class Launcher:
    """One kernel, its bounded config list and its autotune key.

    `configs` are dicts of meta-parameters (with num_warps/num_stages, and maxnreg: a cap on the
    registers a thread, where a kernel's occupancy is held by them); the first is the
    default (interpreter, MHA_COMPILE_NO_AUTOTUNE). `key` names the kernel arguments that
    change the best config; Triton adds the tensors' dtypes to it. Every compile-time flag of the
    kernel (HAS_BIAS, ...) belongs in it: each value is another build, and a config chosen (and
    built, _buildable) for one would otherwise be launched for the other untried
    (tests/kernels/test_launcher.py checks the lists).
    """

    def __init__(self, kernel, configs, key, restore=None, blocks=None, tune=True):
        """restore: arguments the kernel adds into or overwrites while reading them, which
        autotuning's trial runs must not change. blocks: for a kernel that may take TMA tensor
        descriptors, a function of the arguments and meta-parameters (a dict) giving each
        descriptor argument's block shape, which follows the config's tile sizes; it is set on
        the descriptors before every launch and trial (pointer arguments are left alone).
        tune=False: the configs are not timed, each launch takes the first that fits the GPU
        (the later ones are for GPUs with less shared memory)."""
        self.kernel = kernel
        self.arg_names = kernel.arg_names  # kept: bench/gemm_probe.py stands a recorder in for the kernel
        self.configs = configs
        self.key = key
        self.restore = list(restore or [])
        self.blocks = blocks
        hook = None if blocks is None else self._set_blocks
        tl_configs = [triton.Config({k: v for k, v in c.items() if k not in LAUNCH_OPTIONS},
                                    num_warps=c.get("num_warps", 4), num_stages=c.get("num_stages", 2),
                                    maxnreg=c.get("maxnreg"), pre_hook=hook)
                      for c in configs]
        self.tuned = (triton.autotune(configs=tl_configs, key=key, restore_value=self.restore or None,
                                      prune_configs_by={"early_config_prune": self._buildable})(kernel)
                      if len(configs) > 1 and tune else None)
        self.best = {}  # autotune key -> the chosen config's meta-parameters
        self._chosen = {}  # (NO_AUTOTUNE, launch_key of a call's arguments) -> (its config, the launch's key)
        self._fitting = {}  # (autotune key, configs) -> the first config that loads on the GPU (None: none does)
        self._fits_by_call = {}  # a call's launch_key -> (the config list, whether some config fits)

    def _buildable(self, configs, nargs, **kwargs):
        """The configs that build for this call (the autotuner's early prune, before it times them).
        Triton's autotuner skips a config that runs out of resources but raises when one fails to
        build, and some do at some shapes only (the pool forward's BLOCK_N 64 at D = 100 on Triton
        3.6, bench/PERF_NOTES.md v14): each is built here first (JITFunction.warmup, the same
        specialisation the timing run then takes from the cache); a failure is logged and dropped,
        and none building raises, naming every failure."""
        call = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        kept, failures = [], []
        for config in configs:
            meta = {**call, **config.all_kwargs()}
            try:
                if self.blocks is not None:
                    self._set_blocks({**nargs, **meta})
                self.kernel.warmup(**nargs, **meta, grid=(1,))
            except Exception as error:  # noqa: BLE001 - any build failure: the other configs compute the same
                failures.append(f"{config.kwargs} ({type(error).__name__}: {str(error).splitlines()[0][:160]})")
                log.warning("mha_compile: %s does not build under %s; autotuning leaves it out",
                            self.kernel.__name__, failures[-1])
            else:
                kept.append(config)
        if not kept:
            raise RuntimeError(f"mha_compile: {self.kernel.__name__} builds under none of its configs: "
                               + "; ".join(failures))
        return kept

    def fits(self, *args, **kwargs):
        """Whether a launch with these arguments runs within its GPU's resources (shared memory, and
        threads for its registers) under some config: an untuned launch takes the first that does
        (_first_fitting), autotuning skips the others. Where none does, a launch raises
        OutOfResources. Always True off the GPU."""
        if not any(isinstance(a, torch.Tensor) and on_gpu(a) for a in args):
            return True
        return self._first_fitting(*self._bound_and_key(args, kwargs)) is not None

    def launch_where_fits(self, grid, *args, **kwargs):
        """Launch as __call__ does where the arguments fit the GPU under some config (fits) and return
        True; else launch nothing and return False: for a caller with another way to compute
        (triton_pool's attend_bwd_single, attend_bwd_one, pool_attend and attend_bwd_scores). The
        answer is kept by the call's launch_key (and config list): fits' own key took ~19 us of
        host a call here, where the pool's kernels launch every step."""
        call = self._call_key(args, kwargs)
        kept = self._fits_by_call.get(call) if call is not None else None
        if kept is not None and kept[0] is self.configs:
            fits = kept[1]
        else:
            fits = self.fits(*args, **kwargs)
            if call is not None:
                if len(self._fits_by_call) >= MAX_LAUNCHES:
                    self._fits_by_call.clear()
                self._fits_by_call[call] = (self.configs, fits)
        if fits:
            self._call(grid, args, kwargs, call)
        return fits

    def _bound_and_key(self, args, kwargs):
        """(the arguments by name, the autotune key: the key's arguments and the tensors' dtypes). A
        launch option the key names (num_warps, say) that the call leaves to the config is None there."""
        bound = dict(zip(self.arg_names, args), **kwargs)
        return bound, (tuple(bound.get(k) if k in LAUNCH_OPTIONS else bound[k] for k in self.key)
                       + tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))

    def _first_fitting(self, bound, key):
        """The first config whose build for the arguments `bound` (autotune key `key`) loads on
        their GPU, None where none does: each built and loaded in turn (Triton's cache, which the
        launch then takes), once a key and config list. On sm_90 the pool's kernels at D 1024 need
        more shared memory under their first configs than the GPU has at some head counts and dtypes
        (fp32 with 32 heads: 259 KB against 227), which MHA_COMPILE_NO_AUTOTUNE's launches would
        raise on."""
        cached = key + tuple(tuple(sorted(c.items())) for c in self.configs)  # a probe or test may swap the list in
        if cached not in self._fitting:
            self._fitting[cached] = self._first_loading(bound)
        return self._fitting[cached]

    def _first_loading(self, bound):
        """The first config whose build loads (_loads), None where none does. Where one does not, it
        logs that the next is being built: a warning for the first config (once an autotune key, as
        _first_fitting keeps the answer), info after it. Builds of a size that does not fit take
        long (offline, sm_90a, fp32 D 1024 with 32 heads: ~5-55 s each, ten before the pool's
        kernels are settled), and without a word the first call would seem to hang."""
        for i, config in enumerate(self.configs):
            if self._loads(bound, config):
                return config
            if i + 1 < len(self.configs):
                (log.warning if i == 0 else log.info)(
                    "mha_compile: %s does not fit the GPU under %s; building its next config (%d of %d) for "
                    "these shapes: builds this large can take a minute each, once (Triton's cache keeps them)",
                    self.kernel.__name__, config, i + 2, len(self.configs))
        return None

    def _loads(self, bound, config):
        """Whether the kernel built under `config` for the arguments `bound` loads on their GPU."""
        try:
            if self.blocks is not None:
                self._set_blocks({**bound, **config})
            kernel = self.kernel.warmup(**bound, **config, grid=(1,))
            (kernel.result() if hasattr(kernel, "result") else kernel)._init_handles()
        except OutOfResources as error:
            log.info("mha_compile: %s under %s does not fit the GPU: %s", self.kernel.__name__, config, error)
            return False
        except Exception as error:  # noqa: BLE001 - a build failure: this config cannot run either
            log.warning("mha_compile: %s does not build under %s (%s: %s)", self.kernel.__name__, config,
                        type(error).__name__, str(error).splitlines()[0][:160])
            return False
        return True

    def _set_blocks(self, nargs):
        for name, shape in self.blocks(nargs).items():
            if isinstance(nargs[name], TensorDescriptor):
                nargs[name].block_shape = list(shape)

    def _launch(self, grid, args, kwargs, meta, call=None):
        """call: the arguments' launch_key, where the config `meta` is to be remembered for them."""
        if self.blocks is not None:
            self._set_blocks({**dict(zip(self.arg_names, args)), **kwargs, **meta})
            launch(self.kernel, grid({**meta, **kwargs}), *args, **kwargs, **meta)
            return
        key = None if call is None else call + tuple(meta.items())
        if call is not None:
            if len(self._chosen) >= MAX_LAUNCHES:
                self._chosen.clear()
            self._chosen[NO_AUTOTUNE, call] = (meta, key)
        launch_keyed(self.kernel, key, grid({**meta, **kwargs}), args, {**kwargs, **meta})

    def __call__(self, grid, *args, **kwargs):
        """grid: a function of the chosen meta-parameters (a dict) returning the launch grid."""
        self._call(grid, args, kwargs, self._call_key(args, kwargs))

    def _call_key(self, args, kwargs):
        """The call's launch_key, where its launches are keyed (fast launches, no descriptors); else None."""
        return launch_key(self.kernel, args, kwargs) if self.blocks is None and fast_launches() else None

    def _call(self, grid, args, kwargs, call):
        """__call__ with the arguments' launch_key `call` worked out (None: none)."""
        # A call whose arguments' launch_key has a config here launches it at once: the autotune
        # key and the launch's key are not worked out again (~5 of a launch's ~20 us of host time).
        chosen = self._chosen.get((NO_AUTOTUNE, call)) if call is not None else None
        if chosen is not None:
            meta, key = chosen
            launch_keyed(self.kernel, key, grid({**meta, **kwargs}), args, {**kwargs, **meta})
            return
        on_cuda = any(isinstance(a, torch.Tensor) and on_gpu(a) for a in args)
        if self.tuned is None or not on_cuda or NO_AUTOTUNE:
            meta = dict(self.configs[0])
            if not on_cuda:  # the interpreter ignores warps and stages
                for option in LAUNCH_OPTIONS:
                    meta.pop(option, None)
            elif len(self.configs) > 1:  # the first that fits (none: the first, whose launch says why)
                meta = dict(self._first_fitting(*self._bound_and_key(args, kwargs)) or meta)
            self._launch(grid, args, kwargs, meta, call)
            return
        bound, key = self._bound_and_key(args, kwargs)
        best = self.best.get(key)
        if best is not None:  # a plain launch: no autotuner bookkeeping per call
            self._launch(grid, args, kwargs, best, call)
            return
        if capturing():
            # Timing trials synchronise the device, which a CUDA graph capture does not allow (it
            # fails the capture: session 31, a key first met while torch's cudagraph trees captured
            # the backward). The first config that fits runs, not remembered: the next call outside
            # a capture tunes the key.
            meta = dict(self._first_fitting(bound, key) or self.configs[0])
            if (self.kernel.__name__, key) not in _CAPTURE_UNTUNED:
                _CAPTURE_UNTUNED.add((self.kernel.__name__, key))
                log.warning("mha_compile: %s met %s first inside a CUDA graph capture, where it cannot be "
                            "autotuned; the capture takes its first config that fits, %s", self.kernel.__name__,
                            dict(zip(self.key, key)), meta)
            self._launch(grid, args, kwargs, meta)
            return
        log.info("mha_compile: autotuning %s over %d configs for %s",
                 self.kernel.__name__, len(self.configs), dict(zip(self.key, key)))
        outside_graph_pools(lambda: self.tuned[lambda meta: grid({**meta, **kwargs})](*args, **kwargs))
        self.best[key] = self.tuned.best_config.all_kwargs()
        log.info("mha_compile: %s chose %s", self.kernel.__name__,
                 {k: v for k, v in self.best[key].items()
                  if (k in self.configs[0] or k in LAUNCH_OPTIONS) and v is not None})


_CAPTURE_UNTUNED = set()  # (kernel name, autotune key) launched untuned inside a capture: said once


def outside_graph_pools(run):
    """run() on a thread of its own, on the caller's CUDA stream, and its result (or its error).
    Torch's cudagraph trees warm a graph up with every allocation of the warming thread sent to the
    graph's private pool (cudagraph_trees._use_cuda_memory_pool_manager), and an autotuning trial
    allocates Triton's 256 MB L2-flush buffer (do_bench): tuned there, that memory stayed the pool's
    for good (session 42: a reduce-overhead row first in its process held 260-520 MiB more pool
    than the same row after other rows had tuned its kernels). Another thread's allocations go to
    the ordinary cache, which later allocations reuse and torch.cuda.empty_cache can free."""
    stream = torch.cuda.current_stream() if torch.cuda.is_available() else None

    def on_stream():
        # No autograd on the trials: a new thread records by default, and a trial's restore
        # (clone, then copy_ back) would fail on a tensor that requires grad.
        with torch.cuda.stream(stream), torch.no_grad():  # stream None (no CUDA): no stream to take
            return run()

    with ThreadPoolExecutor(max_workers=1) as worker:
        return worker.submit(on_stream).result()


# ---------------------------------------------------------------------------------------------
# fp32 products on 16-bit tensor cores.


@triton.jit
def split16(x, DT: tl.constexpr):
    """x (fp32) = hi + lo, both in DT: hi + lo carries ~16 of fp32's 24 mantissa bits."""
    hi = x.to(DT)
    return hi, (x - hi.to(tl.float32)).to(DT)


@triton.jit
def dot_f32(a, b, SPLIT_DOT: tl.constexpr):
    """a @ b with fp32 accumulation to about fp32 accuracy. SPLIT_DOT = 0: ieee fp32 dot (FMA
    units). Otherwise SPLIT_DOT is the 16-bit dtype of the tokens (1 = bf16, 2 = fp16): an
    operand already in it is used as is, an fp32 one is split into hi + lo halves, and the
    products of the halves (lo · lo dropped) run on the tensor cores: ~2⁻¹⁶ relative. The pool's
    dots are thin ([N, D] × [D, P] with P ≤ 16): on the FMA path they, not the bytes of tok, set
    its time."""
    if SPLIT_DOT == 0:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        DT: tl.constexpr = tl.bfloat16 if SPLIT_DOT == 1 else tl.float16
        if a.dtype == DT:
            b_hi, b_lo = split16(b, DT)
            return tl.dot(a, b_lo, tl.dot(a, b_hi))
        elif b.dtype == DT:
            a_hi, a_lo = split16(a, DT)
            return tl.dot(a_lo, b, tl.dot(a_hi, b))
        else:
            a_hi, a_lo = split16(a, DT)
            b_hi, b_lo = split16(b, DT)
            return tl.dot(a_lo, b_hi, tl.dot(a_hi, b_lo, tl.dot(a_hi, b_hi)))


@triton.jit
def split_pairs(x, SPLIT_DOT: tl.constexpr):
    """x [M, N] fp32 as [M, 2N] in the 16-bit dtype of SPLIT_DOT (as dot_f32's), columns 2n and
    2n + 1 the hi and lo halves of x[:, n] (split16); SPLIT_DOT = 0: x itself. One dot against
    it (dot_pairs) takes both halves' products, where dot_f32 chains two dots of N columns."""
    if SPLIT_DOT == 0:
        return x
    else:
        hi, lo = split16(x, tl.bfloat16 if SPLIT_DOT == 1 else tl.float16)
        return tl.reshape(tl.join(hi, lo), [x.shape[0], 2 * x.shape[1]])


@triton.jit
def dot16(a, b, SPLIT_DOT: tl.constexpr):
    """a @ b (fp32 accumulation) of operands in the 16-bit dtype of SPLIT_DOT; SPLIT_DOT = 0: an
    ieee fp32 dot."""
    if SPLIT_DOT == 0:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def dot_pairs(a, b2, SPLIT_DOT: tl.constexpr):
    """a @ b, b given as b2 = split_pairs(b): a [M, K] in the 16-bit dtype, b2 [K, 2N], to
    about fp32 accuracy; SPLIT_DOT = 0: an ieee fp32 dot."""
    return sum_pairs(dot16(a, b2, SPLIT_DOT), SPLIT_DOT)


@triton.jit
def sum_pairs(x, SPLIT_DOT: tl.constexpr):
    """[M, 2N] → [M, N], columns 2n and 2n + 1 added: a product a @ split_pairs(b) (the hi and
    lo halves' columns); SPLIT_DOT = 0: x itself."""
    if SPLIT_DOT == 0:
        return x
    else:
        return tl.sum(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]), axis=2)


@triton.jit
def repeat_pairs(v, SPLIT_DOT: tl.constexpr):
    """v [M] as [2M], each value twice (a scale for split_pairs' columns); SPLIT_DOT = 0: v."""
    if SPLIT_DOT == 0:
        return v
    else:
        return tl.reshape(tl.join(v, v), [2 * v.shape[0]])


# ---------------------------------------------------------------------------------------------
# Activations (codes above). u: pre-activation in fp32; u3 = x W3 for swiglu.

GELU_TANH_C = math.sqrt(2.0 / math.pi)
LOG2E = tl.constexpr(1.4426950408889634)


def inline_ptx():
    """Whether the kernels may use inline PTX: not under the interpreter (it runs them in Python)
    nor on ROCm (HIP builds of torch; Triton compiles for AMD GPUs there), where rcp and exp2 take
    `1 / x` and `tl.exp2`, which the backend lowers to its own fast forms."""
    return not interpreting() and torch.version.hip is None


# Read at import, as triton.jit itself reads TRITON_INTERPRET when it wraps a kernel.
_PTX = tl.constexpr(inline_ptx())


@triton.jit
def rcp(x):
    """1 / x in fp32 to 1 ulp (rcp.approx.ftz.f32, one MUFU). `1.0 / x` is div.full with its range
    checks: 18 instructions an element of gelu in the hidden kernel's epilogue (ncu, session 17)."""
    if _PTX:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def exp2(x):
    """2^x in fp32 (ex2.approx.ftz.f32, one MUFU, 2 ulp); tl.exp adds a multiply by log2(e) and
    the non-ftz form's subnormal scaling. Callers fold log2(e) into their constants."""
    if _PTX:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def sigmoid(u):
    """σ(u) = 1 / (1 + e^−u); inf in the denominator (u < −88) gives 0, as it should."""
    return rcp(1.0 + exp2(-LOG2E * u))


@triton.jit
def tanh_gate(u):
    """(σ(2z), σ(2z)σ(−2z)) at gelu_tanh's z = √(2/π)(u + 0.044715u³): gelu_tanh(u) = ½u(1 + tanh z)
    = u σ(2z), and ½(1 − tanh² z) = 2σ(2z)σ(−2z). σ(−2z) is taken as e^−2z σ(2z), not 1 − σ(2z),
    which cancels where σ → 1: act′ by 1 − t² was off by 1.97e-6 at u = 4.96 even with correctly
    rounded fp32 (the GPU test's bound there is 1.98e-6), 9e-5 at u = 12 with σ 2 ulp off. The
    exponent is capped at 126 so that e stays finite below u ≈ −10 (σ → 2^−126, not inf · 0), where
    σ(2z)σ(−2z) stays 2^−126 instead of falling to 0: act_bwd bounds what multiplies it."""
    e = exp2(tl.minimum(-2.0 * LOG2E * 0.7978845608028654 * (u + 0.044715 * u * u * u), 126.0))
    s = rcp(1.0 + e)
    return s, e * s * s


@triton.jit
def gelu_cdf(u):
    """(Φ(u), φ(u)) by Abramowitz and Stegun 7.1.26 (|error| ≤ 1.5e-7 in erf), sharing the
    density's exponential. libdevice's erf re-loads its coefficients with a MOV each at GEMM1's
    254 registers: 1,443 of its epilogue's 4,988 instructions (ncu, session 17)."""
    e = exp2(-0.5 * LOG2E * u * u)  # e^(−u²/2)
    t = rcp(1.0 + 0.23164189550253904 * tl.abs(u))  # p = 0.3275911 / √2
    q = t * (0.127414796 + t * (-0.142248368 + t * (0.7107068705 + t * (-0.7265760135 + t * 0.5307027145)))) * e
    # Φ(u) = 1 − ½erfc(u/√2) at u ≥ 0, ½erfc(−u/√2) below; the a_i above are halved
    return tl.where(u >= 0, 1.0 - q, q), e * 0.3989422804014327


@triton.jit
def act_fwd(u, u3, ACT: tl.constexpr):
    if ACT == 0:  # gelu (erf)
        return u * gelu_cdf(u)[0]
    elif ACT == 1:  # gelu (tanh)
        return u * tanh_gate(u)[0]
    elif ACT == 2:  # silu
        return u * sigmoid(u)
    else:  # swiglu
        return u * sigmoid(u) * u3


@triton.jit
def act_bwd(dh, u, u3, ACT: tl.constexpr):
    """(∂u, ∂u3) given ∂h; ∂u3 is only meaningful for swiglu."""
    if ACT == 0:
        cdf, pdf = gelu_cdf(u)
        return dh * (cdf + u * pdf), dh
    elif ACT == 1:
        # act′ = σ(2z) + 2σ(2z)σ(−2z) z′(w) w at w = max(u, −20): tanh_gate's σσ stays 2^−126 below
        # u ≈ −10, where it falls to 0, so with w = u act′ grew as u³ 2^−126 (1.4 at u = −1e13, session 69).
        # Below u = −10 the term is under 2e-35 either way. t = w σσ first, then times w twice: above
        # u = 1.8e19, where w² overflows, σσ = 0 gives 0 rather than 0 · inf. +64 SASS instructions in
        # the hidden kernel's 4168 at large (offline, sm_90a); clamping both sides cost 256, and σσ
        # without the cap, from e^−2|z|, cost 192 there and 512 in GEMM1's forward's 3864.
        s, ss = tanh_gate(u)
        w = tl.maximum(u, -20.0, propagate_nan=tl.PropagateNan.ALL)  # a NaN u gives a NaN act′, as in eager
        t = w * ss
        return dh * (s + 2.0 * 0.7978845608028654 * (t + 3 * 0.044715 * (t * w) * w)), dh
    else:
        sig = sigmoid(u)
        dsilu = sig * (1.0 + u * (1.0 - sig))
        if ACT == 2:
            return dh * dsilu, dh
        else:
            return dh * u3 * dsilu, dh * (u * sig)


# ---------------------------------------------------------------------------------------------
# The merge on load: the MoE input x = y[r] = ctx[r] + inv[r // H] is formed in registers from
# its two sources (kernels="fused": by the router, and by the MoE's slot-row gather, which
# writes the slot rows); kernels="staged" passes the materialised y as `x_ptr` with HAS_INV=False.


@triton.jit
def load_rows(x_ptr, rows, r_ok, offs_d, d_ok, D):
    """x[rows, offs_d] in x's dtype (0 where masked): x_ptr [R,D] row-major."""
    return tl.load(x_ptr + rows.to(tl.int64)[:, None] * D + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                   other=0.0)


@triton.jit
def load_x(x_ptr, inv_ptr, rows, r_ok, offs_d, d_ok, H, D, HAS_INV: tl.constexpr):
    """x[rows, offs_d] in fp32: x_ptr [R,D] row-major, plus inv [R/H, D] when HAS_INV. rows are
    int32 (R < 2³¹), and so is their division by H: in int64 it took the medium router's forward
    1568 → 1392 SASS instructions and its merged ∂Wg 2312 → 1864 (offline, sm_90a)."""
    x = load_rows(x_ptr, rows, r_ok, offs_d, d_ok, D).to(tl.float32)
    if HAS_INV:
        x += load_rows(inv_ptr, rows // H, r_ok, offs_d, d_ok, D)
    return x
