"""Graph dumps: MHA_COMPILE_DUMP=folder or options={"dump": folder}.

Each process writes into its own run folder, `folder/run-<YYYYmmdd-HHMMSS>-<pid>` (created
with exist_ok=False; a taken name gets a `-1`, `-2`... suffix, so two processes, even two with
the same pid in different containers, never share one). In it, one folder per compiled graph,
`graph_<NNN>` numbered in compile order, and `index.html` linking everything:

    graph_000/captured.py    the graph as Dynamo captured it, as a runnable script
    graph_000/rewritten.py   the graph after rewriting (calls torch.ops.mha.region), runnable
    graph_000/replayed.py    under mode="reduce-overhead", where a region's pool runs eagerly
                             outside the CUDA graphs: what the graphs capture (mha::moe on the
                             pool's inv, an input; the report's match says so under "graphs")
    graph_000/report.txt     the match / near-miss report for people
    graph_000/report.json    the same as data (fields below)
    graph_000/graph.dot      a picture of the captured graph: region green, near-misses red
    graph_000/graph.svg      ...rendered by graphviz's `dot`, when it is installed
    graph_000/rewritten.dot, rewritten.svg   the rewritten graph, its mha::region call green
    graph_000/graph_full.dot, rewritten_full.dot   every node, when the pictures above collapse
                             the nodes far from the highlights (large graphs)
    graph_000/*_constants.pt tensors the graph reads with get_attr, if any (loaded by the scripts)

Run a script: `python graph_000/captured.py [--seed N] [--device cpu] [--save out.pt]`. It
rebuilds the GraphModule, makes random inputs of the recorded shapes, dtypes and strides
(symbolic sizes take their hint; parameters are random too), runs it and prints the outputs'
shapes; `--save` writes {"inputs", "outputs"} with torch.save.

report.json fields:
    schema         1 (bumped when a field changes meaning)
    index          the graph's number in this process's compile order (the NNN of graph_NNN)
    run            the run folder's name
    source         where the graph comes from: Dynamo's compile id and the file and line its code starts at
    ended_by       the graph break that ended the graph and where, or ""
    options        the backend options in effect, as strings
    matches        one per replaced region: output, ctx, tok (node names), nodes (every node the
                   region covers), config (act, top_k, renorm...), params (region parameter ->
                   the graph input it is read from), kernels (the kernel set chosen) and
                   kernels_reason (why), shapes ({ctx, tok, out}: sizes as strings, symbolic
                   ones by name), dtype, graph ("<top>" or a nested graph's path), graphs,
                   keep_hidden, slot_runs, exports, kept, copied, empty_rows (debug/README.md)
    near_misses    one per candidate that is almost the block: anchor (its top-k node), node
                   (where it stops being the block), reason (what to change), and, added here,
                   target (what that node calls), shape and dtype of that node, graph
    fallback       why the graph runs as captured (the rewrite failed, or verify disagreed), or null
    inputs         the graph's inputs in order: name, kind (tensor | int | float | none), and
                   for tensors shape (concrete), symbolic (sizes as strings), stride, dtype, device
    nodes          every node of the captured graph: name, op, target, shape, dtype, region
                   (index into matches, or null), near_miss (reason, or null)
    node_count     {"captured": n, "rewritten": n}
    files          file names in the graph folder: captured, rewritten, replayed, text, json, dot, svg,
                   dot_full, rewritten_dot, rewritten_svg, rewritten_dot_full (null where not
                   written: svg without `dot`, *_full when nothing was collapsed, replayed
                   without a pool run outside the CUDA graphs)
    code_before, code_after   the graph's forward code before and after rewriting

A dump that cannot be written (the folder is a file, or not writable) is reported once as a
warning on the "mha_compile" logger and the compile goes on without dumps; so does a picture
that cannot be drawn. `publish` also logs each report at DEBUG (TORCH_LOGS="+mha_compile")
and emits it as structured-trace artifacts under TORCH_TRACE (see logs.py).
"""
import json
import logging
import os
import time
from pathlib import Path

import torch

from mha_compile.debug import logs
from mha_compile.debug.html import write_index
from mha_compile.debug.picture import graph_dot, node_info, render_svg
from mha_compile.debug.script import graph_script, input_specs

log = logging.getLogger("mha_compile")
SCHEMA = 1
_run_folders = {}  # (pid, absolute folder) -> this process's run folder
_warned = set()


def publish(report, captured, lowered, folder=None, replayed=None):
    """Everything the debug side does with a graph's report: log it, trace it, dump it.
    replayed: the graph the CUDA graphs capture where it is not `lowered` (the pool split)."""
    try:
        logs.register()
        text = report_text(report, captured)
        log.debug("mha_compile: graph %d report:\n%s", report.index, text)
        doc = report_document(report, captured, lowered)
        logs.trace_report(doc, text)
    except Exception as error:  # a report that cannot be built must not cost the user's compile
        _warn_once(("report", type(error).__name__), "mha_compile: could not build the report of graph %d (%s: %s)",
                   report.index, type(error).__name__, error)
        return None
    return write_dump(folder, report, captured, lowered, doc, text, replayed) if folder else None


def run_folder(folder):
    """This process's run folder under `folder`, created on first use (never an existing one)."""
    key = (os.getpid(), os.path.abspath(folder))
    if key not in _run_folders:
        root = Path(folder)
        if root.exists() and not root.is_dir():
            raise NotADirectoryError(f"{folder!r} is a file, not a folder")
        root.mkdir(parents=True, exist_ok=True)
        base = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        for attempt in range(1000):
            path = root / (base if attempt == 0 else f"{base}-{attempt}")
            try:
                path.mkdir(exist_ok=False)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"no free run folder name {base}-N under {folder!r}")
        _run_folders[key] = path
    return _run_folders[key]


def current_run(folder):
    """The run folder this process writes under `folder`, or None if it has written none."""
    return _run_folders.get((os.getpid(), os.path.abspath(folder)))


def write_dump(folder, report, captured, lowered, doc=None, text=None, replayed=None):
    """Write graph_<index>/ (scripts, report, pictures) and refresh index.html. Returns the graph folder."""
    try:
        run = run_folder(folder)
        out = run / f"graph_{report.index:03d}"
        out.mkdir()
    except (OSError, ValueError) as error:  # ValueError: a path the OS refuses (a NUL byte, a lone surrogate)
        _warn_once(("folder", str(folder)), "mha_compile: cannot write graph dumps to %r (%s); compiling without "
                   "dumps. Set MHA_COMPILE_DUMP / options['dump'] to a folder you can write.", str(folder), error)
        return None
    doc = doc if doc is not None else report_document(report, captured, lowered)
    text = text if text is not None else report_text(report, captured)
    doc["run"] = run.name
    files = doc["files"]
    try:
        files["captured"] = _write_script(out, "captured", captured, f"{report.name} as captured", False)
        files["rewritten"] = _write_script(out, "rewritten", lowered, f"{report.name} after rewriting", True)
        if replayed is not None:
            files["replayed"] = _write_script(out, "replayed", replayed, f"{report.name} as the CUDA graphs "
                                              "capture it (each pool run before them: mha::pool)", True)
        _write_report(out, report, captured, lowered, doc, text)
    except Exception as error:  # noqa: BLE001 - a dump that fails must not cost the user's compile (a review's:
        # an ASCII locale's UnicodeError failed it)
        _warn_once(("write", str(folder)), "mha_compile: graph dump to %r incomplete (%s: %s)", str(out),
                   type(error).__name__, error)
    log.info("mha_compile: graph %d dumped to %s", report.index, out)
    return out


def refresh_dump(out, report, captured, lowered):
    """Rewrite out's report (text, JSON) and pictures, and the run's index, from report as it is
    now: verify's fallback comes at the first call, after the dump was written at compile time,
    which went on saying the region was replaced (found by a read-through). The scripts stay."""
    try:
        doc = report_document(report, captured, lowered)
        old = json.loads((out / "report.json").read_text(encoding="utf-8"))
        doc["run"], doc["files"] = old.get("run"), old.get("files", doc["files"])  # the scripts' names
        _write_report(out, report, captured, lowered, doc, report_text(report, captured))
    except Exception as error:  # noqa: BLE001 - the user's call, in which this runs, must go on
        _warn_once(("refresh", str(out)), "mha_compile: could not update the dump %r after a fallback (%s: %s)",
                   str(out), type(error).__name__, error)


def _write_report(out, report, captured, lowered, doc, text):
    """Graph folder out's pictures, report.txt and report.json (their names into doc's files),
    then its run's index.html: at the dump, and again after a fallback (refresh_dump)."""
    files = doc["files"]
    files["dot"], files["svg"], files["dot_full"] = _write_picture(out, "graph", captured, report, rewritten=False)
    files["rewritten_dot"], files["rewritten_svg"], files["rewritten_dot_full"] = _write_picture(
        out, "rewritten", lowered, report, rewritten=True)
    (out / "report.txt").write_text(text + "\n", encoding="utf-8")
    files["text"], files["json"] = "report.txt", "report.json"
    (out / "report.json").write_text(json.dumps(doc, indent=2, default=str), encoding="utf-8")
    write_index(out.parent)


def _write_script(out, stem, gm, title, needs_ops):
    try:
        source, constants = graph_script(gm, title, filename=f"{out.name}/{stem}.py",
                                         constants_file=f"{stem}_constants.pt", needs_ops=needs_ops)
        if constants:
            torch.save(constants, out / f"{stem}_constants.pt")
    except OSError:
        raise
    except Exception as error:  # a graph the script writer cannot rebuild: still show its code
        _warn_once(("script", type(error).__name__), "mha_compile: %s.py of a graph dump is not runnable (%s: %s)",
                   stem, type(error).__name__, error)
        source = f"# {title}: not runnable ({type(error).__name__}: {error}); the graph's code:\n{gm.code}"
    (out / f"{stem}.py").write_text(source, encoding="utf-8")
    return f"{stem}.py"


def _write_picture(out, stem, gm, report, rewritten):
    """Write stem.dot, (with graphviz) stem.svg and, if the picture collapses far nodes, stem_full.dot.

    Returns the three file names (None where not written)."""
    replaced = f"{len(report.matches)} region(s) " + ("matched, none replaced" if report.fallback else "replaced")
    title = (f"{report.name} {'after rewriting' if rewritten else 'as captured'}: {replaced}, "
             f"{len(report.near_misses)} near-miss(es)")
    if report.fallback:
        title += f"\nfallback: {report.fallback}"
    if rewritten:
        args = dict(replaced_target=_region_op())
    else:
        args = dict(regions=[(f"MHA region {i} → kernels={m['kernels']} ({m['kernels_reason']})", m["nodes"])
                             for i, m in enumerate(report.matches)], near_misses=report.near_misses)
    try:
        dot = graph_dot(gm, title, **args)
        full = graph_dot(gm, title, collapse=False, **args) if "collapsed_0" in dot else None
    except Exception as error:  # never fail a compile for a picture
        _warn_once(("picture", type(error).__name__), "mha_compile: could not draw graph %d (%s: %s)",
                   report.index, type(error).__name__, error)
        return None, None, None
    (out / f"{stem}.dot").write_text(dot, encoding="utf-8")
    if full is not None:
        (out / f"{stem}_full.dot").write_text(full, encoding="utf-8")
    svg = render_svg(dot, out / f"{stem}.svg")
    return f"{stem}.dot", (f"{stem}.svg" if svg else None), (f"{stem}_full.dot" if full else None)


def _region_op():
    try:
        return torch.ops.mha.region.default
    except (AttributeError, RuntimeError):
        return None


def report_document(report, captured, lowered):
    """The report as the JSON document described in this module's docstring."""
    doc = report.to_json()
    nodes = {n.name: n for n in captured.graph.nodes}
    region_of = {name: i for i, m in enumerate(report.matches) for name in m["nodes"]}
    miss_at = {}
    for miss in report.near_misses:
        miss_at.setdefault(miss["node"], miss["reason"])
    doc["near_misses"] = [dict(miss, **_node_fields(nodes.get(miss["node"]))) for miss in report.near_misses]
    doc.update(
        schema=SCHEMA, run=None,
        inputs=[dict(name=name, **spec) for name, spec in input_specs(captured)],
        nodes=[dict(name=n.name, op=n.op, **_node_fields(n), region=region_of.get(n.name),
                    near_miss=miss_at.get(n.name))
               for n in captured.graph.nodes],
        node_count={"captured": len(captured.graph.nodes), "rewritten": len(lowered.graph.nodes)},
        files={key: None for key in ("captured", "rewritten", "replayed", "text", "json", "dot", "svg", "dot_full",
                                     "rewritten_dot", "rewritten_svg", "rewritten_dot_full")})
    return doc


def _node_fields(node):
    if node is None:
        return {"target": None, "shape": None, "dtype": None}
    what, shape, dtype = node_info(node)
    return {"target": what, "shape": shape or None, "dtype": dtype or None}


def report_text(report, captured):
    """The report for people: str(report) and the graph's inputs."""
    lines = [str(report), "  inputs:"]
    for name, spec in input_specs(captured):
        if spec["kind"] == "tensor":
            lines.append(f"    {name}: [{', '.join(spec['symbolic'])}] {spec['dtype']} on {spec['device']}")
        else:
            lines.append(f"    {name}: {spec['kind']} {spec.get('value', '')}")
    return "\n".join(lines)


def _warn_once(key, message, *args):
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)
