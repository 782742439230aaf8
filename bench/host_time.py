"""Where the host time of a training step goes, on CUDA, at a preset where the host is the limit.

    PYTHONPATH=. python bench/host_time.py [--preset small] [--calls 200]

Without CUDA graphs the fused path is host-bound at small and medium (the tables of sessions
11-13, bench/PERF_NOTES.md: small fwd+bwd 4.9 ms plain against 0.85 ms as a graph replay).
This measures the host side alone: the time to *issue* `calls` calls (perf_counter around the
loop, synchronised before and after, so the GPU work of earlier calls is not counted). That is host time and only host
time while the GPU keeps up, which the "gpu" column shows (do_bench's median of the same call).
Pieces, from the whole compiled step down to one Triton launch:
    compiled fwd+bwd / fwd   torch.compile(block, backend="mha") as a user runs it (the region's
                             own CUDA graphs on, options graphs="auto"); "graphs off": without them;
                             "reduce-overhead": the whole compiled graph replayed as a CUDA graph
    region_call fwd+bwd      ops.region_call, what the compiled graph calls, graphs "on" / "off"
    op fwd+bwd / fwd         torch.ops.mha.region called directly (no Dynamo, no AOTAutograd)
    op fwd, grad enabled     the same forward recording autograd (what a training step pays)
    op fwd+bwd, one thread   with torch.autograd.set_multithreading_enabled(False): the CUDA
                             backward then runs on the calling thread, not the engine's
    region_forward/backward  the kernel set's Python alone (no custom op, no autograd)
    group                    the expert grouping: three small launches and their buffers
    bare launch              one trivial @triton.jit kernel, through JITFunction.run
    torch.empty / add        one allocation, one tiny aten op
Then each of bare launch, torch.add, torch.empty and a little pure Python run inside a backward,
with autograd's multithreading on (the CUDA backward runs on the engine's device thread, as in
a user's step) and off (on the calling thread): host us per piece on each thread.
Then cProfile of the compiled step, region_forward and region_backward on the main thread (the
autograd engine runs a CUDA backward on its own thread, which cProfile does not see; single-
threaded autograd, or calling region_backward directly, keeps it on this one).
"""
import argparse
import copy
import cProfile
import pstats
import time

import torch
import triton
import triton.language as tl
import triton.testing

from mha_compile import models, ops  # noqa: F401  (ops registers torch.ops.mha)
from mha_compile.kernels import fused, triton_moe


@triton.jit
def _add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)


class _RunInBackward(torch.autograd.Function):
    """Identity whose backward runs `work` `repeats` times: a piece's cost on the thread that
    runs a CUDA backward."""

    @staticmethod
    def forward(ctx, x, work, repeats):
        ctx.work, ctx.repeats = work, repeats
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        for _ in range(ctx.repeats):
            ctx.work()
        return grad, None, None


def engine_thread_us(work, x, repeats=20, calls=50):
    """Host us of one `work` inside a backward: (multithreaded, single-threaded autograd)."""
    def step(n):
        return lambda: _RunInBackward.apply(x, work, n).sum().backward()

    costs = []
    for threads in (True, False):
        with torch.autograd.set_multithreading_enabled(threads):
            costs.append((host_us(step(repeats), calls) - host_us(step(0), calls)) / repeats)
    return costs


def _python_work():
    return sum(i * i for i in range(200))


def host_us(fn, calls):
    """Microseconds to issue one call of `fn`, GPU work of earlier calls excluded."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued / calls * 1e6


def gpu_us(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def training_step(preset, dtype=torch.bfloat16, dev="cuda"):
    """The dense spelling's block at `preset` on the GPU and one training step's tensors, seeded:
    (block, its region parameters, ctx, tok, the output's gradient, every leaf)."""
    torch.manual_seed(0)
    p = models.PRESETS[preset]
    block = models.MHABlock.from_preset(preset, spelling="dense").to(dev, dtype)
    params = models.block_parameters(block)
    ctx = torch.randn(p["B"], p["H"], p["D"], device=dev, dtype=dtype, requires_grad=True)
    tok = torch.randn(p["B"], p["N"], p["D"], device=dev, dtype=dtype, requires_grad=True)
    grad = torch.randn(p["B"], p["H"], p["D"], device=dev, dtype=dtype)
    return block, params, ctx, tok, grad, [ctx, tok] + [t for t in params if t is not None]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    dev = "cuda"
    p = models.PRESETS[args.preset]
    block, params, ctx, tok, grad, leaves = training_step(args.preset)
    moe = block.moe
    compiled = torch.compile(block, backend="mha", options={"kernels": "fused"}, dynamic=False)
    twin = copy.deepcopy(block)  # its own Dynamo cache entry, for the other graphs setting
    twin_leaves = list(twin.parameters())
    compiled_off = torch.compile(twin, backend="mha", options={"kernels": "fused", "graphs": "off"}, dynamic=False)
    whole = copy.deepcopy(block)  # the whole compiled graph replayed as a CUDA graph
    whole_leaves = list(whole.parameters())
    # torch.compile takes mode or options, not both: kernels "auto" is the fused set on CUDA
    compiled_whole = torch.compile(whole, backend="mha", mode="reduce-overhead", dynamic=False)

    def clear():
        for t in leaves + twin_leaves + whole_leaves:
            t.grad = None

    def whole_step():
        torch.compiler.cudagraph_mark_step_begin()
        clear()
        compiled_whole(ctx, tok).backward(grad)

    def region_call(graphs):
        return lambda: (clear(), ops.region_call(ctx, tok, *params, None, moe.top_k, moe.renorm, moe.act, "fused",
                                                 False, graphs=graphs)[0].backward(grad))

    def op():
        return torch.ops.mha.region(ctx, tok, *params, None, moe.top_k, moe.renorm, moe.act, "fused")[0]

    def no_grad(fn):
        def call():
            with torch.no_grad():
                fn()
        return call

    raw = [t.detach() for t in (ctx, tok)] + [None if t is None else t.detach() for t in params]
    saved = fused.region_forward(*raw, None, moe.top_k, moe.renorm, moe.act)
    index = saved[4]
    buf = torch.randn(1024, device=dev)
    pieces = {
        "compiled fwd+bwd": lambda: (clear(), compiled(ctx, tok).backward(grad)),
        "compiled fwd": no_grad(lambda: compiled(ctx, tok)),
        "compiled fwd+bwd, reduce-overhead": whole_step,
        "compiled fwd+bwd, graphs off": lambda: (clear(), compiled_off(ctx, tok).backward(grad)),
        "compiled fwd, graphs off": no_grad(lambda: compiled_off(ctx, tok)),
        "region_call fwd+bwd, graphs on": region_call("on"),
        "region_call fwd+bwd, graphs off": region_call("off"),
        "op fwd+bwd": lambda: (clear(), op().backward(grad)),
        "op fwd": no_grad(op),
        "op fwd, grad enabled": op,
        "region_forward": lambda: fused.region_forward(*raw, None, moe.top_k, moe.renorm, moe.act),
        "region_backward": lambda: fused.region_backward(grad, *raw, None, *saved[1:], moe.top_k, moe.renorm,
                                                         moe.act),
        "group": lambda: triton_moe.group(index, p["E"]),
        "bare launch": lambda: _add_one_kernel[(1,)](buf, 1024, BLOCK=1024),
        "torch.empty": lambda: torch.empty(4096, device=dev),
        "torch.add": lambda: torch.add(buf, buf),
    }
    print(f"{args.preset} bf16 on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}; host = issue time per call, gpu = do_bench median")
    print(f"{'piece':<32}{'host us':>10}{'gpu us':>10}")
    for name, fn in pieces.items():
        host = host_us(fn, args.calls)
        print(f"{name:<32}{host:>10.1f}{gpu_us(fn):>10.1f}", flush=True)
    with torch.autograd.set_multithreading_enabled(False):
        host = host_us(pieces["op fwd+bwd"], args.calls)
        print(f"{'op fwd+bwd, 1 thread':<32}{host:>10.1f}{gpu_us(pieces['op fwd+bwd']):>10.1f}", flush=True)
    print(f"\n{'piece inside a backward':<32}{'engine us':>10}{'caller us':>10}")
    x = torch.randn(1024, device=dev, requires_grad=True)
    for name in ("bare launch", "torch.add", "torch.empty"):
        engine, caller = engine_thread_us(pieces[name], x)
        print(f"{name:<32}{engine:>10.1f}{caller:>10.1f}", flush=True)
    engine, caller = engine_thread_us(_python_work, x)
    print(f"{'pure Python (200 squares)':<32}{engine:>10.1f}{caller:>10.1f}", flush=True)
    # The compiled step with the backward on this thread, so that cProfile sees all of it.
    with torch.autograd.set_multithreading_enabled(False):
        for name in ("compiled fwd+bwd", "region_forward", "region_backward"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(50):
                pieces[name]()
            prof.disable()
            torch.cuda.synchronize()
            print(f"\ncProfile, {name} x50, by own time")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
            if name == "compiled fwd+bwd":
                print(f"cProfile, {name} x50, by cumulative time")
                pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
