"""One benchmark row in a process of its own (`python -m bench --isolate`).

Why: rows whose time is the host's (small and medium, large's plain rows; peers and ours alike)
run slower the later they come in one process, though the harness resets Dynamo, the region
graphs and the allocator between rows. On one H200 in session 41, medium's reduce-overhead row
took 0.619 ms as the first row of its process and 1.093 as the sixth of another (PERF_NOTES v41,
v44). A fresh process per row times every row as a first row, at the cost of starting Python,
torch and CUDA again and loading the compiled kernels from the on-disk caches (seconds a row).

The parent calls `measure(job, quick)`; the child, `python -m bench.row_process '<job as JSON>'
[--quick]`, measures it with `bench.measure.run_row` and prints the row as one JSON line led by
MARK. Everything else the child prints reaches the parent's stderr.
"""
import json
import subprocess
import sys

MARK = "bench-row: "


def command(job, quick):
    """The child's command line for `job`."""
    return [sys.executable, "-m", "bench.row_process", json.dumps(job)] + (["--quick"] if quick else [])


def measure(job, quick=False):
    """The row of `job` measured in a new process; an error row where that process died or
    printed no row (its exit status and last output say why)."""
    done = subprocess.run(command(job, quick), stdout=subprocess.PIPE, text=True)
    rows, other = [], []
    for line in done.stdout.splitlines():
        (rows if line.startswith(MARK) else other).append(line)
    if other:
        print("\n".join(other), file=sys.stderr)
    if rows:
        if done.returncode != 0:  # measured and printed, then failed on its way out
            print(f"bench: the row's own process exited with status {done.returncode} after its row",
                  file=sys.stderr)
        return json.loads(rows[-1][len(MARK):])
    error = f"the row's own process exited with status {done.returncode} and printed no row"
    return dict(job, status="error", error=error, traceback="\n".join(other[-40:]))


def main(argv):
    from bench import measure as bench_measure  # the child's import: torch and CUDA start here
    job = json.loads(argv[0])
    row = bench_measure.run_row(job, {}, quick="--quick" in argv[1:])
    print(MARK + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
