"""Where one kernel launch's warps spend their time, from Nsight Compute's source page.

    ncu -i REPORT.ncu-rep -k KERNEL -c 1 --page source --csv --print-source sass > k.csv
    python bench/ncu_source.py k.csv [more.csv ...] [--top 12]

(`bash bench/h200_session.sh ncu-source` profiles GEMM1 and the hidden kernel at large and runs
this on both.) Each SASS instruction carries its warp-stall samples and how many times warps
executed it. Instructions executed equally often belong to one part of the kernel: the K loop's
body runs once a k-step, an epilogue once a job, a producer's loop once a stage, and the warps
that wait out the kernel at its end barrier once. So the samples are summed by execution count
(the share of the warps' time each part takes, stalled or issuing), with each part's commonest
opcodes, then the instructions with the most samples and their two main stall reasons.
"""
import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _number(text):
    return float(text.replace(",", "") or 0)


def read_sass(path):
    """(kernel name, [{column: value}]) from an `ncu --page source --csv --print-source sass` file:
    its first line names the kernel, its second holds the columns."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    if len(lines) < 3 or SAMPLES not in lines[1] or EXECUTED not in lines[1]:
        raise SystemExit(f"ncu_source: {path} is not ncu's source page of SASS with stall samples "
                         f"(columns {SAMPLES!r}, {EXECUTED!r})")
    kernel = lines[0][1] if len(lines[0]) > 1 else "?"
    return kernel, [dict(zip(lines[1], row)) for row in lines[2:] if len(row) == len(lines[1])]


def opcode(source):
    """The opcode of a SASS line, without its predicate and modifiers ("@!P0 BRA 0x.." -> "BRA")."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def parts(rows):
    """[(executions, share of samples, instructions, Counter of opcodes)] by execution count, most
    samples first."""
    total = sum(_number(r[SAMPLES]) for r in rows) or 1.0
    samples, count, ops = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
    for r in rows:
        n = int(_number(r[EXECUTED]))
        samples[n] += _number(r[SAMPLES])
        count[n] += 1
        ops[n][opcode(r["Source"])] += 1
    return [(n, samples[n] / total, count[n], ops[n]) for n, _ in samples.most_common()]


def top_instructions(rows, top):
    """[(share of samples, source, [(samples, stall reason)] × 2)] of the `top` most sampled."""
    total = sum(_number(r[SAMPLES]) for r in rows) or 1.0
    reasons = [c for c in (rows[0] if rows else {}) if c.startswith("stall_") and "Not Issued" not in c]
    out = []
    for r in sorted(rows, key=lambda r: -_number(r[SAMPLES]))[:top]:
        main = sorted(((_number(r[c]), c[len("stall_"):]) for c in reasons), reverse=True)[:2]
        out.append((_number(r[SAMPLES]) / total, r["Source"].strip(), main))
    return out


def report(path, top=12):
    kernel, rows = read_sass(path)
    lines = [f"{kernel}: {len(rows)} SASS instructions, {sum(_number(r[SAMPLES]) for r in rows):.0f} stall samples",
             "by how often an instruction ran (one part of the kernel each):"]
    for n, share, count, ops in parts(rows)[:8]:
        common = ", ".join(f"{op} {k}" for op, k in ops.most_common(5))
        lines.append(f"  ran {n:>9}x: {100 * share:5.1f}% of samples, {count:>5} instructions ({common})")
    lines.append("most sampled instructions:")
    for share, source, main in top_instructions(rows, top):
        why = ", ".join(f"{reason} {samples:.0f}" for samples, reason in main if samples)
        lines.append(f"  {100 * share:5.1f}%  {source[:64]:<64} {why}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    print("\n\n".join(report(path, args.top) for path in args.csv))


if __name__ == "__main__":
    main()
