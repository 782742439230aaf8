"""Reading the top-k MoE spelled as grouped GEMMs over the (row, slot) pairs sorted by expert.

What a user who knows torch._grouped_mm writes (bench/grouped_mm_moe.py is the benchmark's):

    flat = topi.reshape(-1)                            # the R·k (row, slot) pairs, row-major
    order = flat.argsort()                             # the pairs sorted by expert (or flat.sort())
    expert, rows = flat[order], order // k             # each sorted pair's expert and row
    offs = torch.searchsorted(expert, torch.arange(E), right=True)   # each expert's end, or the
                                                     # counts' cumsum: one_hot(flat, E).sum(0), histc, scatter_add_
    u = torch._grouped_mm(x[rows], W1, offs=offs) + b1[expert]
    f = torch._grouped_mm(act(u), W2, offs=offs) + b2[expert]
    out = torch.zeros_like(x).index_add(0, rows, f * topw.reshape(-1)[order, None])

Every value on the sorted pairs has the pair axis "pairs:<sort node>" and carries the sort it
follows (info "order"): x's rows, the gates and the rows the outputs are added at must follow
the same sort of the same top-k. The experts in sorted order and the offsets need only the same
flat top-k: every ascending sort of it gives the same sequence of experts (descending sorts are
refused), so the experts, biases and group ends of one sort hold for another. A piece from
another top-k, rows of another k or offsets that are not each expert's end leave the MoE unread
(a near-miss), never misread.
Kinds: "sorted" (sort's (values, indices)), "order" (the argsort), "pexpert" and "prow" (each
sorted pair's expert and row), "ones" and "ecount" (each expert's pairs counted), "offs", "xs"
(x's rows in the order), "bsel" (a bias per sorted pair), "wsorted" (the gates in the order) and
"pcontrib" (f · gate per sorted pair); u, h and f are moe.py's with expert ("grouped", sort node).
"""
import torch

from mha_compile.lowering.canonicalize import dtype, shape
from mha_compile.lowering.interpret import ONE, ParamRef, Reject, Val, broadcast, ext_ref, known_eq

GROUPED = "grouped"


def grouped_rule(walk, node, op, gate_info, expert_info):
    """The Val of `op` on the sorted pairs, or None (moe.py's rules then read it). gate_info and
    expert_info are moe.py's: what a gate and a set of experts carry into the MoE's output."""
    kind = op.kind
    if kind in ("argsort", "sort"):
        return _sort(walk, node, op)
    if kind == "getitem":
        return _index(walk, walk.val(op.args[0]), op.args[1])
    if kind == "index_select":
        return _index(walk, walk.val(op.args[0]), op.args[2]) if op.args[1] == 0 else None
    if kind == "floordiv":
        return _pair_rows(node, walk.val(op.args[0]), walk.val(op.args[1]))
    if kind == "searchsorted":
        return _offsets(walk, node, op)
    if kind in ("sum", "histc", "scatter_add", "ones_like", "cumsum", "bincount"):
        return _counts(walk, node, op)
    if kind == "grouped_mm":
        return _grouped_mm(walk, node, op)
    if kind == "add" and len(op.args) == 2:
        return _bias(walk, *(walk.val(a) for a in op.args))
    if kind == "mul" and len(op.args) == 2:
        return _gated(*(walk.val(a) for a in op.args), gate_info, expert_info)
    if kind == "index_add":
        return _combine(walk, op)
    return None


def _flat_pairs(walk, val):
    """(the role of a top-k output flattened to its (row, slot) pairs row-major, the rows' merged
    role, k) for a topi or topw Val, or None. With k = 1 the flat pairs are the rows themselves."""
    topk = walk.vals.get(val.info.get("topk")) if val is not None and val.roles else None
    if topk is None or topk.kind != "topk":
        return None
    rows = walk.axes.merge(topk.roles[:-1])
    pairs = walk.axes.merge(topk.roles)
    if val.roles[0] == pairs or known_eq(walk.axes.sizes.get("s"), 1) and val.roles[0] == rows:
        return val.roles[0], rows, topk.info["k"]
    return None


def _sort(walk, node, op):
    src, dim, descending = walk.val(op.args[0]), op.args[1], op.args[2]
    if src is not None and src.kind == "order" and op.kind == "argsort" and not descending and dim in (None, 0, -1):
        # argsort of the order, its inverse: at each flat pair, its place among the sorted ones
        return Val("unorder", (src.info["flat"],), src.info)
    if src is None or src.kind != "topi" or src.roles is None or len(src.roles) != 1:
        return None
    flat = _flat_pairs(walk, src)
    if flat is None or dim not in (None, 0, -1):
        return None
    if descending:
        raise Reject(f"{node.name}: the (row, slot) pairs are sorted by expert in descending order; grouped "
                     f"GEMMs take the experts' groups in ascending order (offs)")
    info = {"order": node, "topk": src.info["topk"], "flat": flat[0], "rows": flat[1], "k": flat[2]}
    return Val("order" if op.kind == "argsort" else "sorted", (f"pairs:{node.name}",) if op.kind == "argsort" else None,
               info)


def _index(walk, src, index):
    """t[i] (or t.index_select(0, i)) on the sorted pairs: sort's outputs, the experts, x's rows,
    a bias per pair or the gates, each by the index that puts it in the sort's order."""
    if src is None:
        return None
    if src.kind == "sorted" and index in (0, 1):
        info = src.info
        return Val("pexpert" if index == 0 else "order", (f"pairs:{info['order'].name}",), info)
    items = index if isinstance(index, tuple) else (index,)
    first, rest = items[0], items[1:]
    by = walk.val(first) if isinstance(first, torch.fx.Node) else None
    if by is None or by.roles is None or any(i is not None for i in rest):
        return None
    info, pairs = by.info, by.roles[0]
    if by.kind == "order" and src.kind == "topi" and not rest and src.roles == (info["flat"],) and \
            src.info["topk"] is info["topk"]:
        return Val("pexpert", by.roles, info)
    if by.kind == "order" and src.kind == "topw" and src.roles and src.roles[0] == info["flat"] and \
            all(r == ONE for r in src.roles[1:]) and src.info["topk"] is info["topk"]:
        return Val("wsorted", (pairs,) + src.roles[1:] + (ONE,) * len(rest), dict(src.info, order=info["order"]))
    if by.kind == "prow" and src.kind == "x" and not rest and src.roles == (info["rows"], "d"):
        return Val("xs", (pairs, "d"), info)
    if by.kind == "order" and src.kind == "x" and not rest and src.roles == (info["flat"], "d"):
        return Val("xs", (pairs, "d"), info)  # x at each flat pair's row (x[arange(R·k) // k]), sorted
    if by.kind == "unorder" and src.kind == "pcontrib" and not rest and src.info["order"] is info["order"] and \
            src.roles == (f"pairs:{info['order'].name}", "d"):  # back in the flat pairs' order
        return Val("gcontrib", (info["flat"], "d"), {"gate": src.info["gate"], "experts": src.info["experts"]})
    ref = ext_ref(src)
    if by.kind == "pexpert" and ref is not None and not rest and ref.perm is None and ref.select is None and \
            not ref.steps:
        size = shape(ref.node)
        if size is None or len(size) != 2 or not walk.axes.bind("e", size[0]):
            return None
        return Val("bsel", (pairs, None), dict(info, ref=ParamRef(ref.node), width=size[1]))
    return None


def _pair_rows(node, order, k):
    """order // k: each sorted pair's row (the pairs are row-major, k a row)."""
    if order is None or order.kind != "order" or k is None or k.kind != "const":
        return None
    if k.info["value"] != order.info["k"]:
        raise Reject(f"{node.name}: the sorted pairs' rows are taken as order // {k.info['value']}, but top-k "
                     f"chooses k = {order.info['k']} experts a row")
    return Val("prow", order.roles, order.info)


def _offsets(walk, node, op):
    """searchsorted(the sorted experts, arange(E), right=True): each expert's end among the sorted
    pairs, the `offs` torch._grouped_mm takes (arange(1, E + 1) on the left side says the same)."""
    seq, values, right, side, sorter = walk.val(op.args[0]), op.args[1], op.args[3], op.args[4], op.args[5]
    if seq is None or seq.kind != "pexpert" or sorter is not None:
        return None
    right = bool(right) or side == "right"
    span = _arange(values)
    experts = walk.axes.sizes.get("e")
    if span is None or not isinstance(experts, int):
        return None
    if span != ((0, experts) if right else (1, experts + 1)):
        raise Reject(f"{node.name}: the grouped GEMMs' offsets are searchsorted over arange{span} "
                     f"(right={right}), not each expert's end among the sorted pairs: "
                     f"searchsorted(experts, arange({experts}), right=True)")
    return Val("offs", ("e",), _pairs_of(seq.info))


def _pairs_of(info):
    """What the experts' sequence in sorted order depends on: the top-k and its flat pairs."""
    return {"topk": info["topk"], "flat": info["flat"]}


def _same_pairs(walk, order, info):
    """Whether the sort `order` (a node) sorts the flat pairs that `info` (_pairs_of) counts."""
    sort = walk.vals.get(order)
    return sort is not None and _pairs_of(sort.info) == _pairs_of(info)


def _counts(walk, node, op):
    """Each expert's count of (row, slot) pairs, from the flat top-k: one_hot(flat, E).sum(0),
    histc(flat, bins=E) over a range that puts expert e in bin e, or zeros(E).scatter_add_(0,
    flat, ones_like(flat)); and their cumsum(0), each expert's end: the offsets."""
    args = [walk.val(a) for a in op.args]
    experts = walk.axes.sizes.get("e")
    if op.kind == "ones_like":
        src = args[0]
        return Val("ones", src.roles, src.info) if src is not None and src.kind == "topi" else None
    if op.kind == "cumsum":
        src, dim = args[0], op.args[1]
        if src is None or src.kind != "ecount" or dim not in (0, -1):
            return None
        return Val("offs", src.roles and ("e",), src.info)
    if op.kind == "bincount":
        # bincount(flat, minlength=E) has max(E, max(flat) + 1) = E bins, but its traced size is
        # data-dependent (unbacked, under capture_dynamic_output_shape_ops): no roles to bind
        src, weights, minlength = args[0], op.args[1], op.args[2]
        flat = _flat_pairs(walk, src) if src is not None and src.kind == "topi" and len(src.roles) == 1 else None
        if flat is None or weights is not None or minlength != experts:
            return None
        return Val("ecount", None, _flat_info(src, flat))
    if op.kind == "sum":
        src, dim, keepdim = args[0], op.args[1], op.args[2]
        if src is None or src.kind != "onehot" or dim not in (0, -2) or keepdim or len(src.roles) != 2:
            return None
        flat = _flat_pairs(walk, src)
        return None if flat is None else Val("ecount", ("e",), _flat_info(src, flat))
    if op.kind == "histc":  # of the flat experts, or of them sorted (the same counts)
        src, bins, low, high = args[0], op.args[1], op.args[2], op.args[3]
        flat = _flat_pairs(walk, src) if src is not None and src.kind == "topi" and len(src.roles) == 1 else None
        flat = (src.info["flat"],) if src is not None and src.kind == "pexpert" else flat
        if flat is None or not isinstance(experts, int):
            return None
        if bins != experts or not _histc_bins_are_experts(experts, low, high):
            raise Reject(f"{node.name}: histc(bins={bins}, min={low}, max={high}) of the experts does not count "
                         f"each of the {experts} experts in a bin of its own (bins={experts}, min=0, max={experts - 1} "
                         f"or {experts} do)")
        return Val("ecount", ("e",), _flat_info(src, flat))
    base, dim, index, ones = args[:4]  # scatter_add
    if index is not None and index.kind == "prow":
        return _combine(walk, op)  # zeros.scatter_add_(0, rows[:, None].expand(-1, D), f · gate)
    flat = _flat_pairs(walk, index) if index is not None and index.kind == "topi" and len(index.roles) == 1 else None
    if flat is None or base is None or base.kind != "zero" or op.args[1] != 0 or ones is None or ones.kind != "ones" \
            or ones.roles != index.roles or ones.info["topk"] is not index.info["topk"]:
        return None
    val = Val("ecount", ("e",), _flat_info(index, flat))
    if op.kwargs.get("_inplace"):
        walk.vals[op.args[0]] = val  # the counts are the zeros' own storage from here on
    return val


def _flat_info(val, flat):
    return {"topk": val.info["topk"], "flat": flat[0]}


def _histc_bins_are_experts(experts, low, high):
    """Whether histc(ids, bins=E, min=low, max=high) counts expert e in bin e for every e < E
    (bin = ⌊(v − low) · E / (high − low)⌋, the last bin closed: max E − 1 or E both do)."""
    if not all(isinstance(b, (int, float)) for b in (low, high)) or not high > low:
        return False
    for e in range(experts):
        if not low <= e <= high:
            return False
        index = experts - 1 if e == high else int((e - low) * experts / (high - low))
        if index != e:
            return False
    return True


def _arange(node):
    """(start, stop) of torch.arange(start, stop) with step 1 and int bounds, or None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target is not torch.arange:
        return None
    args = list(node.args) + [node.kwargs.get(k) for k in ("start", "end", "step") if k in node.kwargs]
    if not all(isinstance(a, int) for a in args) or not 1 <= len(args) <= 3:
        return None
    start, stop, step = (0, args[0], 1) if len(args) == 1 else (args + [1])[:3]
    return (start, stop) if step == 1 else None


def _grouped_mm(walk, node, op):
    """torch._grouped_mm(a, W, offs=offs): x's rows in the order against W1 (or W3) -> u, h -> f
    against W2, each sorted pair by its expert's weight [E, in, out]."""
    a, w, offs = walk.val(op.args[0]), walk.val(op.args[1]), walk.val(op.args[2])
    out_dtype = op.args[4]
    if a is None or offs is None or offs.kind != "offs" or op.args[3] is not None or \
            out_dtype not in (None, dtype(op.args[0])):
        return None
    ref, size = ext_ref(w), shape(op.args[1])
    if ref is None or ref.select is not None or ref.steps or size is None or len(size) != 3 or \
            not walk.axes.bind("e", size[0]):
        return None
    if a.kind == "xs" and _same_pairs(walk, a.info["order"], offs.info) and \
            known_eq(size[1], walk.axes.sizes.get("d")):
        return Val("u", (a.roles[0], "f"),
                   {"expert": (GROUPED, a.info["order"]), "topk": offs.info["topk"], "w1": ref, "b1": None})
    if a.kind == "h" and isinstance(a.info["expert"], tuple) and a.info["expert"][0] == GROUPED and \
            _same_pairs(walk, a.info["expert"][1], offs.info) and known_eq(size[1], walk.axes.sizes.get("f")):
        return Val("f", (a.roles[0], "d"), dict(a.info, w2=ref, b2=None))
    return None


def _bias(walk, a, b):
    """u + b1[expert] or f + b2[expert] on the sorted pairs."""
    if a is None or b is None:
        return None
    if b.kind in ("u", "f"):
        a, b = b, a
    if a.kind not in ("u", "f") or b.kind != "bsel" or not isinstance(a.info["expert"], tuple) or \
            not _same_pairs(walk, a.info["expert"][1], b.info):
        return None
    key = "b1" if a.kind == "u" else "b2"
    if a.info[key] is not None or not known_eq(b.info["width"], walk.axes.sizes.get(a.roles[-1])):
        return None
    return Val(a.kind, a.roles, dict(a.info, **{key: b.info["ref"]}))


def _gated(a, b, gate_info, expert_info):
    """f · gate per sorted pair (the gates taken in the same order)."""
    if a is None or b is None:
        return None
    if b.kind == "f":
        a, b = b, a
    if a.kind != "f" or b.kind != "wsorted" or a.info["expert"] != (GROUPED, b.info["order"]) or \
            broadcast(b.roles, a.roles) != a.roles:
        return None
    return Val("pcontrib", a.roles, {"gate": gate_info(b.info), "experts": expert_info(a.info),
                                     "order": b.info["order"]})


def _combine(walk, op):
    """zeros.index_add(0, rows, f · gate), or zeros.scatter_add(0, rows[:, None] broadcast over the
    width, f · gate): each row's gated expert outputs summed, the MoE's output."""
    out, dim, index, src = (walk.val(a) for a in op.args[:4])
    if out is None or out.kind != "zero" or dim is None or dim.kind != "const" or dim.info["value"] != 0 or \
            index is None or index.kind != "prow" or src is None or src.kind != "pcontrib" or \
            src.info["order"] is not index.info["order"]:
        return None
    if op.kind == "index_add" and (op.args[4] not in (None, 1) or len(index.roles) != 1):
        return None
    if op.kind == "scatter_add" and (index.roles[0] != src.roles[0] or any(r != ONE for r in index.roles[1:]) or
                                     len(index.roles) != len(src.roles) or shape(op.args[2]) != shape(op.args[3])):
        return None
    val = Val("moe_out", (index.info["rows"], "d"), {"gate": src.info["gate"], "experts": src.info["experts"]})
    if op.kwargs.get("_inplace"):
        walk.vals[op.args[0]] = val  # the in-place add changes what later readers of `out` see
    return val
