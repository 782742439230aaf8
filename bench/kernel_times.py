"""Forward and forward+backward times of the region: fused vs staged vs reference vs eager.

    python -m bench.kernel_times [--preset medium] [--dtype bf16] [--out rows.json]

One preset, one dtype (default medium, bf16; an H200 is what SPEC §5 measures on). Peers:
the mha::region op with kernels = fused | staged | reference, and the plain module
(MHABlock.from_preset(preset, spelling=dense | loop)) run eagerly. Times are medians of
triton.testing.do_bench on random inputs; fwd runs under no_grad, fwd+bwd backpropagates a
random gradient into every input and parameter. The floor is max(FLOPs / 790 TFLOP/s, bytes /
4.3 TB/s) with SPEC §5's FLOP counts. Autotuning happens in a warm-up call before timing.
"""
import argparse
import json
import logging

import torch
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="also print per-kernel CUDA times of fused/staged")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtype = DTYPES[args.dtype]
    p = models.PRESETS[args.preset]
    torch.manual_seed(0)
    dev = "cuda"
    blocks = {s: models.MHABlock.from_preset(args.preset, spelling=s).to(dev, dtype) for s in ("dense", "loop")}
    blocks["loop"].load_state_dict(blocks["dense"].state_dict())
    params = [t for t in models.block_parameters(blocks["dense"])]
    ctx = torch.randn(p["B"], p["H"], p["D"], device=dev, dtype=dtype, requires_grad=True)
    tok = torch.randn(p["B"], p["N"], p["D"], device=dev, dtype=dtype, requires_grad=True)
    grad = torch.randn(p["B"], p["H"], p["D"], device=dev, dtype=dtype)
    leaves = [ctx, tok] + [t for t in params if t is not None]
    moe = blocks["dense"].moe

    def op(kernels):
        return lambda: torch.ops.mha.region(ctx, tok, *params, None, moe.top_k, moe.renorm, moe.act, kernels)[0]

    peers = {f"mha {k}": op(k) for k in ("fused", "staged", "reference")}
    peers.update({f"eager {s}": (lambda b: lambda: b(ctx, tok))(b) for s, b in blocks.items()})

    with torch.no_grad():
        want = peers["eager loop"]().float()
    rows = []
    for name, fn in peers.items():
        with torch.no_grad():
            got = fn().float()  # warm-up: compiles and autotunes outside the timing
        err = float((got - want).norm() / want.norm())
        fn().backward(grad)
        with torch.no_grad():
            fwd = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        both = triton.testing.do_bench(lambda: fn().backward(grad), warmup=25, rep=200, grad_to_none=leaves,
                                       return_mode="median")
        rows.append(dict(peer=name, preset=args.preset, dtype=args.dtype, fwd_ms=fwd, fwd_bwd_ms=both,
                         rel_err_vs_eager_loop=err))
        print(f"done {name}: fwd {fwd:.3f} ms, fwd+bwd {both:.3f} ms, rel err {err:.1e}", flush=True)
    floor = (floor_ms(p, dtype, False), floor_ms(p, dtype, True))
    device = torch.cuda.get_device_name()
    print(f"\n{args.preset} preset {p}, {args.dtype}, {device}, torch {torch.__version__}")
    print(f"{'peer':<16}{'fwd ms':>10}{'fwd+bwd ms':>12}{'x floor fwd':>13}{'x floor f+b':>13}{'err':>10}")
    for r in rows:
        print(f"{r['peer']:<16}{r['fwd_ms']:>10.3f}{r['fwd_bwd_ms']:>12.3f}{r['fwd_ms'] / floor[0]:>13.1f}"
              f"{r['fwd_bwd_ms'] / floor[1]:>13.1f}{r['rel_err_vs_eager_loop']:>10.1e}")
    print(f"{'floor':<16}{floor[0]:>10.3f}{floor[1]:>12.3f}")
    if args.profile:
        for name in ("mha fused", "mha staged"):
            fn = peers[name]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn().backward(grad)
                torch.cuda.synchronize()
            print(f"\n{name}: fwd+bwd x5, CUDA time per kernel")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, floor_ms=floor, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
