"""triton_util.Launcher's bookkeeping on the GPU path, with stand-ins for the kernel and for
triton.autotune (the tuned path only runs on CUDA): tune once per key, log the choice, then
launch the chosen config directly; leave out of autotuning the configs that do not build."""
import functools
import logging
import threading
import types

import pytest
import torch
import triton
import triton.language as tl

from kernel_cases import read_at_import
from mha_compile.kernels import triton_util


@triton.jit
def _noop(x_ptr, N, BLOCK: tl.constexpr):
    pass


def _launcher(kernel, configs):
    """A Launcher built on a real (never launched) kernel, its launches then going to `kernel`."""
    launcher = triton_util.Launcher(_noop, configs, key=["N"])
    launcher.kernel = kernel
    return launcher


class _Kernel:
    """A @triton.jit kernel's launch surface, kernel[grid](*args, **kwargs), and its warmup's, whose
    builds all load on the GPU."""
    arg_names = ["x_ptr", "N", "BLOCK"]
    __name__ = "_fake_kernel"

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))

    def warmup(self, grid, **kwargs):
        return types.SimpleNamespace(_init_handles=lambda: None)


class _Autotuner:
    def __init__(self, chosen):
        self.tunes, self.chosen = [], chosen
        self.best_config = self

    def all_kwargs(self):
        return dict(self.chosen)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.tunes.append((grid({"BLOCK": 64}), args, kwargs))


def _tuned_launcher(monkeypatch):
    """(kernel, launcher) on the tuned GPU path: two configs, the stand-in autotuner choosing the
    second."""
    monkeypatch.setattr(triton_util, "on_gpu", lambda t: True)
    monkeypatch.setattr(triton_util, "NO_AUTOTUNE", False)
    kernel = _Kernel()
    launcher = _launcher(kernel, [dict(BLOCK=32, num_warps=4), dict(BLOCK=64, num_warps=8)])
    launcher.tuned = _Autotuner(dict(BLOCK=64, num_warps=8, num_stages=3, maxnreg=None))
    return kernel, launcher


def _grid(meta):
    return (meta["BLOCK"],)


def test_tunes_once_per_key_logs_the_choice_then_launches_it(monkeypatch, caplog):
    kernel, launcher = _tuned_launcher(monkeypatch)
    x, grid = torch.zeros(4), _grid
    with caplog.at_level(logging.INFO, logger="mha_compile"):
        launcher(grid, x, 100)
    assert len(launcher.tuned.tunes) == 1 and not kernel.launches
    assert "_fake_kernel chose {'BLOCK': 64, 'num_warps': 8, 'num_stages': 3}" in caplog.text
    launcher(grid, x, 100)  # same key: the chosen config, launched directly
    assert len(launcher.tuned.tunes) == 1
    assert kernel.launches == [((64,), (x, 100), dict(BLOCK=64, num_warps=8, num_stages=3, maxnreg=None))]
    launcher(grid, x, 200)  # a new key tunes again
    assert len(launcher.tuned.tunes) == 2


def test_no_autotuning_inside_a_cuda_graph_capture(monkeypatch, caplog):
    """A key first met while a CUDA graph is being captured launches the first config untuned
    (timing trials synchronise, which fails the capture), says so once, and is tuned at its first
    call outside a capture."""
    kernel, launcher = _tuned_launcher(monkeypatch)
    monkeypatch.setattr(triton_util, "capturing", lambda: True)
    x, grid = torch.zeros(4), _grid
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        launcher(grid, x, 300)
        launcher(grid, x, 300)
    assert not launcher.tuned.tunes
    assert kernel.launches == [((32,), (x, 300), dict(BLOCK=32, num_warps=4))] * 2
    assert caplog.text.count("first inside a CUDA graph capture") == 1
    monkeypatch.setattr(triton_util, "capturing", lambda: False)
    launcher(grid, x, 300)
    assert len(launcher.tuned.tunes) == 1


def test_autotuning_runs_on_a_thread_of_its_own_and_passes_its_errors_on(monkeypatch):
    """The trials run outside the calling thread (whose allocations a CUDA-graph warm-up sends to
    the graph's pool: outside_graph_pools), without autograd, and a failing trial still raises in
    the caller."""
    kernel, launcher = _tuned_launcher(monkeypatch)
    threads = []
    tune = launcher.tuned

    class _Recording(_Autotuner):
        def __getitem__(self, grid):
            return lambda *args, **kwargs: threads.append((threading.get_ident(), torch.is_grad_enabled()))

    launcher.tuned = _Recording(tune.chosen)
    launcher(_grid, torch.zeros(4), 100)
    assert threads and threads[0] == (threads[0][0], False) and threads[0][0] != threading.get_ident()

    class _Failing(_Autotuner):
        def __getitem__(self, grid):
            def fail(*args, **kwargs):
                raise RuntimeError("trial failed")
            return fail

    launcher.tuned = _Failing(tune.chosen)
    with pytest.raises(RuntimeError, match="trial failed"):
        launcher(_grid, torch.zeros(4), 200)


def test_first_config_without_autotuning(monkeypatch):
    """MHA_COMPILE_NO_AUTOTUNE (the GPU tests) and the interpreter launch the first config."""
    monkeypatch.setattr(triton_util, "NO_AUTOTUNE", True)
    monkeypatch.setattr(triton_util, "on_gpu", lambda t: True)
    kernel = _Kernel()
    launcher = _launcher(kernel, [dict(BLOCK=32, num_warps=4), dict(BLOCK=64, num_warps=8)])
    launcher(lambda meta: (meta["BLOCK"],), torch.zeros(4), 100)
    assert kernel.launches[0][0] == (32,) and kernel.launches[0][2] == dict(BLOCK=32, num_warps=4)
    monkeypatch.setattr(triton_util, "on_gpu", lambda t: False)  # the interpreter: no warps
    launcher(lambda meta: (meta["BLOCK"],), torch.zeros(4), 100)
    assert kernel.launches[1][2] == dict(BLOCK=32)


def test_a_register_cap_is_a_compiler_option_not_a_meta_parameter(monkeypatch):
    """A config's maxnreg goes to Triton's config and to a GPU launch as the compiler's option, never
    to the kernel as a meta-parameter, and the interpreter gets none of it."""
    launcher = triton_util.Launcher(_noop, [dict(BLOCK=32, num_warps=4, maxnreg=128), dict(BLOCK=64, num_warps=8)],
                                    key=["N"])
    capped, plain = launcher.tuned.configs
    assert capped.maxnreg == 128 and capped.kwargs == {"BLOCK": 32} and plain.maxnreg is None
    monkeypatch.setattr(triton_util, "NO_AUTOTUNE", True)
    monkeypatch.setattr(triton_util, "on_gpu", lambda t: True)
    kernel = _Kernel()
    launcher.kernel = kernel
    launcher(lambda meta: (meta["BLOCK"],), torch.zeros(4), 100)
    assert kernel.launches[0][2] == dict(BLOCK=32, num_warps=4, maxnreg=128)
    monkeypatch.setattr(triton_util, "on_gpu", lambda t: False)
    launcher(lambda meta: (meta["BLOCK"],), torch.zeros(4), 100)
    assert kernel.launches[1][2] == dict(BLOCK=32)


def test_descriptor_block_shapes_follow_the_config(monkeypatch):
    """A descriptor argument's block shape is set from each config: before a plain launch of
    the chosen config, and by every autotune trial's pre_hook; pointer arguments are left alone."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    monkeypatch.setattr(triton_util, "on_gpu", lambda t: True)
    monkeypatch.setattr(triton_util, "NO_AUTOTUNE", False)
    configs = [dict(BLOCK=32, num_warps=4), dict(BLOCK=64, num_warps=8)]
    blocks = lambda meta: dict(x_ptr=(meta["BLOCK"] // 2, 16))  # noqa: E731
    launcher = triton_util.Launcher(_noop, configs, key=["N"], blocks=blocks)
    x = torch.zeros(64, 16)
    desc = TensorDescriptor.from_tensor(x, [1, 1])
    # autotune trials: each config's pre_hook sets the shape for that config
    for config, want in zip(launcher.tuned.configs, ([16, 16], [32, 16])):
        config.pre_hook({"x_ptr": desc, "N": 100, **config.kwargs})
        assert desc.block_shape == want
    config.pre_hook({"x_ptr": x, "N": 100, **config.kwargs})  # a plain tensor: untouched, no error
    # the chosen config's plain launch
    kernel = _Kernel()
    launcher.kernel = kernel
    launcher.tuned = _Autotuner(dict(BLOCK=32, num_warps=4, num_stages=3))
    launcher(lambda meta: (1,), desc, 100)  # tunes (the stand-in launches nothing)
    launcher(lambda meta: (1,), desc, 100)  # launches the choice: its blocks first
    assert kernel.launches and desc.block_shape == [16, 16]


def test_tma_device_needs_hopper(monkeypatch):
    """TMA descriptors on a GPU of compute capability 9 or later, or the interpreter's CPU;
    never on an earlier GPU or for meta tensors (unless bench/offline_sass.py says so)."""
    monkeypatch.setattr(triton_util, "capability", lambda device: (8, 0))
    assert not triton_util.tma_device(torch.device("cuda"))
    monkeypatch.setattr(triton_util, "capability", lambda device: (9, 0))
    assert triton_util.tma_device(torch.device("cuda"))
    assert triton_util.tma_device(torch.device("cpu"))
    assert not triton_util.tma_device(torch.device("meta"))
    # alignment: F = 47 fp32 rows (188 bytes) are not 16-byte strides; a contiguous [4, 48] is
    assert triton_util.tma_ok(torch.zeros(4, 48)) and not triton_util.tma_ok(torch.zeros(4, 47))
    assert not triton_util.tma_ok(torch.zeros(48, 4).t())  # last dimension not contiguous


def test_gpus_before_sm80_take_the_reference_path(monkeypatch):
    """device_reason: a CUDA GPU older than sm_80 (a T4's sm_75: no bf16 tensor-core dots in Triton,
    64 KB of shared memory a block) sends the region to the reference path, with the reason; sm_80
    and later take the kernels; a fake CUDA tensor on a machine without CUDA is not asked about."""
    from mha_compile.kernels import triton_region
    def fresh():  # the answer is kept a device: a cache of this test's own, dropped after it
        monkeypatch.setattr(triton_util, "_gpu_reason", functools.lru_cache(None)(triton_util._gpu_reason.__wrapped__))
    gpu = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=torch.float16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton_util, "capability", lambda device: (7, 5))
    fresh()
    reason = "a GPU of sm_75 runs on the reference path (the Triton kernels need sm_80 or newer)"
    assert triton_util.device_reason(gpu) == reason
    assert triton_region.why_unsupported(gpu, gpu, gpu, 2, "gelu", None) == reason
    for capability in ((8, 0), (8, 9), (9, 0)):
        monkeypatch.setattr(triton_util, "capability", lambda device, c=capability: c)
        fresh()
        assert triton_util.device_reason(gpu) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(triton_util, "capability", lambda device: pytest.fail("read a GPU's properties"))
    fresh()
    assert triton_util.device_reason(gpu) is None


class _Warmups:
    """JITFunction.warmup's surface: records each build, fails those `fails` says."""
    __name__ = "_fake_kernel"

    def __init__(self, fails):
        self.builds, self.fails = [], fails

    def warmup(self, grid, **kwargs):
        self.builds.append(kwargs)
        if self.fails(kwargs):
            raise RuntimeError("PassManager::run failed\n(the compiler's dump)")


def test_autotuning_leaves_out_configs_that_do_not_build(caplog):
    """Triton's autotuner raises when a config fails to build; the Launcher's early prune builds
    each config first, logs and drops a failure, and times the rest."""
    launcher = triton_util.Launcher(_noop, [dict(BLOCK=32, num_warps=4), dict(BLOCK=64, num_warps=8)], key=["N"])
    assert launcher.tuned.early_config_prune == launcher._buildable
    launcher.kernel = _Warmups(lambda kwargs: kwargs["BLOCK"] == 64)
    x = torch.zeros(4)
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        kept = launcher._buildable(launcher.tuned.configs, {"x_ptr": x, "N": 100}, grid=lambda meta: (1,),
                                   warmup=False)
    assert [c.kwargs for c in kept] == [{"BLOCK": 32}]
    assert "_fake_kernel does not build under {'BLOCK': 64} (RuntimeError: PassManager::run failed)" in caplog.text
    # each build with the call's arguments and the config's meta-parameters, not the launch's grid
    assert [(b["x_ptr"] is x, b["N"], b["BLOCK"], b["num_warps"]) for b in launcher.kernel.builds] == [
        (True, 100, 32, 4), (True, 100, 64, 8)]
    assert all("warmup" not in b and "grid" not in b for b in launcher.kernel.builds)


def test_autotuning_with_no_config_that_builds_says_so():
    launcher = triton_util.Launcher(_noop, [dict(BLOCK=32), dict(BLOCK=64)], key=["N"])
    launcher.kernel = _Warmups(lambda kwargs: True)
    with pytest.raises(RuntimeError, match="_fake_kernel builds under none of its configs") as error:
        launcher._buildable(launcher.tuned.configs, {"x_ptr": torch.zeros(4), "N": 100}, grid=None, warmup=False)
    assert "{'BLOCK': 32}" in str(error.value) and "{'BLOCK': 64}" in str(error.value)


@triton.jit
def _copy(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < N), mask=offs < N)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_autotuning_survives_a_config_that_does_not_build_cuda(monkeypatch):
    """On the GPU: BLOCK 48 fails to build (tl.arange needs a power of two), which Triton's own
    autotuner would raise; the Launcher times BLOCK 64 alone and copies right."""
    monkeypatch.setattr(triton_util, "NO_AUTOTUNE", False)
    launcher = triton_util.Launcher(_copy, [dict(BLOCK=48), dict(BLOCK=64)], key=["N"])
    x = torch.randn(1000, device="cuda")
    y = torch.empty_like(x)
    launcher(lambda meta: (triton.cdiv(1000, meta["BLOCK"]),), x, y, 1000)
    assert torch.equal(y, x)
    assert list(launcher.best.values())[0]["BLOCK"] == 64


def _pool_bytes(pool):
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if tuple(s.get("segment_pool_id", (0, 0))) == tuple(pool))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_autotuning_in_a_graph_warmup_leaves_its_pool_alone_cuda(monkeypatch):
    """A key first tuned while cudagraph trees warm a graph up (every allocation of the thread sent
    to the graph's pool): the trials' 256 MB flush buffer does not stay in that pool. The control,
    Triton's do_bench called in the same warm-up, shows the pool would keep it."""
    from torch._inductor.cudagraph_trees import _use_cuda_memory_pool_manager
    monkeypatch.setattr(triton_util, "NO_AUTOTUNE", False)
    launcher = triton_util.Launcher(_copy, [dict(BLOCK=64), dict(BLOCK=128)], key=["N"])
    x = torch.randn(1013, device="cuda")
    y = torch.empty_like(x)
    pools = []
    for tune in (lambda: launcher(lambda meta: (triton.cdiv(1013, meta["BLOCK"]),), x, y, 1013),
                 lambda: triton.testing.do_bench(lambda: y.copy_(x), warmup=1, rep=1)):
        pool = torch.cuda.graph_pool_handle()
        graph, first = torch.cuda.CUDAGraph(), torch.empty(1, device="cuda")
        with torch.cuda.graph(graph, pool=pool):  # the pool exists once a capture used it
            first.add_(1)
        with _use_cuda_memory_pool_manager(x.device.index, pool, torch.cuda.Stream()):
            tune()
        torch.cuda.synchronize()
        pools.append(_pool_bytes(pool) / 2**20)
    assert torch.equal(y, x)
    assert pools[0] < 32 and pools[1] > 200, f"pool MiB after the Launcher's tuning, after do_bench: {pools}"


def test_device_properties_are_read_once_a_device(monkeypatch):
    """capability and num_sms ask torch once per device (each ask costs host time per launch)."""
    asked = []
    props = {2: types.SimpleNamespace(major=9, minor=0, multi_processor_count=132),
             3: types.SimpleNamespace(major=8, minor=6, multi_processor_count=84)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: asked.append(index) or props[index])
    triton_util._cuda_properties.cache_clear()
    try:
        for _ in range(3):
            assert triton_util.capability(torch.device("cuda", 2)) == (9, 0)
            assert triton_util.num_sms(torch.device("cuda", 2)) == 132
            assert triton_util.capability(torch.device("cuda", 3)) == (8, 6)
        assert sorted(asked) == [2, 3]
    finally:
        triton_util._cuda_properties.cache_clear()


# Compile-time parameters a kernel's key may leave out, and why: each follows from the key (the
# sizes and dtypes in it) or is a module constant, so it cannot differ between calls of one key.
DERIVED = {
    "PRECISION": "from the operands' dtype, which the key holds",
    "BLOCK_D": "from D", "BLOCK_P": "from P", "BLOCK_Q": "from P", "BLOCK_DH": "from D and P", "BLOCK_E": "from E",
    "BLOCK_H": "from H", "BLOCK_C": "from N_FBLK", "GW_BLOCK": "a module constant",
}


def test_every_compile_time_flag_is_in_its_kernels_autotune_key():
    """Each Launcher's constexpr parameters are tuned (in its configs), in its key, or DERIVED:
    HAS_B1, HAS_BIAS, HAS_SCALE and SUM_H were not, so GEMM2 (bias, scale) and ∂x (neither), or
    a layer with b1 and one without, shared one chosen config that the other had never built."""
    from mha_compile.kernels import triton_matmul, triton_moe, triton_pool, triton_router
    missing = {}
    for module in (triton_matmul, triton_moe, triton_pool, triton_router):
        for name, launcher in vars(module).items():
            if not isinstance(launcher, triton_util.Launcher):
                continue
            tuned = set().union(*launcher.configs)
            kernel = launcher.kernel  # under TRITON_INTERPRET=1 an InterpretedFunction: read the source's
            params = kernel.params if hasattr(kernel, "params") else triton.runtime.jit.JITFunction(kernel.fn).params
            flags = [p.name for p in params if p.is_constexpr]
            left = [f for f in flags if f not in tuned and f not in launcher.key and f not in DERIVED]
            if left:
                missing[f"{module.__name__}.{name}"] = left
    assert not missing, f"compile-time parameters in no autotune key: {missing}"


class _Compiled:
    """A CompiledKernel's launch surface: compiled[grid](*every parameter's value, in order)."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


class _JitKernel:
    """A @triton.jit kernel's surface for triton_util.launch: its parameters (name, default) and
    kernel[grid](*args, **kwargs), which launches and returns the compiled kernel, as
    JITFunction.run does."""
    params = [types.SimpleNamespace(name=name, default=default)
              for name, default in (("x_ptr", None), ("N", None), ("scale", 0.5), ("BLOCK", None))]
    __name__ = "_fake_jit_kernel"

    def __init__(self, compiled=None):
        self.runs, self.compiled = [], []
        self.make = compiled or _Compiled

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.runs.append((grid, args, kwargs))
            self.compiled.append(self.make())
            return self.compiled[-1]
        return run


class _CompiledWithLauncher(_Compiled):
    """A CompiledKernel whose launcher is a CudaLauncher (built without compiling anything) with
    `launch` recording its arguments, as _direct_launch finds Triton 3.6's."""
    function, packed_metadata = 1234, (4, 1, 0)

    def __init__(self, scratch=0):
        from triton.backends.nvidia.driver import CudaLauncher
        super().__init__()
        self.direct = []
        self.run = object.__new__(CudaLauncher)
        self.run.launch = lambda *args: self.direct.append(args)
        self.run.global_scratch_size = self.run.profile_scratch_size = scratch
        self.run.launch_cooperative_grid, self.run.launch_pdl = False, True


def _on_the_gpu(monkeypatch):
    """launch's GPU path with CPU tensors standing in for CUDA ones."""
    monkeypatch.setattr(triton_util, "interpreting", lambda: False)
    monkeypatch.setattr(triton_util, "on_gpu", lambda t: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton_util, "_launches", {})


def test_a_launch_signature_compiled_once_then_launches_its_compiled_kernel(monkeypatch):
    """triton_util.launch: the first launch of a signature goes through kernel[grid] (JITFunction.run);
    the next ones with the same signature go to the compiled kernel it returned, with every
    parameter's value in order (the keyword, else the default) and the grid padded to three."""
    _on_the_gpu(monkeypatch)
    kernel, x = _JitKernel(), torch.zeros(8)
    triton_util.launch(kernel, (3,), x, 100, BLOCK=32, num_warps=4)
    assert kernel.runs == [((3,), (x, 100), dict(BLOCK=32, num_warps=4))]
    triton_util.launch(kernel, (5, 2), x, 100, BLOCK=32, num_warps=4)
    assert len(kernel.runs) == 1 and kernel.compiled[0].launches == [((5, 2, 1), (x, 100, 0.5, 32))]
    for _ in range(2):  # another signature: the default given as a keyword
        triton_util.launch(kernel, (7,), x, 100, scale=0.25, BLOCK=32, num_warps=4)
    assert len(kernel.runs) == 2 and kernel.compiled[1].launches == [((7, 1, 1), (x, 100, 0.25, 32))]


@pytest.mark.parametrize("change", ["int", "bool for 1", "dtype", "alignment", "constexpr", "option", "device"])
def test_a_launch_that_triton_could_compile_apart_goes_through_jit_run(monkeypatch, change):
    """Every change Triton may specialise on takes a launch of its own through kernel[grid]: an
    int's value (1 and multiples of 16 are specialised), True against 1, a tensor's dtype, its
    address no longer a multiple of 16, a constexpr, a launch option, the device."""
    _on_the_gpu(monkeypatch)
    kernel, x = _JitKernel(), torch.zeros(8)
    args, kwargs = [x, 1], dict(BLOCK=32, num_warps=4)
    triton_util.launch(kernel, (1,), *args, **kwargs)
    if change == "int":
        args[1] = 16
    elif change == "bool for 1":
        args[1] = True
    elif change == "dtype":
        args[0] = x.half()
    elif change == "alignment":
        args[0] = x[1:]
    elif change == "constexpr":
        kwargs["BLOCK"] = 64
    elif change == "option":
        kwargs["num_warps"] = 8
    else:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    triton_util.launch(kernel, (1,), *args, **kwargs)
    assert len(kernel.runs) == 2 and not kernel.compiled[0].launches


@pytest.mark.parametrize("why", ["flag off", "interpreter", "tensor off the GPU", "another kind", "a stand-in"])
def test_launches_that_cannot_be_keyed_always_go_through_jit_run(monkeypatch, why):
    """MHA_COMPILE_FAST_LAUNCH=0, the interpreter, a tensor off the GPU and an argument of a kind
    launch_key does not know send every launch through kernel[grid], as does a stand-in for a
    kernel without Triton's parameter list (a test's spy wrapping the real one: session 38's GPU
    suite failed on one)."""
    _on_the_gpu(monkeypatch)
    kernel, arg = _JitKernel(), torch.zeros(8)
    if why == "a stand-in":
        kernel.params = None
    if why == "flag off":
        monkeypatch.setattr(triton_util, "FAST_LAUNCH", False)
    elif why == "interpreter":
        monkeypatch.setattr(triton_util, "interpreting", lambda: True)
    elif why == "tensor off the GPU":
        monkeypatch.setattr(triton_util, "on_gpu", lambda t: False)
    elif why == "another kind":
        arg = object()
    for _ in range(3):
        triton_util.launch(kernel, (1,), arg, 100, BLOCK=32)
    assert len(kernel.runs) == 3 and not any(c.launches for c in kernel.compiled)


def test_the_fast_launches_are_on_by_default():
    """MHA_COMPILE_FAST_LAUNCH=0 turns them off (read at import)."""
    read = [read_at_import("mha_compile.kernels.triton_util", "FAST_LAUNCH", "MHA_COMPILE_FAST_LAUNCH", value)
            for value in ("0", None)]
    assert read == ["False", "True"]


@triton.jit
def _scale(x_ptr, y_ptr, N, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < N) * scale, mask=offs < N)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fast_launches_compute_what_jit_run_does_cuda(monkeypatch):
    """On the GPU: triton_util.launch goes through JITFunction.run once a signature (the same
    one again, a misaligned x, another N) and gets each call right, a float argument's new value
    read as given; the kept launches call Triton's launch function directly, and go through
    CompiledKernel[grid] while a launch hook is set."""
    from triton.runtime.jit import JITFunction

    monkeypatch.setattr(triton_util, "FAST_LAUNCH", True)
    monkeypatch.setattr(triton_util, "_launches", {})
    runs = []
    real = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: runs.append(1) or real(self, *a, **k))
    x = torch.randn(1001, device="cuda")
    for view, scale, expected_runs in ((x[:1000], 2.0, 1), (x[:1000], 3.0, 1), (x[1:], 0.5, 2), (x[:999], 4.0, 3),
                                       (x[:1000], -1.0, 3)):
        y = torch.empty_like(view)
        triton_util.launch(_scale, (triton.cdiv(view.numel(), 128),), view, y, view.numel(), scale, BLOCK=128)
        assert torch.equal(y, view * scale) and len(runs) == expected_runs
    assert len(triton_util._launches) == 3
    assert all(direct is not None for _, _, direct in triton_util._launches.values())  # Triton 3.6's launcher
    # A launch hook set (as a profiler sets one): a kept signature's launch goes through
    # CompiledKernel[grid] again and the hook sees it.
    from triton import knobs
    names = []
    hook = lambda metadata: names.append(metadata.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        y = torch.empty(1000, device="cuda")
        triton_util.launch(_scale, (8,), x[:1000], y, 1000, 5.0, BLOCK=128)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert torch.equal(y, x[:1000] * 5.0) and names == ["_scale"] and len(runs) == 3


@pytest.mark.parametrize("why_not", [None, "hook", "hook assigned", "scratch", "DIRECT_LAUNCH off"])
def test_a_kept_launch_calls_tritons_launch_function_directly(monkeypatch, why_not):
    """A kept signature whose compiled kernel has Triton's CudaLauncher and needs no scratch
    memory: its later launches call the launcher's launch function with what CompiledKernel[grid]
    and CudaLauncher would pass (grid, the current stream, the kernel, cooperative, pdl, no scratch,
    the packed metadata, no hooks, every parameter's value). With a launch hook set (a profiler;
    added to Triton's hook chain, or a function put in its place), or scratch memory to allocate,
    or DIRECT_LAUNCH off, they go through compiled[grid], which runs them."""
    from triton import knobs

    _on_the_gpu(monkeypatch)
    monkeypatch.setattr(triton_util, "_raw_stream", lambda device: 1000 + device)
    monkeypatch.setattr(triton_util, "DIRECT_LAUNCH", why_not != "DIRECT_LAUNCH off")
    kernel, x = _JitKernel(lambda: _CompiledWithLauncher(256 if why_not == "scratch" else 0)), torch.zeros(8)
    triton_util.launch(kernel, (5, 2), x, 100, BLOCK=32, num_warps=4)
    hooks, called = knobs.runtime.launch_enter_hook, []
    if why_not == "hook":
        hooks.add(called.append)
    if why_not == "hook assigned":  # a function in the HookChain's place
        monkeypatch.setattr(knobs.runtime, "launch_exit_hook", called.append)
    try:
        triton_util.launch(kernel, (5, 2), x, 100, BLOCK=32, num_warps=4)
    finally:
        hooks.remove(called.append)
    compiled, = kernel.compiled
    assert len(kernel.runs) == 1
    if why_not:
        assert not compiled.direct and compiled.launches == [((5, 2, 1), (x, 100, 0.5, 32))]
    else:
        assert not compiled.launches
        assert compiled.direct == [(5, 2, 1, 1000, 1234, False, True, None, None, (4, 1, 0), None, None, None,
                                    x, 100, 0.5, 32)]


def test_a_launchers_remembered_config_launches_directly_on_its_device(monkeypatch):
    """Launcher's own launch key (the call's, then the config's meta-parameters) ends in the
    config, not the device: the direct launch takes the stream of the device the kernel was
    launched on first (device 2 here)."""
    _on_the_gpu(monkeypatch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(triton_util, "_raw_stream", lambda device: 1000 + device)
    monkeypatch.setattr(triton_util, "NO_AUTOTUNE", True)
    kernel, x = _JitKernel(_CompiledWithLauncher), torch.zeros(8)
    launcher = _launcher(kernel, [dict(BLOCK=32, num_warps=4), dict(BLOCK=64, num_warps=8)])
    for _ in range(2):
        launcher(_grid, x, 100)
    compiled, = kernel.compiled
    assert len(kernel.runs) == 1 and not compiled.launches
    assert compiled.direct == [(32, 1, 1, 1002, 1234, False, True, None, None, (4, 1, 0), None, None, None,
                                x, 100, 0.5, 32)]


@pytest.mark.parametrize("gluon,change", [(gluon, change) for gluon in (False, True)
                                          for change in (None, "block shape", "shape", "strides", "dtype")]
                         + [(True, "layout")])
def test_a_descriptor_is_keyed_by_every_field_but_its_address(monkeypatch, gluon, change):
    """A TMA descriptor argument (Triton's, or Gluon's with its shared-memory layout): the same
    fields on another buffer launch the compiled kernel; a change of any field Triton may compile
    for, or that the launcher builds the descriptor from, goes through kernel[grid] again."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor

    _on_the_gpu(monkeypatch)

    def descriptor(t, block, dtype=gl.float32):
        if gluon:
            return GluonTensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dtype))
        return TensorDescriptor.from_tensor(t, block)

    kernel = _JitKernel()
    triton_util.launch(kernel, (1,), descriptor(torch.zeros(64, 64), [16, 32]), 100, BLOCK=32)
    t, block, dtype = torch.zeros(64, 64), [16, 32], gl.float32
    if change == "block shape":
        block = [32, 32]
    elif change == "shape":
        t = torch.zeros(128, 64)
    elif change == "strides":
        t = torch.zeros(64, 128)[:, :64]
    elif change == "dtype":
        t, dtype = t.half(), gl.float16
    elif change == "layout":  # Gluon's: another swizzle for the same block
        dtype = gl.float16
    triton_util.launch(kernel, (1,), descriptor(t, block, dtype), 100, BLOCK=32)
    assert len(kernel.runs) == (1 if change is None else 2)
    assert len(kernel.compiled[0].launches) == (1 if change is None else 0)


def test_a_launchers_config_is_remembered_by_the_calls_launch_key(monkeypatch):
    """Launcher on the GPU path: a call's config (the first, under MHA_COMPILE_NO_AUTOTUNE) goes
    through kernel[grid] once; the same call again launches the compiled kernel at once with the
    config's meta-parameters in their parameters' places. With autotuning back on, the same call
    tunes its key: what was remembered under NO_AUTOTUNE is not its choice."""
    _on_the_gpu(monkeypatch)
    monkeypatch.setattr(triton_util, "NO_AUTOTUNE", True)
    kernel, x = _JitKernel(), torch.zeros(8)
    launcher = _launcher(kernel, [dict(BLOCK=32, num_warps=4), dict(BLOCK=64, num_warps=8)])
    for _ in range(3):
        launcher(_grid, x, 100)
    assert kernel.runs == [((32,), (x, 100), dict(BLOCK=32, num_warps=4))]
    assert kernel.compiled[0].launches == [((32, 1, 1), (x, 100, 0.5, 32))] * 2
    monkeypatch.setattr(triton_util, "NO_AUTOTUNE", False)
    launcher.tuned = _Autotuner(dict(BLOCK=64, num_warps=8))
    launcher(_grid, x, 100)
    assert len(launcher.tuned.tunes) == 1


class _Loads:
    """A kernel's warmup surface whose builds load on the GPU or run out of its resources."""
    arg_names = ["x_ptr", "N", "BLOCK"]
    __name__ = "_fake_kernel"

    def __init__(self, too_big):
        self.too_big, self.builds = too_big, []

    def warmup(self, grid, **kwargs):
        self.builds.append(kwargs["BLOCK"])
        too_big = self.too_big(kwargs)

        def load():
            if too_big:
                raise triton_util.OutOfResources(241664, 232448, "shared memory")
        return types.SimpleNamespace(_init_handles=load)


def test_fits_where_a_config_loads_and_an_untuned_launch_takes_the_first_that_does(monkeypatch, caplog):
    """Launcher.fits: whether any config's build for the call loads on the GPU (built in turn up to
    the first that does, once an autotune key; off the GPU always True); an untuned launch
    (MHA_COMPILE_NO_AUTOTUNE) takes that first config rather than one that would run out of the
    GPU's resources; launch_where_fits launches only where one fits."""
    monkeypatch.setattr(triton_util, "NO_AUTOTUNE", True)
    launcher = triton_util.Launcher(_noop, [dict(BLOCK=32, num_warps=4), dict(BLOCK=64, num_warps=8),
                                            dict(BLOCK=128, num_warps=8)], key=["N"])
    launcher.kernel = _Loads(lambda kwargs: kwargs["BLOCK"] == 32)
    x = torch.zeros(4)
    assert launcher.fits(x, 100)  # off the GPU: nothing built
    assert launcher.kernel.builds == []
    monkeypatch.setattr(triton_util, "on_gpu", lambda t: True)
    with caplog.at_level(logging.INFO, logger="mha_compile"):
        assert launcher.fits(x, 100)
        assert launcher.fits(x, 100)  # the same key: not built again
    assert launcher.kernel.builds == [32, 64]
    assert "_fake_kernel under {'BLOCK': 32, 'num_warps': 4} does not fit the GPU" in caplog.text
    launched = []
    monkeypatch.setattr(triton_util, "launch_keyed", lambda kernel, key, grid, args, kwargs: launched.append(kwargs))
    launcher(lambda meta: (1,), x, 100)
    assert launched == [dict(BLOCK=64, num_warps=8)]
    launcher.kernel.too_big = lambda kwargs: True
    assert not launcher.fits(x, 200)  # another key: built again, and none loads
    assert launcher.kernel.builds == [32, 64, 32, 64, 128]
    launcher.configs = [dict(BLOCK=128, num_warps=8)]  # a probe's or test's one config: its own answer
    assert not launcher.fits(x, 100)
    assert launcher.kernel.builds[-1] == 128
    # launch_where_fits: nothing launched where no config fits; else the first that does
    launcher.kernel.too_big = lambda kwargs: kwargs["BLOCK"] != 64
    assert not launcher.launch_where_fits(lambda meta: (1,), x, 300)
    assert len(launched) == 1
    launcher.configs = [dict(BLOCK=128, num_warps=8), dict(BLOCK=64, num_warps=8)]
    assert launcher.launch_where_fits(lambda meta: (1,), x, 300)
    assert launched[1:] == [dict(BLOCK=64, num_warps=8)]


def test_launch_where_fits_keeps_its_answer_by_the_calls_launch_key(monkeypatch):
    """launch_where_fits asks fits once a call signature (its launch_key) and config list: the same
    call again launches (or not) on the kept answer, without working out the autotune key; another
    signature, or another config list swapped in, asks again."""
    _on_the_gpu(monkeypatch)
    monkeypatch.setattr(triton_util, "NO_AUTOTUNE", True)
    launcher = triton_util.Launcher(_noop, [dict(BLOCK=32, num_warps=4), dict(BLOCK=64, num_warps=8)], key=["N"])
    launcher.kernel = _Loads(lambda kwargs: kwargs["BLOCK"] == 32)
    asked, launched = [], []
    fits = launcher.fits
    monkeypatch.setattr(launcher, "fits", lambda *args: asked.append(args[1]) or fits(*args))
    monkeypatch.setattr(triton_util, "launch_keyed", lambda kernel, key, grid, args, kwargs: launched.append(kwargs))
    x = torch.zeros(4)
    assert all(launcher.launch_where_fits(lambda meta: (1,), x, 100) for _ in range(3))
    assert asked == [100] and launched == [dict(BLOCK=64, num_warps=8)] * 3
    launcher.kernel.too_big = lambda kwargs: True
    assert not any(launcher.launch_where_fits(lambda meta: (1,), x, 200) for _ in range(2))
    assert asked == [100, 200] and len(launched) == 3
    launcher.configs = [dict(BLOCK=64, num_warps=8)]  # swapped in: asked again, and none fits now
    assert not launcher.launch_where_fits(lambda meta: (1,), x, 100)
    assert asked == [100, 200, 100] and len(launched) == 3


def test_an_untimed_launcher_takes_the_first_config_that_fits(monkeypatch, caplog):
    """Launcher(tune=False) (the router's ∂Wg: num_stages 3, 2, 1): no autotuner, and on the GPU,
    autotuning on or off, each call takes the first config whose build fits (here stages 3 runs out
    of shared memory, as on sm_86), with the call's own launch options (num_warps) beside it."""
    monkeypatch.setattr(triton_util, "on_gpu", lambda t: True)
    monkeypatch.setattr(triton_util, "NO_AUTOTUNE", False)
    launcher = triton_util.Launcher(_noop, [dict(num_stages=3), dict(num_stages=2), dict(num_stages=1)],
                                    key=["N", "BLOCK", "num_warps"], tune=False)
    assert launcher.tuned is None
    built = []

    class Stages:
        arg_names, __name__ = ["x_ptr", "N"], "_fake_kernel"

        def warmup(self, grid, **kwargs):
            built.append(kwargs["num_stages"])

            def load():
                if kwargs["num_stages"] == 3:
                    raise triton_util.OutOfResources(106496, 101376, "shared memory")
            return types.SimpleNamespace(_init_handles=load)
    launcher.kernel = Stages()
    launched = []
    monkeypatch.setattr(triton_util, "launch_keyed", lambda kernel, key, grid, args, kwargs: launched.append(kwargs))
    x = torch.zeros(4)
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        for _ in range(2):
            launcher(lambda meta: (1,), x, 100, BLOCK=64, num_warps=4)
    assert launched == [dict(BLOCK=64, num_warps=4, num_stages=2)] * 2 and built == [3, 2]
    # the first call says, once, that it builds the next config: a build that does not fit can take a minute
    assert [r.getMessage() for r in caplog.records] == [
        "mha_compile: _fake_kernel does not fit the GPU under {'num_stages': 3}; building its next config (2 of 3) "
        "for these shapes: builds this large can take a minute each, once (Triton's cache keeps them)"]
    launcher(lambda meta: (1,), x, 100, BLOCK=64)  # num_warps, which the key names, left to Triton's default
    assert launched[-1] == dict(BLOCK=64, num_stages=2) and built == [3, 2, 3, 2]  # a key of its own
