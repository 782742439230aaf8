"""`mha_compile.explain(model_or_fn, *args, **kwargs)`: what the backend would do, without training
(one forward, no backward, in the caller's grad mode)."""
import collections
import contextlib
import copy
import inspect
import types

import torch
from torch.utils import _pytree

from mha_compile import backend
from mha_compile.debug.report import ExplainReport
from mha_compile.options import Options

NO_GRAPH = ("Dynamo handed the backend no graph, so nothing was matched or missed: the call ran no "
            "operation Dynamo captured (a function that returns its inputs as they are, a forward under "
            "torch.compiler.disable, or one Dynamo gave up on: see its warnings)")


NO_BLOCK = ("No MHA block was found, nor anything close: no graph here takes a top-k of a router's softmax (the "
            "MoE's routing), where the matcher starts looking")

RECOMPILE_LIMIT = ("Dynamo reached its recompile limit on {frames} and runs it eagerly, so nothing in it was "
                   "compiled or matched, here or in your own torch.compile of the model: each explain adds an "
                   "entry to the frame of a submodule after a graph break. torch._dynamo.reset() clears them")


def explain(model_or_fn, *args, mha_options=None, mha_dynamic=None, **kwargs):
    """Compile with backend="mha", run the forward once (no backward) in the caller's grad mode,
    and return an ExplainReport. The module's buffers, the tensors given and the random-number
    state are left as found (`_state_kept`).

    The keywords are the model's, as `args` are (SPEC's `explain(model_or_fn, *args, **kwargs)`),
    but for the backend's options: `mha_options=` always, and `options=` where the forward names
    no parameter `options` (`_backend_options`), so that a forward of its own `options` gets them.
    `mha_dynamic=` is torch.compile's `dynamic` (True: sizes and int inputs symbolic from the start,
    where what is matched can differ: a top-k k given as an int becomes a value of the graph).

    The caller's mode, not no_grad: it is the mode the model will train in, and what is compiled
    depends on it (Dynamo records a torch.no_grad() inside the model only where grad is on, so
    under no_grad a frozen pool's region read as a match the training compile refuses; and in
    training the op keeps a copy of a ctx the caller holds). Under no_grad, the inference view.

    Dynamo keeps what it compiles on the code object it starts from, and stops compiling a code
    object for one module after config.recompile_limit (8) entries. Started from the model's own
    forward, the ninth explain of a model got an empty report, and the user's own torch.compile
    of that model ran a new shape eagerly. So Dynamo starts here from a copy of that code (`_own_code`),
    whose entries go with it."""
    options, kwargs = _backend_options(model_or_fn, mha_options, kwargs)
    Options.parse(options)  # a bad key or value raises here as itself, not wrapped by Dynamo after tracing
    reports, full = [], _frames_at_limit(model_or_fn)  # frames Dynamo will run eagerly this time

    def observe(report, gm, lowered):
        reports.append(report)

    def mha(gm, example_inputs):
        return backend.mha_backend(gm, example_inputs, options=options)

    backend.observers.append(observe)
    try:
        with (_own_code(model_or_fn) as target, _state_kept(model_or_fn, args, kwargs), _sizes_seen_kept(),
              _graph_breaks() as breaks):
            torch.compile(target, backend=mha, dynamic=mha_dynamic)(*args, **kwargs)
    finally:
        backend.observers.remove(observe)
    if full or any(line.startswith("Dynamo recompile limit exceeded") for line in breaks):
        frames = ", ".join(full) if full else "a frame (graph_breaks)"
        return ExplainReport(reports, note=RECOMPILE_LIMIT.format(frames=frames), graph_breaks=breaks)
    if not reports:
        return ExplainReport(reports, note=NO_GRAPH, graph_breaks=breaks)
    nothing = not any(r.matches or r.near_misses for r in reports)
    return ExplainReport(reports, note=NO_BLOCK if nothing else "", graph_breaks=breaks)


def _frames_at_limit(model_or_fn):
    """The forwards of the model's modules whose code holds Dynamo's recompile limit of entries,
    which Dynamo runs eagerly from then on without a word (its warning and counter come once, at the call
    that reached the limit). Read through Dynamo's debug list of a code object's entries; a torch
    without it: none."""
    entries = getattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    modules = model_or_fn.modules() if isinstance(model_or_fn, torch.nn.Module) else ()
    if entries is None:
        return []
    codes = {type(m).forward.__code__: type(m).__qualname__ for m in modules
             if hasattr(type(m).forward, "__code__")}
    limit = torch._dynamo.config.recompile_limit
    return [f"{name}.forward" for code, name in codes.items() if len(entries(code)) >= limit]


def _backend_options(model_or_fn, mha_options, kwargs):
    """(the backend's options, the model's keywords). `options=` was the backend's alone until
    session 66, so a forward with an `options` parameter could not be explained with it; it still is
    the backend's where the forward does not name it (or takes it positionally only, or through
    **kwargs), and mha_options= is not given."""
    if mha_options is not None or "options" not in kwargs or _names_options(model_or_fn):
        return mha_options, kwargs
    kwargs = dict(kwargs)
    return kwargs.pop("options"), kwargs


def _names_options(model_or_fn):
    fn = model_or_fn.forward if isinstance(model_or_fn, torch.nn.Module) else model_or_fn
    try:
        parameter = inspect.signature(fn).parameters.get("options")
    except (TypeError, ValueError):  # a builtin or an extension's function: no signature to read
        return False
    return parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


@contextlib.contextmanager
def _graph_breaks():
    """The graph breaks Dynamo took while explain compiled, as a list it fills on leaving: each
    reason's first lines (what was called, Dynamo's explanation and hint), with how often. A region split
    by a break cannot be replaced, and the near-miss in the later graph sees only its own half.
    Read from Dynamo's counters (torch._dynamo.utils.counters), before and after: "graph_break",
    and "unimplemented" for what made Dynamo skip a whole frame and run it eagerly (a break inside
    a loop: a review's print() in the expert loop left no break listed)."""
    from torch._dynamo.utils import counters  # torch imports Dynamo lazily
    before = {kind: collections.Counter(counters[kind]) for kind in ("graph_break", "unimplemented")}
    breaks = []
    try:
        yield breaks
    finally:
        first = lambda reason: [line.strip() for line in str(reason).splitlines() if line.strip()]
        seen = set()
        for kind, suffix in (("graph_break", ""), ("unimplemented", "; Dynamo skipped the frame, which ran eagerly")):
            for reason, count in (collections.Counter(counters[kind]) - before[kind]).items():
                lines = first(reason)
                if lines[:1] and lines[0] not in seen:
                    seen.add(lines[0])
                    breaks.append(f"{' '.join(lines[:3])} ({count}x{suffix})")


@contextlib.contextmanager
def _state_kept(model_or_fn, args, kwargs):
    """The forward explain runs leaves what it wrote as it found it: the buffers and parameters of
    the module (a BatchNorm's running statistics, a counter, a scale moved under no_grad), the
    tensors given (written in place), and the random-number state (dropout's draws). A Python
    attribute the forward sets stays set. The parameters' copies are kept in host memory, so that
    a model that fills its GPU can still be explained."""
    module = model_or_fn if isinstance(model_or_fn, torch.nn.Module) else getattr(model_or_fn, "__self__", None)
    owned = isinstance(module, torch.nn.Module)
    parameters, buffers = ([*module.parameters()], [*module.buffers()]) if owned else ([], [])
    tensors = [t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)] + buffers
    found = ([(t, t.detach().clone()) for t in tensors if t.device.type != "meta"]  # meta holds no values
             + [(p, p.detach().to("cpu", copy=True)) for p in parameters if p.device.type != "meta"])
    try:
        with torch.random.fork_rng(devices=sorted({t.device.index for t in tensors + parameters if t.is_cuda})):
            yield
    finally:  # a forward that raised midway may have written too
        with torch.no_grad():
            for tensor, value in found:
                if not torch.equal(tensor.detach().to(value.device), value):
                    tensor.copy_(value)


@contextlib.contextmanager
def _sizes_seen_kept():
    """Dynamo's record of which input sizes changed between compiles of a function, as it was:
    it is keyed by the code's file, first line and name (torch._dynamo.pgo), which _own_code's
    copy shares with the model's own, so two explains at two batch sizes made the user's first
    torch.compile of the model dynamic in the batch (found by a read-through). Where a torch
    build keeps no such record there, nothing. (With torch.compiler.config.job_id set, Dynamo also
    writes the record to its cache after each compile, which this does not undo.)"""
    try:
        from torch._dynamo import pgo
        found = (copy.deepcopy(pgo._CODE_STATE), copy.deepcopy(pgo._INIT_CODE_STATE))
    except (ImportError, AttributeError):
        pgo = None  # yielded outside the handler: an error of the forward's is not chained to this one
    try:
        yield
    finally:
        if pgo is not None:
            pgo._CODE_STATE, pgo._INIT_CODE_STATE = found


@contextlib.contextmanager
def _own_code(model_or_fn):
    """model_or_fn with the function Dynamo starts from (a module's forward, a function or a
    method) copied onto a code object of its own: a module's for the duration (its forward set on
    the instance, so that its hooks still run), a function's or method's as a new callable.
    Anything else as it is: a C function, a callable object, or one of Dynamo's own wrappers
    (torch.compiler.disable's, which torch.compile reads by their attributes)."""
    if isinstance(model_or_fn, torch.nn.Module):
        module, forward = model_or_fn, model_or_fn.forward
        if not (isinstance(forward, types.MethodType) and forward.__self__ is module and _copyable(forward.__func__)):
            yield module
            return
        own = module.__dict__.get("forward")
        module.__dict__["forward"] = types.MethodType(_copy(forward.__func__), module)
        try:
            yield module
        finally:
            if own is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = own
    elif _copyable(model_or_fn):
        yield _copy(model_or_fn)
    elif isinstance(model_or_fn, types.MethodType) and _copyable(model_or_fn.__func__):
        yield types.MethodType(_copy(model_or_fn.__func__), model_or_fn.__self__)
    else:
        yield model_or_fn


def _copyable(func):
    return isinstance(func, types.FunctionType) and not hasattr(func, "_torchdynamo_orig_callable")


def _copy(func):
    """func on a new code object (code.replace() always makes one), otherwise the same function."""
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    own.__kwdefaults__, own.__qualname__ = func.__kwdefaults__, func.__qualname__
    own.__dict__.update(func.__dict__)
    return own
