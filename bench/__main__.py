"""`python -m bench`: presets × dtypes × modes × spellings × passes, one row each.

Writes <out>/<name>.json (rows), <name>.md (table), <name>.png (speedup by preset) and
<name>.errors.log (tracebacks); prints the table. JSON and markdown are rewritten after every
row, so a run cut short (time limit, Ctrl-C) still leaves its results. See bench/README.md.
"""
import argparse
import json
import os
import shlex
import statistics
import sys
import time

import torch

from bench import measure, modes, plot, report, row_process
from mha_compile.models import PRESETS

PASSES = ("fwd+bwd", "fwd")  # training first: the targets that matter most are there
CUDA_PRESETS, CUDA_QUICK_PRESETS = ("small", "medium", "large"), ("small", "medium")
CUDA_MODES = ("eager", "inductor", "inductor-max-autotune", "mha-staged", "mha-fused", "mha-fused-nographs",
              "mha-fused-cudagraphs", "mha-fused-keep", "mha-fused-keep-plain")
# max-autotune compiles for minutes per graph: by default only at medium, where SPEC §5 found it
# the best peer and the 8× target is relative to it (small's target is absolute: < 0.25 ms).
CUDA_AUTOTUNE_PRESETS = ("medium",)
# Inductor max-autotune's fwd+bwd compile at medium on the H200 (bf16): dense 181 s (session 32),
# grouped_mm 221 s, the fastest of the three at run time (1.344 ms against dense's 1.919; session
# 33), loop over 263 s (session 31, unfinished). Session 32's table ran them dense, loop,
# grouped_mm, and its budget cut the two last, the best peer among them.
AUTOTUNE_ORDER = ("dense", "grouped_mm", "loop")
CPU_PRESETS, CPU_QUICK_PRESETS = ("tiny", "small"), ("tiny",)
CPU_MODES = ("eager", "inductor", "mha-reference")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer presets and modes, shorter timing")
    p.add_argument("--presets", help=f"comma list of {list(PRESETS)}")
    p.add_argument("--dtypes", help="comma list of fp32, bf16, fp16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--modes", help=f"comma list of {list(modes.MODES)}")
    p.add_argument("--spellings", help=f"comma list of {list(modes.SPELLINGS)}")
    p.add_argument("--passes", help=f"comma list of {list(PASSES)}")
    p.add_argument("--autotune-presets", help="presets where inductor-max-autotune runs "
                   f"(default on CUDA: {','.join(CUDA_AUTOTUNE_PRESETS)}; 'all' for every preset)")
    p.add_argument("--autotune-spellings", help="spellings where inductor-max-autotune runs (default: every one "
                   "of --spellings); e.g. those whose compiles an earlier run left in Inductor's cache")
    p.add_argument("--budget", type=float, help="seconds after which no new row starts (rest: skipped)")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    p.add_argument("--out", default="out/bench", help="output folder (default: out/bench)")
    p.add_argument("--name", default="bench", help="file name stem of the outputs (default: bench)")
    p.add_argument("--commit", help="commit to record when the tree has no .git (default: git HEAD)")
    p.add_argument("--isolate", action="store_true",
                   help="measure each row in a process of its own (bench/row_process.py): host-bound rows "
                        "then do not depend on the rows before them; seconds more a row")
    p.add_argument("--rounds", type=_positive_int, default=1,
                   help="time every row this many times, rounds interleaved (every row once, then again): "
                        "a row's time is its rounds' median, so a host whose speed moves during the run "
                        "(bench/PERF_NOTES.md v45) is sampled that many times a row (default 1)")
    p.add_argument("--resume", action="store_true",
                   help="keep the groups (preset, dtype, pass) that <out>/<name>.json already holds whole, "
                        "measured on this device, torch, triton and commit; run the rest")
    return p.parse_args(argv)


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of rounds, 1 or more")
    return value


def _list(value, allowed, default, what):
    items = default if value is None else [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad:
        raise SystemExit(f"--{what}: unknown {bad}; expected some of {list(allowed)}")
    return list(items)


def plan(args, device_type):
    """The jobs in run order, and notes saying what was left out and why."""
    cuda = device_type == "cuda"
    presets = _list(args.presets, PRESETS, (CUDA_QUICK_PRESETS if args.quick else CUDA_PRESETS) if cuda
                    else (CPU_QUICK_PRESETS if args.quick else CPU_PRESETS), "presets")
    dtypes = _list(args.dtypes, ("fp32", "bf16", "fp16"), ["bf16"] if cuda else ["fp32"], "dtypes")
    default_modes = [m for m in CUDA_MODES if not (args.quick and m == "inductor-max-autotune")] if cuda else CPU_MODES
    mode_list = _list(args.modes, modes.MODES, default_modes, "modes")
    spellings = _list(args.spellings, modes.SPELLINGS, modes.SPELLINGS, "spellings")
    passes = _list(args.passes, PASSES, PASSES, "passes")
    autotune = list(PRESETS) if args.autotune_presets == "all" else _list(
        args.autotune_presets, PRESETS, CUDA_AUTOTUNE_PRESETS if cuda else list(PRESETS), "autotune-presets")
    tuned_spellings = _list(args.autotune_spellings, modes.SPELLINGS, spellings, "autotune-spellings")
    notes = []
    if not cuda:
        notes.append("CPU: reduced set (presets " + ", ".join(presets) + "; " + ", ".join(dtypes) + "; modes "
                     + ", ".join(mode_list) + "); the full sweep and the floor need CUDA")
    if "inductor-max-autotune" in mode_list and set(presets) - set(autotune):
        tuned = [p for p in presets if p in autotune]
        where = "ran only at " + ", ".join(tuned) if tuned else "ran at none of these presets"
        notes.append(f"inductor-max-autotune {where} (--autotune-presets): elsewhere the best peer may be "
                     "slower than it could be")
    untuned = [s for s in spellings if s not in tuned_spellings]
    if "inductor-max-autotune" in mode_list and untuned:
        notes.append(f"inductor-max-autotune not run on the {', '.join(untuned)} spelling(s) (--autotune-spellings): "
                     "the best peer may be slower than it could be there")
    if args.isolate:
        notes.append("each row measured in a process of its own (--isolate): no row's time depends on the rows "
                     "before it; first-call times include loading the compiled kernels from disk")
    else:
        notes.append("the rows share one process, in the order listed: host-bound rows can run slower the later "
                     "they come (up to 1.8x in session 41, bench/PERF_NOTES.md v44); --isolate measures each alone, but the host's own "
                     "speed moves as much (session 42, v45)")
    jobs = []
    for pass_ in PASSES:
        for preset in presets:
            for dtype in dtypes:
                for spelling in spellings:
                    for mode in mode_list:
                        if pass_ not in passes:
                            continue
                        if spelling == "grouped_mm" and mode not in modes.GROUPED_MM_MODES:
                            continue
                        if mode == "inductor-max-autotune" and (preset not in autotune
                                                                or spelling not in tuned_spellings):
                            continue
                        jobs.append({"preset": preset, "dtype": dtype, "mode": mode, "spelling": spelling,
                                     "pass": pass_, "device_type": device_type})
    # Within each pass, max-autotune last: the slowest to compile, so a time budget cuts it
    # first; training (fwd+bwd) before forward, since the targets that matter most are there.
    # Its spellings in AUTOTUNE_ORDER, quickest to compile first: a budget then cuts the loop one.
    jobs.sort(key=lambda job: (PASSES.index(job["pass"]), job["mode"] == "inductor-max-autotune",
                               AUTOTUNE_ORDER.index(job["spelling"]) if job["mode"] == "inductor-max-autotune" else 0))
    return jobs, notes


class Progress:
    """tqdm when installed, else one line per finished row on stderr."""

    def __init__(self, total):
        self.total, self.done = total, 0
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def start(self, label):
        if self.bar is not None:
            self.bar.set_description(label)

    def finish(self, label, row):
        self.done += 1
        result = f"{row['time_ms']:.3f} ms" if row.get("time_ms") else f"{row['status']}: {row.get('error')}"
        if self.bar is not None:
            self.bar.update()
        else:
            print(f"[{self.done}/{self.total}] {label}: {result}"[:200], file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _label(job):
    return f"{job['preset']} {job['dtype']} {job['pass']} {job['spelling']} {job['mode']}"


def _group_of(row):
    return row["preset"], row["dtype"], row["pass"]


def resumed_rows(path, jobs, env, isolated=False, rounds=1, settings=None, quick=False):
    """(The rows of an earlier run to keep, its meta), whole groups only: a group (preset, dtype,
    pass) is what one speedup compares, so all its rows must come from one process. A group this
    run plans is kept when every planned job of it has a row that ran (ok in every round asked, or
    error; not skipped, nor cut to fewer rounds); an incomplete one runs again in full. A group
    this run does not plan (a chain's earlier call ran other presets: h200_session.sh's
    PRESETS=medium, then RESUME=1 PRESETS=small,large) is kept as it is, first. The earlier run
    must match `env` (device, versions, commit), and its rounds, isolation, --quick and
    MHA_COMPILE_* settings."""
    if not os.path.exists(path):
        raise SystemExit(f"--resume: {path} does not exist; run without --resume first")
    with open(path) as f:
        earlier = json.load(f)
    for field in ("device", "torch", "triton", "commit"):
        if earlier["meta"].get(field) != env[field]:
            raise SystemExit(f"--resume: {path} was measured with {field}={earlier['meta'].get(field)!r}, "
                             f"this run has {env[field]!r}; rows from both cannot be compared")
    if earlier["meta"].get("rounds", 1) != rounds:
        raise SystemExit(f"--resume: {path} timed each row in {earlier['meta'].get('rounds', 1)} round(s), "
                         f"this run in {rounds}; a table's rows must be measured the same way")
    if earlier["meta"].get("isolated", False) != isolated:
        how = {True: "each row in its own process (--isolate)", False: "in one process"}
        raise SystemExit(f"--resume: {path} was measured {how[not isolated]}, this run {how[isolated]}; "
                         "a table's rows must be measured the same way")
    if earlier["meta"].get("quick", False) != quick:
        how = {True: "with --quick (do_bench 10/40 ms)", False: "without --quick"}
        raise SystemExit(f"--resume: {path} was timed {how[not quick]}, this run {how[quick]}; "
                         "a table's rows must be measured the same way")
    if earlier["meta"].get("settings", {}) != (settings or {}):
        raise SystemExit(f"--resume: {path} was measured with MHA_COMPILE_* settings "
                         f"{earlier['meta'].get('settings', {})}, this run with {settings or {}}; "
                         "a table's rows must be measured the same way")
    # An ok row the budget or a stop cut to fewer rounds than asked (round_ms shorter) did not
    # run as this table's rows must: its group runs again, as an incomplete one does.
    ran = {tuple(r[k] for k in ("preset", "dtype", "pass", "spelling", "mode")): r
           for r in earlier["rows"] if r.get("status") == "error"
           or (r.get("status") == "ok" and (rounds == 1 or len(r.get("round_ms") or ()) >= rounds))}
    planned = dict.fromkeys(_group_of(job) for job in jobs)
    kept = [r for r in earlier["rows"] if _group_of(r) not in planned]
    for group in planned:
        members = [job for job in jobs if _group_of(job) == group]
        rows = [ran.get((*group, job["spelling"], job["mode"])) for job in members]
        if all(rows):
            kept += rows
    return kept, earlier["meta"]


def inductor_cache_note():
    """A note when TORCHINDUCTOR_CACHE_DIR already holds compiled code (h200_session.sh's
    autotune-cache part fills it in an earlier call): Inductor rows' first calls then compile
    from that cache, not from scratch. None otherwise."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder or not os.path.isdir(folder):
        return None
    files = sum(len(names) for _, _, names in os.walk(folder))
    if not files:
        return None
    return (f"Inductor's cache ({folder}) held {files} files from an earlier run: the Inductor rows' "
            "first-call times are compiles from that cache, not from scratch")


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    jobs, notes = plan(args, device_type)
    cached = inductor_cache_note()
    if cached:
        notes.append(cached)
    env = report.environment(device_type, args.commit)
    command = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--resume"]
    settings = report.mha_settings()
    meta = dict(env, date=report.now(), command="python -m bench " + shlex.join(command), isolated=args.isolate,
                rounds=args.rounds, quick=args.quick, settings=settings, notes=notes)
    if settings:
        notes.append("run with " + ", ".join(f"{k}={v}" for k, v in settings.items()) + " set in the "
                     "environment: these rows ran under those values (a value can equal the default; README's table of "
                     "environment variables gives each default)")
    if args.rounds > 1:
        notes.append(f"each row timed in {args.rounds} rounds, interleaved (every row once, then again): its ms is "
                     "the rounds' median, the note gives how many rounds it got and their range (a run cut short "
                     "by its budget or a stop leaves fewer); its peak is the largest round's, its first call the "
                     "first round's")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.name)
    kept = []
    if args.resume:
        kept, earlier = resumed_rows(stem + ".json", jobs, env, args.isolate, args.rounds, settings, args.quick)
        done = {_group_of(r) for r in kept}
        jobs = [job for job in jobs if _group_of(job) not in done]
        how = ("this command" if earlier.get("command") == meta["command"]
               else f"`{earlier.get('command')}`")
        notes.append(f"{len(kept)} rows ({len(done)} whole groups of preset, dtype and pass) from a run of {how} "
                     f"at {earlier.get('date')}, resumed at {meta['date']}; each group's rows come from one run")
        notes += [f"from that run: {note}" for note in earlier.get("notes", []) if note not in notes]
    print(f"bench: {len(jobs)} rows on {env['device']}, torch {env['torch']}, triton {env['triton']}, "
          f"commit {env['commit']}", file=sys.stderr)
    for note in notes:
        print(f"bench: {note}", file=sys.stderr)

    cache, started = {}, time.perf_counter()
    schedule = [job for _ in range(args.rounds) for job in jobs]
    measured = {}  # a job's label -> its rounds' rows so far, in the order the jobs first ran
    progress = Progress(len(schedule))
    running = None  # (job, when it started) while a row is being measured
    try:
        for job in schedule:
            label = _label(job)
            progress.start(label)
            if args.budget is not None and time.perf_counter() - started > args.budget:
                row = dict(job, status="skipped", error=f"time budget of {args.budget:.0f} s spent")
            else:
                # On disk first as unfinished: a process killed inside a row (max-autotune's
                # compile does not answer an interrupt) then leaves a table that names it.
                running = (job, time.perf_counter())
                _write(stem, meta, kept + _merged(measured, args.rounds,
                                                  _unfinished(job, env, running[1] - started, None)))
                row = (row_process.measure(job, quick=args.quick) if args.isolate
                       else measure.run_row(job, cache, quick=args.quick))
                running = None
            trace = row.pop("traceback", None)
            if trace:
                with open(stem + ".errors.log", "a") as log:
                    log.write(f"==== {label}\n{trace}\n")
            measured.setdefault(label, []).append({**dict.fromkeys(report.ROW_FIELDS), **row, **env})
            progress.finish(label, row)
            _write(stem, meta, kept + _merged(measured, args.rounds))
    except KeyboardInterrupt:
        done = sum(map(len, measured.values()))
        notes.append(f"interrupted after {done} of {len(schedule)} rows")
        print(f"bench: interrupted; writing the {done} rows done", file=sys.stderr)
        if running is not None:
            job, since = running
            measured.setdefault(_label(job), []).append(_unfinished(job, env, since - started,
                                                                     time.perf_counter() - since))
    finally:
        progress.close()
    rows = kept + _merged(measured, args.rounds)
    _write(stem, meta, rows)
    print(report.table(rows))
    for note in notes:
        print(f"note: {note}")
    print(plot.plot_speedup(rows, stem + ".png"))
    print(f"rows written to {stem}.json and {stem}.md")
    return 0


def _merged(measured, asked, running=None):
    """One row a job from its rounds' rows (merge_rounds; `asked`: --rounds), in the order the
    jobs first ran; `running`: the row being measured, as unfinished (one more round of its job,
    or its job's first: a process killed in a later round leaves a row whose round_ms shows the
    rounds done)."""
    running_label = None if running is None else _label(running)
    rows = [merge_rounds(rounds + ([running] if label == running_label else []), asked)
            for label, rounds in measured.items()]
    if running is not None and running_label not in measured:
        rows.append(running)
    return rows


def merge_rounds(rounds, asked=1):
    """A job's row from its rounds (`asked`: how many --rounds asked for): a round that failed
    (error) is the row, so no failure hides behind a good round; otherwise the round with the
    median time (the lower of the two middle ones) with time_ms the rounds' median (of two, their
    mean: the lower one made every 2-round row its fastest, and a row the budget cut to two beside
    one with three was timed by another statistic), round_ms (every finished round's time, in
    order), the largest round's peak memory and the first round's first call (the compile; later
    rounds compile from caches). A job with no finished round: its last row (skipped,
    unfinished). With more than one round asked, round_ms is there even when one round
    finished, so the table says a row got fewer than asked."""
    failed = [r for r in rounds if r.get("status") == "error"]
    if failed:
        return failed[0]
    done = [r for r in rounds if r.get("status") == "ok" and r.get("time_ms") is not None]
    if not done:
        return rounds[-1]
    if len(rounds) == 1 and asked == 1:
        return rounds[0]
    lower = statistics.median_low(r["time_ms"] for r in done)
    row = dict(next(r for r in done if r["time_ms"] == lower), time_ms=statistics.median(r["time_ms"] for r in done))
    peak = max(done, key=lambda r: r.get("peak_mib") or 0)
    row.update({k: peak.get(k) for k in ("peak_mib", "peak_delta_mib", "graph_pool_mib")},
               first_call_s=done[0].get("first_call_s"), round_ms=[r["time_ms"] for r in done])
    return row


def _unfinished(job, env, started_s, ran_s):
    """The row of a job that did not finish: started `started_s` into the run, interrupted after
    `ran_s` seconds (None: still running when these files were last written)."""
    how = (f"interrupted after {ran_s:.0f} s" if ran_s is not None
           else "still running when the process stopped")
    error = f"{how} (started at {started_s:.0f} s of the run)"
    return {**dict.fromkeys(report.ROW_FIELDS), **job, "status": "unfinished", "error": error, **env}


def _write(stem, meta, rows):
    report.add_speedups(rows)
    report.write_json(stem + ".json", meta, rows)
    report.write_markdown(stem + ".md", meta, rows, meta["notes"])


if __name__ == "__main__":
    sys.exit(main())
