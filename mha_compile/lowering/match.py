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
import dataclasses

from mha_compile.lowering.canonicalize import canon, shape
from mha_compile.lowering.interpret import ONE, Axes, Val, Walk, broadcast, known_eq, layout_rule
from mha_compile.lowering.moe import moe_params, moe_rule
from mha_compile.lowering.pool import pool_params, pool_rule

PARAM_NAMES = ("q", "wk", "bk", "wv", "bv", "wo", "bo", "wg", "w1", "b1", "w2", "b2", "w3")
_LAYOUT = ("reshape", "permute", "expand", "cast")
_SIZE_QUERIES = ("size", "dim", "numel", "stride")


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

    def summary(self):
        return {"output": self.output.name, "ctx": self.ctx.name, "tok": self.tok.name,
                "nodes": [n.name for n in self.nodes], "config": dict(self.config),
                "params": {k: _describe(v) for k, v in self.params.items()},
                "kernels": self.kernels, "kernels_reason": self.kernels_reason,
                "shapes": {"ctx": _shape_str(self.ctx), "tok": _shape_str(self.tok), "out": _shape_str(self.output)},
                "dtype": str(_dtype(self.ctx))}


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
    text = ref.node.name
    if ref.select is not None:
        text += f"[{ref.select}]"
    if ref.perm is not None:
        text += f".permute{ref.perm}"
    return text


def _shape_str(node):
    s = shape(node)
    return None if s is None else [str(d) for d in s]


def _dtype(node):
    value = node.meta.get("example_value")
    return getattr(value, "dtype", None)


def _ancestors(node):
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _descendants(node):
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.users)
    return seen


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


def find_regions(gm):
    """All MHA regions of gm's graph: (matches, near_misses). The graph is not changed."""
    nodes = list(gm.graph.nodes)
    matches, misses = [], []
    for anchor in nodes:
        op = canon(anchor)
        if op is None or op.kind != "topk":
            continue
        try:
            matches.append(_match_at(nodes, anchor))
        except _Miss as miss:
            misses.append(NearMiss(anchor.name, getattr(miss.node, "name", str(miss.node)), miss.reason))
    return matches, misses


def _match_at(nodes, anchor):
    router = _strip(anchor.args[0], _LAYOUT + ("softmax",))
    op = canon(router)
    if op is None or op.kind not in ("linear", "matmul"):
        raise _Miss(anchor, f"{anchor.name}: top-k is not taken on a softmax of a router product x·Wgᵀ")
    x = op.args[0]
    y = _strip(x)
    y_op = canon(y)
    if y_op is None or y_op.kind != "add":
        raise _Miss(y, f"{anchor.name}: the MoE's input {y.name} is not a broadcast-add of a pooled vector "
                       f"over horizons (no merge ctx + inv[:, None] before the router)")
    ctx, inv, bcast = _merge_operands(y, y_op)
    tok, pool_walk = _read_pool(nodes, inv)
    _check_merge(nodes, y, ctx, inv, bcast, pool_walk)
    out, moe_walk = _read_moe(nodes, anchor, y)
    region = _region_nodes(nodes, (ctx, tok), out)
    params, config = moe_params(moe_walk.vals[out])
    params.update(pool_params(pool_walk.vals[inv]))
    return Match(anchor, out, ctx, tok, params, config, region)


def _merge_operands(y, y_op):
    """(ctx, inv, broadcast operand) of y = ctx + inv broadcast over the horizon axis."""
    y_shape = shape(y)
    a, b = y_op.args[:2]
    if y_shape is None or len(y_shape) != 3 or not all(hasattr(t, "op") for t in (a, b)):
        raise _Miss(y, f"{y.name}: the merge must add two tensors into [B,H,D], got shape {y_shape}")
    for ctx, bcast in ((a, b), (b, a)):
        inv = _strip(bcast)
        if shape(ctx) is not None and len(shape(ctx)) == 3 and shape(inv) is not None and len(shape(inv)) == 2:
            return ctx, inv, bcast
    raise _Miss(y, f"{y.name}: neither operand of the merge is a [B,D] vector broadcast over horizons")


def _read_pool(nodes, inv):
    """Read the pool backwards from inv: try each token tensor that feeds a projection."""
    ancestors = _ancestors(inv)
    inner = [n for n in nodes if n in ancestors]
    candidates = []
    for n in inner:
        op = canon(n)
        if op is not None and op.kind in ("linear", "matmul"):
            src = op.args[0]
            if hasattr(src, "op") and shape(src) is not None and len(shape(src)) == 3 and src not in candidates:
                candidates.append(src)
    reason = (inv, f"{inv.name}: no [B,N,D] token tensor feeds a projection of the pool")
    for tok in candidates:
        walk = Walk(pool_rule, {tok: Val("tok", ("b", "n", "d"))}, inner, _descendants(tok))
        val = walk.vals.get(inv)
        if val is not None and val.kind == "inv":
            return tok, walk
        reason = walk.first_reason(inv, inner)
    raise _Miss(*reason) if isinstance(reason, tuple) else _Miss(inv, reason)


def _check_merge(nodes, y, ctx, inv, bcast, pool_walk):
    """inv [B,D] must be added along the horizon axis: bcast's roles are (b, 1, d)."""
    between = [n for n in nodes if n in _ancestors(bcast) and n in _descendants(inv)]
    walk = Walk(lambda w, n, op: layout_rule(w, n, op) if op.kind in _LAYOUT else None,
                {inv: Val("inv", ("b", "d"))}, between, _descendants(inv))
    walk.axes = pool_walk.axes
    val = walk.vals.get(bcast)
    ctx_shape, inv_shape = shape(ctx), shape(inv)
    if not (known_eq(ctx_shape[0], inv_shape[0]) and known_eq(ctx_shape[2], inv_shape[1])):
        raise _Miss(y, f"{y.name}: ctx {list(ctx_shape)} and inv {list(inv_shape)} do not share batch and width")
    roles = None if val is None else broadcast(("b", "h", "d"), val.roles)
    if roles != ("b", "h", "d"):
        got = "an unreadable layout" if val is None else f"axes {val.roles}"
        raise _Miss(bcast, f"{y.name}: inv is broadcast with {got}; the merge adds inv[b] to every horizon "
                           f"of ctx[b] (inv.unsqueeze(1))")


def _read_moe(nodes, anchor, y):
    inside = _descendants(y)
    walk = Walk(moe_rule, {y: Val("x", ("b", "h", "d"))}, [n for n in nodes if n in inside or canon(n) is not None], inside)
    outs = [n for n in nodes if n in walk.vals and walk.vals[n].kind == "moe_out"
            and walk.vals[n].info["gate"]["topk"] is anchor]
    if not outs:
        node, reason = _moe_failure(walk, nodes, anchor)
        raise _Miss(node, reason)
    finals = [n for n in outs if any(u not in outs for u in n.users)]
    return finals[-1], walk


def _moe_failure(walk, nodes, anchor):
    for n in nodes:
        if n in walk.reasons:
            return n, walk.reasons[n]
    partial = [n for n in nodes if n in walk.vals and walk.vals[n].kind == "contrib"]
    if partial:
        covered = sorted(walk.vals[partial[-1]].info["covered"])
        return partial[-1], (f"{partial[-1].name}: the expert outputs summed cover experts {covered} of "
                             f"{walk.axes.sizes.get('e')}; every expert must be added exactly once")
    return anchor, f"{anchor.name}: the experts after this router could not be read as act(x W1 + b1) W2 + b2 weighted by the top-k gates"


def _region_nodes(nodes, inputs, out):
    """Nodes the op replaces: on a path from ctx or tok to out, plus parameter views only they use.

    An intermediate used outside the region (other than for its size) makes it a near-miss.
    """
    ancestors = _ancestors(out)
    reach, upstream = set(), set()
    for i in inputs:
        reach |= _descendants(i)
        upstream |= _ancestors(i)  # what feeds ctx or tok (an earlier block, say) is not ours
    region = (ancestors & reach) - upstream
    changed = True
    while changed:
        changed = False
        for n in ancestors - region - upstream:
            if n.op in ("call_function", "call_method") and n.users and all(u in region for u in n.users):
                region.add(n)
                changed = True
    for n in region:
        if n is out:
            continue
        for user in n.users:
            if user not in region and not (user.op == "call_method" and user.target in _SIZE_QUERIES):
                raise _Miss(n, f"{n.name} is used outside the region (by {user.name}); replacing the region would drop it")
    return [n for n in nodes if n in region]
