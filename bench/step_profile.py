"""Where a compiled training step's time goes: the host's issue time against the GPU's kernels.

    PYTHONPATH=. python bench/step_profile.py [--preset small] [--runs mha-fused-cudagraphs:loop,...]

Each run is mode:spelling, a bench mode (bench/modes.py), inductor-reduce-overhead (Inductor
with mode="reduce-overhead", the peer that replays CUDA graphs as our cudagraphs mode does) or
mha-inductor-reduce-overhead (backend="mha" with rest="inductor" under reduce-overhead, the mode
given in the options) or mha-options-reduce-overhead (mha-fused-cudagraphs with the mode given in
the options, as mha-fused-keep gives it) or mha-fused-keep-static-tok (mha-fused-keep with tok
marked static, torch._dynamo.mark_static_address: the replays read it in place instead of copying
it in) or mha-fused-keep-pool-inside (mha-fused-keep with whole_graph.POOL_OUTSIDE off: the pool
captured in the graphs, tok copied in before each replay, as before session 40) or
mha-inductor-reduce-overhead-pool-inside (the same for rest="inductor", whose pool has gone outside
the graphs since session 42)
on the dense or loop spelling, bf16 on CUDA. For each:
the bench's training step (bench/measure.timed_step) timed as the bench times it (do_bench's
median) but on one batch every step (the bench alternates two since session 55), the host's
time to issue one step (50 steps under perf_counter with no sync between them, and with the
drain after), the GPU's kernel time a step (the profiler's total of its kernels' own CUDA time
over 10 steps), then the top host ops by their own CPU time and the top ops by their own GPU
time.
Session 24 found small's reduce-overhead row host-bound: 0.64 ms of issue a step against ~0.2
of kernels (bench/results/step_profile_small.txt).
"""
import argparse
import time
from unittest import mock

import torch
import triton.testing

from bench import cases, measure, modes
from mha_compile import whole_graph

EXTRA_MODES = ("inductor-reduce-overhead", "mha-inductor-reduce-overhead", "mha-options-reduce-overhead",
               "mha-fused-keep-static-tok", "mha-fused-keep-pool-inside", "mha-inductor-reduce-overhead-pool-inside")
RUNS = "mha-fused-cudagraphs:loop,mha-fused-cudagraphs:dense,inductor-reduce-overhead:loop,mha-fused:loop"


def parse_runs(text):
    """[(mode, spelling)] from "mode:spelling,..."; a clear error for any other value."""
    runs = []
    for item in text.split(","):
        mode, _, spelling = item.partition(":")
        if mode not in modes.MODES + EXTRA_MODES:
            raise ValueError(f"--runs {item!r}: mode {mode!r} is not one of {modes.MODES + EXTRA_MODES}")
        if spelling not in ("dense", "loop"):
            raise ValueError(f"--runs {item!r}: spelling {spelling!r} is not 'dense' or 'loop'")
        runs.append((mode, spelling))
    return runs


def compile_model(mode, model, tok):
    """The compiled model a run times (the pool-inside modes are built by profile)."""
    if mode == "inductor-reduce-overhead":
        return torch.compile(model, mode="reduce-overhead", dynamic=False)
    if mode == "mha-inductor-reduce-overhead":
        return torch.compile(model, backend="mha", options={"rest": "inductor", "mode": "reduce-overhead"},
                             dynamic=False)
    if mode == "mha-options-reduce-overhead":
        return torch.compile(model, backend="mha", options={"mode": "reduce-overhead"}, dynamic=False)
    if mode == "mha-fused-keep-static-tok":
        torch._dynamo.mark_static_address(tok)
        return modes.build("mha-fused-keep", model)
    return modes.build(mode, model)


def profile(preset, mode, spelling):
    torch._dynamo.reset()
    model = cases.make_model(preset, spelling, "bf16", "cuda")
    ctx, tok, grad_out = cases.make_inputs(preset, "bf16", "cuda")
    ctx.requires_grad_(True)
    tok.requires_grad_(True)
    leaves = [ctx, tok, *model.parameters()]
    if mode.endswith("-pool-inside"):
        # read at compile time, which is the first call (inside timed_step's first step below)
        with mock.patch.object(whole_graph, "POOL_OUTSIDE", False):
            fn = compile_model(mode.removesuffix("-pool-inside"), model, tok)
            measure.timed_step(fn, ctx, tok, grad_out, leaves, True)()
    else:
        fn = compile_model(mode, model, tok)

    step = measure.timed_step(fn, ctx, tok, grad_out, leaves, True)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    bench = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        step()
    issued = (time.perf_counter() - start) / 50 * 1e3
    torch.cuda.synchronize()
    drained = (time.perf_counter() - start) / 50 * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    # kernels only: a replayed graph's kernels are also counted to the op that launched it
    kernels = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"== {preset} {spelling} {mode}: do_bench {bench:.3f} ms; host issue {issued:.3f} ms a step, "
          f"{drained:.3f} with the drain; GPU kernels {kernels / 10 / 1e3:.3f} ms a step", flush=True)
    print(events.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=70), flush=True)
    # the GPU's side: a replay's input copies (cudagraph trees copy every non-static input) show here
    print(events.table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=70), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--runs", default=RUNS, help="mode:spelling,...")
    args = parser.parse_args()
    runs = parse_runs(args.runs)
    if not torch.cuda.is_available():
        raise SystemExit("bench/step_profile.py times CUDA graphs and CUDA kernels: it needs a CUDA GPU")
    for mode, spelling in runs:
        try:
            profile(args.preset, mode, spelling)
        except Exception as error:  # noqa: BLE001 - one run's failure must not lose the others
            print(f"== {mode} {spelling}: {type(error).__name__}: {error}", flush=True)


if __name__ == "__main__":
    main()
