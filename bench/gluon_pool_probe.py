"""The pool backward in gluon_pool's kernel (tok read once) against triton_pool's, alone, on the
H200: the two Triton kernels as pool_backward launches them at large (each its autotuner's pick),
the one Triton kernel (both passes a batch row), and the Gluon kernel, each timed as CUDA graph
replays on the same inputs, with its registers and spills; the Gluon kernel's outputs against the
two kernels' (∂tok to one bf16 rounding, t̄ and the ∂u partials to fp32 rounding).

    PYTHONPATH=. python bench/gluon_pool_probe.py [--presets large,medium]

The rate is over bwd2_bytes (small_kernels_probe): the bytes of one read of tok, as the Gluon
kernel moves them (the two kernels read tok twice).
"""
import argparse

import torch
import triton
import triton.testing

import small_kernels_probe as probe
from mha_compile.kernels import gluon_pool


def timed(fn):
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")


def run(preset):
    c = probe.case(preset, torch.bfloat16, "cuda")
    x = probe.backward_inputs(c)
    x.ds = probe.bwd_scores(x)
    traffic = probe.bwd2_bytes(c.B, c.N, c.D, c.P, c.tok.element_size())
    print(f"pool backward: tok [{c.B}, {c.N}, {c.D}], P={c.P}, {traffic / 1e6:.0f} MB once", flush=True)
    two = lambda: (probe.bwd_scores(x, x.ds), probe.bwd(x))[1]  # noqa: E731
    want = [t.clone() for t in two()]
    ms = timed(two)
    print(f"  {'two Triton kernels (autotuned)':<40} {ms * 1e3:8.1f} us {traffic / ms / 1e9:5.2f} TB/s", flush=True)
    one = lambda: probe.bwd_one(x)  # noqa: E731
    got = [t.clone() for t in one()]
    ms = timed(one)
    print(f"  {'one Triton kernel (autotuned)':<40} {ms * 1e3:8.1f} us {traffic / ms / 1e9:5.2f} TB/s  "
          f"{probe.agreement(got, want)}", flush=True)
    saved, gluon_pool.ENABLED = gluon_pool.ENABLED, True
    try:
        why = gluon_pool.unsupported(x.tok, c.P)
    finally:
        gluon_pool.ENABLED = saved
    if why is not None:
        print(f"  Gluon kernel: not taken ({why})", flush=True)
        return
    grad_tok, tbar, du = out = probe.bwd_outputs(x)
    gluon = lambda: (gluon_pool.attend_bwd(x.tok, x.u, x.attn, x.dtbar, tbar, du, grad_tok), out)[1]  # noqa: E731
    got = [t.clone() for t in gluon()]
    ms = timed(gluon)
    grid = gluon_pool.programs(c.B, c.N, c.D, torch.cuda.get_device_properties(0).multi_processor_count)
    print(f"  {'Gluon kernel, tok read once':<40} {ms * 1e3:8.1f} us {traffic / ms / 1e9:5.2f} TB/s  "
          f"{grid} programs  {probe.agreement(got, want)}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="large,medium")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gluon_pool_probe.py times kernels: it needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for preset in args.presets.split(","):
        run(preset)


if __name__ == "__main__":
    main()
