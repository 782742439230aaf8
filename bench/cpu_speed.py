"""Reference path vs eager on the CPU, forward+backward, one thread, CPU time (not wall time).

    python bench/cpu_speed.py [--preset small] [--repeats 5]

CPU time of a single-threaded process is what this machine can measure reliably while other
work shares its two cores (wall time swung 3x between runs); the ratio is what we quote.
"""
import argparse
import copy
import time

import torch

from mha_compile import models
from mha_compile.demo import median_ms


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=list(models.PRESETS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    p = models.PRESETS[args.preset]
    for spelling in models.MOE_SPELLINGS:
        torch.manual_seed(0)
        block = models.MHABlock.from_preset(args.preset, spelling=spelling)
        mha = torch.compile(copy.deepcopy(block), backend="mha")
        ctx = torch.randn(p["B"], p["H"], p["D"], requires_grad=True)
        tok = torch.randn(p["B"], p["N"], p["D"], requires_grad=True)
        step = lambda f: f(ctx, tok).square().mean().backward()
        eager_ms, mha_ms = (median_ms(lambda: step(m), args.repeats, clock=time.process_time) for m in (block, mha))
        print(f"{args.preset} {spelling:5s} fwd+bwd: eager {eager_ms:7.1f} ms  mha(reference) {mha_ms:7.1f} ms  "
              f"speedup {eager_ms / mha_ms:.2f}x")


if __name__ == "__main__":
    main()
