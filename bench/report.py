"""Rows to results: the environment key, speedups over the best peer, the table, JSON and markdown."""
import datetime
import json
import math
import os
import platform
import subprocess

import torch
from tabulate import tabulate

from bench.cases import TIE_MARGIN
from bench.modes import MHA_MODES, PEER_MODES, kernels_named

# Fields that, with the environment's, identify a row (the JSON "key").
KEY_FIELDS = ("preset", "dtype", "mode", "spelling", "pass", "device", "torch", "triton", "commit")
# Every row has these (None where they do not apply); bench/README.md says what each means.
RESULT_FIELDS = ("status", "error", "time_ms", "round_ms", "first_call_s", "host_probe_ms", "peak_mib",
                 "peak_delta_mib", "graph_pool_mib", "rel_err", "grad_rel_err", "tie_rows", "tie_rows_flipped", "rows_off",
                 "regions_replaced", "kernels_chosen", "lowering_note", "flops_min", "flops_mode", "bytes_min",
                 "floor_s", "pct_floor", "tflops", "tflops_mode", "speedup", "best_peer", "best_peer_ms",
                 "best_peer_peak_mib", "peak_ratio", "B", "H", "N", "D", "P", "F", "E", "k")
ROW_FIELDS = KEY_FIELDS + RESULT_FIELDS
# Relative error above which a row is flagged in the table (SPEC §4's bounds; bf16 rows are
# compared to an fp32 reference, away from the rows near a top-k tie: bench/cases.TIE_MARGIN).
# fp32: SPEC §4 asks 1e-5 of kernels whose dots are ieee (ours); 5e-4 only where TF32 is declared.
FLAG_ERROR = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}


def environment(device_type, commit=None):
    """The fields every row carries besides its job: device, versions, commit."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = torch.cuda.get_device_name() if device_type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    return dict(device=device, torch=torch.__version__, triton=triton_version, commit=commit or git_commit())


def mha_settings(environ=None):
    """The MHA_COMPILE_* environment variables set for this run ({name: value}): switches of the
    kernels (MHA_COMPILE_SLOT_CHUNK_MB, MHA_COMPILE_KEEP_HIDDEN, ...) that a table measured under
    them must say it was."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ) if k.startswith("MHA_COMPILE_")}


def git_commit():
    """HEAD's hash, with -dirty when tracked files differ; 'unknown' outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root).returncode != 0
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def add_speedups(rows):
    """speedup = best peer time / row time, per (preset, dtype, pass, device); names the peer, and
    gives peak_ratio = this row's peak / that peer's (issue 4's memory target: at most 0.5),
    where both were measured (CUDA rows)."""
    best = {}
    for row in rows:
        if row.get("status") == "ok" and row["mode"] in PEER_MODES:
            group = _group(row)
            if group not in best or row["time_ms"] < best[group]["time_ms"]:
                best[group] = row
    for row in rows:
        peer = best.get(_group(row))
        row["best_peer"] = f"{peer['mode']}/{peer['spelling']}" if peer else None
        row["best_peer_ms"] = peer["time_ms"] if peer else None
        row["speedup"] = peer["time_ms"] / row["time_ms"] if peer and row.get("time_ms") else None
        if not_lowered(row):  # its time is not the kernels its mode names: no speedup under that name
            row["speedup"] = None
        row["best_peer_peak_mib"] = peer.get("peak_mib") if peer else None
        row["peak_ratio"] = (row["peak_mib"] / row["best_peer_peak_mib"]
                             if row.get("peak_mib") and row["best_peer_peak_mib"] else None)
    return rows


def not_lowered(row):
    """Why a finished backend="mha" row did not time the kernels its mode names, or None where it
    did (and for peers, and rows that did not finish): a region must be confirmed replaced
    (explain found one or more) by the kernel set the mode names (modes.kernels_named) in every
    match. An explain that failed leaves it unconfirmed: not lowered too, not taken on trust."""
    if row.get("mode") not in MHA_MODES or row.get("status") != "ok":
        return None
    replaced, ran = row.get("regions_replaced"), row.get("kernels_chosen") or []
    if replaced is None:
        why = row.get("lowering_note") or "no lowering check recorded"
        return f"NOT LOWERED: not confirmed ({why})"[:120]
    if replaced == 0:
        return "NOT LOWERED: no region replaced, timed the graph as captured"
    named = kernels_named(row["mode"])
    if not ran or any(kernels != named for kernels in ran):
        return f"NOT LOWERED AS NAMED: ran the {', '.join(map(str, ran)) or 'unrecorded'} kernels, not {named}"
    return None


def _over_bound(row):
    """(rel err over the dtype's bound or a row away from the top-k ties off the reference's
    (rows_off), grad err over the bound), False where not measured."""
    bound = FLAG_ERROR.get(row["dtype"], FLAG_ERROR["fp32"])
    # "not <=": a NaN error is over every bound (NaN > bound is False)
    over = [row.get(name) is not None and not row[name] <= bound for name in ("rel_err", "grad_rel_err")]
    return over[0] or bool(row.get("rows_off")), over[1]


def _group(row):
    return row["preset"], row["dtype"], row["pass"], row["device"]


def _fmt(value, spec):
    return "" if value is None else format(value, spec)


def table_rows(rows):
    """Rows for tabulate: one line per measurement, errors shortened."""
    out = []
    for r in rows:
        err, grad = r.get("rel_err"), r.get("grad_rel_err")
        flag, gflag = (" (!)" if over else "" for over in _over_bound(r))
        note = "" if r.get("status") == "ok" else f"{r.get('status')}: {r.get('error') or ''}"[:70]
        if not_lowered(r):
            note = not_lowered(r)
        elif r.get("status") == "ok" and r.get("graph_pool_mib"):
            note = f"peak MiB: {r['graph_pool_mib']:.0f} of it CUDA-graph pools"
        if r.get("tie_rows_flipped"):
            note = "; ".join(n for n in (f"top-k: {r['tie_rows_flipped']} of the {r['tie_rows']} tie rows chose "
                                         "other experts", note) if n)
        if r.get("rows_off"):
            note = "; ".join(n for n in (f"(!) {r['rows_off']} rows away from the ties 10%+ off", note) if n)
        if r.get("status") == "ok" and r.get("round_ms"):
            done = r["round_ms"]
            spread = f"{len(done)} rounds {min(done):.3f}-{max(done):.3f} ms" if len(done) > 1 else "1 round only"
            note = "; ".join(n for n in (spread, note) if n)
        out.append([r["preset"], r["dtype"], r["pass"], r["spelling"], r["mode"],
                    _fmt(r.get("time_ms"), ".3f"), _fmt(r.get("speedup"), ".2f"),
                    _fmt(r.get("pct_floor"), ".1f"), _fmt(r.get("tflops"), ".2f"),
                    _fmt(r.get("peak_mib"), ".0f"), _fmt(r.get("peak_ratio"), ".2f"),
                    _fmt(err, ".1e") + flag, _fmt(grad, ".1e") + gflag,
                    _fmt(r.get("first_call_s"), ".1f"), note])
    return out


HEADERS = ["preset", "dtype", "pass", "spelling", "mode", "ms", "× best peer", "% floor", "TFLOP/s",
           "peak MiB", "peak ÷ best peer's", "rel err", "grad err", "1st call s", "note"]


def table(rows, fmt="simple"):
    return tabulate(table_rows(rows), headers=HEADERS, tablefmt=fmt, disable_numparse=True)


LEGEND = """\
- **ms**: median time of one step (fwd: forward under no_grad; fwd+bwd: forward and backward).
- **× best peer**: the best peer's time / this row's time, in the same run; peers are eager,
  Inductor and Inductor max-autotune on every spelling (dense, loop, grouped_mm) that finished
  in the run; the notes above the table name any preset, dtype and pass missing one of them,
  and any whose best peer (the fastest, right or not) is flagged (!).
- **% floor**: the roofline floor / this time (mha_compile/cost.py: max(FLOPs / 790 TFLOP/s,
  bytes / 4.3 TB/s), both measured on an H200, SPEC §5); CUDA bf16 rows only.
- **TFLOP/s**: the region's minimum FLOPs / time (useful work, whatever the mode computes).
- **peak MiB**: torch.cuda.max_memory_allocated over one step (model, inputs and grads included),
  plus what CUDA-graph pools hold beside their live tensors: rows that replay graphs
  (mha-fused-cudagraphs, mha-fused-keep, mha-fused-trees and inductor-max-autotune whole graphs; mha-fused's region graphs,
  options graphs="auto", at small and medium) write their intermediates there, memory the
  allocator's count leaves out. The note gives the pools' part.
- **peak ÷ best peer's**: this row's peak MiB / the best peer's (the fastest peer of the row's
  preset, dtype and pass, as in × best peer); issue 4 asks at most 0.5 in training.
- **rel err / grad err**: ‖out − ref‖/‖ref‖ and the worst gradient's, against the eager loop
  spelling in fp32 on the same rounded parameters and inputs; (!) marks errors above the
  dtype's bound (fp32 1e-5, bf16 2e-2); the worse of two batches, each against the reference on
  it. Rows (of B·H) whose top-k choice rounding can flip are
  counted apart (SPEC §4): those where the reference's k-th router probability exceeds its
  (k+1)-th by less than {bf16} of the k-th in bf16 ({fp16} fp16, {fp32} fp32; bench/cases.py) are
  left out of rel err, and their upstream gradient is zero in the check, the reference's too; the
  notes above the table say how many, and a row's note how many of them chose other experts (a
  row 10% or more off the reference's). A row away from them as far off stays in rel err, and
  the note counts it, with (!).
- **1st call s**: the first call, synchronised: compile time plus one step for compiled modes.
  Triton compiles and autotunes each kernel once per process: the first mha row of a kernel set
  at a preset pays it (e.g. mha-staged at medium), later rows reuse the kernels.
- **unfinished**: a row that was being measured when the run was interrupted or killed (a
  compiled mode's first call compiles: Inductor max-autotune can take minutes); the note says
  when it started.
- **NOT LOWERED**: a backend="mha" row where mha_compile.explain found no region replaced (the
  backend then runs the graph as captured, so its time is not our kernels'), or could not say
  (explain failed: not confirmed); **NOT LOWERED AS NAMED**: one whose region ran another kernel
  set than its mode names (the backend falls back fused -> staged -> reference where a set cannot
  run). Such a row gets no × best peer and is left out of the plot.
""".format(**{dtype: f"2^{math.log2(margin):.0f}" for dtype, margin in TIE_MARGIN.items()})


def compile_table(rows):
    """The backend's compile time beside Inductor's: first-call seconds per mode, by preset and pass."""
    columns = list(dict.fromkeys((r["preset"], r["pass"]) for r in rows))
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        cells = []
        for preset, pass_ in columns:
            times = [r["first_call_s"] for r in rows if (r["mode"], r["preset"], r["pass"]) == (mode, preset, pass_)
                     and r.get("first_call_s") is not None]
            cells.append(f"{max(times):.1f}" if times else "")
        lines.append([mode, *cells])
    headers = ["mode (worst spelling)", *[f"{p} {q}" for p, q in columns]]
    return tabulate(lines, headers=headers, tablefmt="github", disable_numparse=True)


def write_json(path, meta, rows):
    with open(path, "w") as f:
        json.dump(dict(meta=meta, key_fields=list(KEY_FIELDS), rows=rows), f, indent=1, default=str)


def write_markdown(path, meta, rows, notes=()):
    lines = [f"# mha-compile benchmark: {meta.get('device')}", "",
             f"torch {meta.get('torch')}, triton {meta.get('triton')}, commit {meta.get('commit')}, "
             f"{meta.get('date')}.", "", f"Command: `{meta.get('command')}`", ""]
    notes = (list(notes) + [n for n in [host_probe_note(rows), floor_note(rows)] if n] + peer_notes(rows)
             + wrong_peer_notes(rows) + tie_notes(rows))
    lines += [f"- {note}" for note in notes] + ([""] if notes else [])
    lines += [table(rows, "github"), "", LEGEND, "## Compile time (first call, s)", "", compile_table(rows), ""]
    errors = [r for r in rows if r.get("status") == "error"]
    if errors:
        lines += ["## Errors", ""]
        lines += [f"- {r['preset']} {r['dtype']} {r['pass']} {r['spelling']} {r['mode']}: {r['error']}"
                  for r in errors]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def host_probe_note(rows):
    """How far the host's speed moved over the rows (each row's host_probe_ms), or None with
    fewer than two probes."""
    probes = [r["host_probe_ms"] for r in rows if r.get("host_probe_ms") is not None]
    if len(probes) < 2:
        return None
    low, high = min(probes), max(probes)
    return (f"host probe (bench/timing.py: a fixed pure-Python loop just before each row's timing) "
            f"{low:.2f}-{high:.2f} ms over these rows ({high / low:.1f}x): the host's speed moved that "
            "much during the run; host-bound rows (small, medium, large's plain ones) move with it")


def peer_notes(rows):
    """For each (preset, dtype, pass, device) whose × best peer is not against every peer (eager,
    Inductor, max-autotune on each spelling of the group's rows), a note naming the peers it is
    against and those missing (not asked, failed, cut by the budget or unfinished): the legend's
    list alone let a table against Inductor only read as against all three."""
    notes = []
    for group in dict.fromkeys(_group(r) for r in rows):
        members = [r for r in rows if _group(r) == group]
        spellings = list(dict.fromkeys(r["spelling"] for r in members))
        ran = {(r["mode"], r["spelling"]) for r in members if r.get("status") == "ok" and r["mode"] in PEER_MODES}
        missing = [f"{m}/{s}" for m in PEER_MODES for s in spellings if (m, s) not in ran]
        if missing:
            against = ", ".join(f"{m}/{s}" for m, s in sorted(ran)) or "none"
            notes.append(f"{' '.join(group[:3])}: × best peer is against {against} only; "
                         f"not timed here: {', '.join(missing)}")
    return notes


def wrong_peer_notes(rows):
    """For each (preset, dtype, pass, device) whose best peer is off the reference beyond the
    dtype's bound (flagged (!)), a note saying × best peer is against a wrong answer: the fastest
    peer is the one the table compares against, right or not, and this says which it was."""
    notes = []
    for group in dict.fromkeys(_group(r) for r in rows):
        members = [r for r in rows if _group(r) == group]
        names = {m["best_peer"] for m in members if m.get("best_peer")}
        for peer in (m for m in members if f"{m['mode']}/{m['spelling']}" in names and any(_over_bound(m))):
            errors = ", ".join([f"{label} {peer[name]:.1e}" for label, name in (("rel err", "rel_err"),
                                ("grad err", "grad_rel_err")) if peer.get(name) is not None]
                               + ([f"{peer['rows_off']} rows 10%+ off"] if peer.get("rows_off") else []))
            notes.append(f"{' '.join(group[:3])}: the best peer, {peer['mode']}/{peer['spelling']}, is off the "
                         f"reference beyond {group[1]}'s bound ({errors}; away from the top-k ties): × best peer "
                         "is against a wrong answer there")
    return notes


def tie_notes(rows):
    """For each preset and dtype whose check set rows aside (tie_rows), how many of the 2·B·H rows
    of its two batches (measure._measure checks each)."""
    notes = []
    for preset, dtype in dict.fromkeys((r["preset"], r["dtype"]) for r in rows if r.get("tie_rows")):
        ties = max(r["tie_rows"] for r in rows if (r["preset"], r["dtype"]) == (preset, dtype) and r.get("tie_rows"))
        rows_bh = next(r["B"] * r["H"] for r in rows if (r["preset"], r["dtype"]) == (preset, dtype))
        notes.append(f"{preset} {dtype}: rel err leaves out, and grad err takes no gradient from, the {ties} of "
                     f"{2 * rows_bh} rows (two batches of {rows_bh}) near a top-k tie, whose choice rounding can "
                     "flip (legend)")
    return notes


def floor_note(rows):
    """A note where % floor was computed for rows not measured on an H200: the floor's rates are
    the H200's (SPEC §5), not the device's."""
    devices = sorted({r["device"] for r in rows if r.get("pct_floor") is not None and "H200" not in str(r["device"])})
    if not devices:
        return None
    return (f"% floor uses the H200's measured rates (790 TFLOP/s bf16, 4.3 TB/s; SPEC §5), and these rows ran "
            f"on {', '.join(devices)}: against that device's own rates the % would differ")


def now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
