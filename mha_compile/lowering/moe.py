"""Reading the top-k MoE: x [rows..., D] -> out [rows..., D] (SPEC §1, step 3).

Router: x -> logits (rows,e) -> probs (softmax over e) -> topk over e -> topw / topi (rows,s),
optionally renormalised (topw / Σ_s topw, or a softmax over the k top logits, which is the same).
Gates, four ways:
  gate (rows,e)       dense: zeros scattered with topw at topi, or Σ_s one_hot(topi) · topw;
  gatecol (rows,1)    one expert's gate in a loop: Σ_s topw · (topi == e);
  gatesel (sel,1)     Mixtral: topw[rows, slots] at where(one_hot(topi)[e]) for expert e;
  topw (rows,s)       gathered weights: W1[topi] etc., the gate multiplies each slot; the
                      (row, slot) pairs may also be flattened (W1[topi.reshape(-1)] with
                      x expanded over the slots and torch.bmm): the merged role "b*h*s".
Experts: u = x W1 + b1 (rows,f) -> h = act(u) (swiglu: silu(u) ⊙ x W3; an act written out in
elementwise ops: activation.py) -> f = h W2 + b2 (rows,d),
for one expert (a slice W1[e] of stacked parameters, or an nn.Linear of its own: `expert` None),
for all at once (dense: an extra "e" axis) or per slot (gathered: an extra "s" axis).
Combine: gate_e · f_e summed (or index_add_-ed) over every expert exactly once, Σ_e gate · f,
or Σ_s topw · f. A contribution remembers each expert's parameters; when all are covered they
become stacked parameters: views of one stacked tensor where the user stacked them, else a
torch.stack of the separate tensors in the graph (see StackRef in interpret.py).
"""
import dataclasses
import operator

import torch

from mha_compile.kernels.reference import accumulation_dtype
from mha_compile.lowering.activation import KINDS as ELEMENTWISE, written_out
from mha_compile.lowering.canonicalize import Op, canon, dtype, float_dtype, shape, sum_of_product, written
from mha_compile.lowering.interpret import (ONE, ParamRef, Reject, StackRef, Val, broadcast, canonical_perm,
                                            einsum_roles, ext_ref, graph_scalar, graph_value_reason, is_one,
                                            known_eq, layout_rule, move_roles, row_as_select, select_rule)
from mha_compile.lowering.moe_grouped import grouped_rule
from mha_compile.lowering.moe_pairs import pair_rows
from mha_compile.lowering.moe_split import WIDE, split_later, split_rule

ACT_OF = {("gelu", "none"): "gelu", ("gelu", "tanh"): "gelu_tanh", ("silu", None): "silu"}
EXPERT_PARAMS = ("w1", "b1", "w3", "w2", "b2")


def _rows(roles):
    return roles[:-1]


def moe_rule(walk, node, op):
    """The Val of `op`; a product x·W whose columns are split later has its hidden axis WIDE
    (moe_split.py: the blocks are the experts' W1 and W3)."""
    if _into_shared_zeros(walk, node, op):
        return None
    val = split_rule(walk, node, op) or _read(walk, node, op)
    if val is not None and val.kind == "u" and val.roles and "f" in val.roles and split_later(node):
        return Val("u", tuple(WIDE if r == "f" else r for r in val.roles), val.info)
    return val


def _into_shared_zeros(walk, node, op):
    """Whether node writes in place into zeros whose rows share memory (zeros_like(x[:1]).expand(R, D),
    which the dense gates' out-of-place scatter may start from): eager raises there or sums into one
    row, the op would not (found by a review). Any write: x += y, index_add_, x[i] = v, out=."""
    target = written(node)
    val = walk.val(target) if target is not None else None
    return val is not None and val.kind == "zero" and val.info.get("shared", False)


def _read(walk, node, op):
    grouped = grouped_rule(walk, node, op, _gate_info, _expert_info)
    if grouped is not None:
        return grouped
    if op.kind in ("reshape", "permute", "expand", "cast"):
        index = _index_into_one(node, op)
        if index is not None:
            val = select_rule(walk, node, index) or _getitem(walk, node, index)
            if val is not None:
                return val
        src = walk.val(op.args[0]) if op.args else None
        if src is not None and src.kind == "ufn":  # values at points, which a layout op would reorder
            keeps = op.kind == "cast" and dtype(node) is not None and dtype(node) == dtype(op.args[0])
            return src if keeps else None  # sigmoid(u).contiguous(), .clone(), .to(its dtype): every value kept
        if src is not None and src.kind == "wsel":
            return _wsel_layout(walk, node, op, src)
        val = layout_rule(walk, node, op)
        return _slot_broadcast(walk, node, val) if op.kind == "expand" and val is not None else val
    if op.kind == "getitem":
        return select_rule(walk, node, op) or _getitem(walk, node, op)
    if op.kind == "stack":
        return _stack(walk, node, [walk.val(t) for t in op.args[0]], op.args[1])
    args = [walk.val(a) for a in op.args]
    if op.kind in ELEMENTWISE:
        written = written_out(node, op, args)
        if written is not None:
            return written
    if op.kind == "linear":
        x, w, b = args
        if ext_ref(w) is None or (b is not None and b.kind not in ("ext", "const")):
            return None
        return _weight_product(walk, node, x, ext_ref(w), linear=True, bias=ext_ref(b))
    if op.kind == "matmul" and args[1] is not None and args[1].kind == "wsel":
        return _gathered_matmul(args[0], args[1])
    if op.kind == "matmul" and args[0] is not None and args[0].kind == "wsel":
        return _gathered_matmul(args[1], args[0], column=True)
    if op.kind == "matmul" and ext_ref(args[1]) is not None:
        return _weight_product(walk, node, args[0], ext_ref(args[1]), linear=False, bias=None)
    if op.kind == "einsum" and len(args) == 3:
        return _einsum(walk, node, op.args[0], args[1:])
    if op.kind == "softmax":
        return _softmax(node, args[0], op.args[1])
    if op.kind == "topk":
        return _topk(node, *args)
    if op.kind == "sum":
        product = sum_of_product(op)  # (gate[..., None] * f).sum(-2): Σ_e gate · f, the einsum it is
        return _sum(walk, node, args[0], op.args[1], op.args[2]) or (
            None if product is None else _einsum(walk, node, product.args[0], [walk.val(a) for a in product.args[1:]]))
    if op.kind == "gather":
        return _gather(walk, op, *args)
    if op.kind == "div":
        return _renorm(*args)
    if op.kind == "clamp":
        return _sum_clamped(walk, node, args[0], *op.args[1:])
    if op.kind == "normalize":
        return _normalize(walk, node, args[0], *op.args[1:])
    if op.kind == "norm":
        return _l1_sum(walk, node, args[0], *op.args[1:])
    if op.kind == "eq":
        topi, e = args
        if topi is not None and topi.kind == "topi" and e is not None and e.kind == "const" and \
                isinstance(e.info["value"], int):
            return Val("eqmask", topi.roles, dict(topi.info, expert=e.info["value"]))
        return None
    if op.kind in ("zeros_like", "zeros"):
        src = args[0] if op.kind == "zeros_like" and args else None
        return Val("zero", src.roles if src is not None else None)
    if op.kind == "scatter":
        val = _scatter(walk, node, *args)
        if val is not None and op.kwargs.get("_inplace"):
            walk.vals[op.args[0]] = val  # zeros.scatter_(...): later readers of the zeros read the gate
        return val
    if op.kind == "one_hot":
        return _one_hot(walk, node, *args)
    if op.kind == "nonzero":
        return _where(walk, node, args[0], op.args[1])
    if op.kind == "index_add":
        return _index_add(walk, node, op, *args[:4]) or _pairs_added(walk, op, args[0], args[1], args[3])
    if op.kind == "setitem":
        return _set_rows(walk, node, op, *args)
    if op.kind in ("gelu", "silu"):
        return _activation(node, op, args[0])
    if op.kind == "mul":
        return _mul(walk, node, *args)
    if op.kind == "add":
        return _add(walk, node, *args)
    return None


def _where(walk, node, mask, as_tuple):
    """torch.where(one_hot(topi)[..., e]) or torch.where(topi == e): the (row, slot) pairs that chose
    expert e. The mask's axes must be the top-k's own rows and slots, so that a row comes at most
    once (top-k picks distinct experts): topi expanded over a new axis and merged into the slots
    repeats each row (found by a review). Or mask.nonzero(), the pairs as the columns of one [n, 2]
    tensor, read as nz[:, 0] and nz[:, 1] (expert-parallel code's spelling; a review's): its axes are
    kept in info, and no layout op reads it."""
    if mask is None or mask.kind not in ("emask", "eqmask") or as_tuple not in (True, False, None):
        return None
    topk = walk.vals.get(mask.info["topk"])
    if topk is None or len(mask.roles) != 2 or set(mask.roles) != set(topk.roles):
        return None
    if as_tuple is not True:
        return Val("where", None, dict(mask.info, tag=node, columns=mask.roles))
    return Val("where", mask.roles, dict(mask.info, tag=node))


def _index_into_one(node, op):
    """W[e] or one_hot(...)[e] with one expert (E = 1): canonicalize reads an index into a size-1
    axis as a squeeze (a reshape); here it is the expert's slice first, the squeeze if not."""
    if op.kind == "reshape" and node.target is operator.getitem and isinstance(node.args[1], int):
        return Op("getitem", (op.args[0], node.args[1]))
    return None


def _getitem(walk, node, op):
    src, index = walk.val(op.args[0]), op.args[1]
    if src is None:
        return None
    if src.kind in ("topk", "where") and isinstance(index, int) and "columns" not in src.info:
        return _tuple_item(src, index)
    if src.kind == "where" and "columns" in src.info and isinstance(index, tuple) and len(index) == 2 and \
            index[0] == slice(None) and isinstance(index[1], int):  # nz[:, i] of mask.nonzero()
        return _tuple_item(src, index[1])
    if src.kind == "onehot" and isinstance(index, int) and src.roles[0] == "e":  # one_hot(...).permute(2,1,0)[e]
        return Val("emask", src.roles[1:], dict(src.info, expert=index))
    items = index if isinstance(index, tuple) else (index,)
    vals = [walk.val(i) if hasattr(i, "op") else None for i in items]
    if src.kind == "x" and len(items) == 1 and len(src.roles) == 2 and isinstance(items[0], torch.fx.Node) and \
            pair_rows(walk.memo, items[0], walk.axes.sizes.get(src.roles[0]),
                      walk.axes.sizes.get("s")):  # x[arange(R·k) // k]
        return Val("x", (f"{src.roles[0]}*s", src.roles[1]), src.info)
    if src.kind in ("zero", "contrib") and len(items) == 1 and vals[0] is not None and vals[0].kind == "selidx":
        return Val("taken", None, {"base": op.args[0], "was": src, "index": items[0]})  # out[rows], a copy
    if src.kind == "x" and len(items) in (1, 2) and items[:-1] in ((), (None,)) and vals[-1] is not None and \
            vals[-1].kind == "selidx":  # x[rows], or x[None, rows] (transformers 4.3x's Mixtral, then reshaped)
        sel = vals[-1].info
        if sel["axis"] != src.roles[0] or len(src.roles) != 2:
            return None
        rows = (f"sel:{sel['tag'].name}", src.roles[1])
        return Val("x", (ONE,) * (len(items) - 1) + rows, {"sel": sel["tag"], "rows": src.roles[:-1]})
    if src.kind == "topw" and len(items) == 3 and items[2] is None and all(
            v is not None and v.kind == "selidx" for v in vals[:2]):
        rows, slots = vals[0].info, vals[1].info
        if rows["tag"] is not slots["tag"] or (rows["axis"], slots["axis"]) != src.roles or \
                rows["topk"] is not src.info["topk"]:
            return None
        return Val("gatesel", (f"sel:{rows['tag'].name}", ONE), dict(src.info, expert=rows["expert"]))
    if src.kind == "ext" and src.info["ref"] is not None and len(items) == 1 and vals[0] is not None and \
            vals[0].kind == "topi":  # gathered weights W[topi]
        ref = src.info["ref"]
        w_shape = shape(ref.node)
        if ref.perm is not None or ref.select is not None or ref.steps or w_shape is None or \
                not walk.axes.bind("e", w_shape[0]):
            return None
        return Val("wsel", vals[0].roles + (None,) * (len(w_shape) - 1), {"ref": ref, "topk": vals[0].info["topk"]})
    return None


def _wsel_layout(walk, node, op, src):
    """A layout op on gathered weights W[topi]: roles (topi's axes..., None for each of the
    weight's own axes). The topi axes move as roles do; the own axes must stay last, and a
    transpose of them is remembered in `own` (the parameter's axis behind each own axis, in
    order), so that the product reads the parameter the right way round. Anything that
    reshapes the own axes leaves the weights unread."""
    n_own = sum(1 for r in src.roles if r is None)
    lead = len(src.roles) - n_own
    own = src.info.get("own", tuple(range(n_own)))
    if op.kind == "cast":
        return src
    if op.kind == "permute":
        perm = tuple(op.args[1])
        if sorted(perm[lead:]) != list(range(lead, len(perm))):
            return None
        return Val("wsel", tuple(src.roles[p] for p in perm[:lead]) + (None,) * n_own,
                   dict(src.info, own=tuple(own[p - lead] for p in perm[lead:])))
    in_shape, out_shape = shape(op.args[0]), shape(node)
    if in_shape is None or out_shape is None or len(out_shape) < n_own or \
            not all(known_eq(a, b) for a, b in zip(in_shape[lead:], out_shape[len(out_shape) - n_own:])):
        return None
    roles = move_roles(walk, op, src.roles[:lead], tuple(in_shape[:lead]), tuple(out_shape[:len(out_shape) - n_own]))
    return None if roles is None else Val("wsel", roles + (None,) * n_own, src.info)


def _slot_broadcast(walk, node, val):
    """x (or h) expanded along a new axis of k = the top-k's size: that axis reads as the slot
    axis "s". The values do not vary along it, so the label only says how it lines up with
    W[topi]: x.unsqueeze(1).expand(R, k, D).reshape(R·k, 1, D) pairs with W1[topi.reshape(-1)]."""
    k = walk.axes.sizes.get("s")
    out = shape(node)
    if val.kind not in ("x", "h") or k is None or out is None or "s" in val.roles:
        return val
    slots = [i for i, (r, n) in enumerate(zip(val.roles, out)) if r == ONE and not is_one(n) and known_eq(n, k)]
    if len(slots) != 1:
        return val
    return Val(val.kind, tuple("s" if i == slots[0] else r for i, r in enumerate(val.roles)), val.info)


def _gathered_matmul(a, w, column=False):
    """x @ W1[topi] -> u and h @ W2[topi] -> f, per (row, slot) pair, as torch.matmul/bmm read
    them: a row a [..., 1, K] against W [..., K, N] with the same leading (row, slot) axes, or a
    broadcast along them (x[:, None, None, :] @ W1[topi]); with `column`, W first: W [..., N, K]
    against a column a [..., K, 1] (transformers' batched_mm experts), the product [..., N, 1]."""
    n_own = sum(1 for r in w.roles if r is None)
    if a is None or a.roles is None or a.kind not in ("x", "h") or n_own != 2 or len(a.roles) != len(w.roles):
        return None
    lead = w.roles[:-2]
    vector = a.roles[:-3:-1] if column else a.roles[-2:]  # (the size-1 axis, the contracted one)
    if vector != (ONE, "d" if a.kind == "x" else "f") or any(r not in (l, ONE) for r, l in zip(a.roles[:-2], lead)):
        return None
    if a.kind == "h" and (a.info["expert"] != "gathered" or a.info["topk"] is not w.info["topk"]):
        return None
    if not column:
        return _gathered_out(a, lead + (ONE,), w, 0)  # matmul contracts W's second to last axis
    out = _gathered_out(a, lead, w, 1)  # W first: the product contracts its last axis
    return Val(out.kind, out.roles + (ONE,), out.info)


def _gathered_out(src, rows, w, own_axis):
    """u = x W1[topi] (src x) or f = h W2[topi] (src h) per (row, slot), roles rows + (f | d).
    The parameter behind W[topi] is read as [E, contracted, out] (W1 [E,D,F], W2 [E,F,D]):
    transposed when the contracted axis, the view's own axis `own_axis`, is its last."""
    perm = None if w.info.get("own", (0, 1))[own_axis] == 0 else (0, 2, 1)
    ref = ParamRef(w.info["ref"].node, perm)
    if src.kind == "x":
        return Val("u", rows + ("f",), {"expert": "gathered", "topk": w.info["topk"], "w1": ref, "b1": None})
    return Val("f", rows + ("d",), dict(src.info, w2=ref, b2=None))


def _gather(walk, op, probs, dim, index):
    """probs.gather(-1, topi) on the tensor the top-k ran on: its values, topk's first output."""
    if probs is None or index is None or dim is None or index.kind != "topi" or probs.kind not in ("probs", "logits") \
            or dim.kind != "const" or not isinstance(dim.info["value"], int):
        return None
    topk = index.info["topk"]
    if topk.args[0] is not op.args[0] or probs.roles[dim.info["value"]] != "e" or topk not in walk.vals:
        return None
    if index.roles != walk.vals[topk].roles or tuple("s" if r == "e" else r for r in probs.roles) != index.roles:
        return None  # the indices in another row order gather other rows' values (0.56 off, a review's)
    return _tuple_item(walk.vals[topk], 0)


def _tuple_item(src, i):
    if src.kind == "where":
        if i not in (0, 1):
            return None
        axes = src.info.get("columns") or src.roles
        return Val("selidx", None, {k: v for k, v in src.info.items() if k != "columns"} | {"axis": axes[i]})
    if i == 0:
        return Val("toplogit" if src.info.get("on_logits") else "topw", src.roles, dict(src.info, renorm=False))
    if i == 1:
        return Val("topi", src.roles, dict(src.info))
    return None


def _weight_product(walk, node, x, ref, linear, bias):
    """x against a parameter: the router's logits, or W1/W3 (from x) and W2 (from h) of an expert."""
    if x is None or x.roles is None or ref.steps:
        return None
    w_shape = shape(ref.node)
    if w_shape is None:
        return None
    used = ref if linear is False else dataclasses.replace(ref, perm=_swap(ref.perm))  # as [in,out]
    if node is walk.router:
        if x.kind != "x" or ref.select is not None or x.roles[-1] != "d" or len(w_shape) != 2:
            return None
        if bias is not None:
            raise Reject(f"{node.name}: the router adds a bias (nn.Linear(D, E) with bias=True); the region's router "
                         f"is x·Wgᵀ alone: build it with bias=False")
        return Val("logits", _rows(x.roles) + ("e",), {"wg": ParamRef(ref.node, _swap(used.perm)), "x_roles": x.roles})
    if ref.select is None and len(w_shape) == 2:  # an expert of its own (nn.Linear in a ModuleList)
        expert, base = None, used
    elif ref.select is not None and len(w_shape) == 3:
        expert = ref.select
        base = ParamRef(ref.node, None if used.perm is None else (0,) + tuple(1 + p for p in used.perm), expert)
    else:
        return None
    if x.kind == "x" and x.roles[-1] == "d":
        val = Val("u", _rows(x.roles) + ("f",), {"expert": expert, "w1": base, "b1": None})
        return _with_bias(walk, val, "b1", bias)
    if x.kind == "h" and _per_expert(x.info["expert"]) and _per_expert(expert):
        # W2[e] after another slice's W1 (W1 permuted, W1[0] for every expert, a shared W1 expanded):
        # each gate's expert keeps the slices it used, stacked in gate order (_stacked), so it is the block
        val = Val("f", _rows(x.roles) + ("d",), dict(x.info, w2=base, b2=None))
        return _with_bias(walk, val, "b2", bias)
    return None


def _per_expert(expert):
    """Whether an expert's value is one expert's: a slice W[e] (e) or a weight of its own (None)."""
    return expert is None or type(expert) is int


def _swap(perm):
    base = perm or (0, 1)
    swapped = (base[1], base[0])
    return None if swapped == (0, 1) else swapped


def _with_bias(walk, val, key, bias):
    if bias is None:
        return val
    return _add(walk, None, val, Val("ext", None, {"ref": bias}))


def _einsum(walk, node, equation, operands):
    """Dense experts: x·W1 / h·W2 over every expert at once, Σ_e gate · f, gathered W[topi]."""
    read = einsum_roles(equation, [v.roles if v is not None else None for v in operands])
    if read is None or any(v is None for v in operands):
        return None
    out_roles, letters, contracted, terms = read
    kinds = [v.kind for v in operands]
    if sorted(kinds) == ["f", "gate"]:
        gate, f = operands if kinds[0] == "gate" else operands[::-1]
        if f.info["expert"] != "all" or {letters.get(l) for l in contracted} != {"e"}:
            return None
        roles = gate.roles[:-1] if gate.roles[-1] == ONE else gate.roles  # [rows, e] or [rows, e, 1]
        if roles[-1] != "e" or out_roles != _rows(roles) + ("d",):
            return None
        return Val("moe_out", out_roles, {"gate": _gate_info(gate.info), "experts": _expert_info(f.info)})
    if sorted(kinds) == ["f", "topw"]:  # gathered: Σ_s topw · f
        w, f = operands if kinds[0] == "topw" else operands[::-1]
        if f.info["expert"] != "gathered" or f.info["topk"] is not w.info["topk"] or \
                {letters.get(l) for l in contracted} != {"s"} or out_roles != _rows(w.roles) + ("d",):
            return None
        return Val("moe_out", out_roles, {"gate": _gate_info(w.info), "experts": _expert_info(f.info)})
    if sorted(kinds) == ["onehot", "topw"]:  # Σ_s topw · one_hot(topi)
        w, onehot = operands if kinds[0] == "topw" else operands[::-1]
        if onehot.info["topk"] is not w.info["topk"] or {letters.get(l) for l in contracted} != {"s"} or \
                out_roles != _rows(w.roles) + ("e",):
            return None
        return Val("gate", out_roles, dict(w.info))
    if "wsel" in kinds:
        return _gathered_product(walk, node, equation, operands, kinds)
    if "ext" not in kinds:
        return None
    src, w = (operands[0], operands[1]) if kinds[1] == "ext" else (operands[1], operands[0])
    if ext_ref(w) is None:
        return None
    w_term, stored = terms[kinds.index("ext")], shape(ext_ref(w).node)
    fresh = [l for l in w_term if letters.get(l) is None]
    if stored is None or len(stored) != len(w_term) or ext_ref(w).select is not None or ext_ref(w).steps:
        return None
    # a weight stored in another axis order and permuted for the einsum (W2 kept [E, D, F], nn.Linear's
    # [out, in] per expert, read as .transpose(1, 2)): its letters name the permuted view's axes
    view = ext_ref(w).perm or tuple(range(len(stored)))
    w_shape = tuple(stored[p] for p in view)
    size = dict(zip(w_term, w_shape))
    if src.kind == "x" and {letters.get(l) for l in contracted} == {"d"} and len(fresh) == 2:
        # The weight's two own letters are its expert axis and its hidden axis: the expert
        # axis is the one as long as the router's E (in [E,D,F] order where both are).
        by_size = [l for l in fresh if walk.axes.sizes.get("e") is not None and size[l] == walk.axes.sizes["e"]]
        e = by_size[0] if len(by_size) == 1 else fresh[0]
        letters = dict(letters, **{e: "e", next(l for l in fresh if l != e): "f"})
        canonical, kind, extra = ("e", "d", "f"), "u", {"expert": "all", "b1": None}
        key = "w1"
    elif src.kind == "h" and src.info["expert"] == "all" and {letters.get(l) for l in contracted} == {"f"} and \
            len(fresh) == 1:
        letters = dict(letters, **{fresh[0]: "d"})
        canonical, kind, extra = ("e", "f", "d"), "f", dict(src.info, b2=None)
        key = "w2"
    else:
        return None
    w_roles = [None] * len(view)  # the stored tensor's axes' roles
    for letter, axis in zip(w_term, view):
        w_roles[axis] = letters[letter]
    out = tuple(letters.get(l) for l in _output(equation))
    rows = src.roles[:-2] if src.kind == "h" else src.roles[:-1]
    perm = canonical_perm(tuple(w_roles), canonical)
    if perm is False or out != rows + (canonical[0], canonical[2]):
        return None
    return Val(kind, out, dict(extra, **{key: ParamRef(ext_ref(w).node, perm)}))


def _gathered_product(walk, node, equation, operands, kinds):
    """x · W1[topi] -> u (rows,s,f); h · W2[topi] -> f (rows,s,d): per slot, the chosen expert's weight."""
    if sorted(kinds) not in (["wsel", "x"], ["h", "wsel"]):
        return None
    src, w = (operands[0], operands[1]) if kinds[1] == "wsel" else (operands[1], operands[0])
    terms = equation.replace(" ", "").split("->")[0].split(",")
    src_term, w_term = (terms[0], terms[1]) if kinds[1] == "wsel" else (terms[1], terms[0])
    out_term = _output(equation)
    rows = w.roles[:-3]  # topi's (rows..., s) then the weight's two own axes
    if len(w_term) != len(w.roles) or len(w.roles) < 4:
        return None
    own = w_term[-2:]
    contracted_role = "d" if src.kind == "x" else "f"
    if src.kind == "h" and (src.info["expert"] != "gathered" or src.info["topk"] is not w.info["topk"]):
        return None
    src_roles = dict(zip(src_term, src.roles))
    if src_roles.get(src_term[-1]) != contracted_role or src_term[-1] not in own:
        return None
    inner = src_term[-1]
    other = own[0] if own[1] == inner else own[1]
    row_letters = w_term[:-2]
    if src.kind == "x" and (len(src_term) != len(rows) + 1 or src_term[:-1] != row_letters[:-1]):
        return None
    if src.kind == "h" and src_term[:-1] != row_letters:
        return None
    if out_term != row_letters + other:
        return None
    return _gathered_out(src, w.roles[:-2], w, own.index(inner))


def _output(equation):
    return equation.replace(" ", "").split("->")[1]


def _softmax(node, logits, dim):
    if logits is None or not isinstance(dim, int):
        return None
    if logits.kind == "toplogit":  # softmax over the k top logits = renormalised top-k of the softmax
        if logits.roles[dim] != "s":
            raise Reject(f"{node.name}: the softmax of the top-k logits runs over dim {dim}, not over the k chosen")
        return Val("topw", logits.roles, dict(logits.info, renorm=True, on_logits=False))
    if logits.kind != "logits":
        return None
    if logits.roles[dim] != "e":
        raise Reject(f"{node.name}: the router's softmax runs over dim {dim}, not over the experts")
    return Val("probs", logits.roles, dict(logits.info))


def _topk(node, probs, k, dim, largest, sorted_):
    if probs is not None and probs.kind in ("probs", "logits") and k is not None and k.kind != "const" and \
            graph_scalar(canon(node).args[1]):
        raise Reject(graph_value_reason(node, "top-k's k", canon(node).args[1]))
    if probs is None or k is None or probs.kind not in ("probs", "logits") or k.kind != "const":
        return None
    dim = -1 if dim is None or dim.info["value"] is None else dim.info["value"]
    if probs.roles[dim] != "e":
        raise Reject(f"{node.name}: top-k runs over dim {dim}, not over the experts")
    if largest is not None and largest.info["value"] is False:
        raise Reject(f"{node.name}: top-k picks the smallest probabilities (largest=False)")
    if not isinstance(k.info["value"], int) or k.info["value"] < 1:  # (a review's: k = 0 crashed the op)
        raise Reject(f"{node.name}: top-k keeps k = {k.info['value']} experts a row; the region needs k ≥ 1")
    roles = tuple("s" if r == "e" else r for r in probs.roles)  # the k slots where the experts were
    return Val("topk", roles, dict(probs.info, k=k.info["value"], topk=node, on_logits=probs.kind == "logits"))


def _sum(walk, node, src, dim, keepdim):
    if src is None or src.kind not in ("topw", "maskedw", "gate_s", "gcontrib") or not isinstance(dim, int):
        return None
    # With k = 1 the flat (row, slot) pairs are the rows: their contributions come back with a
    # size-1 axis in the slot's place (view(R, 1, D)), and summing it is the sum over the one slot.
    one_slot = src.kind == "gcontrib" and src.roles[dim] == ONE and "s" not in src.roles and _one_slot(walk)
    if src.roles[dim] != "s" and not one_slot:
        return None
    roles = src.roles[:dim % len(src.roles)] + ((ONE,) if keepdim else ()) + src.roles[dim % len(src.roles) + 1:]
    if src.kind == "gate_s":
        return Val("gate", roles, dict(src.info))
    if src.kind == "gcontrib":
        return None if keepdim else Val("moe_out", roles, dict(src.info))
    return Val("sumw" if src.kind == "topw" else "gatecol", roles, dict(src.info))


def _sum_plus_eps(walk, node, total, eps):
    """Σw + eps as a renormaliser (w / (Σw + 1e-20), DeepSeek's spelling). Σw of the top k of a
    softmax over E experts is at least k/E (_least_sum), so an eps under (k/E)·ε/8, ε the machine
    epsilon of the dtype the sum is taken in (2⁻⁵⁵·k/E in float64, 2⁻²⁶·k/E in float32), is below
    half an ulp of Σw: Σw + eps rounds to Σw exactly, and the renormalisation is the region's. A
    larger eps changes the weights: not the block."""
    c, least = eps.info["value"], _least_sum(walk, total)
    if not isinstance(c, (int, float)) or least is None:
        return None
    kind = float_dtype(node) or torch.float64
    bound = least * torch.finfo(kind).eps / 8
    if 0 <= c <= bound:
        return total
    raise Reject(f"{node.name}: the top-k weights are renormalised by Σw + {c:g}; the region divides by Σw "
                 f"exactly, and an eps this large changes the weights (by up to {c / least:.1e} relative). Drop "
                 f"the eps (Σw ≥ k/E = {least:g} cannot be 0), or keep eps ≤ {bound:.1e}, which rounds away in "
                 f"{str(kind).removeprefix('torch.')}")


def _least_sum(walk, total):
    """k/E, the least Σw of the top k of a softmax over E experts (each of the k is at least the
    mean 1/E), or None where E is not known."""
    E = walk.axes.sizes.get("e")
    return total.info["k"] / E if isinstance(E, int) else None


def _sum_clamped(walk, node, total, low, high):
    """Σw.clamp(min=eps) as a renormaliser, where the clamp never acts (_floor_never_acts)."""
    if total is not None and total.kind == "sumw" and high is None and graph_scalar(low):
        raise Reject(graph_value_reason(node, "the floor under Σw", low))  # read as "not the block's math" before
    if total is None or total.kind != "sumw" or high is not None or not isinstance(low, (int, float)):
        return None
    return total if _floor_never_acts(walk, node, total, low, "Σw clamped at ") else None


def _normalize(walk, node, topw, p, dim, eps):
    """F.normalize(w, p=1, dim=slots): w / max(Σ|w|, eps), the top-k weights being non-negative
    probabilities: w / Σw where eps never acts (_floor_never_acts)."""
    if topw is not None and topw.kind == "topw" and not topw.info["renorm"] and graph_scalar(eps):
        raise Reject(graph_value_reason(node, "F.normalize's eps", eps))
    if topw is None or topw.kind != "topw" or topw.info["renorm"] or not isinstance(dim, int) or \
            topw.roles[dim] != "s" or not isinstance(eps, (int, float)) or _least_sum(walk, topw) is None:
        return None
    if p != 1:
        raise Reject(f"{node.name}: the top-k weights are normalised by their L{p} norm (F.normalize, p={p!r}); "
                     f"the block renormalises them by their sum, p=1")
    _floor_never_acts(walk, node, topw, eps, "F.normalize's eps=")
    return Val("topw", topw.roles, dict(topw.info, renorm=True))


def _l1_sum(walk, node, topw, p, dim, keepdim):
    """torch.norm(w, p=1, dim=slots) (DBRX's router): Σ|w| = Σw, the top-k weights being non-negative
    probabilities (a review's: refused before). Where one rounds to 0, the norm's gradient there
    (sign 0) differs from the sum's (1), but π = 0 multiplies it in the softmax's backward."""
    if topw is None or topw.kind != "topw" or topw.info["renorm"] or not isinstance(dim, int) or \
            topw.roles[dim] != "s":
        return None
    if p != 1 or isinstance(p, bool):
        raise Reject(f"{node.name}: the top-k weights are divided by their norm with p={p!r}; the block "
                     f"renormalises them by their sum, the norm with p=1")
    return _sum(walk, node, topw, dim, bool(keepdim))


def _floor_never_acts(walk, node, weights, floor, what):
    """Whether a floor under Σw (a clamp's min, F.normalize's eps) never acts: it is at most the
    least Σw that eager can compute (_least_computed_sum); at or below 0 it never acts either. None
    where E is not known; a floor that can act (or a NaN one) is a near-miss."""
    least, kind = _least_sum(walk, weights), _coarsest(_dtypes_from(node, weights.info["topk"]))
    if least is None:
        return None
    bound = _least_computed_sum(least, walk.axes.sizes["e"], weights.info["k"], kind)
    if not _as_compared(floor, float_dtype(node) or kind) <= bound:
        name = str(kind).removeprefix("torch.")
        acts = ("a floor at or above k/E acts on each row whose Σw is below it" if floor >= least else
                f"a floor above {bound:.6g} may act where Σw rounds below k/E (near-equal probabilities, or k = E)")
        raise Reject(f"{node.name}: the top-k weights are renormalised with {what}{floor:g}; Σw ≥ k/E = {least:g}, "
                     f"and ≥ {bound:.6g} as {name} rounds it: {acts}, where the region divides by Σw itself")
    return True


def _as_compared(floor, kind):
    """The largest the floor may be when the clamp compares it with Σw (of dtype kind): as written,
    or rounded to kind (the CPU's clamp_min) or, for a 16-bit kind, to float32 (its opmath)."""
    return max(floor, *(torch.tensor(floor, dtype=d).item() for d in (kind, accumulation_dtype(kind))))


def _least_computed_sum(least, E, k, kind):
    """The least Σw of the top k of a softmax over E experts that eager computes in `kind`: k/E
    (`least`) times 1 - m, m = eps(kind) + (E + 2k + 8) eps(acc), acc the dtype torch accumulates in
    (float32 for a 16-bit kind, at::opmath_type, on the CPU and CUDA; else kind).

    Why (u = eps/2 of acc, each op rounding by at most u, any order of summation): with e_j the
    computed exp(x_j - max), the k largest e_j sum to at least k/E of Σe in exact arithmetic,
    whatever exp's error. The computed Σe is at most Σe / (1 - (E-1)u) (Higham's γ_{E-1}); the
    quotient, or a product with 1/Σe, costs 2u; exp evaluated apart for the sum and the quotient,
    within 2 ulps each (CUDA's expf, SLEEF, glibc), 8u. The top k of the computed π sum to at least
    these k's π; summing them costs γ_{k-1} <= 2(k-1)u; rounding each π and Σw to a kind coarser than
    acc costs eps(kind) in all (counted always). That is m <= eps(kind) + (E + 2k + 7)u: half the
    margin taken, the rest slack for products of the (1 - δ) terms.
    Σw falls below k/E only by rounding, where k = E (a bf16 Σw of 0.996 in 2% of rows of random
    logits, E = 4) or the probabilities are near-equal: measured at most eps(kind)/2 below. The
    bound k/(2E) kept before refused floors that never act (a review's)."""
    return least * (1 - torch.finfo(kind).eps - (E + 2 * k + 8) * torch.finfo(accumulation_dtype(kind)).eps)


def _dtypes_from(node, topk):
    """The floating dtypes from the router's softmax to node (π, casts of π, w, Σw), where known."""
    kinds, seen, stack = set(), set(), [node]
    while stack and len(seen) < 16:  # a few nodes: the sum, a cast, the top-k's getitem
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        kinds.add(float_dtype(n))
        if n is topk:
            kinds.update(_dtypes_to_softmax(n))
        else:
            stack.extend(n.all_input_nodes)
    return kinds - {None}


def _dtypes_to_softmax(topk):
    """The dtypes of top-k's input and of what it is made from, back to the softmax: π computed in
    bf16 and cast up (.float()) before the top-k was rounded to bf16 all the same, so its Σw can fall
    as far below k/E as bf16's; taken for float32's, a floor of 0.9999 at k = E = 4 passed, where
    eager's clamp acted in 177 of 512 rows (a review's). A few single-input steps at most."""
    kinds, n = set(), topk.all_input_nodes[0] if topk.all_input_nodes else None
    for _ in range(8):
        if n is None:
            break
        kinds.add(float_dtype(n))
        if getattr(canon(n), "kind", None) == "softmax" or len(n.all_input_nodes) != 1:
            break
        n = n.all_input_nodes[0]
    return kinds


def _coarsest(kinds):
    """The coarsest of kinds; bfloat16, the coarsest a softmax gives, where none is known."""
    return max(kinds, key=lambda kind: torch.finfo(kind).eps, default=torch.bfloat16)


def _one_slot(walk):
    return known_eq(walk.axes.sizes.get("s"), 1)


def _renorm(topw, total):
    if topw is None or total is None or topw.kind != "topw" or total.kind != "sumw":
        return None
    if total.info["topk"] is not topw.info["topk"] or topw.info["renorm"] or total.info["renorm"]:
        return None
    if total.roles is None or topw.roles is None or not _divides_own_row(topw.roles, total.roles):
        return None
    return Val("topw", topw.roles, dict(topw.info, renorm=True))


def _divides_own_row(weights, sums):
    """Whether w / Σw, broadcast as written, divides each row's weights by that row's own sum: Σw's
    axes, aligned from the right, are w's with the slots' axis of size 1. w / w.sum(-1) without
    keepdim ([R, k] / [R], R = k: column j by row j's sum) and a sum taken in another row order
    matched (0.10 and 0.146 off, a review's)."""
    if len(sums) > len(weights):
        return False
    sums = (ONE,) * (len(weights) - len(sums)) + tuple(sums)
    return all(t == ONE if w == "s" else t == w for w, t in zip(weights, sums))


def _scatter(walk, node, zero, dim, index, src):
    if zero is None or zero.kind != "zero" or index is None or index.kind != "topi" or src is None or \
            src.kind != "topw":
        return None
    if index.info["topk"] is not src.info["topk"] or dim is None or dim.kind != "const" or index.roles != src.roles:
        return None  # (indices in another row order than their weights scattered other rows' gates: a review's)
    out = shape(node)
    if dim.info["value"] % len(out) != len(out) - 1 or not walk.axes.bind("e", out[-1]):
        return None
    return Val("gate", _rows(src.roles) + ("e",), dict(src.info))


def _one_hot(walk, node, topi, classes):
    if topi is None or topi.kind != "topi":
        return None
    out = shape(node)
    if out is None or not walk.axes.bind("e", out[-1]):
        return None
    return Val("onehot", topi.roles + ("e",), dict(topi.info))


def _activation(node, op, u):
    if u is None or u.kind != "u":
        return None
    approximate = op.args[1] if op.kind == "gelu" else None
    if op.kind == "gelu" and approximate is None:
        approximate = "none"
    act = ACT_OF.get((op.kind, approximate))
    if act is None:
        return None
    return Val("h", u.roles, dict(u.info, act=act, w3=None))


def _mul(walk, node, a, b):
    if a is None or b is None:
        return None
    pair = {a.kind: a, b.kind: b}
    if "topw" in pair and "eqmask" in pair:
        topw, mask = pair["topw"], pair["eqmask"]
        roles = broadcast(topw.roles, mask.roles)  # None where the mask's rows are in another order (a review's)
        if topw.info["topk"] is not mask.info["topk"] or roles is None:
            return None
        return Val("maskedw", roles, dict(topw.info, expert=mask.info["expert"]))
    if "topw" in pair and "onehot" in pair:
        topw, onehot = pair["topw"], pair["onehot"]
        roles = broadcast(topw.roles, onehot.roles)
        if topw.info["topk"] is not onehot.info["topk"] or roles != onehot.roles:
            return None
        return Val("gate_s", roles, dict(topw.info))
    if "topw" in pair and "f" in pair:  # gathered: topw[..., None] · f per slot
        topw, f = pair["topw"], pair["f"]
        w_roles = topw.roles
        if "s" not in f.roles and _one_slot(walk):  # k = 1 and flat pairs: the slot axis is a broadcast
            w_roles = tuple(ONE if r == "s" else r for r in w_roles)
        if f.info["expert"] != "gathered" or f.info["topk"] is not topw.info["topk"] or \
                broadcast(w_roles, f.roles) != f.roles:
            return None
        return Val("gcontrib", f.roles, {"gate": _gate_info(topw.info), "experts": _expert_info(f.info)})
    if ("gatecol" in pair or "gatesel" in pair) and "f" in pair:
        gate, f = pair.get("gatecol") or pair["gatesel"], pair["f"]
        if f.info["expert"] in ("all", "gathered") or broadcast(gate.roles, f.roles) != f.roles:
            return None
        kind = "contrib" if gate.kind == "gatecol" else "contrib_sel"
        return Val(kind, f.roles, {"gate": _gate_key(gate.info), "experts": {gate.info["expert"]: _expert_key(f.info)},
                                   "covered": frozenset([gate.info["expert"]])})
    if "h" in pair and "u" in pair:  # swiglu: silu(x W1 + b1) ⊙ (x W3)
        h, u3 = pair["h"], pair["u"]
        # W3 from another slice than W1 (permuted, W3[0] for every expert, a shared W3 expanded) is the
        # block, as W1's is beside W2: each gate's expert keeps the slices it used (_stacked)
        experts_agree = u3.info["expert"] == h.info["expert"] or \
            _per_expert(u3.info["expert"]) and _per_expert(h.info["expert"])
        if h.info["act"] != "silu" or h.info["w3"] is not None or not experts_agree or \
                h.roles != u3.roles or h.info.get("topk") is not u3.info.get("topk"):
            return None
        if u3.info["b1"] is not None:
            raise Reject(f"{node.name}: the SwiGLU's up projection x·W3 adds a bias; the block's SwiGLU is "
                         f"silu(x·W1 + b1) ⊙ (x·W3), with no bias on x·W3")
        return Val("h", h.roles, dict(h.info, act="swiglu", w3=u3.info["w1"]))
    return None


def _gate_key(info):
    return (info["topk"], info["renorm"], info["k"], info["wg"])


def _gate_info(info):
    return {"topk": info["topk"], "renorm": info["renorm"], "k": info["k"], "wg": info["wg"]}


def _expert_key(info):
    return tuple(info.get(k) for k in ("w1", "b1", "w3", "act", "w2", "b2"))


def _expert_info(info):
    return {k: info.get(k) for k in ("w1", "b1", "w3", "act", "w2", "b2")}


def _add(walk, node, a, b):
    if a is None or b is None:
        if node is not None and any(v is not None and v.kind == "contrib" for v in (a, b)):
            _summed_onto_other(node)
        return None
    if {a.kind, b.kind} == {"taken", "contrib_sel"}:  # out[rows] += f(x[rows]) · w[rows, slots], then stored
        taken, more = (a, b) if a.kind == "taken" else (b, a)
        return Val("taken_plus", None, dict(taken.info, plus=more))
    if "sumw" in (a.kind, b.kind) and "const" in (a.kind, b.kind):
        return _sum_plus_eps(walk, node, a if a.kind == "sumw" else b, b if b.kind == "const" else a)
    a, b = (Val("zero") if _is_zero(v) else v for v in (a, b))  # Python's sum() over the experts starts at 0
    if b.kind in ("u", "f") or a.kind in ("zero",):
        a, b = b, a
    if a.kind in ("u", "f") and b.kind == "wsel" and a.info["expert"] == "gathered":  # + b[topi]
        key = "b1" if a.kind == "u" else "b2"
        if a.info[key] is not None or b.info["topk"] is not a.info["topk"] or len(b.roles) != len(a.roles) or \
                b.roles[:-1] != a.roles[:-1]:
            return None
        return Val(a.kind, a.roles, dict(a.info, **{key: ParamRef(b.info["ref"].node)}))
    if a.kind in ("u", "f") and b.kind == "ext" and ext_ref(b) is not None:
        key = "b1" if a.kind == "u" else "b2"
        ref = ext_ref(b)
        if _per_expert(a.info["expert"]) and ref.select is None:
            ref = row_as_select(walk, ref) or ref  # b1[e:e+1], b1.narrow(0, e, 1): [1, F], as b1[e] added
        if a.info[key] is not None or ref.steps:
            return None
        b_shape = shape(ref.node)
        if ref.select is not None:
            if ref.perm is not None or b_shape is None or len(b_shape) != 2:
                return None
        elif _per_expert(a.info["expert"]):  # a bias of its own (b1.T[e] where E = F): stacked, as a weight is
            if ref.perm is not None or b_shape is None or len(b_shape) != 1:
                return None
        elif a.info["expert"] != "all" or not _bias_shape_ok(walk, a, ref):
            return None
        used = b.info.get("node")  # none for F.linear's bias, which it adds on the last axis
        own = ("e", a.roles[-1]) if a.info["expert"] == "all" else a.roles[-1:]
        if used is not None and not _lines_up(shape(used), a.roles, own):
            return None
        return Val(a.kind, a.roles, dict(a.info, **{key: ref}))
    if {a.kind, b.kind} == {"moe_out", "contrib"}:
        done, more = (a, b) if a.kind == "moe_out" else (b, a)
        if done.info["gate"]["topk"] is more.info["gate"][0]:  # read by match._read_moe, after the output
            return Val("added_again", done.roles, {"reason": (
                f"{node.name}: expert(s) {sorted(more.info['covered'])} added again after every expert's output "
                f"was summed; every expert must be added exactly once")})
    if a.kind == "contrib" and b.kind in ("zero", "contrib"):
        if b.kind == "zero":
            return _complete(walk, a)
        return _join(walk, node, a, b)
    if "contrib" in (a.kind, b.kind) and node is not None:
        _summed_onto_other(node)
    return None


def _summed_onto_other(node):
    raise Reject(f"{node.name}: an expert's output is added to something other than zeros or the other experts' "
                 f"outputs (Python's sum() with a start, say); the block sums them from zero")


def _is_zero(val):
    value = val.info.get("value") if val.kind == "const" else None
    return type(value) in (int, float) and value == 0


def _join(walk, node, a, b):
    if a.info["gate"] != b.info["gate"] or a.roles != b.roles:
        return None
    twice = a.info["covered"] & b.info["covered"]
    if twice:
        raise Reject(f"{node.name}: expert(s) {sorted(twice)} added twice to the expert outputs summed; every "
                     f"expert must be added exactly once")
    info = dict(a.info, covered=a.info["covered"] | b.info["covered"],
                experts={**a.info["experts"], **b.info["experts"]})
    return _complete(walk, Val("contrib", a.roles, info))


def _index_add(walk, node, op, out, dim, index, src):
    """Mixtral: out.index_add_(0, rows, f_e(x[rows]) · w[rows, slots]) per expert."""
    if out is None or src is None or index is None or src.kind != "contrib_sel" or index.kind != "selidx" or \
            out.kind not in ("zero", "contrib") or dim is None or dim.kind != "const" or dim.info["value"] != 0:
        return None
    tag = index.info["tag"]
    if op.args[4] not in (None, 1) or index.info["axis"] == "s" or f"sel:{tag.name}" != src.roles[0] or \
            set(src.info["covered"]) != {index.info["expert"]}:
        return None
    roles = (index.info["axis"],) + src.roles[1:]
    val = Val("contrib", roles, dict(src.info))
    if out.kind == "contrib":
        val = _join(walk, node, out, val)
    else:
        val = _complete(walk, val)
    if val is not None and op.kwargs.get("_inplace"):
        walk.vals[op.args[0]] = val  # the in-place add changes what later readers of `out` see
    return val


def _set_rows(walk, node, op, out, index, value):
    """out[rows] = out[rows] + f(x[rows]) · w[rows, slots] (mistral's `results[batch_idx] += ...`):
    out.index_add_(0, rows, ...) where rows, one expert's from torch.where, name each row at most
    once (top-k picks distinct experts), and nothing wrote out between the read and the store."""
    if value is None or value.kind != "taken_plus" or value.info["base"] is not op.args[0] or \
            value.info["index"] is not op.args[1] or out is not value.info["was"]:
        return None
    added = Op("index_add", (op.args[0], 0, op.args[1], None, 1), {"_inplace": True})
    return _index_add(walk, node, added, out, walk.val(0), index, value.info["plus"])


def _pairs_added(walk, op, out, dim, src):
    """out.index_add_(0, arange(R·k) // k, f · w) onto zeros: each (row, slot) pair's contribution
    added into its row, Σ_s topw · f (transformers' batched_mm experts)."""
    if out is None or src is None or out.kind != "zero" or src.kind != "gcontrib" or dim is None or \
            dim.kind != "const" or dim.info["value"] != 0 or op.args[4] not in (None, 1) or len(src.roles) != 2 or \
            not src.roles[0].endswith("*s") or src.roles[1] != "d":
        return None
    rows = src.roles[0][:-len("*s")]
    if not pair_rows(walk.memo, op.args[2], walk.axes.sizes.get(rows), walk.axes.sizes.get("s")):
        return None
    val = Val("moe_out", (rows, "d"), dict(src.info))
    if op.kwargs.get("_inplace"):
        walk.vals[op.args[0]] = val
    return val


def _stack(walk, node, vals, dim):
    """Dense over nn.Linear experts: torch.stack([expert_e(x) for e], dim) is f over every expert."""
    if not vals or any(v is None or v.kind != "f" or v.info["expert"] in ("all", "gathered") for v in vals):
        return None
    experts = len(vals)
    if not walk.axes.bind("e", experts) or vals[0].roles is None or any(v.roles != vals[0].roles for v in vals):
        return None
    keys = {e: _expert_key(v.info) for e, v in enumerate(vals)}
    refs = _stacked(keys, experts)
    if refs is None:
        return None
    roles = list(vals[0].roles)
    roles.insert(dim % (len(roles) + 1), "e")
    if roles[-2:] != ["e", "d"]:
        return None
    return Val("f", tuple(roles), dict(refs, expert="all"))


def _lines_up(used, roles, own):
    """Whether a bias, as the add broadcasts it (`used`, its shape there, right-aligned on `roles`),
    varies along its own axes only: b1[:, None, :] added to the dense u [R, E, F] puts b1's experts
    on the rows (with E = R it broadcast, 0.117 off: a review's), b1[e][:, None] its F on them."""
    if used is None or len(used) > len(roles):
        return False
    placed = roles[len(roles) - len(used):]
    return all(is_one(size) or role in own for size, role in zip(used, placed))


def _bias_shape_ok(walk, val, ref):
    """A bias over every expert is [E,F] for u and [E,D] for f, right-aligned on (e, f|d)."""
    b_shape = shape(ref.node)
    return b_shape is not None and len(b_shape) == 2 and ref.perm is None and \
        walk.axes.bind("e", b_shape[0]) and walk.axes.bind(val.roles[-1], b_shape[1])


def _stacked(keys, experts):
    """Per-expert parameters as stacked ones: a view where the user stacked them, else a StackRef."""
    names = ("w1", "b1", "w3", "act", "w2", "b2")
    acts = {k[3] for k in keys.values()}
    if len(acts) != 1:
        return None
    out = {"act": acts.pop()}
    for i, name in enumerate(names):
        if name == "act":
            continue
        refs = [keys[e][i] for e in range(experts)]
        if all(r is None for r in refs):
            out[name] = None
        elif any(r is None for r in refs):
            return None
        elif all(r.node is refs[0].node and r.select == e and r.perm == refs[0].perm and r.steps == refs[0].steps
                 for e, r in enumerate(refs)) and _holds_just(refs[0].node, experts):
            out[name] = ParamRef(refs[0].node, refs[0].perm, steps=refs[0].steps)  # steps act before the select
        else:
            out[name] = StackRef(tuple(refs))
    return out


def _holds_just(node, experts):
    """Whether a stored tensor's first axis is the experts, no more: a W1 of E + 1 rows read for e in
    range(E) (padded storage) went to the op whole, which took E from it and crashed (a review's);
    it is stacked from its E slices instead."""
    size = shape(node)
    return size is not None and len(size) > 0 and known_eq(size[0], experts)


def _complete(walk, contrib):
    """A sum of contributions is the MoE's output once it covers every expert exactly once."""
    experts = walk.axes.sizes.get("e")
    if isinstance(experts, int) and contrib.info["covered"] == frozenset(range(experts)):
        refs = _stacked(contrib.info["experts"], experts)
        if refs is None:
            return contrib
        gate_topk, renorm, k, wg = contrib.info["gate"]
        return Val("moe_out", contrib.roles, {"gate": {"topk": gate_topk, "renorm": renorm, "k": k, "wg": wg},
                                              "experts": refs})
    return contrib


def moe_params(out):
    """Parameters and config of the MoE from the Val of its output."""
    gate, experts = out.info["gate"], out.info["experts"]
    params = {name: experts[name] for name in ("w1", "b1", "w2", "b2", "w3")}
    params["wg"] = gate["wg"]
    return params, {"top_k": gate["k"], "renorm": gate["renorm"], "act": experts["act"]}
