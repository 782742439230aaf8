"""The torch.compile entry: options -> passes -> run the rest (eager | inductor).

`torch.compile(model, backend="mha", options={...})` finds this function through the entry
point `mha` in the group `torch_dynamo_backends`. It copies Dynamo's graph, rewrites the copy
(find the regions, pick kernels, replace them with the `mha::region` op) and runs the result.
Any failure in the rewrite returns the graph exactly as captured, with a warning that says
why; `options={"strict": True}` raises instead. The original graph is never half-rewritten.
"""
import dataclasses
import functools
import itertools
import logging
import os
import re

import torch

from mha_compile import ops, step_graphs, verify, whole_graph
from mha_compile.debug.dump import publish, refresh_dump
from mha_compile.debug.report import GraphReport
from mha_compile.lowering.match import (DDP_HINT, DDP_PIECE, HOP_BODY, drop_dead_math, find_regions,
                                        read_accumulators_by_view)
from mha_compile.lowering.rewrite import rewrite
from mha_compile.lowering.select import (CAPTURED_WHOLE, choose_kernels, describe_graphs, describe_keep_hidden,
                                         describe_slot_runs, size_text)
from mha_compile.options import MODES, Options

log = logging.getLogger("mha_compile")

_graph_counter = itertools.count()
# Callables that receive each GraphReport (explain and the dumps listen here).
observers = []


def mha_backend(gm, example_inputs, options=None, mode=None):
    """Dynamo backend: rewrite MHA regions of gm, then run everything with `rest`."""
    opts = _eager_where_inductor_miscomputes(gm, example_inputs, Options.parse(options))
    mode = _mode(mode, opts.mode)
    if opts.step_graphs is True and mode != "reduce-overhead":
        raise ValueError(f"mha options: step_graphs=True replays the CUDA graphs of mode='reduce-overhead' through "
                         f"mha_compile's own; give it with mode='reduce-overhead', not mode={mode!r}")
    report = GraphReport(next(_graph_counter), graph_source(gm), graph_end(gm),
                         options={k: str(v) for k, v in vars(opts).items()})
    report.code_before = gm.code
    whole = _whole_graph_captured(opts, mode, example_inputs)
    try:
        lowered = lower(gm, opts, report, whole)
    except Exception as error:
        if opts.strict:
            raise
        report.fallback = _first_line(error)
        log.warning("mha_compile: rewriting %s failed (%s); running it as captured", report.name, report.fallback)
        lowered = gm
    report.code_after = lowered.code
    split = _planned_pool_split(lowered, example_inputs, opts, whole, report)
    if opts.own_step_graphs(mode) and whole and report.matches:
        _mark_step_graphs(report, *((split.graph, split.examples) if split else (lowered, example_inputs)))
    # log, trace and (with a dump folder) dump the report, and the graphs as they replay with a split
    dumped = publish(report, gm, lowered, opts.dump, replayed=split.graph if split else None)
    for observer in list(observers):
        observer(report, gm, lowered)
    try:
        compiled = run_rest(lowered, example_inputs, opts, mode, whole, split, report)
    except Exception as error:
        if opts.strict or lowered is gm:
            raise
        # as for a failed rewrite: Inductor could not compile the op where torch.func's transforms
        # run inside the graph (the op's autograd is not theirs; a session 68 test), say
        report.fallback = f"compiling the rewritten graph failed ({_first_line(error)}); running it as captured"
        log.warning("mha_compile: %s: %s", report.name, report.fallback)
        if dumped:
            refresh_dump(dumped, report, gm, lowered)
        lowered = gm
        compiled = run_rest(gm, example_inputs, opts, mode, whole)
    if opts.verify and lowered is not gm:
        original = run_rest(gm, example_inputs, opts, mode, whole)
        fell_back = functools.partial(refresh_dump, dumped, report, gm, lowered) if dumped else None
        compiled = verify.verified(gm, original, compiled, report, opts.strict, fell_back)
    if whole or opts.rest == "inductor":  # else the graph runs eagerly, its regions on ops.region_call
        compiled = _tangents_eagerly(compiled, gm, report.name)
    return compiled


def graph_source(gm):
    """Where Dynamo's graph comes from, for people: its compile id (frame/recompile, as TORCH_LOGS
    names it) and the file, line and function its first traced call is in (the code torch.compile
    started from; a function named torch_dynamo_resume_in_... after a graph break), as
    "Dynamo 0/1, forward at models.py:131". "" where neither is known (a graph built by hand)."""
    compile_id = getattr(gm, "meta", {}).get("dynamo_compile_id")
    trace = next((n.meta["stack_trace"] for n in gm.graph.nodes if n.meta.get("stack_trace")), "")
    where = re.search(r'File "([^"]+)", line (\d+), in (\S+)', trace or "")
    parts = ([f"Dynamo {compile_id}"] if compile_id is not None else []) + (
        [f"{where[3]} at {os.path.basename(where[1])}:{where[2]}"] if where else [])
    return ", ".join(parts)


def graph_end(gm):
    """The graph break that ended Dynamo's graph, for people: "a graph break at models.py:131:
    Call to `torch._dynamo.graph_break()`" (where, and its reason's first line), from the reason
    Dynamo sets on the graph it hands a backend; "" where the graph ran to the function's end."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return ""
    stack = getattr(reason, "user_stack", None) or []
    where = f" at {os.path.basename(stack[-1].filename)}:{stack[-1].lineno}" if stack else ""
    text = str(getattr(reason, "reason", "") or "").strip()
    return f"a graph break{where}" + (f": {text.splitlines()[0]}" if text else "")


def _eager_where_inductor_miscomputes(gm, example_inputs, opts):
    """opts, with rest="eager" in place of "inductor" where gm, compiled for training, writes a
    parameter in place (`with torch.no_grad(): self.scale.add_(1)`; step_graphs.written_inputs):
    AOTAutograd's min-cut partitioner, which Inductor compiles through, gave such a graph wrong
    gradients (torch 2.13, aot_eager and inductor alike, with or without our op: the backward
    recomputed the write from the parameter after the forward had written it, ∂x 25% off where the
    scale went from 1.5 to 2.0, twice applied; the default partitioner, aot_eager_default_partitioner
    and Dynamo's cudagraphs backend, which the trees of rest="eager" use, saves it and is right;
    bench/aot_min_cut_repro.py).
    A warning names the parameters. Where the fake run that finds the writes fails, opts as given."""
    trained = [i for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad]
    if opts.rest != "inductor" or not torch.is_grad_enabled() or not trained:
        return opts
    try:
        written = sorted(step_graphs.written_inputs(gm, example_inputs) & set(trained))
    except Exception as error:  # noqa: BLE001 - what cannot be found runs as asked
        log.info("mha_compile: finding the inputs a graph writes failed (%s); rest='inductor' as asked",
                 _first_line(error))
        return opts
    if not written:
        return opts
    names = [node.name for node in gm.graph.find_nodes(op="placeholder")]
    log.warning("mha_compile: the graph writes parameter(s) %s in place and takes their gradients: AOTAutograd's "
                "min-cut partitioner, which rest='inductor' compiles through, gives such a graph wrong gradients (its "
                "backward recomputes the write from the parameter already written), so this graph runs with "
                "rest='eager'",
                [names[i] for i in written])
    return dataclasses.replace(opts, rest="eager")


def _tangents_eagerly(compiled, gm, name):
    """compiled, except that a call carrying forward-mode tangents (torch.autograd.forward_ad)
    runs gm, the graph as Dynamo captured it, eagerly: CUDA-graph replays carry no tangents, and
    Inductor's code drops them (torch 2.13: a compiled x.sin() gave the tangent None, where eager
    and aot_eager give cos(x)·t). The captured graph, not the rewritten one: it needs no verify."""
    said = []

    def call(*args):
        if not ops.has_tangents(args):
            return compiled(*args)
        if not said:
            said.append(True)
            log.info("mha_compile: %s called with forward-mode tangents: run as captured, eagerly, since "
                     "CUDA-graph replays and Inductor's code do not carry them", name)
        return gm(*args)
    return call


def lower(gm, opts, report, whole_graph_captured=False):
    """A rewritten copy of gm; fills report with matches and near-misses (and, for each match,
    whether the region will replay its own CUDA graphs: not when the whole graph is captured).

    Regions are also sought in the subgraphs of higher-order ops (the body Dynamo makes for
    torch.utils.checkpoint, say), whose GraphModules hang off gm as attributes. The search runs
    once, on copies (graph_copy keeps node names, so reports read the same); a rewritten
    subgraph is rewritten on its own copy, so the captured graph is never touched, and when
    nothing matches gm itself is returned. Raises where the rest cannot run the op: rest="inductor"
    or CUDA graphs of the whole graph, under torch.func's grad or jvp (_differentiating_transform).
    """
    new, copies, found = whole_graph.copy_graph(gm)[0], {}, {}
    ddp = "DDPOptimizer" in str(getattr(getattr(gm, "compile_subgraph_reason", None), "reason", ""))
    for path, _ in _graph_modules(gm):
        sub = _copy_attribute(new, path, copies)
        drop_dead_math(sub.graph)
        read_accumulators_by_view(sub.graph)
        found[path] = (sub, find_regions(sub, HOP_BODY if path else DDP_PIECE if ddp else None))
    for path, (_, (_, misses)) in found.items():
        report.near_misses += [dict(m.summary(), graph=path or "<top>") for m in misses]
        for miss in misses:
            # a block cut by DDP's graph split is no spelling of the user's: said louder than a near-miss
            (log.warning if DDP_HINT in miss.reason else log.info)("mha_compile: near-miss at %s: %s", miss.node,
                                                                   miss.reason)
    if not any(matches for _, (matches, _) in found.values()):
        return gm
    for path, (sub, (matches, _)) in found.items():
        for match in matches:
            match.kernels, match.kernels_reason = choose_kernels(match, opts.kernels)
            match.graphs = describe_graphs(match, opts.graphs, whole_graph_captured)
            match.keep_hidden = opts.keep_hidden
            match.keeps = describe_keep_hidden(match, opts.keep_hidden)
            match.runs = describe_slot_runs(match)
        report.matches += [dict(m.summary(), graph=path or "<top>") for m in matches]
        if matches:
            rewrite(sub, matches)
    transform = (opts.rest == "inductor" or whole_graph_captured) and _differentiating_transform(gm)
    if transform:
        raise NotImplementedError(
            f"torch.func's {transform} runs inside the graph; "
            f"{'Inductor' if opts.rest == 'inductor' else 'CUDA graphs'} compile mha::region through AOTAutograd, "
            f"and the op's autograd cannot run under {transform} "
            "(rest='eager' without CUDA graphs runs the region's reference math there)")
    log.info("mha_compile: %s: replaced %d region(s)", report.name, len(report.matches))
    return new


def _differentiating_transform(gm):
    """"grad" or "jvp" where the graph (or a subgraph) enters a torch.func transform that
    differentiates (grad, vjp, jacrev; jvp, jacfwd), else None. Under them a traced mha::region
    raised ("must override the setup_context staticmethod"), and the failed trace left the
    transform's level entered, so that compiling the captured graph after it failed too."""
    entries = {"_grad_increment_nesting": "grad", "_jvp_increment_nesting": "jvp"}
    for _, sub in _graph_modules(gm):
        for node in sub.graph.nodes:
            if node.op == "call_function" and getattr(node.target, "__name__", None) in entries:
                return entries[node.target.__name__]
    return None


def _graph_modules(gm, prefix=""):
    """(attribute path, GraphModule) of gm and of every subgraph it reaches through get_attr."""
    yield prefix, gm
    for node in gm.graph.find_nodes(op="get_attr"):
        sub = getattr(gm, node.target, None)
        if isinstance(sub, torch.fx.GraphModule):
            yield from _graph_modules(sub, f"{prefix}.{node.target}" if prefix else node.target)


def _copy_attribute(root, path, copies):
    """The GraphModule at `path` under the copy `root`, itself replaced by a copy (once)."""
    if not path:
        return root
    if path not in copies:
        parent_path, _, name = path.rpartition(".")
        parent = _copy_attribute(root, parent_path, copies)
        copies[path] = whole_graph.copy_graph(getattr(parent, name))[0]
        setattr(parent, name, copies[path])
    return copies[path]


def _mode(given, in_options):
    """The mode to honour: torch.compile's, or options["mode"] (torch.compile passes one or the
    other); both given and different is an error, not a silent pick."""
    if given not in MODES:
        raise ValueError(f"mha backend: mode={given!r} is not supported; expected one of {MODES}")
    if given not in (None, "default") and in_options not in (None, "default") and given != in_options:
        raise ValueError(f"mha backend: mode={given!r} and options['mode']={in_options!r} disagree; give one of them")
    return in_options if given in (None, "default") else given


def _inductor_patches(mode):
    return torch._inductor.list_mode_options(mode) if mode not in (None, "default") else {}


def _whole_graph_captured(opts, mode, example_inputs):
    """Whether `mode` replays the whole compiled graph as a CUDA graph (then the region's own
    graphs stay off: it is captured with the rest)."""
    if opts.rest == "inductor":
        return bool(_inductor_patches(mode).get("triton.cudagraphs"))
    return mode == "reduce-overhead" and any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)


def run_rest(gm, example_inputs, opts, mode, whole, split=None, report=None):
    """Everything outside the region: eagerly, or through Inductor (honouring `mode`); whole:
    _whole_graph_captured's answer for this compile; split: _planned_pool_split's, for gm, whose
    report (if given) is corrected where the split cannot be compiled."""
    if opts.rest == "inductor":
        compile_graphs = functools.partial(_inductor, mode=mode, graphs="off" if whole else opts.graphs)
    elif whole:
        compile_graphs = (functools.partial(_own_step_graphs, asked=opts.step_graphs is True, strict=opts.strict)
                          if opts.own_step_graphs(mode) else whole_graph.capture)
    else:
        if mode == "reduce-overhead":
            # a warning where step_graphs=True asked for the step graphs by name
            (log.warning if opts.step_graphs is True else log.info)(
                "mha_compile: mode='reduce-overhead' without CUDA inputs: running without CUDA graphs%s",
                " (step_graphs=True does not apply)" if opts.step_graphs is True else "")
        elif mode not in (None, "default"):
            log.info("mha_compile: mode=%r with rest='eager': everything outside the region runs eagerly, without "
                     "the mode's autotuning or CUDA graphs (rest='inductor' takes them)", mode)
        return _retargeted(gm, {**_region_target(ops.region_call, opts.graphs), **_EAGER_CHECKPOINTS}).forward
    with cache_key_tagged():
        if split is not None:
            try:
                return whole_graph.capture_split(split, compile_graphs)
            except Exception as error:
                if opts.strict:
                    raise
                log.warning("mha_compile: running the pool outside the CUDA graphs failed (%s); capturing it "
                            "with the rest%s", _first_line(error),
                            " (the graph's dump, written before, says outside)" if opts.dump else "")
                for match in report.matches if report is not None else ():
                    match["graphs"] = CAPTURED_WHOLE
        return compile_graphs(gm, example_inputs)


def _own_step_graphs(gm, example_inputs, asked, strict):
    """step_graphs.compile on gm, run eagerly with its region calls on RegionFunction (graphs off:
    the step's graphs take the region with the rest); torch's trees (whole_graph.capture) where it
    refuses gm, with a warning where step_graphs=True asked for them; strict: a failed capture raises."""
    eager = _retargeted(gm, {**_region_target(ops.region_call, "off"), **_EAGER_CHECKPOINTS}).forward
    return step_graphs.compile(gm, example_inputs, eager, whole_graph.capture, asked, strict)


def _inductor(gm, example_inputs, mode, graphs):
    """Inductor's compile_fx on gm under `mode`'s settings (patched for this compile only), its
    region calls with the `graphs` setting."""
    from torch._inductor.compile_fx import compile_fx
    return compile_fx(_retargeted(gm, _region_target(torch.ops.mha.region.default, graphs)), example_inputs,
                      config_patches=_inductor_patches(mode))


def _planned_pool_split(gm, example_inputs, opts, whole, report):
    """whole_graph.plan_pool_split(gm) where the whole graph is captured as CUDA graphs, by
    rest="eager" (whole_graph.capture) or by Inductor (its mode's CUDA graphs): the regions'
    pools then run outside the graphs, with report's matches saying which; None where no pool
    leaves. Where planning fails: a warning and None (the graphs then capture gm whole, which
    computes the same), unless opts.strict."""
    if not whole or not report.matches:
        return None
    try:
        split = whole_graph.plan_pool_split(gm, example_inputs)
    except Exception as error:
        if opts.strict:
            raise
        log.warning("mha_compile: running the pool outside the CUDA graphs failed (%s); capturing it with the rest",
                    _first_line(error))
        return None
    if split is not None:
        _mark_split(report, split.toks)
    return split


def _mark_split(report, toks):
    """Each of report's top-level matches whose tok is in `toks` (name -> bytes) says that its
    pool runs outside the CUDA graphs."""
    for match in report.matches:
        if match["graph"] == "<top>" and match["tok"] in toks:
            match["graphs"] = (f"no: the whole graph is captured as a CUDA graph (mode); its pool runs eagerly "
                               f"before each replay (mha::pool, on tok where it is: {size_text(toks[match['tok']])} "
                               "not copied into the graphs), its MoE inside them (mha::moe)")


def _mark_step_graphs(report, graph, examples):
    """Each match's "CUDA graphs" line says whose graphs replay the step where step_graphs would:
    ours, or torch's trees and why (step_graphs.why_not on the graph they capture)."""
    reason = step_graphs.why_not(graph, examples, step_graphs.CudaGraphs.takes)
    how = ("through mha_compile's own step graphs (options step_graphs)" if reason is None
           else f"through torch's CUDA-graph trees, not mha_compile's step graphs, since {reason}")
    for match in report.matches:
        match["graphs"] = f"{match['graphs']}; {how}"


def _first_line(error):
    """The error as "Type: its message's first line", for a warning or a report's fallback reason."""
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def cache_key_tagged():
    """torch.compiler.config.cache_key_tag with ops.cache_digest() appended, for one compile:
    torch's compile caches key a custom op by its name alone, so a graph compiled by another build
    of mha_compile (other schemas, fakes or autograd), or under another MHA_COMPILE_KEEP_HIDDEN,
    must not be served to this one. The user's own tag is kept in front of ours."""
    ours, tag = f"mha-{ops.cache_digest()}", torch.compiler.config.cache_key_tag
    return torch.compiler.config.patch(cache_key_tag=f"{tag}|{ours}" if tag else ours)


def _region_target(target, graphs):
    """The retargeting (_retargeted) of the `mha::region` calls to `target` with the `graphs` setting.

    ops.region_call is for a graph that runs eagerly: nothing traces it, so the region can skip
    the custom op's per-call overhead (the same kernels and gradients; ops.RegionFunction).
    Reports and dumps keep showing the op as the rewrite made it."""
    if target is torch.ops.mha.region.default and graphs == "off":
        return {}
    return {torch.ops.mha.region.default: (target, {"graphs": graphs})}


def _checkpoint_keeping_rng(body, *args, **kwargs):
    """torch.utils.checkpoint as Dynamo captured it (the tag_activation_checkpoint higher-order op),
    for a graph that runs eagerly. The op's own eager implementation sets preserve_rng_state=False,
    leaving the random numbers to Inductor's functionalisation: run eagerly, the backward's
    recomputation drew new dropout masks, and every gradient was off (0.63 of a Linear's before
    the checkpointed dropout; a review's, with or without a region matched). Here the RNG state is
    kept as eager's checkpoint keeps it, unless the user's call said preserve_rng_state=False."""
    from torch._higher_order_ops.wrap import TagActivationCheckpoint
    from torch.utils.checkpoint import checkpoint
    options, body_kwargs = TagActivationCheckpoint.divide_kwargs(kwargs)
    options.pop("use_reentrant", None)  # the op always runs the non-reentrant form; the gradients are the same
    if "_checkpoint_context_fn" in body.meta:  # selective checkpointing's policy
        options["context_fn"] = body.meta["_checkpoint_context_fn"]
    return checkpoint(lambda *a: torch.fx.Interpreter(body).run(*a), *args, use_reentrant=False,
                      **options, **body_kwargs)


# The checkpoints of a graph run eagerly (rest="eager": plain, or the step graphs' eager runs)
_EAGER_CHECKPOINTS = {torch.ops.higher_order.tag_activation_checkpoint: (_checkpoint_keeping_rng, {})}


def _retargeted(gm, targets):
    """gm, or a copy whose calls of each target in `targets` ({target: (new target, kwargs added)})
    call the new target instead, in gm and in its subgraphs."""
    paths = [path for path, sub in _graph_modules(gm)
             if any(sub.graph.find_nodes(op="call_function", target=t) for t in targets)]
    if not paths:
        return gm
    new, copies = whole_graph.copy_graph(gm)[0], {}
    for path in paths:
        sub = _copy_attribute(new, path, copies)
        for old, (target, kwargs) in targets.items():
            for node in sub.graph.find_nodes(op="call_function", target=old):
                node.target = target
                node.kwargs = {**node.kwargs, **kwargs}
        sub.recompile()
    return new
