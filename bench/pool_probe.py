"""The pool's kernels alone on the GPU: the forward (pool_forward) and the backward
(pool_backward) as one kernel a batch row or as its two passes' kernels (triton_pool.ROW_BACKWARD),
timed side by side with triton.testing.do_bench after autotuning, on random bf16 tokens and fp32
weights at SPEC §5's presets. The two backward forms must agree (every gradient, relative error
printed), and each is compared with the memory floor (tok read, ∂tok written).

    PYTHONPATH=. python bench/pool_probe.py [--presets medium,large]
"""
import argparse
import logging

import torch
import triton.testing

from mha_compile.kernels import triton_pool
from mha_compile.models import PRESETS

NAMES = ("tok", "q", "wk", "wv", "bv", "wo", "bo")


def pool_case(p, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, N, D, P = p["B"], p["N"], p["D"], p["P"]
    rand = lambda *s, scale=1.0: torch.randn(*s, device="cuda", generator=g) * scale  # noqa: E731
    tok = rand(B, N, D).bfloat16()
    weights = (rand(P, D // P), rand(D, D, scale=D ** -0.5), rand(D, D, scale=D ** -0.5), rand(D, scale=0.1),
               rand(D, D, scale=D ** -0.5), rand(D, scale=0.1))
    return tok, weights, rand(B, D)


def probe(name):
    p = PRESETS[name]
    tok, (q, wk, wv, bv, wo, bo), grad_inv = pool_case(p)
    floor_us = 2 * tok.numel() * tok.element_size() / 4.3e12 * 1e6  # read tok, write ∂tok
    inv, attn = triton_pool.pool_forward(tok, q, wk, wv, bv, wo, bo)
    fwd = triton.testing.do_bench(lambda: triton_pool.pool_forward(tok, q, wk, wv, bv, wo, bo)) * 1e3
    print(f"{name}: B={p['B']} N={p['N']} D={p['D']} P={p['P']}; forward {fwd:7.1f} us "
          f"(tok read once: {floor_us / 2:.1f} us)")
    grads = {}
    for row in (False, True):
        triton_pool.ROW_BACKWARD = row
        step = lambda: triton_pool.pool_backward(grad_inv, tok, q, wk, wv, bv, wo, attn)  # noqa: E731
        grads[row] = step()
        us = triton.testing.do_bench(step) * 1e3
        print(f"  backward {'one kernel a row' if row else 'two kernels     '} {us:7.1f} us "
              f"({us / floor_us:.2f}x the floor of {floor_us:.1f} us)")
    errs = {n: float((a.double() - b.double()).norm() / b.double().norm())
            for n, a, b in zip(NAMES, grads[True], grads[False])}
    print("  one kernel against two, rel err: " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="medium,large")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the autotuner's choices
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}, triton {triton.__version__}")
    for name in args.presets.split(","):
        probe(name)


if __name__ == "__main__":
    main()
