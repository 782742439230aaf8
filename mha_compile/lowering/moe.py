"""Reading the top-k MoE: x [rows..., D] -> out [rows..., D] (SPEC §1, step 3).

Router: x -> logits (rows,e) -> probs (softmax over e) -> topk over e -> topw / topi (rows,s),
optionally renormalised (topw / Σ_s topw). Gates, two ways:
  gate (rows,e)       a dense gate: zeros scattered with topw at topi (dense spelling);
  gatecol (rows,1)    one expert's gate: Σ_s topw · (topi == e) (loop spelling).
Experts, for one expert (loop) or all at once (dense, an extra "e" axis):
  u = x W1 + b1 (rows,f) -> h = act(u) (swiglu: silu(u) ⊙ x W3) -> f = h W2 + b2 (rows,d).
Combine: gatecol_e · f_e summed over every expert exactly once, or Σ_e gate · f.
Each expert-specific Val carries its config; sums only join Vals with the same config.
"""
from mha_compile.lowering.canonicalize import shape
from mha_compile.lowering.interpret import (ONE, ParamRef, Reject, Val, broadcast, canonical_perm, einsum_roles,
                                            ext_ref, layout_rule, select_rule)

ACT_OF = {("gelu", "none"): "gelu", ("gelu", "tanh"): "gelu_tanh", ("silu", None): "silu"}


def _rows(roles):
    return roles[:-1]


def moe_rule(walk, node, op):
    if op.kind in ("reshape", "permute", "expand", "cast"):
        return layout_rule(walk, node, op)
    if op.kind == "getitem":
        return select_rule(walk, node, op) or _topk_item(walk, op)
    args = [walk.val(a) for a in op.args]
    if op.kind == "linear":
        x, w, b = args
        if ext_ref(w) is None or (b is not None and b.kind not in ("ext", "const")):
            return None
        return _weight_product(walk, node, x, ext_ref(w), linear=True, bias=ext_ref(b))
    if op.kind == "matmul" and ext_ref(args[1]) is not None:
        return _weight_product(walk, node, args[0], ext_ref(args[1]), linear=False, bias=None)
    if op.kind == "einsum" and len(args) == 3:
        return _einsum(walk, node, op.args[0], args[1:])
    if op.kind == "softmax":
        return _softmax(node, args[0], op.args[1])
    if op.kind == "topk":
        return _topk(node, *args)
    if op.kind == "sum":
        return _sum(node, args[0], op.args[1], op.args[2])
    if op.kind == "div":
        return _renorm(*args)
    if op.kind == "eq":
        topi, e = args
        if topi is not None and topi.kind == "topi" and e is not None and e.kind == "const" and isinstance(e.info["value"], int):
            return Val("eqmask", topi.roles, dict(topi.info, expert=e.info["value"]))
        return None
    if op.kind == "zeros_like":
        return Val("zero", args[0].roles if args[0] is not None else None)
    if op.kind == "scatter":
        return _scatter(walk, node, *args)
    if op.kind in ("gelu", "silu"):
        return _activation(node, op, args[0])
    if op.kind == "mul":
        return _mul(walk, node, *args)
    if op.kind == "add":
        return _add(walk, node, *args)
    return None


def _topk_item(walk, op):
    src, i = walk.val(op.args[0]), op.args[1]
    if src is None or src.kind != "topk" or i not in (0, 1):
        return None
    if i == 0:
        return Val("topw", src.roles, dict(src.info, renorm=False))
    return Val("topi", src.roles, dict(src.info))


def _weight_product(walk, node, x, ref, linear, bias):
    """x against a parameter: the router's logits, or W1/W3 (from x) and W2 (from h) of an expert."""
    if x is None or x.roles is None:
        return None
    w_shape = shape(ref.node)
    used = ref if linear is False else ParamRef(ref.node, _swap(ref.perm), ref.select)  # as [in,out]
    if x.kind == "x" and ref.select is None and linear and x.roles[-1] == "d" and len(w_shape) == 2:
        if bias is not None:
            return None
        return Val("logits", _rows(x.roles) + ("e",), {"wg": ref, "x_roles": x.roles})
    if x.kind == "x" and ref.select is None and not linear and x.roles[-1] == "d" and len(w_shape) == 2:
        return Val("logits", _rows(x.roles) + ("e",), {"wg": ParamRef(ref.node, _swap(ref.perm)), "x_roles": x.roles})
    if ref.select is None:
        return None
    expert = ref.select
    base = ParamRef(ref.node, None if used.perm is None else (0,) + tuple(1 + p for p in used.perm))
    if x.kind == "x" and x.roles[-1] == "d":
        val = Val("u", _rows(x.roles) + ("f",), {"expert": expert, "w1": base, "b1": None})
        return _with_bias(walk, val, "b1", bias)
    if x.kind == "h" and x.info["expert"] == expert:
        val = Val("f", _rows(x.roles) + ("d",), dict(x.info, w2=base, b2=None))
        return _with_bias(walk, val, "b2", bias)
    return None


def _swap(perm):
    base = perm or (0, 1)
    swapped = (base[1], base[0])
    return None if swapped == (0, 1) else swapped


def _with_bias(walk, val, key, bias):
    if bias is None:
        return val
    return _add(walk, None, val, Val("ext", None, {"ref": bias}))


def _einsum(walk, node, equation, operands):
    """Dense experts: x·W1 / h·W2 over every expert at once, and Σ_e gate · f."""
    read = einsum_roles(equation, [v.roles if v is not None else None for v in operands])
    if read is None or any(v is None for v in operands):
        return None
    out_roles, letters, contracted, terms = read
    kinds = [v.kind for v in operands]
    if kinds == ["gate", "f"] or kinds == ["f", "gate"]:
        gate, f = operands if kinds[0] == "gate" else operands[::-1]
        if f.info["expert"] != "all" or {letters.get(l) for l in contracted} != {"e"}:
            return None
        if out_roles != _rows(gate.roles) + ("d",):
            return None
        return Val("moe_out", out_roles, {"gate": gate.info, "experts": f.info})
    if "ext" not in kinds:
        return None
    src, w = (operands[0], operands[1]) if kinds[1] == "ext" else (operands[1], operands[0])
    w_term, w_shape = terms[kinds.index("ext")], shape(ext_ref(w).node)
    fresh = [l for l in w_term if letters.get(l) is None]
    if w_shape is None or len(w_shape) != len(w_term) or ext_ref(w).select is not None or ext_ref(w).perm is not None:
        return None
    size = dict(zip(w_term, w_shape))
    if src.kind == "x" and {letters.get(l) for l in contracted} == {"d"} and len(fresh) == 2:
        # The weight's two own letters are its expert axis and its hidden axis: the expert
        # axis is the one as long as the router's E (in [E,D,F] order where both are).
        by_size = [l for l in fresh if walk.axes.sizes.get("e") is not None and size[l] == walk.axes.sizes["e"]]
        e = by_size[0] if len(by_size) == 1 else fresh[0]
        letters = dict(letters, **{e: "e", next(l for l in fresh if l != e): "f"})
        canonical, kind, extra = ("e", "d", "f"), "u", {"expert": "all", "b1": None}
        key = "w1"
    elif src.kind == "h" and src.info["expert"] == "all" and {letters.get(l) for l in contracted} == {"f"} and len(fresh) == 1:
        letters = dict(letters, **{fresh[0]: "d"})
        canonical, kind, extra = ("e", "f", "d"), "f", dict(src.info, b2=None)
        key = "w2"
    else:
        return None
    w_roles = tuple(letters[l] for l in w_term)
    out = tuple(letters.get(l) for l in _output(equation))
    rows = src.roles[:-2] if src.kind == "h" else src.roles[:-1]
    perm = canonical_perm(w_roles, canonical)
    if perm is False or out != rows + (canonical[0], canonical[2]):
        return None
    return Val(kind, out, dict(extra, **{key: ParamRef(ext_ref(w).node, perm)}))


def _output(equation):
    return equation.replace(" ", "").split("->")[1]


def _softmax(node, logits, dim):
    if logits is None or logits.kind != "logits" or not isinstance(dim, int):
        return None
    if logits.roles[dim] != "e":
        raise Reject(f"{node.name}: the router's softmax runs over dim {dim}, not over the experts")
    return Val("probs", logits.roles, dict(logits.info))


def _topk(node, probs, k, dim, largest, sorted_):
    if probs is None or k is None:
        return None
    if probs.kind == "logits":
        raise Reject(f"{node.name}: top-k is taken on the router logits before the softmax")
    if probs.kind != "probs" or k.kind != "const":
        return None
    dim = -1 if dim is None or dim.info["value"] is None else dim.info["value"]
    if probs.roles[dim] != "e":
        raise Reject(f"{node.name}: top-k runs over dim {dim}, not over the experts")
    if largest is not None and largest.info["value"] is False:
        raise Reject(f"{node.name}: top-k picks the smallest probabilities (largest=False)")
    return Val("topk", _rows(probs.roles) + ("s",), dict(probs.info, k=k.info["value"], topk=node))


def _sum(node, src, dim, keepdim):
    if src is None or src.kind not in ("topw", "maskedw") or not isinstance(dim, int):
        return None
    if src.roles[dim] != "s":
        return None
    roles = _rows(src.roles) + ((ONE,) if keepdim else ())
    return Val("sumw" if src.kind == "topw" else "gatecol", roles, dict(src.info))


def _renorm(topw, total):
    if topw is None or total is None or topw.kind != "topw" or total.kind != "sumw":
        return None
    if total.info["topk"] is not topw.info["topk"] or topw.info["renorm"] or total.info["renorm"]:
        return None
    return Val("topw", topw.roles, dict(topw.info, renorm=True))


def _scatter(walk, node, zero, dim, index, src):
    if zero is None or zero.kind != "zero" or index is None or index.kind != "topi" or src is None or src.kind != "topw":
        return None
    if index.info["topk"] is not src.info["topk"] or dim is None or dim.kind != "const":
        return None
    out = shape(node)
    if dim.info["value"] % len(out) != len(out) - 1 or not walk.axes.bind("e", out[-1]):
        return None
    return Val("gate", _rows(src.roles) + ("e",), dict(src.info))


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
        if topw.info["topk"] is not mask.info["topk"]:
            return None
        return Val("maskedw", broadcast(topw.roles, mask.roles), dict(topw.info, expert=mask.info["expert"]))
    if "gatecol" in pair and "f" in pair:
        gate, f = pair["gatecol"], pair["f"]
        if f.info["expert"] != gate.info["expert"] or broadcast(gate.roles, f.roles) != f.roles:
            return None
        return Val("contrib", f.roles, {"gate": _gate_key(gate.info), "experts": _expert_key(f.info),
                                        "covered": frozenset([f.info["expert"]])})
    if "h" in pair and "u" in pair:  # swiglu: silu(x W1 + b1) ⊙ (x W3)
        h, u3 = pair["h"], pair["u"]
        if h.info["act"] != "silu" or h.info["w3"] is not None or u3.info["b1"] is not None or \
                u3.info["expert"] != h.info["expert"] or h.roles != u3.roles:
            return None
        return Val("h", h.roles, dict(h.info, act="swiglu", w3=u3.info["w1"]))
    return None


def _gate_key(info):
    return (info["topk"], info["renorm"], info["k"], info["wg"])


def _expert_key(info):
    return tuple(info.get(k) for k in ("w1", "b1", "w3", "act", "w2", "b2"))


def _add(walk, node, a, b):
    if a is None or b is None:
        return None
    if b.kind in ("u", "f") or a.kind in ("zero",):
        a, b = b, a
    if a.kind in ("u", "f") and b.kind == "ext":
        key = "b1" if a.kind == "u" else "b2"
        ref = b.info["ref"]
        if a.info[key] is not None:
            return None
        if ref.select is not None:
            if a.info["expert"] != ref.select or ref.perm is not None:
                return None
        elif a.info["expert"] != "all" or not _bias_shape_ok(walk, a, ref):
            return None
        return Val(a.kind, a.roles, dict(a.info, **{key: ParamRef(ref.node)}))
    if a.kind == "contrib" and b.kind in ("zero", "contrib"):
        if b.kind == "zero":
            return _complete(walk, a)
        if a.info["gate"] != b.info["gate"] or a.info["experts"] != b.info["experts"] or \
                a.info["covered"] & b.info["covered"] or a.roles != b.roles:
            return None
        return _complete(walk, Val("contrib", a.roles, dict(a.info, covered=a.info["covered"] | b.info["covered"])))
    return None


def _bias_shape_ok(walk, val, ref):
    """A bias over every expert is [E,F] for u and [E,D] for f, right-aligned on (e, f|d)."""
    b_shape = shape(ref.node)
    return b_shape is not None and len(b_shape) == 2 and ref.perm is None and \
        walk.axes.bind("e", b_shape[0]) and walk.axes.bind(val.roles[-1], b_shape[1])


def _complete(walk, contrib):
    """A sum of contributions is the MoE's output once it covers every expert exactly once."""
    experts = walk.axes.sizes.get("e")
    if isinstance(experts, int) and contrib.info["covered"] == frozenset(range(experts)):
        gate_topk, renorm, k, wg = contrib.info["gate"]
        w1, b1, w3, act, w2, b2 = contrib.info["experts"]
        return Val("moe_out", contrib.roles, {"gate": {"topk": gate_topk, "renorm": renorm, "k": k, "wg": wg},
                                              "experts": {"w1": w1, "b1": b1, "w3": w3, "act": act, "w2": w2, "b2": b2}})
    return contrib


def moe_params(out):
    """Parameters and config of the MoE from the Val of its output."""
    gate, experts = out.info["gate"], out.info["experts"]
    params = {name: experts[name] for name in ("w1", "b1", "w2", "b2", "w3")}
    params["wg"] = gate["wg"]
    return params, {"top_k": gate["k"], "renorm": gate["renorm"], "act": experts["act"]}
