"""Forward and forward+backward times of the region: fused vs staged vs reference vs eager.

    PYTHONPATH=. python bench/kernel_times.py [--presets small,medium,large] [--dtype bf16] [--peers fused,dense]
                                              [--graphs fused,dense] [--profile] [--out rows.json]

Presets and one dtype (default medium, bf16; an H200 is what SPEC §5 measures on). Peers:
the mha::region op with kernels = fused | staged | reference, and the plain module
(MHABlock.from_preset(preset, spelling=dense | loop)) run eagerly. Peers named in --graphs are
also timed as CUDA graph replays (forward, and forward+backward with the autograd graph
captured): what torch.compile(mode="reduce-overhead") runs, and a proof that the path has no
host sync (a capture failure is printed, not hidden). Times are medians of
triton.testing.do_bench on random inputs; fwd runs under no_grad, fwd+bwd backpropagates a
random gradient into every input and parameter. The floor is max(FLOPs / 790 TFLOP/s, bytes /
4.3 TB/s) with SPEC §5's FLOP counts. Autotuning happens in a warm-up call before timing.
"""
import argparse
import json
import logging

import torch
import triton
import triton.testing

from mha_compile import models, ops  # noqa: F401  (ops registers torch.ops.mha)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def floor_ms(p, dtype, backward):
    R = p["B"] * p["H"]
    flops = 4 * R * p["k"] * p["D"] * p["F"] * (3 if backward else 1)
    size = torch.empty(0, dtype=dtype).element_size()
    weights = p["E"] * (2 * p["D"] * p["F"] + p["F"] + p["D"]) + 3 * p["D"] ** 2
    moved = (2 * R * p["D"] + p["B"] * p["N"] * p["D"] + weights) * size * (2 if backward else 1)
    return max(flops / 790e12, moved / 4.3e12) * 1e3


def graphed(step, leaves):
    """A CUDA graph of `step` (captured after warm-up on a side stream), or the reason it failed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except Exception as error:  # a host sync or an uncapturable op: report it, keep going
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return graph


def bench_preset(name, dtype_name, peer_names, graph_names, profile):
    dtype = DTYPES[dtype_name]
    p = models.PRESETS[name]
    torch.manual_seed(0)
    dev = "cuda"
    blocks = {s: models.MHABlock.from_preset(name, spelling=s).to(dev, dtype) for s in ("dense", "loop")}
    blocks["loop"].load_state_dict(blocks["dense"].state_dict())
    params = [t for t in models.block_parameters(blocks["dense"])]
    ctx = torch.randn(p["B"], p["H"], p["D"], device=dev, dtype=dtype, requires_grad=True)
    tok = torch.randn(p["B"], p["N"], p["D"], device=dev, dtype=dtype, requires_grad=True)
    grad = torch.randn(p["B"], p["H"], p["D"], device=dev, dtype=dtype)
    leaves = [ctx, tok] + [t for t in params if t is not None]
    moe = blocks["dense"].moe

    def op(kernels):
        return lambda: torch.ops.mha.region(ctx, tok, *params, None, moe.top_k, moe.renorm, moe.act, kernels)[0]

    every = {k: op(k) for k in ("fused", "staged", "reference")}
    every.update({s: (lambda b: lambda: b(ctx, tok))(b) for s, b in blocks.items()})
    label = {"fused": "mha fused", "staged": "mha staged", "reference": "mha reference",
             "dense": "eager dense", "loop": "eager loop"}
    with torch.no_grad():
        want = every["dense"]().float()
    rows = []
    for peer in peer_names:
        fn = every[peer]
        with torch.no_grad():
            got = fn().float()  # warm-up: compiles and autotunes outside the timing
        err = float((got - want).norm() / want.norm())
        fn().backward(grad)
        with torch.no_grad():
            fwd = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        both = triton.testing.do_bench(lambda: fn().backward(grad), warmup=25, rep=100, grad_to_none=leaves,
                                       return_mode="median")
        row = dict(peer=label[peer], preset=name, dtype=dtype_name, fwd_ms=fwd, fwd_bwd_ms=both,
                   rel_err_vs_eager_dense=err)
        if peer in graph_names:
            def fwd_step():
                with torch.no_grad():
                    fn()
            g_fwd = graphed(fwd_step, leaves)
            g_both = graphed(lambda: fn().backward(grad), leaves)
            for key, g in (("graph_fwd_ms", g_fwd), ("graph_fwd_bwd_ms", g_both)):
                row[key] = (triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median")
                            if isinstance(g, torch.cuda.CUDAGraph) else g)
            for t in leaves:
                t.grad = None
        rows.append(row)
        print(f"done {name} {label[peer]}: fwd {fwd:.3f} ms, fwd+bwd {both:.3f} ms, "
              f"graph {row.get('graph_fwd_ms', '-')} / {row.get('graph_fwd_bwd_ms', '-')}, "
              f"rel err vs eager dense (both in {dtype_name}) {err:.1e}",
              flush=True)
    floor = (floor_ms(p, dtype, False), floor_ms(p, dtype, True))
    if profile and "fused" in peer_names:
        fn = every["fused"]

        def train_step():
            # from no gradients, as a training step after zero_grad(set_to_none=True): else
            # autograd adds each gradient into the last step's (at large ~0.4 ms of add_ a step,
            # mostly ∂tok's 512 MiB, which the sessions before 2026-11-30's 8th counted as ours)
            for t in leaves:
                t.grad = None
            fn().backward(grad)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                train_step()
            torch.cuda.synchronize()
        print(f"\n{name} mha fused: fwd+bwd x5, CUDA time per kernel")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=24, max_name_column_width=60))
        host_profile(train_step, f"{name} mha fused")
    return rows, floor


def host_profile(step, what, calls=10):
    """Where the host time of `step` goes, by self CPU time, every thread included (the autograd
    engine runs a CUDA backward on its own thread; cProfile's per-frame attribution across
    threads was misleading here): without CUDA graphs the fused path is host-bound (medium:
    ~4.8 ms a fwd+bwd step through torch.compile against ~1.3 ms as a graph replay)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    print(f"\n{what}: host time of {calls} fwd+bwd calls, by self CPU time (torch.profiler)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(f"\n{what}: torch's own kernels in {calls} fwd+bwd calls, by aten op and input shapes")
    for e in aten_by_shape(prof)[:25]:
        print(f"{e.key:<22} {e.count / calls:5.1f} a call {e.self_device_time_total / calls:9.1f} us a call  "
              f"{e.input_shapes}")


def aten_by_shape(prof):
    """The aten ops with GPU time of their own (torch's kernels, not ours), grouped by their input
    shapes, the most first: the shapes name the call site (session 30: ~228 us a large step,
    PERF_NOTES v33, where the profiler's Python stacks came back empty on the H200). Printed by
    hand: torch's table asserted on a list filtered so (a device-time total of 0 against rows)."""
    kept = [e for e in prof.key_averages(group_by_input_shape=True)
            if e.key.startswith("aten::") and e.self_device_time_total > 0]
    return sorted(kept, key=lambda e: -e.self_device_time_total)


def fmt_ms(v):
    return f"{v:.3f}" if isinstance(v, float) else "-" if v is None else "fail"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="medium", help="comma list of models.PRESETS names")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--peers", default="fused,staged,reference,dense,loop",
                        help="comma list of fused, staged, reference, dense, loop")
    parser.add_argument("--graphs", default="fused,dense", help="peers also timed as CUDA graph replays")
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="also print per-kernel CUDA times of fused")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    peers, graphs = args.peers.split(","), args.graphs.split(",")
    results = []
    for name in args.presets.split(","):
        rows, floor = bench_preset(name, args.dtype, peers, graphs, args.profile)
        results.append(dict(preset=name, floor_ms=floor, rows=rows))
    device = torch.cuda.get_device_name()
    print(f"\n{args.dtype}, {device}, torch {torch.__version__}, triton {triton.__version__}; do_bench medians, ms")
    print(f"{'preset':<8}{'peer':<15}{'fwd':>8}{'f+b':>8}{'graph fwd':>11}{'graph f+b':>11}"
          f"{'f+b/floor':>11}{'err':>9}")
    for res in results:
        for r in res["rows"]:
            print(f"{r['preset']:<8}{r['peer']:<15}{r['fwd_ms']:>8.3f}{r['fwd_bwd_ms']:>8.3f}"
                  f"{fmt_ms(r.get('graph_fwd_ms')):>11}{fmt_ms(r.get('graph_fwd_bwd_ms')):>11}"
                  f"{r['fwd_bwd_ms'] / res['floor_ms'][1]:>11.1f}{r['rel_err_vs_eager_dense']:>9.1e}")
        print(f"{res['preset']:<8}{'floor':<15}{res['floor_ms'][0]:>8.3f}{res['floor_ms'][1]:>8.3f}")
    print(f"err: the forward's relative gap to eager on the dense spelling, both in {args.dtype}: eager's own "
          "rounding is in it (the GPU tests hold every output and gradient to float64)")
    for res in results:
        for r in res["rows"]:
            for key in ("graph_fwd_ms", "graph_fwd_bwd_ms"):
                if isinstance(r.get(key), str):
                    print(f"{r['preset']} {r['peer']} {key}: {r[key]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, triton=triton.__version__, results=results),
                      f, indent=1)


if __name__ == "__main__":
    main()
