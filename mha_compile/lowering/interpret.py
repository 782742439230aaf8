"""A small abstract interpreter over FX graphs: each node gets a meaning, not a spelling.

A `Val` says what a node computes (its `kind`, e.g. "proj" for an affine map of the tokens)
and what each of its axes is (`roles`, e.g. ("b", "n", "d")). Rules read canonical ops
(canonicalize.py), check the axes they combine and produce the next Val. A node whose rule
declines gets no Val; a rule that recognises an op but finds it wrong records a reason, which
is what a near-miss report shows.

Axis roles are names; reshapes split and merge them by sizes: "d" split into (P, Dh) gives
("d.0", "d.1"), and merging ("d.0", "d.1") gives "d" back, while ("d.1", "d.0") does not.
"b*h" is the merge of "b" and "h" and splits back into them.
"""
import dataclasses

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mha_compile.lowering.aliases import may_copy, written_in_place
from mha_compile.lowering.canonicalize import (Op, call_name, canon, canon_kind, dtype, float_dtype, known_number,
                                               known_numbers, shape)

ONE = "1"  # the role of a size-1 axis
SIZE_QUERIES = ("size", "dim", "numel", "stride")  # calls that read a tensor's shape, not its values
OUTSIDE_KINDS = ("ext", "zero")  # Vals a node outside the region may have
# Vals whose values are whole numbers (indices, masks, counts, offsets): a cast of one to an
# integer dtype is exact, where of any other it rounds
INTEGER_KINDS = ("zero", "topi", "eqmask", "onehot", "emask", "where", "selidx", "order", "sorted", "pexpert", "prow",
                 "offs", "ones", "ecount")


@dataclasses.dataclass
class Val:
    kind: str
    roles: tuple | None = None
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ParamRef:
    """A tensor from outside the region used as a parameter: node, then `steps`, then [select],
    then permuted by perm.

    `steps` are small graph-side views or computations on parameters that the rewrite emits
    before the region op (never a copy of a large tensor): ("index", items) with items made of
    ints, ":" (a full slice) and ("range", start, stop); ("reshape", shape); ("not",) for a
    mask of the opposite sense; ("linear", weight ParamRef, bias ParamRef or None) for a learned
    query that goes through a query projection (nn.MultiheadAttention: q = Wq·query + bq).
    """
    node: object
    perm: tuple | None = None  # permutation of the stored tensor's axes (with select: expert axis 0 first,
    # the rest applied to the expert's slice), None for identity
    select: int | None = None  # index taken on axis 0 first (a per-expert slice)
    steps: tuple = ()


@dataclasses.dataclass(frozen=True)
class StackRef:
    """Per-expert parameters in separate tensors (an nn.ModuleList of nn.Linear experts),
    stacked over a new expert axis 0 in expert order by the rewrite."""
    refs: tuple


def with_step(ref, *steps):
    return None if ref is None else dataclasses.replace(ref, steps=ref.steps + tuple(steps))


def ref_shape(ref):
    """The shape of what `ref` hands the op (rewrite._param builds it), or None where a size is
    not known."""
    if isinstance(ref, StackRef):
        parts = {ref_shape(r) for r in ref.refs}
        return None if len(parts) != 1 or None in parts else (len(ref.refs), *parts.pop())
    sizes = shape(ref.node)
    if sizes is None:
        return None
    sizes = list(sizes)
    for step in ref.steps:
        if step[0] == "index":
            items = list(step[1]) + [":"] * (len(sizes) - len(step[1]))
            if len(items) != len(sizes) or any(isinstance(i, tuple) and not isinstance(i[2], int) for i in items):
                return None
            sizes = [s if i == ":" else i[2] - i[1] for i, s in zip(items, sizes) if not isinstance(i, int)]
        elif step[0] == "reshape":
            sizes = list(step[1])
        elif step[0] == "linear":
            weight = ref_shape(step[1])
            if weight is None:
                return None
            sizes = sizes[:-1] + [weight[0]]
        elif step[0] not in ("isneginf", "not"):
            return None
    perm = ref.perm
    if ref.select is not None:
        sizes = sizes[1:]
        perm = None if perm is None else tuple(p - 1 for p in perm[1:])
    return tuple(sizes if perm is None else [sizes[p] for p in perm])


def ext_val(node, ref, lay):
    """An external tensor: `ref` reads it as a parameter (None if it cannot be), `lay` are its axes'
    roles from its base (fresh names; ONE for size-1 and broadcast axes), `node` the node itself."""
    return Val("ext", None, {"ref": ref, "lay": lay, "node": node})


def base_layout(node):
    shp = shape(node)
    return None if shp is None else tuple(ONE if is_one(s) else f"@{node.name}.{i}" for i, s in enumerate(shp))


class Reject(Exception):
    """Raised by a rule that recognised an op but found it is not the block's: the reason."""


def graph_scalar(node):
    """Whether node is a scalar that is a value of the graph (a SymInt or SymFloat, a 0-d tensor),
    where the block needs a constant (the scores' scale, top-k's k)."""
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    if known_number(node) is not None:  # a SymInt or SymFloat of a known value: a constant (canonicalize)
        return False
    return isinstance(value, (torch.SymInt, torch.SymFloat)) or isinstance(value, torch.Tensor) and value.dim() == 0


def graph_value_reason(node, what, arg):
    """A near-miss's reason for `what` of node given as `arg`, a value of the graph (graph_scalar)."""
    return (f"{node.name}: {what} is {arg.name}, a value of the graph, not a constant: the op fixes it when the "
            f"graph is compiled. Dynamo makes a number such a value under dynamic=True, or once it has seen it take "
            f"two (automatic dynamic shapes: a number passed to the forward; a float attribute too, under "
            f"torch._dynamo.config.specialize_float = False, the default): compile with dynamic=False, or keep it "
            f"a constant (a module's int attribute, self.k; 1 / math.sqrt(Dh) of a fixed Dh)")


def known_eq(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def known_lt(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    try:
        return bool(statically_known_true(a < b))
    except Exception:
        return False


def is_one(size):
    return isinstance(size, int) and size == 1


class Axes:
    """Sizes of the roles seen so far; splits and merges are checked against them."""

    def __init__(self, trivial_split=None):
        self.sizes = {}
        self.trivial_split = trivial_split

    def bind(self, role, size):
        if role == ONE or role is None:
            return True
        if role in self.sizes:
            return known_eq(self.sizes[role], size)
        self.sizes[role] = size
        return True

    def bind_all(self, roles, shp):
        return roles is not None and shp is not None and len(roles) == len(shp) and all(
            self.bind(r, s) for r, s in zip(roles, shp))

    def merge(self, roles):
        if len(roles) == 1:
            return roles[0]
        bases = {r.rsplit(".", 1)[0] for r in roles if "." in r}
        if len(bases) == 1 and list(roles) == [f"{next(iter(bases))}.{i}" for i in range(len(roles))]:
            return next(iter(bases))
        return "*".join(roles)

    def split(self, role, sizes):
        """A merged role "a*b*c" splits back along its parts, grouped in order by the sizes
        ([A·B, C] gives ("a*b", "c")); any other split gives fresh roles (role.0, role.1, ...)."""
        groups = self._group(role.split("*"), sizes)
        if groups is not None:
            return tuple(self.merge(g) for g in groups)
        parts = tuple(f"{role}.{i}" for i in range(len(sizes)))
        return parts if all(self.bind(p, s) for p, s in zip(parts, sizes)) else None

    def _group(self, parts, sizes):
        """Consecutive runs of `parts` whose known sizes multiply to each of `sizes`, or None."""
        groups, i = [], 0
        for size in sizes:
            group, product = [], 1
            while i < len(parts) and (not group or known_lt(product, size)):
                if self.sizes.get(parts[i]) is None:
                    return None
                group.append(parts[i])
                product, i = product * self.sizes[parts[i]], i + 1
            if not group or not known_eq(product, size):
                return None
            groups.append(group)
        return groups if i == len(parts) and len(parts) > 1 else None

    def reshape(self, in_shape, in_roles, out_shape):
        """Roles after a row-major reshape, or None when the axes cannot be followed.

        Axes of size > 1 are grouped by equal products (1 -> n splits, n -> 1 merges). A size-1
        axis with a real role (a single token) keeps it where the output has a size-1 axis in the
        same place. With `trivial_split` set to a role X (the one-head hypothesis of the pool,
        P = 1), a size-1 axis just before X reads as the split (X.0, X.1) and the reverse merge
        gives X back: for one head that split is exact, so the labels stay true to the values.
        """
        src = [(s, r, a) for a, (s, r) in enumerate(zip(in_shape, in_roles)) if not is_one(s)]
        dst = [i for i, s in enumerate(out_shape) if not is_one(s)]
        out = [ONE if is_one(s) else None for s in out_shape]
        groups = []  # (input axes, output axes)
        i = j = 0
        while i < len(src) or j < len(dst):
            if i >= len(src) or j >= len(dst):
                return None
            group_in, group_out = [src[i]], [dst[j]]
            p_in, p_out = src[i][0], out_shape[dst[j]]
            i, j = i + 1, j + 1
            while not known_eq(p_in, p_out):
                if known_lt(p_in, p_out) and i < len(src):
                    group_in.append(src[i])
                    p_in, i = p_in * src[i][0], i + 1
                elif known_lt(p_out, p_in) and j < len(dst):
                    group_out.append(dst[j])
                    p_out, j = p_out * out_shape[dst[j]], j + 1
                else:
                    return None
            roles = [r for _, r, _ in group_in]
            if None in roles:
                return None
            if len(group_out) == 1:
                out[group_out[0]] = self._merge_with_trivial(roles, [a for _, _, a in group_in], in_shape, in_roles)
            elif len(roles) == 1:
                parts = self.split(roles[0], [out_shape[k] for k in group_out])
                if parts is None:
                    return None
                for k, r in zip(group_out, parts):
                    out[k] = r
            else:  # several into several: [B·P, Dh] -> [B, P·Dh] regroups "b*d.0", "d.1" as "b", "d"
                regrouped = self._group("*".join(roles).split("*"), [out_shape[k] for k in group_out])
                if regrouped is None:
                    return None
                for k, parts in zip(group_out, regrouped):
                    out[k] = self.merge(parts)
            groups.append(([a for _, _, a in group_in], group_out))
        self._carry_size_one(in_shape, in_roles, out, groups)
        return tuple(out)

    def _merge_with_trivial(self, roles, axes, in_shape, in_roles):
        """X.1 merged with a size-1 X.0 before it gives X back; size-1 axes without a role between
        them (the query's length 1 in SDPA's [B, P, 1, Dh]) do not change the row-major order."""
        x = self.trivial_split
        if x and roles == [f"{x}.1"]:
            i = axes[0] - 1
            while i >= 0 and is_one(in_shape[i]) and in_roles[i] == ONE:
                i -= 1
            if i >= 0 and is_one(in_shape[i]) and in_roles[i] == f"{x}.0":
                return x
        return self.merge(roles)

    def _carry_size_one(self, in_shape, in_roles, out, groups):
        """Size-1 input axes with real roles keep them in the matching output gap (see reshape)."""
        def gap(before):  # output positions between group `before - 1` and group `before`
            lo = groups[before - 1][1][-1] + 1 if before > 0 else 0
            hi = groups[before][1][0] if before < len(groups) else len(out)
            return range(lo, hi)

        taken = set()
        for a, (size, role) in enumerate(zip(in_shape, in_roles)):
            if not is_one(size) or role in (ONE, None):
                continue
            before = sum(1 for ins, _ in groups if ins[-1] < a)
            slot = next((k for k in gap(before) if out[k] == ONE and k not in taken), None)
            if slot is not None:
                out[slot] = role
                taken.add(slot)
        x = self.trivial_split
        if x:
            for ins, outs in groups:
                k = outs[0]
                if len(ins) == len(outs) == 1 and out[k] == x and k > 0 and out[k - 1] == ONE and k - 1 not in taken \
                        and self.bind(f"{x}.0", 1) and self.bind(f"{x}.1", self.sizes.get(x)):
                    out[k - 1], out[k] = f"{x}.0", f"{x}.1"


def broadcast(a, b):
    """Roles of a broadcasting elementwise op (right-aligned), or None on a clash."""
    if a is None or b is None:
        return None
    n = max(len(a), len(b))
    a, b = (ONE,) * (n - len(a)) + tuple(a), (ONE,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x == y or y == ONE:
            out.append(x)
        elif x == ONE:
            out.append(y)
        else:
            return None
    return tuple(out)


def einsum_roles(equation, operand_roles):
    """(output roles, role of each letter, contracted letters) of an einsum, or None."""
    equation = equation.replace(" ", "")
    if "." in equation or "->" not in equation:
        return None
    inputs, output = equation.split("->")
    terms = inputs.split(",")
    if len(terms) != len(operand_roles) or any(len(set(t)) != len(t) for t in terms + [output]):
        return None  # a letter twice in one term takes a diagonal ("rkdd": x · diag(W1[e]), a review's)
    letters = {}
    for term, roles in zip(terms, operand_roles):
        if roles is None:
            continue
        if len(term) != len(roles):
            return None
        for letter, role in zip(term, roles):
            if role is None:  # an axis the caller reads itself (a gathered weight's own axes)
                continue
            if letters.get(letter, role) != role and ONE not in (role, letters[letter]):
                return None
            if letters.get(letter) in (None, ONE):
                letters[letter] = role
    named = [r for r in letters.values() if r not in (None, ONE)]
    if len(named) != len(set(named)):
        return None  # two letters on one axis: "re,rxd->rd" sums each apart, (Σ_e g)·(Σ_x f) (a review's)
    contracted = set("".join(terms)) - set(output)
    return tuple(letters.get(l) for l in output), letters, contracted, terms


_FROM_NOTHING = ("zeros", "new_zeros", "zeros_like")


def _reads_through(node):
    """Whether canon reads `node` through an input of its own (a sum of a product, canonicalize's
    sum_of_product: its meaning comes from the product's operands, not from the product)."""
    return canon_kind(node) == "sum" and any(canon_kind(i) == "mul" for i in node.all_input_nodes)


class Walk:
    """Evaluates `rule` over `nodes` in graph order, starting from `start` {node: Val}."""

    def __init__(self, rule, start, nodes, inside, trivial_split=None, **context):
        self.rule, self.vals, self.reasons, self.axes = rule, dict(start), {}, Axes(trivial_split)
        self.inside = inside  # nodes that depend on a start: everything else is external
        self.lazy = {}  # Vals of external call nodes, computed when a region node reads them
        self.memo = {}  # what a rule works out once a walk (moe_pairs' index values, read at x[i] and index_add_)
        self.__dict__.update(context)  # what a rule may need to know (the router node, say)
        for node, val in start.items():
            self.axes.bind_all(val.roles, shape(node))
        for node in nodes:
            if node in self.vals:
                continue
            if node in inside and node.op != "placeholder" and not any(i in self.vals for i in node.all_input_nodes) \
                    and getattr(node.target, "__name__", node.target) not in _FROM_NOTHING \
                    and not _reads_through(node):
                continue  # nothing it reads has a meaning: it cannot get one (keeps a long graph linear)
            op = canon(node)
            if op is None:
                continue
            try:
                val = rule(self, node, op)
            except Reject as reason:
                self.reasons[node] = str(reason)
                continue
            if val is not None and (node in inside or val.kind in OUTSIDE_KINDS and not self._remade(node, val)):
                if val.roles is not None and shape(node) is not None and not self.axes.bind_all(val.roles, shape(node)):
                    sizes = [self.axes.sizes.get(r, "?") for r in val.roles]
                    self.reasons[node] = (f"{node.name} has shape {list(shape(node))}, where the block's axes it would "
                                          f"be, {val.roles}, have sizes {sizes}")
                    continue
                self.vals[node] = val

    def _remade(self, node, val):
        """Whether an external tensor read by how it was made ("ext": a query expanded over the batch
        and cloned, read as its row 0; query / √Dh read as the query and a factor) may be a copy that
        the graph writes in place, or whose source it writes (q[0] *= 3 after the clone, or after a
        repeat or contiguous(): reviews', 0.085 and 0.144 off). It is then read as the tensor it is.
        A view (w1[e], with w1 written) reads what its base holds, as the op does: not refused."""
        key = ("written", node)
        if key not in self.memo:
            sources = [r.node for r in (val.info.get("ref"), val.info.get("prescaled", (None,))[0]) if r is not None] \
                if val.kind == "ext" else []
            self.memo[key] = val.kind == "ext" and may_copy(node) and (
                written_in_place(node) or any(written_in_place(s) for s in sources))
        return self.memo[key]

    def val(self, arg):
        """The Val of an argument: computed, external (a parameter-like tensor), or a constant."""
        arg = known_numbers(arg)
        if isinstance(arg, torch.fx.Node):
            if arg in self.vals:
                return self.vals[arg]
            if arg not in self.inside and arg.op in ("call_function", "call_method"):
                if arg not in self.lazy:  # a view of parameters outside the region: read on demand
                    self.lazy[arg] = None
                    op = canon(arg)
                    try:
                        val = None if op is None else self.rule(self, arg, op)
                    except Reject:
                        val = None
                    kept = val is not None and val.kind in OUTSIDE_KINDS and not self._remade(arg, val)
                    self.lazy[arg] = val if kept else None
                if self.lazy[arg] is not None:
                    return self.lazy[arg]
            if arg not in self.inside:
                lay = base_layout(arg)
                if lay is not None:
                    self.axes.bind_all(lay, shape(arg))
                return ext_val(arg, ParamRef(arg), lay)
            return None
        if isinstance(arg, (int, float, bool)) or arg is None:
            return Val("const", None, {"value": arg})
        return None

    def first_reason(self, target, nodes):
        """Why `target` got no Val: the earliest recorded reason among its ancestors."""
        ancestors = set()
        stack = [target]
        while stack:
            node = stack.pop()
            if node in ancestors or node not in self.inside and node is not target:
                continue
            ancestors.add(node)
            stack.extend(node.all_input_nodes)
        for node in nodes:
            if node in ancestors and node in self.reasons:
                return node, self.reasons[node]
        for node in nodes:
            written = [i for i in node.all_input_nodes if self.memo.get(("written", i))]
            if node in ancestors and node not in self.vals and written:
                return node, (f"{node.name} reads {written[0].name}, which the graph writes in place after making it "
                              f"(or writes what it was copied from); "
                              f"the matcher then reads it as the tensor it is, not by how it was made (a query "
                              f"expanded over the batch, a float mask of 0 and -inf), and as that it is not the "
                              f"block's")
        for node in nodes:
            if node in ancestors and node not in self.vals and "dropout" in call_name(node) and any(
                    i in self.vals for i in node.all_input_nodes):
                return node, (f"{node.name} ({call_name(node)}) is not read: dropout in training mode draws "
                              f"random numbers, which the block does not (F.dropout, nn.Dropout or torch.dropout in "
                              f"eval mode, or with p = 0, is read as its input)")
        for node in nodes:
            if node in ancestors and node not in self.vals and any(i in self.vals for i in node.all_input_nodes):
                what = f"{node.name} ({node.op} {getattr(node.target, '__name__', node.target)})"
                if canon(node) is not None:
                    return node, f"{what} is not part of the block's math as far as the matcher can read it"
                if node.op in ("call_function", "call_method") and call_name(node) not in SIZE_QUERIES + ("sym_size",):
                    # a gradient hook on K or the attention weights, say (a review's: the einsum after it was named)
                    return node, (f"{what} is a call the matcher does not read, between the block's values (a "
                                  f"gradient hook, a call of its own): the block's math has none")
        return target, f"{target.name} could not be read as the block"


def layout_rule(walk, node, op):
    """Reshape, permute, expand and cast keep a Val's meaning and move its roles.

    On an external tensor (a parameter) a permute or select is remembered in its ParamRef, a
    cast or a size-1 reshape is transparent; anything else leaves the parameter unread.
    """
    src = walk.val(op.args[0]) if op.args else None
    if src is None:
        return None
    if op.kind == "cast" and src.kind not in INTEGER_KINDS + ("ext",) and _to_integers(op.args[0], node):
        return None  # u.to(torch.int64) changes its values: no layout op (found by a review)
    if op.kind == "cast" and src.kind in INTEGER_KINDS and src.kind != "zero" and not _keeps_integers(op.args[0], node):
        return None  # topi.to(torch.bool) makes every expert but 0 one (found by a review)
    if src.kind == "zero":  # expanded, its rows share memory: no sum may be written into it in place (moe_rule)
        return Val("zero", None, {"shared": True} if op.kind == "expand" or src.info.get("shared") else {})
    in_shape, out_shape = shape(op.args[0]), shape(node)
    if src.kind == "ext":
        return _ext_layout(walk, node, op, src, in_shape, out_shape)
    if src.roles is None or in_shape is None or out_shape is None:
        return Val(src.kind, None, src.info) if op.kind == "cast" else None
    roles = move_roles(walk, op, src.roles, in_shape, out_shape)
    return None if roles is None else Val(src.kind, roles, src.info)


def _keeps_integers(src, node):
    """Whether node's cast keeps the values of integers (indices, counts) or a mask: to int32,
    int64, float32 or float64 (a bool mask to any dtype); not to bool, int8, uint8 or a 16-bit float."""
    before, after = dtype(src), dtype(node)
    return before is not None and after is not None and (
        before == torch.bool or after in (torch.int32, torch.int64, torch.float32, torch.float64))


def _to_integers(src, node):
    """Whether node casts a floating-point src to an integer or bool dtype."""
    after = dtype(node)
    return float_dtype(src) is not None and after is not None and not after.is_floating_point


def move_roles(walk, op, roles, in_shape, out_shape):
    """Roles after a layout op (reshape, permute, expand, cast), or None."""
    if roles is None or in_shape is None or out_shape is None:
        return None
    if op.kind == "cast":
        return roles
    if op.kind == "reshape":
        return walk.axes.reshape(in_shape, roles, out_shape)
    if op.kind == "permute":
        return tuple(roles[i] for i in op.args[1])
    pad = len(out_shape) - len(in_shape)  # expand: new or size-1 axes broadcast
    full = (ONE,) * pad + tuple(roles)
    return tuple(ONE if (i < pad or is_one(in_shape[i - pad])) else full[i] for i in range(len(out_shape)))


def _ext_layout(walk, node, op, src, in_shape, out_shape):
    """A layout op on an external tensor: its roles move (a learned query expanded over the
    batch keeps its own axes and gains broadcast ones); as a parameter, a permute is remembered
    in the ParamRef, a cast or a size-1 reshape is transparent, anything else unreads it."""
    ref = src.info["ref"]
    taken = _squeezed_slice(walk, op, in_shape, out_shape)
    if taken is not None:  # W.narrow(d, e, 1).squeeze(d) is W.select(d, e), read as that select is
        return select_rule(walk, node, taken)  # None: a tensor of its own, as W.select(1, e) is
    lay = move_roles(walk, op, src.info.get("lay"), in_shape, out_shape)
    new_ref = None
    if op.kind == "cast" and not (float_dtype(op.args[0]) and float_dtype(node)):
        # to or from an integer or bool dtype: the values change (w.to(int64).to(float) truncates, and
        # takes no gradient), so the cast is a tensor of its own, not the parameter (a review's: read
        # as the parameter, 1.64 off)
        return ext_val(node, ParamRef(node), lay)
    if ref is not None and op.kind == "cast":
        new_ref = ref
    elif ref is not None and op.kind == "permute" and in_shape is not None:
        perm = op.args[1]
        base = ref.perm or tuple(range(len(in_shape)))
        new_ref = dataclasses.replace(ref, perm=tuple(base[i] for i in perm))
    elif ref is not None and op.kind == "reshape" and in_shape is not None and out_shape is not None and \
            [s for s in in_shape if not is_one(s)] == [s for s in out_shape if not is_one(s)] and ref.perm is None:
        new_ref = ref
    elif ref is not None and op.kind == "reshape" and ref.perm is None and ref.select is None and not ref.steps:
        # a parameter stored in another shape (W1 kept [E, D·F] and viewed [E, D, F], a query kept
        # [D]): the view itself is the parameter the op takes, as a parametrization's result is;
        # autograd carries its gradient back. Unread, the block was refused (a review's).
        own = base_layout(node)
        if lay is not None and any(r == ONE and not is_one(s) for r, s in zip(lay, out_shape)):
            own = lay  # broadcast axes kept (a latent expanded over the batch, projected, then viewed in heads)
        if own is not None and walk.axes.bind_all(own, shape(node)):
            return ext_val(node, ParamRef(node), own)
    if new_ref is None and lay is None:
        return None
    return ext_val(node, new_ref, lay)


BATCH_HEADS = "b*d.0"  # batch and heads merged batch-major: attention over (B·P) batches


def query_ref(val, wanted, one_head=False, heads=None):
    """A batch-invariant tensor read as [P,Dh]: `wanted` names each axis's role at its use
    ("d.0" head, "d.1" head dim, None for an axis it must not vary along). Axes wanted None must
    be broadcast or size 1 (lay role ONE), so taking index 0 there is exact; the result is a
    view of the parameter. None when the tensor does not fit. one_head (P = 1): the head axis
    has size 1 too, so it is a size-1 axis of the query's (lay ONE), kept whole. BATCH_HEADS
    (the query expanded over the batch, then merged with its head axis batch-major, as for a
    (B·P)-batched bmm): its lay must be a broadcast merged with one real axis, and the first
    `heads` entries (batch 0) are the P heads."""
    lay = val.info.get("lay") if val is not None and val.kind == "ext" else None
    heads_wanted = ["d.0" if w == BATCH_HEADS else w for w in wanted]
    if lay is None or len(lay) != len(wanted) or sorted(w for w in heads_wanted if w) != ["d.0", "d.1"]:
        return None
    for w, r in zip(wanted, lay):
        if w == BATCH_HEADS:
            if not (isinstance(heads, int) and r.startswith(f"{ONE}*") and r.count("*") == 1):
                return None
        elif (w is None) != (r == ONE) and not (one_head and w == "d.0" and r == ONE):
            return None
    items = tuple(("range", 0, heads) if w == BATCH_HEADS else ":" if w else 0 for w in wanted)
    wanted = heads_wanted
    ref = ParamRef(val.info["node"])
    if items != (":", ":"):
        ref = with_step(ref, ("index", items))
    kept = [w for w in wanted if w]
    return ref if kept == ["d.0", "d.1"] else dataclasses.replace(ref, perm=(1, 0))


def select_rule(walk, node, op):
    """W[e] on a parameter: a per-expert slice, remembered in the ParamRef. An item of W.unbind(0),
    and row 0 of a one-row slice W[e:e+1] (W.narrow(0, e, 1)), are W[e] too (_slice_of); so is
    W.T[:, e], an index on the axis a permute put the stored axis 0 at (b1 read as b1.T[:, e])."""
    stack, index = _slice_of(walk, op.args[0], op.args[1]) or op.args[:2]
    src = walk.val(stack)
    if src is None or src.kind != "ext":
        return None
    ref = src.info["ref"]
    sizes = ref_shape(ref) if ref is not None and ref.select is None else None
    axis, index = _selected_axis(index, sizes)
    perm = ref.perm or tuple(range(len(sizes))) if axis is not None else None
    if axis is None or perm[axis] != 0:
        return None  # no shape: a tuple (an item of W.unbind(1) is a tensor of its own, as W[:, e] is)
    # a stack permuted behind its expert axis (w2.transpose(1, 2)[e]): the slice, then its own axes permuted
    rest = tuple(p - 1 for i, p in enumerate(perm) if i != axis)
    return ext_val(node, dataclasses.replace(ref, select=index, perm=None if rest == tuple(sorted(rest)) else rest),
                   None)


def _selected_axis(index, sizes):
    """(d, e) where index takes item e of axis d of a tensor of `sizes` (W[e], W[:, e]), e counted from
    the start; (None, None) for any other index, or where the sizes are not known."""
    items = index if isinstance(index, tuple) else (index,)
    axis = len(items) - 1
    if sizes is None or type(items[-1]) is not int or axis >= len(sizes) or not isinstance(sizes[axis], int) or \
            not all(i == slice(None) for i in items[:-1]) or not -sizes[axis] <= items[-1] < sizes[axis]:
        return None, None
    return axis, items[-1] % sizes[axis]


def _slice_of(walk, base, index):
    """(W, e) where base[index] is W[e] for an external W, spelled through one more node: base an
    unbind of W along axis 0 (w1s = W1.unbind(0); w1s[e], or zip(W1.unbind(0), ...) in a loop), or
    base a one-row slice W[e:e+1] of W's axis 0 and index 0 (W.narrow(0, e, 1)[0]). Else None. Read
    as tensors of their own, these slices were stacked again on every call, or refused where the
    slice kept W's 3 axes (an unbind's tuple, W[e:e+1].squeeze(0))."""
    op = _outside_op(walk, base)
    if op is None or type(index) is not int or not isinstance(op.args[0], torch.fx.Node):
        return None
    size = shape(op.args[0])
    if not size or not isinstance(size[0], int):
        return None
    if op.kind == "unbind" and type(op.args[1]) is int and op.args[1] % len(size) == 0 and \
            -size[0] <= index < size[0]:
        return op.args[0], index % size[0]
    wide = _one_wide(walk, base, op)
    return (wide[0], wide[2]) if wide is not None and wide[1] == 0 and index in (0, -1) else None


def _outside_op(walk, base):
    """canon(base) where base is a node outside the region; else None."""
    return canon(base) if isinstance(base, torch.fx.Node) and base not in walk.inside else None


def _one_wide(walk, base, op=None):
    """(W, d, e) where base, outside the region, is the one-wide slice W[:, ..., e:e+1] of W's axis d
    (W.narrow(d, e, 1)), W a node; else None. op: base's canon, where the caller has read it."""
    op = op or _outside_op(walk, base)
    if op is None or op.kind != "getitem" or not isinstance(op.args[0], torch.fx.Node):
        return None
    size = shape(op.args[0])
    items = op.args[1] if isinstance(op.args[1], tuple) else (op.args[1],)
    axis = next((d for d, i in enumerate(items) if i != slice(None)), None)
    if size is None or axis is None or axis >= len(size) or not isinstance(size[axis], int):
        return None
    rest, first = items[axis + 1:], items[axis]
    if not isinstance(first, slice) or first.step not in (None, 1) or \
            not all(type(b) is int or b is None for b in (first.start, first.stop)) or \
            not all(i == slice(None) or i is Ellipsis for i in rest):
        return None
    rows = range(size[axis])[first]  # Python's own reading of the slice: negative and open bounds
    return (op.args[0], axis, rows[0]) if len(rows) == 1 else None


def _squeezed_slice(walk, op, in_shape, out_shape):
    """W.select(d, e), as a getitem, where op squeezes axis d of the one-wide slice W.narrow(d, e, 1)
    (W[:, e:e+1].squeeze(1)); else None. Read as the slice it squeezes, it kept the size-1 axis and
    was no weight the block's math reads (a [D, 1, F] W1, a [D, 1, D] key weight)."""
    wide = _one_wide(walk, op.args[0]) if op.kind == "reshape" and in_shape and out_shape is not None else None
    kept = tuple(in_shape[:wide[1]]) + tuple(in_shape[wide[1] + 1:]) if wide is not None else ()
    if wide is None or len(out_shape) != len(kept) or not all(known_eq(a, b) for a, b in zip(out_shape, kept)):
        return None
    stack, axis, e = wide
    return Op("getitem", (stack, (slice(None),) * axis + (e,) if axis else e))


def row_as_select(walk, ref):
    """W[e] for a bias kept as the one-row slice W[e:e+1] (W.narrow(0, e, 1)) of a stack W: its size-1
    axis leads, so added to an expert's rows it broadcasts as W[e] does; the op takes the stack. None
    for any other ref (b1.T[:, e:e+1] is [F, 1]: along the rows)."""
    wide = _one_wide(walk, ref.node) if ref is not None and ref.select is None and ref.perm is None and \
        not ref.steps else None
    if wide is None or wide[1] != 0:
        return None
    return ext_ref(select_rule(walk, ref.node, Op("getitem", (wide[0], wide[2]))))


def ext_ref(val):
    return val.info["ref"] if val is not None and val.kind == "ext" else None


def canonical_perm(roles, canonical):
    """Permutation taking axes in `roles` order to `canonical` order, or None if identity."""
    if sorted(roles) != sorted(canonical):
        return False
    perm = tuple(roles.index(r) for r in canonical)
    return None if perm == tuple(range(len(perm))) else perm
