"""Reference path vs eager on the CPU, forward and forward+backward, one thread, CPU time (not wall time).

    python bench/cpu_speed.py [--preset small] [--repeats 5]

CPU time of a single-threaded process is what this machine can measure reliably while other
work shares its two cores (wall time swung 3x between runs); the ratio is what we quote. The table
is `make demo`'s (mha_compile.demo.speed_table), at any preset: each mha row must have replaced its
region, or it raises rather than time eager twice.
"""
import argparse

from mha_compile import models
from mha_compile.demo import speed_table


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=list(models.PRESETS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    speed_table(args.preset, args.repeats)


if __name__ == "__main__":
    main()
