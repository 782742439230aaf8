"""Finding MHA regions in a Dynamo graph.

Chosen approach: canonicalize ops (canonicalize.py), then read meaning by abstract
interpretation over shapes and dataflow (interpret.py, pool.py, moe.py), anchored on each
`topk`. We chose this over a list of literal patterns because the block has many spellings
that combine freely (SPEC §2): a literal pattern per combination would multiply, while a rule
per operation composes, and each rule checks the one thing that makes the op the block's
(the axis a softmax runs over, the axis a broadcast adds along, the scale of the scores).

For each topk: router -> merge -> pool are found by walking back; the pool and the MoE are
then read forward. Every candidate ends as a Match or as a NearMiss with a reason.
"""
import bisect
import dataclasses
import math
import operator

import torch

from mha_compile.lowering.activation import KINDS as ELEMENTWISE, refusal
from mha_compile.lowering.aliases import FRESH, aliases as storage_aliases
from mha_compile.lowering.canonicalize import call_name, canon, dtype, float_dtype, is_inplace, is_one, shape, written
from mha_compile.lowering.interpret import (ONE, SIZE_QUERIES, StackRef, Val, Walk, broadcast, known_eq, layout_rule,
                                           ref_shape, with_step)
from mha_compile.lowering.moe import moe_params, moe_rule
from mha_compile.lowering.pool import pool_params, pool_rule

_LAYOUT = ("reshape", "permute", "expand", "cast")


@dataclasses.dataclass
class Match:
    """One region to replace: its inputs, parameters (as ParamRefs), config and nodes."""
    anchor: object
    output: object
    ctx: object
    tok: object
    params: dict
    config: dict
    nodes: list
    kernels: str = "reference"
    kernels_reason: str = ""
    graphs: str = ""  # whether the region replays its own CUDA graphs, and why
    keep_hidden: bool = False  # options keep_hidden: the op keeps the experts' u for the backward
    keeps: str = ""  # whether it does, and why
    runs: str = ""  # how the MoE walks its slot rows: one run or several (MHA_COMPILE_SLOT_CHUNK_MB)
    # Region values the rest of the graph also reads, rebuilt from the op's inv output:
    # {"inv": node, "y": node} (a residual y + MoE(y), say); empty when nothing escapes.
    exports: dict = dataclasses.field(default_factory=dict)
    inv: object = None  # the pool's output node (its dtype is what a rebuilt inv must have)
    # How the op's output [B,H,D] becomes the region's output (out_layout): identity for [B,H,D]
    out_layout: tuple = ((0, 1, 2), (1, 1, 1), 0)
    # Router nodes the rest of the graph reads (π for a load-balancing loss, the logits for a
    # z-loss), computed again after the op from y rebuilt from it (_router_chain), and what read
    # them or an export before the region's end (_deferred): moved after the op, in graph order
    kept: list = dataclasses.field(default_factory=list)
    # With a mask, what a batch row whose keys are all masked gives in the user's spelling: "zero"
    # (SDPA, nn.MultiheadAttention: it attends to nothing, as the op), "nan" (a plain softmax: the
    # rewrite adds the NaN to the op's ctx and to a rebuilt inv); "" without a mask.
    empty_rows: str = ""
    # Inputs the op takes a copy of, since it keeps them for its backward where eager's ops may
    # keep none (_copied): those the graph writes in place after the region (h += block(h, tok)),
    # and ctx where the caller holds it (a graph input or output, which it may write after the
    # call). Under CUDA graphs too: their first calls run on the caller's ctx itself, and a
    # static input (a batch read in place) is the caller's to write.
    copied: tuple = ()
    # Grad modes: of the kept nodes that ran under another mode than out (a reader moved after
    # the op from under torch.no_grad()), and out's, which the rewrite restores after each
    kept_modes: dict = dataclasses.field(default_factory=dict)
    out_mode: bool = True
    # Autocast of the kept nodes whose autocast differs from out's: {node: [(device type, dtype,
    # enabled, cache)]}, the contexts the rewrite enters around each after the op
    kept_autocast: dict = dataclasses.field(default_factory=dict)
    # tok is [N,B,D] (nn.MultiheadAttention's default layout, batch_first=False): the op takes it
    # transposed, [B,N,D]
    tok_seq_first: bool = False
    # the rows of an exported top-k index: "b*h" (batch-major, the op's) or "h*b"
    index_rows: str = "b*h"
    # ctx is [H,B,D] (horizon-first, inv added along its batch axis, inv[None]): the op takes it
    # transposed, [B,H,D], and the output's layout (out_layout) transposes it back
    ctx_horizon_first: bool = False

    def summary(self):
        return {"output": self.output.name, "ctx": self.ctx.name, "tok": self.tok.name,
                "nodes": [n.name for n in self.nodes], "config": dict(self.config),
                "params": {k: _describe(v) for k, v in self.params.items()},
                "kernels": self.kernels, "kernels_reason": self.kernels_reason, "graphs": self.graphs,
                "keep_hidden": self.keeps, "slot_runs": self.runs, "empty_rows": self.empty_rows,
                "exports": {k: v.name for k, v in self.exports.items()}, "kept": [n.name for n in self.kept],
                "copied": list(self.copied),
                "transposed": [name for name, t in (("ctx", self.ctx_horizon_first), ("tok", self.tok_seq_first)) if t],
                "shapes": {"ctx": _shape_str(self.ctx), "tok": _shape_str(self.tok), "out": _shape_str(self.output)},
                "dtype": str(dtype(self.ctx))}


@dataclasses.dataclass
class NearMiss:
    """A candidate that is almost the block but is not: the node where it differs, and why."""
    anchor: str
    node: str
    reason: str

    def summary(self):
        return dataclasses.asdict(self)


def _describe(ref):
    if ref is None:
        return None
    if isinstance(ref, StackRef):
        return "stack(" + ", ".join(_describe(r) for r in ref.refs) + ")"
    text = ref.node.name
    for step in ref.steps:
        if step[0] == "index":  # as Python writes the index: w13[:, :, 0:64]
            text += "[" + ", ".join(i if i == ":" else f"{i[1]}:{i[2]}" if isinstance(i, tuple) else str(i)
                                    for i in step[1]) + "]"
        else:
            text += f".{step[0]}{step[1:] if step[0] != 'linear' else ''}"
    if ref.select is not None:
        text += f"[{ref.select}]"
    if ref.perm is not None:
        text += f".permute{ref.perm}"
    return text


def _shape_str(node):
    s = shape(node)
    return None if s is None else [str(d) for d in s]


def _mutators(node):
    """Users of `node` that change it in place (out.index_add_(...), ctx += ...)."""
    return [u for u in node.users if written(u) is node]


def _ancestors(node, order, stop=()):
    """Nodes `node` depends on; an in-place change of a tensor counts as an input of the readers
    that come after it in graph order. The walk does not go past nodes in `stop` (it keeps the
    search local to one region in a long graph)."""
    seen, stack = set(), [(node, order[node])]
    while stack:
        n, reader = stack.pop()
        if n not in seen:
            seen.add(n)
            if n in stop:
                continue
            stack.extend((i, order[n]) for i in n.all_input_nodes)
            stack.extend((m, order[m]) for m in _mutators(n) if order[m] < reader)
    return seen


def _descendants(node, values_only=False):
    """The nodes that read node, through any chain. values_only: those whose values depend on
    node's; a size query (tok.size(2), which Dynamo emits under dynamic=True for a width it knows)
    and what reads only it depend on no value of node's."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(u for u in n.users if not (values_only and _is_size_query(u)))
    return seen


def _in_order(nodes, subset):
    """The nodes of `subset` in graph order (sorting the subset, not scanning the graph)."""
    order = nodes.order
    return sorted(subset, key=order.__getitem__)


class _Nodes(list):
    """The graph's nodes in order, with each node's position (so subsets sort without a scan), and
    what cut the graph from the rest of the model (find_regions' `piece`)."""

    def __init__(self, graph, piece=None):
        super().__init__(graph.nodes)
        self.order = {n: i for i, n in enumerate(self)}
        self.piece = piece


# What a graph is a piece of, where a cut other than a graph break can split the block (find_regions)
DDP_PIECE, HOP_BODY = "ddp", "body"
DDP_HINT = ("this graph is a piece of DDP's graph split (DDPOptimizer: under torch._dynamo.config.optimize_ddp = True, "
            "the default, Dynamo cuts a DistributedDataParallel model's graph where a gradient bucket fills), and the "
            "cut falls inside the block: set torch._dynamo.config.optimize_ddp = False (one graph; DDP's all-reduce "
            "then waits for the whole backward) or \"python_reducer\" with compiled autograd")
BODY_HINT = ("a function Dynamo keeps apart (torch.utils.checkpoint's, say), which holds only part of the block: put "
             "the whole block inside that function or outside it")


def _elsewhere(nodes, between):
    """Where the rest of a block ran whose MoE or merge reads an input of this graph, for a near-miss."""
    if nodes.piece == DDP_PIECE:
        return f"in an earlier piece of the model's graph, cut off {between}: {DDP_HINT}"
    if nodes.piece == HOP_BODY:
        return f"outside this graph, the body of {BODY_HINT}"
    return (f"in an earlier graph, which Dynamo ended {between} (explain lists where Dynamo broke the graph), or "
            f"outside the compiled function")


def _strip(node, kinds=_LAYOUT):
    while True:
        op = canon(node)
        if op is None or op.kind not in kinds or not isinstance(op.args[0], type(node)):
            return node
        node = op.args[0]


class _Miss(Exception):
    def __init__(self, node, reason):
        super().__init__(reason)
        self.node, self.reason = node, reason


_ROUTING = ("topk", "topw", "topi", "sumw", "onehot", "emask", "where", "selidx", "gate", "gate_s", "gatecol", "probs")
def _split_hint(nodes):
    """What to do about a graph break in the region: the flag where it is off; where it is on
    already, the break is something else (a loop over a tensor: `for e in expert_hit`). In a piece
    of DDP's graph split, the split is the cause (a review's: the flag was advised in vain)."""
    if nodes.piece == DDP_PIECE:
        return DDP_HINT
    if not torch._dynamo.config.capture_dynamic_output_shape_ops:
        return ("set torch._dynamo.config.capture_dynamic_output_shape_ops = True so that Dynamo keeps "
                "torch.where/nonzero or torch.bincount (data-dependent shapes) in one graph with the router")
    return ("capture_dynamic_output_shape_ops is set already, so the break is another: a Python if on a "
            "data-dependent size (if top_x.shape[0] == 0: continue, as older transformers' Mixtral and DBRX skip an "
            "expert with no rows: drop it, an empty index_add_ adds nothing), a Python loop over a tensor (for e in "
            "expert_hit: loop over range(E) instead), .item() or .tolist(), a print; the report's ended_by names it "
            "and its line")


def find_regions(gm, piece=None):
    """All MHA regions of gm's graph: (matches, near_misses). The graph is not changed. piece:
    DDP_PIECE where gm is a piece of DDP's graph split, HOP_BODY where it is a higher-order op's
    body (a checkpointed function), for the reasons of a block the cut splits."""
    nodes = _Nodes(gm.graph, piece)
    matches, misses = [], []
    anchors = [n for n in nodes
               if n.op in ("call_function", "call_method") and getattr(n.target, "__name__", n.target) == "topk"]
    for anchor in anchors:
        op = canon(anchor)
        if op is None or op.kind != "topk":
            continue
        try:
            matches.append(_apart(_match_at(nodes, anchor), matches))
        except _Miss as miss:
            if _leaves_graph(anchor) and not any(said in miss.reason for said in (
                    "graph break", "so the router ran elsewhere", DDP_HINT)):
                miss = _Miss(anchor, f"{anchor.name}: the top-k's weights or indices are outputs of this graph, "
                                     f"so the region is not replaced ({miss.reason}). If the forward does not "
                                     "return them, a graph break splits the MHA region (e.g. at torch.where/"
                                     f"nonzero); {_split_hint(nodes)}")  # returned w read as only a break: a review's
            misses.append(NearMiss(anchor.name, getattr(miss.node, "name", str(miss.node)), miss.reason))
    routed = _routed_otherwise(nodes)
    if not anchors and not routed:  # experts chosen by argmax is no split region (a review's: said so)
        misses.extend(_split_experts(nodes))
    # a top-k that runs after a replaced region on its router's softmax, or on a softmax of its own of
    # the router's logits the region keeps (a load-balancing loss's own selection, transformers'
    # load_balancing_loss_func), is no MoE: its walk blamed the matched experts (reviews')
    kept = {n for match in matches for n in match.kept}
    on_kept = {n.name for n in anchors if n in kept or n.args and isinstance(n.args[0], torch.fx.Node)
               and _strip(n.args[0], _LAYOUT + ("softmax",)) in kept}
    return matches, [m for m in misses if m.anchor not in on_kept] + routed


def _routed_otherwise(nodes):
    """Experts chosen from a router's softmax by max, argmax, sort or argsort where no top-k reads
    that softmax: the matcher starts from top-k only, so without this such a model got no report."""
    misses = []
    for n in nodes:
        name = call_name(n)
        if n.op not in ("call_function", "call_method") or name not in ("max", "argmax", "sort", "argsort") or \
                not n.args or not isinstance(n.args[0], torch.fx.Node) or (name == "max" and len(n.args) < 2
                                                                            and "dim" not in n.kwargs):
            continue
        probs = _strip(n.args[0])
        op = canon(probs)
        if op is None or op.kind != "softmax" or any(call_name(u) == "topk" for u in probs.users):
            continue
        router = canon(_strip(op.args[0]))
        if router is not None and router.kind in ("linear", "matmul") and _selects_experts(n):
            misses.append(NearMiss(n.name, n.name, (
                f"{n.name}: the experts are chosen by {name} of the router's softmax {probs.name}; the matcher reads "
                f"the choice from a top-k only: write {probs.name}.topk(k, dim=-1) (k = 1 in place of max or argmax)")))
    return misses


def _apart(match, earlier):
    """match, where it shares no node with an `earlier` one's region (its nodes, and those it
    moves after its op). One pool whose inv feeds two MoEs gives two regions that both hold the
    pool: replacing the second erased the pool's nodes again, and the graph's code generation
    then looped forever. The first is replaced, exporting inv, and the second runs as written."""
    for other in earlier:
        theirs = set(other.nodes) | set(other.kept)
        shared = [n.name for n in [*match.nodes, *match.kept] if n in theirs]
        if shared:
            raise _Miss(match.anchor, f"{match.anchor.name}: its region shares {', '.join(shared[:4])}"
                                      f"{' and more' if len(shared) > 4 else ''} with the region of "
                                      f"{other.anchor.name} (one pool feeding two MoEs, say), which is replaced; "
                                      f"this one runs as written, on the pooled vector that region exports")
    return match


def _leaves_graph(anchor, limit=64):
    """Whether the top-k's results (through at most `limit` nodes) are outputs of the graph."""
    seen, stack = set(), [anchor]
    while stack and len(seen) < limit:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "output":
            return True
        op = canon(n)
        if n is anchor or (op is not None and op.kind in _LAYOUT + ("getitem", "div", "sum", "softmax", "one_hot")):
            stack.extend(n.users)
    return False


def _selects_experts(choice, hops=6):
    """Whether the indices `choice` gives (max's or sort's second output, argmax's or argsort's
    own) pick experts: compared with an expert's number (or an arange of them), one-hot encoded,
    scattered into, or used to index or gather (W1[index]), within `hops` layout steps. A
    classifier's argmax is none of these (found by a review: it read as a router)."""
    stack = [(choice, 0)] if call_name(choice) in ("argmax", "argsort") else [
        (u, 0) for u in choice.users if canon(u) is not None and canon(u).kind == "getitem" and u.args[1] == 1]
    while stack:
        n, depth = stack.pop()
        for user in n.users:
            op = canon(user)
            kind = None if op is None else op.kind
            if kind == "eq" and any(type(a) is int or isinstance(a, torch.fx.Node) and call_name(a) == "arange"
                                    for a in op.args if a is not n) \
                    or kind in ("one_hot", "gather", "index_select") \
                    or kind == "scatter" and op.args[2] is n or kind == "getitem" and _indexes_by_tensor(op.args[1]):
                return True
            if kind in _LAYOUT + ("getitem",) and depth < hops:
                stack.append((user, depth + 1))
    return False


def _split_experts(nodes):
    """A graph holding index_add_ of expert outputs but no router: the rest of a region split by a
    graph break (Mixtral-style routing without capture_dynamic_output_shape_ops)."""
    adds = [n for n in nodes if n.op == "call_method" and n.target in ("index_add_", "index_add")]
    if not adds:
        return []
    return [NearMiss(adds[0].name, adds[0].name,
                     f"{adds[0].name}: this graph adds expert outputs (index_add_) but holds no router top-k: the MHA "
                     f"region was split by a graph break and cannot be replaced; {_split_hint(nodes)}")]


def _match_at(nodes, anchor):
    router = _strip(anchor.args[0], _LAYOUT + ("softmax",))
    op = canon(router)
    if router.op == "placeholder":  # (a review's: a print of the router's load broke the graph there)
        raise _Miss(anchor, f"{anchor.name}: top-k's input {router.name} is an input of this graph, so the router "
                            f"ran elsewhere: {_elsewhere(nodes, 'between the router and its top-k')}")
    if op is None or op.kind not in ("linear", "matmul"):  # (a review's: the reason named no op)
        what = f"{router.name} ({router.op} {getattr(router.target, '__name__', router.target)})"
        raise _Miss(anchor, f"{anchor.name}: top-k is not taken on a softmax of a router product x·Wgᵀ: it reads "
                            f"{what} there (a temperature, a bias, noise, sigmoid scores or a detach between x·Wgᵀ "
                            f"and the softmax are not the block's router)")
    x = op.args[0]
    y = _strip(x)
    y_op = canon(y)
    if any(known_eq(size, 0) for size in shape(x) or ()):  # (a review's: read as experts it could not read)
        raise _Miss(anchor, f"{anchor.name}: the router's rows {list(shape(x))} are empty (a batch or horizon of "
                            f"size 0): nothing to replace, the graph runs as written")
    if y.op == "placeholder":
        raise _Miss(y, f"{anchor.name}: the MoE's input {y.name} is an input of this graph, so the merge and the "
                       f"pool ran elsewhere: {_elsewhere(nodes, 'before the MoE')}")
    if call_name(y) == "detach":  # x.detach() or torch.detach(x) (a review's: the reason blamed a missing
        # merge, which is there)
        if any(u is not y for u in getattr(y.args[0], "users", ())):  # the experts read x itself
            raise _Miss(y, f"{anchor.name}: the router reads {y.name}, a detach of the MoE's input: eager sends no "
                           f"gradient from the router back into x, where the block's router does (x·Wgᵀ of x itself)")
        raise _Miss(y, f"{anchor.name}: the MoE's input is detached ({y.name}): no gradient reaches ctx and the pool "
                       f"through the MoE, where the block's does")
    if y_op is None or y_op.kind != "add":
        raise _Miss(y, f"{anchor.name}: the MoE's input {y.name} is not a broadcast-add of a pooled vector "
                       f"over horizons (no merge ctx + inv[:, None] before the router)")
    ctx, inv, bcast = _merge_operands(y, y_op)
    tok, pool_walk, tok_seq_first = _read_pool(nodes, inv)
    if known_eq(pool_walk.axes.sizes.get("n"), 0):  # (a review's: 4.4% off, ∂bv 9.4 where eager's is 0)
        raise _Miss(inv, f"{inv.name}: the pool attends over no tokens (tok {list(shape(tok))}): eager's weighted "
                         f"sum is empty, so inv = bo, where the op's reassociation, whose weights sum to 1, gives "
                         f"Wo·bv + bo")
    horizon_first = _check_merge(nodes, y, ctx, inv, bcast, pool_walk)
    out, moe_walk = _read_moe(nodes, anchor, y, router, HORIZON_FIRST if horizon_first else _OP_AXES)
    layout = out_layout(moe_walk.vals[out].roles, moe_walk.axes.sizes)
    if layout is None:
        raise _Miss(out, f"{out.name}: the MoE's output leaves the region with axes {moe_walk.vals[out].roles}, "
                         f"which are not the rows' batch, horizon and width (b, h, d) in an order the rewrite "
                         f"can rebuild from the op's [B,H,D]")
    # y and inv may also be read outside (a residual): the op's inv output rebuilds them. Not
    # for an in-place merge, whose y is ctx's own storage.
    exportable = {"inv": inv} if is_inplace(y) else {"inv": inv, "y": y}
    chosen = [n for n, v in moe_walk.vals.items() if v.kind == "topi" and v.info["topk"] is anchor and
              n.target is operator.getitem]
    # rows batch-major, as the op takes them, or horizon-major (a ctx [H,B,D]): rebuilt transposed
    index = [n for n in chosen if moe_walk.vals[n].roles in (("b*h", "s"), ("h*b", "s"))]
    unsorted = canon(anchor).args[4] is False  # sorted=False: eager's order of the k, not the op's
    if index and not unsorted:
        exportable["index"] = index[0]
    # why an index read outside cannot be the op's (a review's: "used outside the region" said not why)
    why_not = {n: ("top-k is taken with sorted=False, whose order of the k chosen is eager's own, not the op's"
                   if unsorted else f"the op gives top-k's indices for rows taken batch-major or horizon-major "
                                    f"([B·H, k] or [H·B, k]); these are "
                                    f"[{', '.join(str(r) for r in moe_walk.vals[n].roles)}]")
               for n in chosen if n not in index or unsorted}
    keepable = None if is_inplace(y) else _router_chain(moe_walk, y)
    region, exports, kept, moved = _region_nodes(nodes, (ctx, tok), out, exportable, keepable, why_not)
    # The experts' writes into the sum must all come before where the region's output is read: a view of
    # the accumulator taken before the loop (o = out.view(B, H, D); out.index_add_(...) per expert) made
    # the region end there, and the loop, left after the op, added every expert into its output again
    # (a review's: twice eager's output and gradients)
    aliases = set(storage_aliases(out))
    late = [n for n in _in_order(nodes, moe_walk.vals) if nodes.order[n] > nodes.order[out] and is_inplace(n)
            and written(n) in aliases]
    if late:
        raise _Miss(late[0], f"{late[0].name} writes the MoE's sum after {out.name}, where the region would end: the "
                             f"rest reads the sum through a view taken before the experts' writes (o = out.view(...) "
                             f"before the loop); take the view after the loop")
    modes = _grad_modes(nodes)
    training = modes(out)
    _check_one_grad_mode(nodes, modes, list(region) + list(kept), out, training)
    # a moved reader keeps its grad mode (router statistics logged under no_grad), and what is
    # moved keeps its autocast (a router in fp32, autocast off, under a bf16 autocast)
    moved_modes = {n: modes(n) for n in moved if modes(n) != training}
    kept = _in_order(nodes, kept | moved)
    autocast = _autocast_states(nodes)
    _check_promoted_ctx(y, ctx, out, autocast)
    _check_no_coarser_rounding(nodes, region, ctx, tok, y, autocast)
    kept_autocast = {n: change for n in kept if (change := _autocast_change(autocast(n), autocast(out)))}
    data = _descendants(ctx) | _descendants(tok)  # not the mask's or the parameters' own preparation
    for n in region:  # a write in place the walks gave no meaning would be dropped with the region
        if is_inplace(n) and n is not y and n in data and n not in moe_walk.vals and n not in pool_walk.vals:
            raise _Miss(n, f"{n.name} writes in place into {n.args[0].name} inside the region, and is not part of "
                           f"the block's math as far as the matcher can read it")
        _check_write_read_after(nodes, n, y, data)
    if any(y in k.all_input_nodes for k in kept):
        exports["y"] = y  # the kept router nodes read y again, rebuilt from the op
    params, config = moe_params(moe_walk.vals[out])
    params.update(pool_params(pool_walk.vals[inv]))
    params = _fitted(params, {**moe_walk.axes.sizes, **pool_walk.axes.sizes}, out)
    copied = _copied(nodes, ctx, tok, region, out) if training else ()  # under no_grad the op keeps nothing
    return Match(anchor, out, ctx, tok, params, config, region, exports=exports, inv=inv, out_layout=layout,
                 empty_rows=pool_walk.vals[inv].info.get("empty_rows", ""), kept=kept, copied=copied,
                 kept_modes=moved_modes, out_mode=training, kept_autocast=kept_autocast, tok_seq_first=tok_seq_first,
                 ctx_horizon_first=horizon_first,
                 index_rows=moe_walk.vals[exports["index"]].roles[0] if "index" in exports else "b*h")


def _fitted(params, sizes, out):
    """params, each in the shape the op takes it. The walks read a tensor through views that add or
    drop size-1 axes as the tensor itself (a query stored [1, P, Dh] read as query[0], a bias [D, 1]
    read as .view(D)): such a parameter is reshaped as the user's view does. Any other difference is
    a near-miss (a review's: these crashed the op, or with P = 1 a query [Dh, 1] read as .view(1, Dh)
    made Dh heads of width 1)."""
    P, Dh, D, E, F, B, N = (sizes.get(k) for k in ("d.0", "d.1", "d", "e", "f", "b", "n"))
    wanted = {"q": (P, Dh), "wk": (D, D), "bk": (D,), "wv": (D, D), "bv": (D,), "wo": (D, D), "bo": (D,),
              "wg": (E, D), "w1": (E, D, F), "b1": (E, F), "w2": (E, F, D), "b2": (E, D), "w3": (E, D, F),
              "mask": (B, N)}
    squeezed = lambda sizes: [s for s in sizes if s != 1]
    fitted = dict(params)
    for name, ref in params.items():
        want, got = wanted.get(name), None if ref is None else ref_shape(ref)
        if want is None or got is None or not all(isinstance(s, int) for s in (*want, *got)) or got == want:
            continue
        plain = not isinstance(ref, StackRef) and ref.perm is None and ref.select is None
        if not plain or squeezed(got) != squeezed(want):
            raise _Miss(out, f"{out.name}: the block's {name} would reach the region as {list(got)}, where it takes "
                             f"{list(want)} (the matcher read it through views it cannot rebuild)")
        fitted[name] = with_step(ref, ("reshape", want))
    return fitted


# The router's own values: y's rows, the logits x·Wgᵀ and their softmax π, in any layout or dtype.
_ROUTER_KINDS = ("x", "logits", "probs")


def _router_chain(walk, y):
    """A function giving, for a region node read outside (a load-balancing loss on π, a z-loss on
    the logits), the region nodes that compute it from y alone through the router's own values
    (_ROUTER_KINDS), or None where it is not one: those the rewrite keeps, reading y rebuilt from
    the op (one [R,D]·[D,E] product more, where the user reads them)."""
    def chain(node):
        found, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n is y or n in found:
                continue
            val = walk.vals.get(n)
            if val is None or val.kind not in _ROUTER_KINDS or n.op != "call_function" and n.op != "call_method":
                return None
            found.add(n)
            stack.extend(i for i in n.all_input_nodes if i is y or i in walk.inside)
        return found if node in found and node is not y else None
    return chain


_OP_AXES = ("b", "h", "d")  # the op's output [B,H,D]
HORIZON_FIRST = ("h", "b", "d")  # a ctx (and y) [H,B,D]


def out_layout(roles, sizes):
    """How the op's output [B,H,D] becomes a region output whose axes are `roles`, each a merge of
    b, h and d ("h*b": horizon-major rows) or a size-1 axis: (the permutation of the op's axes,
    the op axes each output axis merges in order (0: a new size-1 axis), the size-1 op axes the
    output leaves out, moved last by the permutation). None where the roles are not b, h and d,
    each once (those left out of size 1). The rows' order matters: [H·B, D] rows read out of
    [B·H, D] would be other rows' results."""
    if roles is None:
        return None
    groups = [() if r == ONE else tuple(r.split("*")) for r in roles]
    present = [a for g in groups for a in g]
    missing = [a for a in _OP_AXES if a not in present]
    if sorted(present + missing) != sorted(_OP_AXES) or not all(known_eq(sizes.get(a), 1) for a in missing):
        return None
    perm = tuple(_OP_AXES.index(a) for a in present + missing)
    return perm, tuple(len(g) for g in groups), len(missing)


def drop_dead_math(graph):
    """Erase the calls whose results nothing reads and that only compute (a kind canon knows, not
    written in place): a statistic computed and left unused read as a use outside the region
    ("w is used outside the region (by s)") and kept the block from matching. Dynamo leaves such
    nodes in its graphs. Anything else unused stays (a write in place, a random draw, a call the
    matcher does not know, attention that may draw dropout, a nonzero that defines a size, an op
    that checks its indices: _KEPT_DEAD): the calls that compute only are the kinds canon reads
    and the names in _COMPUTES_ONLY. Run on the copy the rewrite works on: the captured graph is
    not changed."""
    _drop_count_checks(graph)
    for node in reversed(list(graph.nodes)):
        if node.users or node.op not in ("call_function", "call_method") or is_inplace(node):
            continue
        op = canon(node)
        if (op.kind not in _KEPT_DEAD if op is not None else call_name(node) in _COMPUTES_ONLY) and \
                not (op is not None and op.kind == "getitem" and _indexes_by_tensor(op.args[1])):
            graph.erase_node(node)


def read_accumulators_by_view(graph):
    """An expert accumulator the graph fills in place (out.index_add_(0, rows, ...), Mixtral's and
    Qwen2-MoE's spelling) and then reads as it is, by other than a layout op (out + shared_expert(x):
    a review's; read through out.reshape(...) it matched) is read through out.view_as(out), placed
    after its last write: the same tensor, and the matcher reads the region's output there, after
    the writes, as in the reshaped spelling. Run on the copy the rewrite works on."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        writes = sorted(_mutators(node), key=order.__getitem__)
        if not writes or not all(call_name(w) in ("index_add_", "scatter_add_") for w in writes):
            continue
        readers = [u for u in node.users if u not in writes and order[u] > order[writes[-1]]]
        if not any(getattr(canon(u), "kind", None) not in _LAYOUT for u in readers if not _is_size_query(u)):
            continue
        with graph.inserting_after(writes[-1]):
            view = graph.call_method("view_as", (node, node))
        view.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "val")})
        for user in readers:
            user.replace_input_with(node, view)


# Kinds canon reads that are kept unused: attention (it may draw dropout), nonzero (it defines a
# size), and the ops that check their indices and raise in eager where one is out of range
_KEPT_DEAD = ("sdpa", "mha", "nonzero", "one_hot", "gather", "index_select", "scatter", "scatter_add", "index_add",
              "bincount", "histc", "searchsorted", "grouped_mm", "floordiv")  # (// raises on an integer 0)


def _drop_count_checks(graph):
    """A nonzero read only by Dynamo's asserts on the range of its count (u0 >= 0 and u0 <= the
    input's numel, which capture_dynamic_output_shape_ops adds, and which cannot fail) is unused:
    it goes with them. transformers' MoE computes such an `expert_hit` for its loop; looped over
    range(E) instead, it is left unread."""
    for node in list(graph.nodes):
        op = canon(node) if node.op == "call_function" or node.op == "call_method" else None
        checks = _count_checks(node) if op is not None and op.kind == "nonzero" else None
        if checks is not None:
            for check in checks + [node]:
                graph.erase_node(check)


def _count_checks(node):
    """The asserts, comparisons and sizes (in that order) of node's count, where they are all its
    users and can never fail; else None."""
    src = shape(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
    numel = None if src is None or not all(isinstance(n, int) for n in src) else math.prod(src)
    asserts, compares, sizes = [], [], list(node.users)
    for size in sizes:
        if size.target is not torch.ops.aten.sym_size.int or size.args[1] != 0:
            return None
        for compare in size.users:
            bound = compare.args[1] if compare.args[0] is size and isinstance(compare.args[1], int) else None
            holds = bound is not None and (compare.target is operator.ge and bound <= 0 or
                                           compare.target is operator.le and numel is not None and bound >= numel)
            if not holds or any(a.target is not torch.ops.aten._assert_scalar.default for a in compare.users):
                return None
            compares.append(compare)
            asserts.extend(compare.users)
    return asserts + compares + sizes


def _indexes_by_tensor(index):
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.fx.Node) for i in items)


# Calls that draw random numbers (torch's functions and methods, and aten's names for them)
_RANDOM = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "native_dropout",
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli", "bernoulli_",
    "multinomial", "normal", "normal_", "uniform_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
    "poisson", "gumbel_softmax", "rrelu", "rrelu_",
})


def _draws_random(node):
    drawn = node.op in ("call_method", "call_function") and call_name(node) in _RANDOM
    return drawn and getattr(canon(node), "kind", None) != "cast"  # dropout in eval mode draws nothing


def _merge_operands(y, y_op):
    """(ctx, inv, broadcast operand) of y = ctx + inv broadcast over the horizon axis."""
    y_shape = shape(y)
    a, b = y_op.args[:2]
    if not all(hasattr(t, "op") for t in (a, b)):
        constant = a if not hasattr(a, "op") else b
        raise _Miss(y, f"{y.name}: the MoE's input adds the constant {constant!r}, where the merge adds ctx and the "
                       f"pooled vector inv[:, None] (two tensors)")
    if y_shape is None or len(y_shape) != 3:
        raise _Miss(y, f"{y.name}: the merge must add two tensors into [B,H,D], got shape {y_shape}")
    for ctx, bcast in ((a, b), (b, a)):
        inv = _deepest_vector(bcast)
        if shape(ctx) is not None and len(shape(ctx)) == 3 and inv is not None:
            return ctx, inv, bcast
    raise _Miss(y, f"{y.name}: neither operand of the merge is a [B,D] vector broadcast over horizons")


def _deepest_vector(node):
    """The earliest [B,D] tensor on the layout chain that broadcasts it (inv before unsqueeze,
    or out[:, 0] of an attention over one query position)."""
    found = None
    while True:
        s = shape(node)
        if s is not None and len(s) == 2:
            found = node
        op = canon(node)
        if op is None or op.kind not in _LAYOUT or not isinstance(op.args[0], type(node)):
            return found
        node = op.args[0]


def _token_inputs(node):
    """The [B,N,D] tensor a projection reads: linear's input, x of x @ W (W a parameter, up to
    layout ops: attn @ V is not a projection, and stopping at attn would cut the search short
    of K), or nn.MultiheadAttention's key."""
    op = canon(node)
    if op is None or op.kind not in ("linear", "matmul", "mha"):
        return ()
    if op.kind == "matmul":
        weight = _strip(op.args[1]) if hasattr(op.args[1], "op") else None
        if weight is None or weight.op not in ("placeholder", "get_attr"):
            return ()
    src = _strip(op.args[1]) if op.kind == "mha" else op.args[0]
    return (src,) if hasattr(src, "op") and shape(src) is not None and len(shape(src)) == 3 else ()


def _pool_ancestors(inv, order):
    """inv's ancestors up to the [B,N,D] tensors that feed a projection (the token candidates)."""
    seen, stack = set(), [inv]
    stop = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in stop:
            continue
        # a [B, 1, D] input is searched past too: the one latent's pooled row, projected before its
        # [:, 0] (timm's, Perceiver's order; a review's), hid the tokens behind it. It stays a candidate
        stop.update(t for t in _token_inputs(n) if not is_one(shape(t)[1]))
        stack.extend(n.all_input_nodes)
    return seen


def _from_body(node):
    """The name of the higher-order op (tag_activation_checkpoint, say) whose output `node` is one
    of (getitem of its result), else None."""
    op = canon(node)
    if op is None or op.kind != "getitem" or not isinstance(op.args[0], torch.fx.Node):
        return None
    target = op.args[0].target
    return getattr(target, "__name__", str(target)) if isinstance(target, torch._ops.HigherOrderOperator) else None


TOKENS, SEQ_FIRST = ("b", "n", "d"), ("n", "b", "d")  # the token tensor's axes: [B,N,D], or [N,B,D]


def _read_pool(nodes, inv):
    """Read the pool backwards from inv: try each token tensor that feeds a projection."""
    ancestors = _pool_ancestors(inv, nodes.order)
    inner = _in_order(nodes, ancestors)
    candidates = []
    for n in inner:
        op = canon(n)
        if op is not None and op.kind in ("linear", "matmul", "mha"):
            src = _strip(op.args[1]) if op.kind == "mha" else op.args[0]
            if hasattr(src, "op") and shape(src) is not None and len(shape(src)) == 3 and src not in candidates:
                candidates.append(src)
    reason = (inv, f"{inv.name}: no [B,N,D] token tensor feeds a projection of the pool")
    if _strip(inv).op == "placeholder" and not candidates:
        reason = (inv, f"{inv.name}: the pooled vector added over horizons is an input of this graph, so its pool "
                       f"ran elsewhere: {_elsewhere(nodes, 'between the pool and the MoE')}")
    elif _from_body(_strip(inv)) and not candidates:
        reason = (inv, f"{inv.name}: the pooled vector added over horizons comes out of {_from_body(_strip(inv))}, "
                       f"{BODY_HINT}")
    below = {t: _descendants(t, values_only=True) for t in candidates}
    for tok in candidates:
        # A one-head pool (P = 1) views [B,N,D] as [B,N,1,D], which reads the same as an
        # unsqueeze: try the usual reading first, then the one-head one. Then the tokens
        # sequence-first, [N,B,D] (nn.MultiheadAttention's default, batch_first=False; a review's:
        # refused, with a softmax over "the batch axis" blamed in the einsum pool): the op takes
        # them transposed. The reason kept is the batch-first reading's.
        for roles, trivial in ((TOKENS, None), (TOKENS, "d"), (SEQ_FIRST, None), (SEQ_FIRST, "d")):
            walk = Walk(pool_rule, {tok: Val("tok", roles)}, inner, below[tok], trivial_split=trivial)
            val = walk.vals.get(inv)
            if val is not None and val.kind == "inv" and val.roles == ("b", "d"):
                return tok, walk, roles == SEQ_FIRST
            if (roles, trivial) == (TOKENS, None) and not any(tok in below[t] for t in candidates if t is not tok):
                # a candidate made from another (tok + 0.5 fed to the value projection by a pre-hook) is
                # no token tensor: its walk blamed the einsum where the other projection is unread
                reason = walk.first_reason(inv, inner)
    raise _Miss(*reason) if isinstance(reason, tuple) else _Miss(inv, reason)


def _check_merge(nodes, y, ctx, inv, bcast, pool_walk):
    """inv [B,D] must be added along the horizon axis: bcast's roles are (b, 1, d), or (1, b, d)
    with ctx horizon-first, [H,B,D] (nn.Transformer's default layout; a review's: refused before).
    Returns whether ctx is horizon-first. The layout of the broadcast decides, not the sizes: with
    B = H either reading of ctx's axes computes what the user's add does."""
    between = _in_order(nodes, _ancestors(bcast, nodes.order, stop={inv}) & _descendants(inv))
    walk = Walk(lambda w, n, op: layout_rule(w, n, op) if op.kind in _LAYOUT else None,
                {inv: Val("inv", ("b", "d"))}, between, _descendants(inv))
    walk.axes = pool_walk.axes
    val = walk.vals.get(bcast)
    ctx_shape, inv_shape = shape(ctx), shape(inv)
    fits = lambda batch: known_eq(ctx_shape[batch], inv_shape[0]) and known_eq(ctx_shape[2], inv_shape[1])
    # With B = 1 an axis of size 1 may take either role (inv[None] reads as (b, 1, d)): it is a
    # broadcast one, and ctx's sizes decide between the layouts that both read
    roles = None if val is None else tuple(ONE if is_one(n) else r for r, n in zip(val.roles, shape(bcast)))
    reads = lambda axes: roles is not None and broadcast(axes, roles) == axes
    horizon_first = reads(HORIZON_FIRST) and fits(1) and not (reads(_OP_AXES) and fits(0))
    if not all(known_eq(c, s) for c, s in zip(ctx_shape, shape(y))):  # (a review's: ctx[:, :1] + inv[:, None]
        # .expand(B, H, D) became a region over one horizon)
        raise _Miss(y, f"{y.name}: the merge broadcasts ctx {list(ctx_shape)} to {list(shape(y))}; the region "
                       f"takes ctx with every horizon of its output [B,H,D]")
    if not fits(1 if horizon_first else 0):
        raise _Miss(y, f"{y.name}: ctx {list(ctx_shape)} and inv {list(inv_shape)} do not share batch and width "
                       f"(ctx [B, H, D] with inv[:, None], or [H, B, D] with inv[None])")
    if not horizon_first and not reads(_OP_AXES):
        got = "an unreadable layout" if val is None else f"axes {val.roles}"
        raise _Miss(bcast, f"{y.name}: inv is broadcast with {got}; the merge adds inv[b] to every horizon "
                           f"of ctx[b], ctx being [B, H, D] (inv.unsqueeze(1)) or [H, B, D] (inv[None])")
    return horizon_first


def _read_moe(nodes, anchor, y, router, roles):
    inside = _descendants(y)
    walk = Walk(moe_rule, {y: Val("x", roles)}, _in_order(nodes, inside), inside, router=router)
    outs = [n for n in _in_order(nodes, walk.vals) if walk.vals[n].kind == "moe_out"
            and walk.vals[n].info["gate"]["topk"] is anchor]
    if not outs:
        node, reason = _moe_failure(walk, nodes, anchor)
        raise _Miss(node, reason)
    finals = [n for n in outs if any(u not in outs for u in n.users)]
    again = [u for u in finals[-1].users if getattr(walk.vals.get(u), "kind", None) == "added_again"]
    if again:  # an expert summed once more: the output would be replaced, and the extra term read x outside
        raise _Miss(again[0], walk.vals[again[0]].info["reason"])
    return finals[-1], walk


def _moe_failure(walk, nodes, anchor):
    refused = _refused_activation(walk, nodes)
    # A rule's reason, unless it comes after a refused activation, which caused it (an expert's
    # output, given no meaning, was "added to something other than zeros")
    for n in _in_order(nodes, walk.reasons):
        if refused is None or nodes.order[n] < nodes.order[refused[0]]:
            return n, walk.reasons[n]
    valued = _in_order(nodes, walk.vals)
    out_node = next((n for n in reversed(nodes) if n.op == "output"), None)
    leaving = [n for n in valued if out_node in n.users and walk.vals[n].kind in _ROUTING]
    if leaving:
        cut = "" if nodes.piece == DDP_PIECE else " (a graph break splits the region, e.g. at torch.where/nonzero)"
        return leaving[0], (f"{leaving[0].name}: the MoE after top-k {anchor.name} leaves this graph unfinished"
                            f"{cut}; {_split_hint(nodes)}")
    top = walk.vals.get(anchor)
    normalised = any(v.kind == "topw" and v.info.get("topk") is anchor for v in walk.vals.values())
    if top is not None and top.info.get("on_logits") and not normalised:  # a softmax of the k chosen reads as topw
        # (a review's: "not normalised by a softmax" was said of π gathered by the logits' indices too)
        return anchor, (f"{anchor.name}: top-k is taken on the router logits, whose weights the matcher reads only as "
                        f"a softmax over the k chosen logits (Mixtral's, equal to the renormalised top-k of the "
                        f"softmax); here they come otherwise (π gathered by the logits' indices, a slice of the "
                        f"top-k): take the top-k of the softmax itself, probs.topk(k), which is read")
    if refused is not None:
        return refused
    partial = [n for n in valued if walk.vals[n].kind == "contrib"]
    if partial:
        covered, experts = sorted(walk.vals[partial[-1]].info["covered"]), walk.axes.sizes.get("e")
        if covered == list(range(experts if isinstance(experts, int) else 0)):
            return partial[-1], (f"{partial[-1].name}: the expert outputs summed cover every expert once, but the "
                                 f"experts are not one function act(x W1[e] + b1[e]) W2[e] + b2[e] (an activation, "
                                 f"a bias or a width differs between them)")
        return partial[-1], (f"{partial[-1].name}: the expert outputs summed cover experts {covered} of "
                             f"{experts}; every expert must be added exactly once")
    generic = (f"{anchor.name}: the experts after this router could not be read as act(x W1 + b1) W2 + b2 "
               "weighted by the top-k gates")
    for n in _in_order(nodes, walk.inside):  # the first step off an expert's values
        read = [walk.vals[i].kind for i in n.all_input_nodes if walk.vals.get(i) is not None]
        if n not in walk.vals and n.op in ("call_function", "call_method") and any(k in _EXPERT_KINDS for k in read):
            what = next(_EXPERT_KINDS[k] for k in read if k in _EXPERT_KINDS)
            unread = _unread_operand(walk, nodes, n)
            if unread is not None:
                return unread, f"{generic}: {n.name} ({call_name(n)}) on {what} takes {_unread_text(walk, unread)}"
            return n, (f"{generic}: {n.name} ({call_name(n)}) on {what} is not part of that math (the activations "
                       f"read are gelu (erf or tanh), silu and swiglu, each as torch writes it or written out)")
    return anchor, generic


def _refused_activation(walk, nodes):
    """(node, reason) where an expert's activation written out in elementwise ops of u is none of
    the four (activation.py): the ops' last node, read by a step that takes an activation (the W2
    product, SwiGLU's gate) and is refused for it alone; else None. Before this the reason said
    only that the experts could not be read. Not where the step reads the ops through a layout op
    (sigmoid(u).t()), adds them to an activation read (silu(u) + 1e-30 exp(u): the add is named) or
    reads a value given no meaning (a - a folded to 0)."""
    for n in _in_order(nodes, walk.inside):
        if n in walk.vals or n.op not in ("call_function", "call_method"):
            continue
        read = [walk.vals.get(i) for i in n.all_input_nodes]
        ufn = next((i for i, v in zip(n.all_input_nodes, read) if v is not None and v.kind == "ufn"), None)
        if ufn is None or not _takes_activation(walk, n, read, walk.vals[ufn].info["of"]):
            continue
        of = walk.vals[ufn].info["of"]
        steps = [(a, walk.vals[a]) for a in _in_order(nodes, _ancestors(ufn, nodes.order, stop={of}))
                 if getattr(walk.vals.get(a), "kind", None) == "ufn" and walk.vals[a].info["of"] is of]
        gate = next((i for i, v in zip(n.all_input_nodes, read) if v is not None and v.kind == "u"), None)
        said = "" if gate is None else f" (and times {gate.name}, not SwiGLU's silu(x W1) ⊙ x W3)"
        return ufn, f"{ufn.name}: the experts' activation could not be read; {refusal(steps)}{said}"
    return None


def _takes_activation(walk, n, read, of):
    """Whether n, refused, reads a value of written-out ops on u (node `of`) where an activation goes:
    not a layout op, nor an elementwise one on the same u alone (activation.written_out declined it
    for itself: a - a), nor one with an activation read (silu(u) + 1e-30 exp(u)), nor one with an
    operand given no meaning."""
    op = canon(n)
    if op is None or op.kind in _LAYOUT or any(v is not None and v.kind == "h" for v in read):
        return False
    if any(v is None and i in walk.inside for i, v in zip(n.all_input_nodes, read)):
        return False
    return op.kind not in ELEMENTWISE or any(v is not None and v.kind == "u" and i is not of
                                             for i, v in zip(n.all_input_nodes, read))  # SwiGLU's gate


def _unread_operand(walk, nodes, n):
    """Where n, a step on an expert's value, fails for its other operand rather than for itself: the
    first node, on that operand's side, that the walk gave no meaning (a detach or a gradient hook
    on the gates: a review's, whose reason blamed the activation), or the operand itself where it is
    a tensor from outside the region that the walk reads as no expert's slice (W2 of another
    spelling than W1's, a stack unbound). None where every operand was read."""
    for i in n.all_input_nodes:
        val = walk.vals.get(i) if i in walk.inside else walk.val(i)  # outside: read on demand, as the walk did
        if val is not None and val.kind in _EXPERT_KINDS:
            continue
        if i in walk.inside and val is None:
            ancestors = [a for a in _ancestors(i, nodes.order) if a in walk.inside and a not in walk.vals]
            return min(ancestors + [i], key=nodes.order.get)
        if val is not None and val.kind == "ext" and call_name(n) in ("matmul", "mm", "bmm", "einsum", "linear"):
            return i
    return None


def _unread_text(walk, node):
    """What _unread_operand found, for a reason."""
    if node not in walk.inside:  # a weight from outside
        return (f"{node.name} ({call_name(node)}), which could not be read as this expert's weight: W[e] of one "
                f"stacked parameter (or its transpose), or one nn.Linear per expert, spelled alike for W1 and W2")
    return f"what {node.name} ({call_name(node)}) gives, and {node.name} is not part of the block's math"


# The experts' values, as a reason names them (_moe_failure)
_EXPERT_KINDS = {"u": "the expert's pre-activation x W1 + b1", "ublocks": "the expert's pre-activation x W1 + b1",
                 "h": "the expert's hidden activation", "f": "the expert's output"}


def _region_nodes(nodes, inputs, out, exportable=None, keepable=None, why_not=None):
    """(nodes the op replaces, exports, kept, moved): the nodes on a path from ctx or tok to out,
    plus parameter views only they use; exports names the `exportable` nodes also read outside;
    kept are the nodes `keepable` gives for a region node read outside, which stay, moved after
    the op (the router's chain: _router_chain), and leave the region; moved, what read them
    before the region's end (_deferred), moved after the op too.

    Any other intermediate used outside the region (other than for its size) makes it a
    near-miss (why_not: {node: why it cannot be exported}, said there), and so does an export or a
    kept node read before the region ends (its rebuilt value comes later).
    """
    ancestors = _ancestors(out, nodes.order, stop=set(inputs))
    reach = set()
    for i in inputs:
        reach |= _descendants(i)
    # What feeds ctx or tok (an earlier block, say) is not ours. Only nodes before the later of
    # the two can feed one of them, and the backward search above stopped at both.
    last = max(nodes.order[i] for i in inputs)
    maybe = [n for n in ancestors & reach if nodes.order[n] < last and n not in inputs]
    upstream = set()
    if maybe:
        for i in inputs:
            upstream |= _ancestors(i, nodes.order)
    upstream |= set(inputs)
    region = (ancestors & reach) - upstream
    if out not in reach:
        raise _Miss(out, f"{out.name}: the MoE's output is summed into a tensor made from none of the block's inputs "
                         f"(torch.zeros(R, D) filled in place, say): the rewrite replaces values the block computes; "
                         f"start the sum from torch.zeros_like(x)")
    changed = True
    while changed:
        changed = False
        for n in ancestors - region - upstream:
            if n.op in ("call_function", "call_method") and n.users and all(u in region for u in n.users):
                region.add(n)
                changed = True
    region |= _size_checks(region)
    region |= _written_in_place(nodes, region, out)
    _check_no_write_meanwhile(nodes, region, out)
    exportable = {node: name for name, node in (exportable or {}).items()}
    exports, kept, early = {}, set(), []
    for n in _in_order(nodes, region):
        if n is out:
            continue
        for user in n.users:
            if user in region or _is_size_query(user):
                continue
            chain = None if n in exportable or keepable is None else keepable(n)
            if n not in exportable and chain is None:
                because = f": {why_not[n]}" if why_not and n in why_not else ""
                raise _Miss(n, f"{n.name} is used outside the region (by {user.name}); replacing the region would "
                               f"drop it{because}")
            if n in exportable:
                exports[exportable[n]] = n
            else:
                kept |= chain
            if nodes.order[user] < nodes.order[out]:
                early.append(user)
    return _in_order(nodes, region - kept), exports, kept, _deferred(nodes, region, out, early)


def _deferred(nodes, region, out, early):
    """What reads an export or a kept router node before the region's end (a load-balancing loss
    computed where the router is, say), with what depends on it there: moved after the op, whose
    outputs it then reads. Not where the region itself depends on one of them, nor past an
    in-place op (its order against the region's reads would change)."""
    moved = set()
    for root in early:
        later = _descendants(root)
        for n in later:
            if nodes.order.get(n, -1) >= nodes.order[out]:
                continue
            if n in region:
                raise _Miss(root, f"{root.name} reads the region's router and the region reads it back (by "
                                  f"{n.name}); the region cannot be replaced by one op")
            if is_inplace(n) and not _write_moves_safely(nodes, n, root, later, region, out):
                raise _Miss(root, f"{root.name} reads a value of the region (its router's, or one it exports) before "
                                  f"the region ends, and {n.name} writes in place after it: moving them after the op "
                                  f"would reorder that write")
            moved.add(n)
    if moved:  # a write in place between them and the op could change what they read
        start = min(nodes.order[n] for n in moved)
        for n in nodes[start:nodes.order[out]]:
            if n not in region and n not in moved and is_inplace(n):
                raise _Miss(n, f"{n.name} writes in place between where the region's router is read "
                               f"({_in_order(nodes, moved)[0].name}) and the region's end; moving the reader after "
                               f"the op would reorder them")
    # a draw of random numbers moved past another would swap what each draws (dropout in an aux loss)
    drawing = [n for n in _in_order(nodes, moved) if _draws_random(n)]
    for n in nodes[nodes.order[drawing[0]]:nodes.order[out]] if drawing else ():
        if n not in region and n not in moved and _draws_random(n):
            raise _Miss(n, f"{n.name} draws random numbers after {drawing[0].name}, which reads the region's router "
                           f"and draws too, and before the region's end: moving that reader after the op would "
                           f"swap their draws (other numbers than eager's for one seed)")
    return moved


def _write_moves_safely(nodes, n, root, later, region, out):
    """Whether n, a write in place that moves after the op with root (a reader of the region's
    value; later: what follows from root, which moves with it), writes a tensor nothing else reads
    before the region's end: no region node, and no node from root to the region's end that stays
    where it is, reads any tensor sharing its storage.
    Reviews': the ReLU(inplace=True) of a head on inv (the head's own tensor), and an expert-load
    counter buffer (`self.load += one_hot(index).sum(0)` under no_grad), were refused as a
    reordered write. A view of the region's value (inv, y, the router's) is a region node: refused."""
    target = written(n)
    if target is None:
        return False
    shared = set(storage_aliases(target))
    stays = [m for m in nodes[nodes.order[root]:nodes.order[out] + 1] if m not in later]
    return not any(m in shared or shared.intersection(m.all_input_nodes) for m in [*region, *stays])


def _written_in_place(nodes, region, out):
    """Tensors made outside the region that a region node writes in place (gates =
    torch.zeros(R, E); gates.scatter_(...); ctx += inv[:, None]), with every alias of them (a
    write into a view is a write into its base): part of the region, since their value after the
    write is the region's. A reader of one outside the region after the write would read the write
    the op no longer does: a near-miss. Readers before it read what they always did, and the
    tensors stay outside the region for them."""
    found = set()
    for n in region:
        target = written(n)
        if target is None or n is out:
            continue
        aliases = storage_aliases(target)
        given = [a for a in aliases if a.op not in ("call_function", "call_method")]
        if given:
            what = "the graph input" if given[0].op == "placeholder" else "the module's tensor"
            raise _Miss(n, f"{n.name} writes in place into {what} {given[0].name} (ctx += …, say); the op would not "
                           f"write it: write the block out of place (y = ctx + inv[:, None])")
        readers = [u for a in aliases if a is not out for u in a.users  # out's readers read the op's output
                   if u not in region and u not in aliases and not _is_size_query(u)]
        after = [u for u in readers if nodes.order[u] > nodes.order[n]]
        if after:
            raise _Miss(n, f"{n.name} writes in place into {target.name}, which {after[0].name} reads outside the "
                           f"region afterwards; replacing the region would drop the write")
        if not readers:
            found |= aliases
    return found


def _check_no_write_meanwhile(nodes, region, out):
    """The op reads all its inputs where the region ends (it is inserted before out), where the
    region's nodes read them each at its own place: a write in place from outside the region, in
    between, into a tensor a region node read before it would reach the op but not the node it
    replaces (ctx.mul_(2) after the pool read ctx, a parameter changed under no_grad mid-block)."""
    order = nodes.order
    start = min(order[n] for n in region)
    for w in nodes[start:order[out]]:
        target = None if w in region else written(w)
        if target is None:
            continue
        aliases = storage_aliases(target)
        readers = [n for n in region if order[n] < order[w] and any(i in aliases for i in n.all_input_nodes)]
        if readers:
            first = min(readers, key=order.__getitem__)
            raise _Miss(w, f"{w.name} writes in place into {target.name} after the region reads it ({first.name}) "
                           f"and before the region ends ({out.name}); the op would read it at the end, as written: "
                           f"move the write before or after the block")


_ENTER_INFERENCE = getattr(torch.autograd.grad_mode, "_enter_inference_mode", object())
_EXIT_INFERENCE = getattr(torch.autograd.grad_mode, "_exit_inference_mode", object())
# What Dynamo records in a graph for `with torch.no_grad()` / `enable_grad()` / `inference_mode()`
GRAD_MODE_CALLS = (torch._C._set_grad_enabled, _ENTER_INFERENCE, _EXIT_INFERENCE)
_ENTER_AUTOCAST = getattr(torch.amp.autocast_mode, "_enter_autocast", object())
_EXIT_AUTOCAST = getattr(torch.amp.autocast_mode, "_exit_autocast", object())


def _states(nodes, start, step):
    """at(node): the state in force where node runs: `start` (the caller's: Dynamo compiles in
    it), changed by each call_function for which step(call, state) returns a new state (None: a
    call that changes nothing)."""
    positions, states, state = [], [], start
    for n in nodes:
        if n.op == "call_function" and (new := step(n, state)) is not None:
            state = new
            positions.append(nodes.order[n])
            states.append(state)

    def at(node):
        i = bisect.bisect_left(positions, nodes.order[node])
        return states[i - 1] if i else start
    return at


def _grad_step(n, state):
    """Dynamo records `with torch.no_grad():` as torch._C._set_grad_enabled calls, and `with
    torch.inference_mode():` as a pair of _enter/_exit_inference_mode calls. state: (grad
    enabled, the modes the inference contexts entered left)."""
    mode, outer = state
    if n.target is torch._C._set_grad_enabled:
        return bool(n.args[0]), outer
    if n.target is _ENTER_INFERENCE:
        return mode and not n.args[0], outer + (mode,)
    if n.target is _EXIT_INFERENCE and outer:
        return outer[-1], outer[:-1]
    return None


def _grad_modes(nodes):
    """mode(node): whether grad is enabled where node runs; mode.inference(node): whether an
    inference_mode context is entered there."""
    at = _states(nodes, (torch.is_grad_enabled(), ()), _grad_step)

    def mode(node):
        return at(node)[0]
    mode.inference = lambda node: bool(at(node)[1])
    return mode


def _autocast_step(n, stack):
    """The _enter_autocast calls in force (_exit_autocast ends one)."""
    if n.target is _ENTER_AUTOCAST:
        return stack + (n,)
    if n.target is _EXIT_AUTOCAST and n.args and n.args[0] in stack:
        return tuple(enter for enter in stack if enter is not n.args[0])
    return None


def _autocast_states(nodes):
    """state(node): {device type: (dtype, enabled, cache)} of the autocast contexts Dynamo recorded
    around node, the innermost for each device type."""
    at = _states(nodes, (), _autocast_step)
    return lambda node: {enter.args[0]: tuple(enter.args[1:4]) for enter in at(node)}


def _autocast_change(was, there):
    """The contexts to enter where `there` is in force so that `was` is: for each device type whose
    state differs, `was`'s, or the caller's (Dynamo compiles in it) where `was` had none."""
    change = []
    for device in sorted(set(was) | set(there)):
        if was.get(device) != there.get(device):
            dtype, enabled, cache = was.get(device) or (
                torch.get_autocast_dtype(device), torch.is_autocast_enabled(device), torch.is_autocast_cache_enabled())
            change.append((device, dtype, enabled, cache))
    return change


def _check_promoted_ctx(y, ctx, out, autocast):
    """A ctx coarser than y = ctx + inv (a bf16 ctx in a float32 model): eager's MoE runs on the
    promoted y, the op computed it in ctx's dtype (1.4e-3 off, a review's). Under an autocast to
    ctx's dtype at the merge and at the MoE's output, a float32 model runs the MoE's products in
    that dtype too: not refused there. Autocast leaves float64 alone, and a MoE under
    autocast(enabled=False) runs in y's dtype (1.5e-3 and 1.7e-3 off, a review's). An integer or
    bool ctx is never the block's: the op returned out in its dtype (truncated, with no gradient)."""
    if float_dtype(ctx) is None:
        raise _Miss(y, f"{y.name}: ctx is {dtype(ctx)}; the region takes a floating-point ctx (cast it to the "
                       f"model's dtype before the block)")
    if dtype(y) == dtype(ctx):
        return
    device = ctx.meta["example_value"].device.type
    for n in (y, out):
        cast, enabled, _ = autocast(n).get(device, None) or (None, torch.is_autocast_enabled(device), None)
        if not (enabled and dtype(y) == torch.float32 and (cast or torch.get_autocast_dtype(device)) == dtype(ctx)):
            raise _Miss(y, f"{y.name}: ctx is {dtype(ctx)} and the merge promotes it to {dtype(y)}; the op computes "
                           f"the MoE in ctx's dtype, where the model computes it in {dtype(y)} (cast ctx to {dtype(y)} "
                           f"before the block)")


def _check_no_coarser_rounding(nodes, region, ctx, tok, y, autocast):
    """A region node that rounds to floats coarser than the region's activations (y's dtype in the
    MoE, which runs on y's rows: a bf16 tok let a float32 model's bf16 experts through, 3.9e-3 off, a
    review's; the coarser of ctx's and tok's in the pool): a user's `x.bfloat16()` around the
    experts of a float32 model, a float64 model's `softmax(..., dtype=torch.float32)`. The op
    computes in the activations' dtype and would not round there: a float32 model whose experts
    ran in bf16 came out 5e-3 from eager (found by a read-through). A near-miss; the block then
    runs as written. Not a rounding: a node whose inputs are as coarse (weights stored in bf16 and
    read as they are), rounding back to the activations' dtype (a bf16 model's router softmax in
    fp32, then .to(bf16)), and autocast's own to its dtype (entered with a dtype or without,
    around the call or inside it)."""
    def eps(node):
        kind = float_dtype(node)
        return None if kind is None else torch.finfo(kind).eps

    coarser, moe = max((ctx, tok), key=lambda n: eps(n) or 0.0), _descendants(y)
    for n in sorted(region, key=nodes.order.__getitem__):
        own = y if n in moe else coarser
        rounded = eps(n)
        finer_input = rounded is not None and any((eps(a) or rounded) < rounded for a in n.all_input_nodes)
        if eps(own) is None or not finer_input or rounded <= eps(own):
            continue
        device = own.meta["example_value"].device.type
        # the autocast Dynamo recorded around n (its dtype None: the device's default), else the
        # caller's (Dynamo compiles in it)
        cast, enabled, _ = autocast(n).get(device, None) or (None, torch.is_autocast_enabled(device), None)
        if not (enabled and dtype(n) == (cast or torch.get_autocast_dtype(device))):
            raise _Miss(n, f"{n.name} rounds to {dtype(n)}, coarser than the region's {dtype(own)} activations: "
                           f"the op computes in their dtype and would not round there, so the model would compute "
                           f"otherwise (cast the block's inputs, or use torch.autocast)")


def _check_one_grad_mode(nodes, modes, covered, out, at_out):
    """A region whose nodes run under different grad modes (the pool or the router under no_grad:
    a frozen part, whose parameters take no gradient) would become one op run in the mode where
    out is (at_out), giving gradients the user's graph does not: a near-miss. A node with no
    floating output (the one_hot of the top-k indices, under no_grad in transformers' MoE) takes
    no gradient in either mode; not under inference_mode, whose tensors eager refuses to save for
    the backward (an error the op would not raise)."""
    for n in sorted(covered, key=nodes.order.__getitem__):
        if modes(n) != at_out and not (_integers_only(n) and not modes.inference(n)):
            grad = {True: "enabled", False: "disabled"}
            raise _Miss(n, f"{n.name} runs with grad {grad[modes(n)]} where the region's output {out.name} runs "
                           f"with it {grad[at_out]} (torch.no_grad() or inference_mode() around part of the block): "
                           f"one op cannot give gradients to one part of it and not to the other")


def _integers_only(node):
    """Whether every output of node is a tensor of a non-floating dtype (indices, masks, counts)."""
    value = node.meta.get("example_value")
    values = value if isinstance(value, (tuple, list)) else (value,)
    return all(isinstance(v, torch.Tensor) and not v.is_floating_point() and not v.is_complex() for v in values)


def _copied(nodes, ctx, tok, region, out):
    """The inputs ("ctx", "tok") the op must copy to keep for its backward (Match.copied): those
    the graph writes in place after the region (h += block(h, tok) in the graph), and ctx where
    the caller holds it and may write it after the call (h += block(h, tok) outside the graph):
    eager's ops keep none of ctx. tok is kept by eager's projections too (autograd refuses a later
    write there as here), so only the graph's own write calls for its copy."""
    copied = []
    for name, node in (("ctx", ctx), ("tok", tok)):
        aliases = storage_aliases(node)
        if _written_after(nodes, aliases, region, out) or (name == "ctx" and _callers(nodes, aliases)):
            copied.append(name)
    return tuple(copied)


def _callers(nodes, aliases):
    """Whether a tensor (its aliases) is also the caller's: a graph input or module attribute, or
    something the graph returns."""
    returned = next(n for n in reversed(nodes) if n.op == "output").all_input_nodes
    return any(a.op in ("placeholder", "get_attr") or a in returned for a in aliases)


# Writes in place whose rules give the written tensor its new meaning (walk.vals[target]): its
# later readers read that
_TRACKED_WRITES = ("scatter", "index_add", "scatter_add", "setitem")


def _check_write_read_after(nodes, n, y, data):
    """A region node n that writes a tensor in place which a later node reads as that tensor (not
    through n's result): the walks read the tensor as it was before the write, so `u.add_(b1[e]);
    F.silu(u)` lost its bias and `u.mul_(2); F.silu(u)` its factor (found by a review). Only the
    rules of _TRACKED_WRITES follow the write."""
    target = written(n)
    op = canon(n)
    if target is None or n is y or n not in data or (op is not None and op.kind in _TRACKED_WRITES):
        return
    after = _descendants(n)
    readers = [u for a in storage_aliases(target) if a is not n and a not in after for u in a.users
               if u is not n and nodes.order[u] > nodes.order[n]]
    if readers:
        raise _Miss(n, f"{n.name} writes {target.name} in place, and {readers[0].name} reads {target.name} after the "
                       f"write, where the matcher reads it as it was before: write it out of place "
                       f"({target.name} = {target.name} + ..., not {target.name} += ... nor {call_name(n)})")


def _written_after(nodes, aliases, region, out):
    """Whether the graph writes a tensor (any of its aliases) in place after the region ends (an
    in-place residual, h += block(h, tok))."""
    return any(nodes.order[u] > nodes.order[out] and u not in region and written(u) in aliases
               for a in aliases for u in a.users)


# Of those, the calls that only compute from their arguments: no random draw, no dropout
_COMPUTES_ONLY = FRESH - {"rand", "randn", "scaled_dot_product_attention"}


def _is_size_query(node):
    return (node.op == "call_method" and node.target in SIZE_QUERIES) or (
        node.op == "call_function" and "sym_size" in str(node.target))


def _size_checks(region):
    """Runtime checks Dynamo adds on the data-dependent sizes of region nodes (torch.where's
    output: sym_size, comparisons, _assert_scalar): they go with the region when nothing else
    reads them."""
    found = set()
    for n in region:
        for user in n.users:
            if user in region or not (_is_size_query(user) or (
                    user.target is operator.getitem and user.users and all(_is_size_query(u) for u in user.users))):
                continue
            closure = _descendants(user)
            if all(c is user or isinstance(c.meta.get("example_value"), (torch.SymInt, torch.SymBool, int, bool)) or
                   "_assert" in str(c.target) for c in closure if c.op != "output") and \
                    not any(c.op == "output" for c in closure):
                found |= closure
    return found
