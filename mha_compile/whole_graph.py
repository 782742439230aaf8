"""mode="reduce-overhead" with rest="eager": the compiled graph replayed as CUDA graphs.

Dynamo's `cudagraphs` backend (torch._dynamo.backends.cudagraphs) takes a forward's static inputs
(read where they are, not copied into the graph's memory before each replay) to be the inputs
AOTAutograd lifted. Since Dynamo inlines nn.Modules (inline_inbuilt_nn_modules, the default) it
lifts none: every parameter is then copied before every replay, beside ctx and tok (14 inputs,
none static, for the tiny block on torch 2.13; tests/backend/test_whole_graph.py). Inductor's own
reduce-overhead takes them from the TracingContext's fw_metadata.static_input_indices
(torch._inductor.compile_fx.get_static_input_idxs), the parameters and buffers; with
STATIC_PARAMS, `capture` hands Dynamo's backend the same indices for the forward. A static
input whose address changes makes the CUDA-graph trees record again (as under Inductor); one the
graph mutates still makes Dynamo's backend skip CUDA graphs (its check is unchanged).

On by default since session 27; MHA_COMPILE_CUDAGRAPH_STATIC_PARAMS=0 turns it off. On the H200
(torch 2.11, bench/step_profile.py, mha-fused-cudagraphs on the loop spelling, off then on, each
its own process; bench/results/static_params_{medium,large}.txt): the replays' input copies
(aten::_foreach_copy_) took 16 us less GPU a medium step and 50 us less a large one, a medium
step's GPU time 0.673 → 0.657 ms and its host issue 0.829 → 0.650 ms, a large step's GPU time
6.049 → 5.980 ms. It needs the graph to carry Dynamo's metadata (copy_graph keeps it): without
it AOTAutograd marks no input static and this keeps nothing static (session 27's first run).
"""
import contextlib
import copy
import functools
import logging
import operator
import os
import typing
from unittest import mock

import torch

from mha_compile import pool_moe_ops
from mha_compile.options import env_mib
from mha_compile.kernels import triton_region
from mha_compile.lowering.match import GRAD_MODE_CALLS

log = logging.getLogger("mha_compile")

STATIC_PARAMS = os.environ.get("MHA_COMPILE_CUDAGRAPH_STATIC_PARAMS", "1") != "0"


def capture(gm, example_inputs):
    """Dynamo's cudagraphs backend on gm; with STATIC_PARAMS, the forward's parameters and buffers
    kept static. Dynamo's backend builds its forward while this runs; cudagraphify_impl is
    replaced for that time only, in both modules that may hold it (torch 2.13 imports it inside
    the backend, an older one may at module level)."""
    from torch._dynamo.backends import cudagraphs as dynamo_cudagraphs
    from torch._inductor import cudagraph_trees
    if not STATIC_PARAMS:
        return dynamo_cudagraphs.cudagraphs(gm, example_inputs)
    wrapped = functools.partial(_forward_static_params, cudagraph_trees.cudagraphify_impl)
    with contextlib.ExitStack() as stack:
        for module in (cudagraph_trees, dynamo_cudagraphs):
            if hasattr(module, "cudagraphify_impl"):
                stack.enter_context(mock.patch.object(module, "cudagraphify_impl", wrapped))
        return dynamo_cudagraphs.cudagraphs(gm, example_inputs)


def _forward_static_params(cudagraphify_impl, model, inputs, static_input_idxs, *args, **kwargs):
    """cudagraphify_impl with a forward's static inputs taken from the TracingContext, as
    Inductor's reduce-overhead takes them; a backward's (its saved tensors) are left as given."""
    context = torch._guards.TracingContext.try_get()
    if not kwargs.get("is_backward") and context is not None and context.fw_metadata is not None:
        static_input_idxs = list(context.fw_metadata.static_input_indices)
    return cudagraphify_impl(model, inputs, static_input_idxs, *args, **kwargs)


def copy_graph(gm):
    """(gm's graph in a new GraphModule, {gm's node: its copy}), with what Dynamo hands AOTAutograd
    beside the graph: gm.meta (its dynamo_compile_id), _param_name_to_source and each
    placeholder's _dynamo_source. Without them AOTAutograd takes the graph for one Dynamo did not
    capture and marks no input static (fw_metadata.static_input_indices empty), so CUDA graphs
    copied every parameter before each replay (H200, torch 2.11, session 27)."""
    graph, nodes = torch.fx.Graph(), {}
    out = graph.graph_copy(gm.graph, nodes)
    graph.output(out)
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    new = torch.fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new._param_name_to_source = gm._param_name_to_source
    for node, copied in nodes.items():
        if hasattr(node, "_dynamo_source"):
            copied._dynamo_source = node._dynamo_source
    return new, nodes


# Each region's pool run eagerly, outside the CUDA graphs, where that spares the replays a copy of
# tok (plan_pool_split); MHA_COMPILE_POOL_OUTSIDE_GRAPHS=0 captures it with the rest. Read at compile time.
POOL_OUTSIDE = os.environ.get("MHA_COMPILE_POOL_OUTSIDE_GRAPHS", "1") != "0"
# ... where tok holds at least this many bytes. The eager pool costs host time (its launches, forward
# and backward: a large step's host issue 1.99 → 3.62 ms on the H200, session 40), which a step
# whose graphs take ~0.65 ms of GPU (medium) cannot hide, for a copy of ~20 us there (32 MiB); at
# large it saved 0.30 ms of a 5.6 ms step (512 MiB). MHA_COMPILE_POOL_OUTSIDE_MIN_MB sets it.
POOL_OUTSIDE_MIN_ENV = "MHA_COMPILE_POOL_OUTSIDE_MIN_MB"


def pool_outside_min_bytes(text):
    """POOL_OUTSIDE_MIN_BYTES from MHA_COMPILE_POOL_OUTSIDE_MIN_MB's text (None: 256 MiB; 0: every
    size); a clear error for a value that is not a number of MiB from 0 (it was float()'s own)."""
    return env_mib(POOL_OUTSIDE_MIN_ENV, text, 256, "the size of tok from which the pool runs outside the CUDA graphs",
                   zero=True)


POOL_OUTSIDE_MIN_BYTES = pool_outside_min_bytes(os.environ.get(POOL_OUTSIDE_MIN_ENV))
_REGION_ARGS = [a.name for a in torch.ops.mha.region.default._schema.arguments]
_POOL_ARGS = ("tok", "q", "wk", "bk", "wv", "bv", "wo", "bo", "mask")  # mha::pool's, in order
_MOE_ARGS = ("ctx", "wg", "w1", "b1", "w2", "b2", "w3")  # mha::moe's tensors, inv left out, in order


class PoolSplit(typing.NamedTuple):
    """plan_pool_split's result: what the CUDA graphs replay, and what runs before them."""
    graph: torch.fx.GraphModule  # the graphs: each split region as mha::moe on an inv input
    pools: list  # per region, mha::pool's arguments as positions among the call's inputs (None: absent)
    kept: list  # the call's inputs the graphs read, by position
    examples: list  # the graphs' example inputs: those kept, then each region's inv
    toks: dict  # each split region's tok input: its name -> its bytes


def plan_pool_split(gm, example_inputs):
    """The regions of gm whose pool can run eagerly outside the CUDA graphs, as a PoolSplit; None
    where none can (then capture gm as it is).

    The CUDA-graph trees copy each input that is not static into the graphs' memory before a
    replay: tok is 512 MiB at the large preset in bf16. The pool is tok's only reader, forward and
    backward, so a region whose tok is an input of the graph that nothing else reads runs as
    pool_moe_ops' two ops: mha::pool eagerly with its autograd (as PoolFunction: the op's forward
    and backward without its dispatch, since nothing traces that call; its backward runs after the
    graphs' backward, on tok where it is), and mha::moe in the graphs, which take the pool's [B,D]
    inv as an input in tok's place. Only where tok holds POOL_OUTSIDE_MIN_BYTES or more, the pool
    reads inputs alone (tok, its weights, a mask) and the fused kernels take the region in one
    dtype: the two ops run the fused set's own pieces (its outputs and gradients,
    tests/test_pool_moe_ops.py). Inputs left with no reader (tok, the pool's weights) are not
    handed to the graphs. Nothing is traced or captured here: capture_split does that, by capture()
    (rest="eager") or by Inductor under its mode's CUDA graphs (rest="inductor", the backend's)."""
    if not POOL_OUTSIDE:
        return None
    regions = [node for node in gm.graph.find_nodes(op="call_function", target=torch.ops.mha.region.default)
               if _pool_can_leave(node, _bound(node))]
    if not regions:
        return None
    toks = {}
    for node in regions:
        tok = _bound(node)["tok"]
        example = _example(tok)
        toks[tok.name] = example.numel() * example.element_size()
    new, nodes = copy_graph(gm)
    inputs = list(new.graph.find_nodes(op="placeholder"))
    pools = [_split_region(new.graph, nodes[node], inputs) for node in regions]
    for node in inputs:
        if not node.users:
            new.graph.erase_node(node)
    new.graph.lint()
    new.recompile()
    kept = [i for i, node in enumerate(inputs) if node.users]
    invs = [_inv_example(call, example_inputs) for call in pools]
    for node, example in zip(list(new.graph.find_nodes(op="placeholder"))[-len(invs):], invs):
        node.meta["example_value"] = example  # its shape, dtype and strides, for the dump's script
    return PoolSplit(new, pools, kept, [example_inputs[i] for i in kept] + invs, toks)


def capture_split(split, compile_graphs=capture):
    """A PoolSplit's graphs compiled by compile_graphs(graph, example inputs) (capture(), or
    Inductor's compile for rest="inductor": the backend's), called after each region's mha::pool
    on the call's inputs."""
    log.info("mha_compile: %d region pool(s) run eagerly outside the CUDA graphs (tok not copied in)", len(split.pools))
    return _PoolThenGraphs(split.pools, split.kept, compile_graphs(split.graph, split.examples))


def _bound(node):
    """The region call's arguments by name (its defaults filled in)."""
    values = dict(zip(_REGION_ARGS, node.args))
    values.update(node.kwargs)
    for argument in torch.ops.mha.region.default._schema.arguments:
        if argument.name not in values and argument.has_default_value():
            values[argument.name] = argument.default_value
    return values


def _example(value):
    return value.meta.get("example_value") if isinstance(value, torch.fx.Node) else value


def _pool_can_leave(node, values):
    """Whether this region's pool can run outside the graphs (plan_pool_split)."""
    tok = values["tok"]
    if values["kernels"] != "fused" or not isinstance(tok, torch.fx.Node) or tok.op != "placeholder":
        return False
    if any(n.op == "call_function" and n.target in GRAD_MODE_CALLS for n in node.graph.nodes):
        # the pool outside runs before the graph, in the call's grad mode: a region under the
        # graph's own enable_grad (called under no_grad) would lose its pool's gradients
        return False
    if set(tok.users) != {node}:
        return False  # another reader would copy tok in anyway
    if any(isinstance(values[name], torch.fx.Node) and values[name].op != "placeholder" for name in _POOL_ARGS):
        return False  # the eager part would have to run what computes them
    if any(user.target is not operator.getitem or user.args[1] not in (0, 1, 4) for user in node.users):
        return False  # the graph reads a saved output other than the chosen experts (never, as the rewrite builds it)
    tensors = [_example(values[name]) for name in ("ctx", "tok", *_POOL_ARGS[1:-1], *_MOE_ARGS[1:])]
    ctx, tok, w1, mask = tensors[0], tensors[1], _example(values["w1"]), _example(values["mask"])
    if any(not isinstance(t, torch.Tensor) for t in (ctx, tok, w1)) or \
            any(t is not None and not isinstance(t, torch.Tensor) for t in tensors):
        return False
    size = tok.numel() * tok.element_size()
    if not isinstance(size, int) or size < POOL_OUTSIDE_MIN_BYTES:
        return False  # a copy too small to pay for the eager pool's host time (or a symbolic size)
    return (triton_region.why_unsupported(ctx, tok, w1, values["top_k"], values["act"], mask) is None
            and all(t is None or t.dtype == ctx.dtype for t in tensors))


def _split_region(graph, node, inputs):
    """Replace the region call `node` by mha::moe on an input inv appended to the graph's
    inputs; (the positions of mha::pool's arguments among `inputs`, None for an absent one)."""
    values = _bound(node)
    with graph.inserting_after(list(graph.find_nodes(op="placeholder"))[-1]):
        inv = graph.placeholder(f"{node.name}_inv")
    inv._dynamo_source = None  # no source in the user's code (AOTAutograd reads one on every input)
    with graph.inserting_before(node):
        moe = graph.call_function(torch.ops.mha.moe.default, (
            values["ctx"], inv, *[values[name] for name in _MOE_ARGS[1:]], values["top_k"], values["renorm"],
            values["act"], values["keep_hidden"]))
    for user in list(node.users):
        if user.args[1] == 0:
            user.replace_input_with(node, moe)
        elif user.args[1] == 4:  # the chosen experts (a load-balancing loss reads them): mha::moe's
            user.args = (moe, 2)
        else:
            user.replace_all_uses_with(inv)
            graph.erase_node(user)
    graph.erase_node(node)
    return [None if values[name] is None else inputs.index(values[name]) for name in _POOL_ARGS]


def _inv_example(pool_args, example_inputs):
    """An example of mha::pool's inv for the graphs' trace: [B,D] fp32 on tok's device, taking a
    gradient where tok or a pool weight does (as the pool's real output will: Dynamo guards the
    inputs' requires_grad and the grad mode)."""
    tok = example_inputs[pool_args[0]]
    grad = torch.is_grad_enabled() and any(i is not None and example_inputs[i].requires_grad for i in pool_args[:-1])
    return tok.new_empty(tok.shape[0], tok.shape[2], dtype=torch.float32).requires_grad_(grad)


class _PoolThenGraphs:
    """Each split region's mha::pool (PoolFunction), run eagerly on the call's inputs, then the
    captured graphs on the inputs they read and the pools' inv."""

    def __init__(self, pools, kept, compiled):
        self.pools, self.kept, self.compiled = pools, kept, compiled

    def __call__(self, *args):
        invs = [pool_moe_ops.PoolFunction.apply(*[None if i is None else args[i] for i in pool])[0]
                for pool in self.pools]
        return self.compiled(*[args[i] for i in self.kept], *invs)
