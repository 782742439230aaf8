"""Replacing a matched region with one call of the `mha::region` op.

The user's parameters are passed as they are; a layout difference becomes a `permute` view
(never a copy) inserted in the graph, a fused K|V weight is passed as two slice views, a learned
query of nn.MultiheadAttention as Wq·query + bq (a [D]-sized computation on parameters).
Two copies are accepted. Experts written as separate nn.Linear modules are stacked with
torch.stack in the graph, on every call (E·D·F elements, the size of the weights, against the
R·k·D·F work of the MoE); caching the stack across calls would need invalidation on every
optimizer step and would cut the gradient path, and torch.stack keeps autograd to each
expert's own parameters. And in training, ctx or tok goes through ops.kept_copy where the graph
writes it in place after the region (match.Match.copied: `h += block(h, tok)`), so that the
backward reads what the forward read. Region nodes that are dead after the replacement are
erased; anything still used (a size query, say) stays, so nothing the rest of the graph
reads is ever lost.
"""
import operator

import torch

from mha_compile import ops
from mha_compile.lowering.aliases import aliases, written_in_place
from mha_compile.lowering.canonicalize import dtype
from mha_compile.lowering.interpret import StackRef


def _index(items):
    return tuple(slice(None) if i == ":" else slice(i[1], i[2]) if isinstance(i, tuple) else i for i in items)


def _param(graph, ref, per_expert=False):
    if ref is None:
        return None
    if isinstance(ref, StackRef):
        return graph.call_function(torch.stack, ([_param(graph, r, per_expert=True) for r in ref.refs],))
    node = ref.node
    for step in ref.steps:
        if step[0] == "index":
            node = graph.call_function(operator.getitem, (node, _index(step[1])))
        elif step[0] == "reshape":
            node = graph.call_method("reshape", (node, *step[1]))
        elif step[0] == "isneginf":
            node = graph.call_function(torch.isneginf, (node,))
        elif step[0] == "not":
            node = graph.call_function(torch.logical_not, (node,))
        elif step[0] == "linear":
            node = graph.call_function(torch.nn.functional.linear,
                                       (node, _param(graph, step[1]), _param(graph, step[2])))
        else:
            raise NotImplementedError(f"parameter step {step[0]!r} has no rewrite")
    perm = ref.perm
    if ref.select is not None:
        if not per_expert:
            raise ValueError(f"parameter {node.name} is used per expert but was not stacked")
        node = graph.call_function(operator.getitem, (node, ref.select))
        if perm is not None:  # counted on the stored tensor, expert axis first (moe._weight_product)
            perm = tuple(p - 1 for p in perm[1:])
    if perm is not None:
        node = graph.call_method("permute", (node, *perm))
    return node


def replace_region(gm, match):
    """Insert the op before match.output, reroute its users, erase the dead region nodes.
    Returns {region node the rest read: the node that now holds its value} (the output, and the
    exports rebuilt from the op)."""
    graph = gm.graph
    with graph.inserting_before(match.output):
        params = [_param(graph, match.params.get(name)) for name in ops.REGION_INPUTS[2:]]  # after ctx, tok
        mask = _param(graph, match.params.get("mask"))
        nan_rows = _nan_rows(graph, mask, dtype(match.ctx)) if match.empty_rows == "nan" else None
        # [H,B,D] (horizon-first): the op takes it [B,H,D], and _to_layout transposes its output back
        ctx = _transposed(graph, match.ctx) if match.ctx_horizon_first else match.ctx
        ctx = ctx if nan_rows is None else graph.call_function(operator.add, (ctx, nan_rows))
        tok = match.tok
        if "ctx" in match.copied:  # after the add too: a partitioner may recompute an add from ctx
            ctx = _copy(graph, ctx)
        if "tok" in match.copied:
            tok = _copy(graph, tok)
        if match.tok_seq_first:  # [N,B,D] (nn.MultiheadAttention's batch_first=False): the op takes [B,N,D]
            tok = _transposed(graph, tok)
        cfg = match.config
        call = graph.call_function(torch.ops.mha.region.default, (
            ctx, tok, *params, mask, cfg["top_k"], cfg["renorm"],
            cfg["act"], match.kernels, bool(match.exports)), {"keep_hidden": True} if match.keep_hidden else {})
        rebuilt = _rebuild_exports(graph, call, match, ctx, nan_rows)
        out = _to_layout(graph, graph.call_function(operator.getitem, (call, 0)), match.out_layout)
        if dtype(match.output) is not None and dtype(match.output) != dtype(match.ctx):
            # The op returns ctx's dtype; the user's spelling may promote (an fp32 gate times a
            # bf16 expert output is fp32): keep what the rest of the graph was traced with.
            out = graph.call_method("to", (out, dtype(match.output)))
    out.meta.update({k: v for k, v in match.output.meta.items() if k in ("example_value", "val", "stack_trace")})
    match.output.replace_all_uses_with(out)
    inside = set(match.nodes)
    for node in match.kept:  # the router's chain the rest reads: after the op, from the rebuilt y
        # in the grad mode and autocast it ran in (statistics under no_grad, a router in fp32)
        with graph.inserting_before(match.output):
            if node in match.kept_modes:
                graph.call_function(torch._C._set_grad_enabled, (match.kept_modes[node],))
            entered = [graph.call_function(torch.amp.autocast_mode._enter_autocast, state)
                       for state in match.kept_autocast.get(node, ())]
        match.output.prepend(node)
        with graph.inserting_before(match.output):
            for enter in reversed(entered):
                graph.call_function(torch.amp.autocast_mode._exit_autocast, (enter,))
            if node in match.kept_modes:
                graph.call_function(torch._C._set_grad_enabled, (match.out_mode,))
    for name, node in match.exports.items():
        for user in list(node.users):
            if user not in inside:
                user.replace_input_with(node, rebuilt[name])
    for node in reversed(match.nodes):
        if not node.users:
            graph.erase_node(node)
    return {match.output: out, **{node: rebuilt[name] for name, node in match.exports.items()}}


def _copy(graph, node):
    """ops.kept_copy(node), with node's example value (later passes read shapes and dtypes from it)."""
    copy = graph.call_function(ops.kept_copy, (node,))
    copy.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "val")})
    return copy


def _transposed(graph, node):
    """node.transpose(0, 1), with its example value transposed (later passes read shapes from it)."""
    out = graph.call_method("transpose", (node, 0, 1))
    out.meta.update({k: v.transpose(0, 1) for k, v in node.meta.items() if k in ("example_value", "val")})
    return out


def _to_layout(graph, out, layout):
    """The op's output [B,H,D] in the region output's layout (match.out_layout): permuted, its
    size-1 axes the output leaves out squeezed, then merged axis by axis ([B·H, D] rows, or
    [H·B, D] after a transpose); views, no copy where the order is kept."""
    perm, widths, dropped = layout
    if perm != (0, 1, 2):
        out = graph.call_method("permute", (out, *perm))
    for _ in range(dropped):
        out = graph.call_method("squeeze", (out, -1))
    axis = 0
    for width in widths:
        if width == 0:
            out = graph.call_method("unsqueeze", (out, axis))
        elif width > 1:
            out = graph.call_method("flatten", (out, axis, axis + width - 1))
        axis += 1
    return out


def _nan_rows(graph, mask, ctx_dtype):
    """[B,1,1] in ctx's dtype: NaN on the batch rows whose keys are all masked, 0 elsewhere. A plain
    softmax over such a row is NaN in the user's graph, where the op's row attends to nothing
    (reference.pool_forward): added to ctx (and to a rebuilt inv) it makes the row's out NaN as
    the user's, and its gradients as NaN as theirs."""
    empty = graph.call_method("view", (graph.call_method("all", (mask, -1)), -1, 1, 1))
    rows = graph.call_function(torch.where, (empty, float("nan"), 0.0))
    return graph.call_method("to", (rows, ctx_dtype))


def _rebuild_exports(graph, call, match, ctx, nan_rows):
    """The region values the rest of the graph reads, from the op's inv output (output 1, in the
    accumulation dtype): inv in its traced dtype, and y = ctx + inv[:, None] as the merge wrote it
    (ctx as the op took it, and inv with the rows _nan_rows makes NaN, where it does); and the
    top-k's indices, from the op's (output 4), the experts the region used.
    With export_inv set on the op, gradients reaching inv and y flow back through the pool."""
    if not match.exports:
        return {}
    inv = graph.call_function(operator.getitem, (call, 1))
    if "inv" in match.exports and _may_be_written(match.exports["inv"]):
        inv = graph.call_method("clone", (inv,))  # the op keeps its output 1 for its backward (F.relu(inv,
        # inplace=True) after the block made that backward raise: a review's); a [B, D] copy only here
    inv = graph.call_method("to", (inv, dtype(match.inv)))
    if nan_rows is not None:
        inv = graph.call_function(operator.add, (inv, graph.call_method("view", (nan_rows, -1, 1))))
    rebuilt = {"inv": inv}
    if "y" in match.exports and match.ctx_horizon_first:  # as the merge wrote it: [H,B,D], contiguous
        rebuilt["y"] = graph.call_function(operator.add, (match.ctx, graph.call_method("unsqueeze", (inv, 0))))
    elif "y" in match.exports:
        rebuilt["y"] = graph.call_function(operator.add, (ctx, graph.call_method("unsqueeze", (inv, 1))))
    if "index" in match.exports:  # the experts the op chose, [R,k] as top-k's indices (int64)
        index = graph.call_function(operator.getitem, (call, 4))
        if match.index_rows == "h*b":  # the op's rows are batch-major: [B,H,k] -> [H,B,k] -> [H·B,k]
            k = match.config["top_k"]
            index = graph.call_method("view", (index, graph.call_method("size", (ctx, 0)), -1, k))
            index = graph.call_method("reshape", (graph.call_method("transpose", (index, 0, 1)), -1, k))
        rebuilt["index"] = graph.call_method("to", (index, dtype(match.exports["index"])))
    for name, node in rebuilt.items():
        source = match.exports.get(name)
        if source is not None:
            node.meta.update({k: v for k, v in source.meta.items() if k in ("example_value", "val")})
    return rebuilt


def _may_be_written(node):
    """Whether the graph writes node's tensor in place, or hands it (a view of it) on to the caller
    or to a later graph, where a write cannot be seen from here (after a graph break, or returned)."""
    return written_in_place(node) or any(u.op == "output" for a in aliases(node) for u in a.users)


def rewrite(gm, matches):
    """Replace every match in gm (in place) and recompile it.

    A later region may read an earlier one's output or exports (two blocks in a row; a second
    block on the first one's y): those nodes are replaced, so later matches are pointed at their
    replacements first.
    """
    replaced = {}
    for match in matches:
        match.ctx, match.tok = replaced.get(match.ctx, match.ctx), replaced.get(match.tok, match.tok)
        replaced.update(replace_region(gm, match))
    gm.graph.lint()
    gm.recompile()
    return gm


__all__ = ["rewrite", "replace_region", "ops"]
