"""fast_launch.FastLaunch: a kernel's second launch with the same specialisation calls the
compiled kernel's launcher directly, with the same arguments JITFunction.run would give it;
anything that changes Triton's specialisation goes back through JITFunction.run. On the CPU
with a real JITFunction whose run (the compile) is a stand-in; on the GPU with a real kernel."""
import pytest
import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel
from triton.runtime.jit import JITFunction

from mha_compile.kernels import fast_launch


def _copy(x_ptr, y_ptr, N, scale, flag, BLOCK: tl.constexpr, EXTRA: tl.constexpr = 3):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < N), mask=offs < N)


class _Compiled(CompiledKernel):
    """A compiled kernel's launch surface, recording its launches."""

    def __init__(self):
        self.function, self.packed_metadata, self.launches = "function", "packed", []

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream)

    def run(self, *args):
        self.launches.append(args)


@pytest.fixture
def kernel(monkeypatch):
    """A real JITFunction (Triton's parameters, constexprs and defaults) whose run compiles
    nothing: each call returns a new _Compiled, kept in `compiles`."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 77, raising=False)
    jit = JITFunction(_copy)
    jit.compiles = []

    def run(*args, grid, warmup, **kwargs):
        jit.compiles.append((grid, args, kwargs))
        compiled = _Compiled()
        jit.last = compiled
        return compiled

    jit.run = run
    return jit


def _aligned(n, dtype=torch.float32):
    return torch.randn(n).to(dtype)


def _misaligned(n, dtype=torch.float32):
    return torch.randn(n + 1).to(dtype)[1:]  # 2 or 4 bytes past an aligned allocation


def test_second_launch_goes_to_the_compiled_kernel(kernel):
    launcher = fast_launch.FastLaunch(kernel)
    x, y = _aligned(64), _aligned(64)
    launcher[(4,)](x, y, 64, 0.5, True, BLOCK=16, num_warps=4)
    assert len(kernel.compiles) == 1
    compiled = kernel.last
    x2, y2 = _aligned(64), _aligned(64)  # other tensors, same specialisation
    launcher[(4, 2)](x2, y2, 96, 0.25, True, BLOCK=16, num_warps=4)
    assert len(kernel.compiles) == 1
    (launch,) = compiled.launches
    hooks = (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)
    # grid (x, y, 1), the stream, the kernel, its metadata, Triton's hooks, then every parameter
    # in order, the constexprs and the defaults included
    assert launch[:9] == (4, 2, 1, 77, "function", "packed", ("metadata", (4, 2), 77)) + hooks
    assert launch[9:11] == (x2, y2) and launch[11:] == (96, 0.25, True, 16, 3)


@pytest.mark.parametrize("change", [
    "misaligned x", "dtype", "N = 1", "N divisible by 16", "N past int32", "flag", "BLOCK", "EXTRA", "num_warps",
])
def test_a_change_of_specialisation_compiles_again(kernel, change):
    launcher = fast_launch.FastLaunch(kernel)
    args = dict(x=_aligned(64), y=_aligned(64), N=97, scale=0.5, flag=True)
    meta = dict(BLOCK=16, num_warps=4)
    launcher[(1,)](*args.values(), **meta)
    changed = {
        "misaligned x": dict(x=_misaligned(64)), "dtype": dict(x=_aligned(64, torch.bfloat16)), "N = 1": dict(N=1),
        "N divisible by 16": dict(N=96), "N past int32": dict(N=(1 << 31) + 3), "flag": dict(flag=False),
    }.get(change, {})
    changed_meta = {"BLOCK": dict(BLOCK=32), "EXTRA": dict(EXTRA=4), "num_warps": dict(num_warps=8)}.get(change, {})
    launcher[(1,)](*{**args, **changed}.values(), **{**meta, **changed_meta})
    assert len(kernel.compiles) == 2
    launcher[(1,)](*{**args, **changed}.values(), **{**meta, **changed_meta})  # now kept too
    assert len(kernel.compiles) == 2 and len(kernel.last.launches) == 1


def test_ints_alike_for_triton_share_a_kernel(kernel):
    launcher = fast_launch.FastLaunch(kernel)
    for n in (97, 33, 5):  # none is 1, none divisible by 16, all int32
        launcher[(1,)](_aligned(8), _aligned(8), n, 0.5, True, BLOCK=16)
    assert len(kernel.compiles) == 1 and len(kernel.last.launches) == 2


@pytest.mark.parametrize("odd", ["tuple argument", "no compiled kernel", "pre-run hook", "not a JITFunction"])
def test_what_the_key_cannot_describe_always_takes_jitfunction_run(kernel, odd):
    scale = (0.5, 0.5) if odd == "tuple argument" else 0.5
    if odd == "no compiled kernel":  # a recorder standing in for the compile (bench/offline_sass.py)
        run = kernel.run
        kernel.run = lambda *a, **k: run(*a, **k) and None
    if odd == "pre-run hook":
        kernel.pre_run_hooks.append(lambda *a, **k: None)
    target = kernel
    if odd == "not a JITFunction":  # the interpreter's function, a test's stand-in
        target = type("Stand", (), {"__getitem__": lambda self, grid: kernel[grid]})()
    launcher = fast_launch.FastLaunch(target)
    for _ in range(3):
        launcher[(1,)](_aligned(8), _aligned(8), 8, scale, True, BLOCK=16)
    assert len(kernel.compiles) == 3
    assert not launcher.compiled


def test_fast_keeps_one_launcher_a_kernel(kernel):
    assert fast_launch.fast(kernel) is fast_launch.fast(kernel)


@triton.jit
def _scale_kernel(x_ptr, y_ptr, N, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N)
    tl.store(y_ptr + offs, x * scale, mask=offs < N)


@pytest.mark.cuda
def test_fast_launches_compute_what_triton_launches_compute(monkeypatch):
    """On the GPU: aligned and misaligned operands (two specialisations), odd sizes, fresh random
    inputs; the repeat launches take the fast path (JITFunction.run not called) and are right."""
    runs = []
    original = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: runs.append(1) or original(self, *a, **k))
    launcher = fast_launch.FastLaunch(_scale_kernel)
    for repeat in range(3):
        for make in (_aligned, _misaligned):
            n = 1000 + 37 * repeat
            x = make(n).cuda() if make is _aligned else torch.randn(n + 1, device="cuda")[1:]
            y = torch.empty(n + 1, device="cuda")[1:] if make is _misaligned else torch.empty(n, device="cuda")
            launcher[(triton.cdiv(n, 128),)](x, y, n, 0.75, BLOCK=128)
            torch.testing.assert_close(y, x * 0.75, rtol=0, atol=0)
    assert len(runs) == 2 and len(launcher.compiled) == 2
    kept = list(launcher.compiled.values())
    assert kept[0] is not kept[1]  # the misaligned build is another kernel


def test_switched_off_every_launch_takes_jitfunction_run(kernel, monkeypatch):
    monkeypatch.setattr(fast_launch, "ENABLED", False)
    launcher = fast_launch.FastLaunch(kernel)
    for _ in range(2):
        launcher[(1,)](_aligned(8), _aligned(8), 8, 0.5, True, BLOCK=16)
    assert len(kernel.compiles) == 2 and not launcher.compiled
