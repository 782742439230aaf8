"""Reading the inverted attention pool: tok [B,N,D] -> inv [B,D] (SPEC §1, step 1).

Vals, in the order the pool builds them (roles in brackets):
  tok (b,n,d) -> proj (b,n,d)  an affine map of the tokens (K or V; which one is decided by use)
  -> scores (b,d.0,n)          ⟨q_p, K[b,n,p]⟩: d split into heads d.0 and head dim d.1
  -> attn                      softmax over n of scores scaled by exactly 1/√Dh
  -> pooled (b,d.0,d.1)        Σ_n attn · V, then merged back to (b,d)
  -> inv (b,d)                 the output projection.
Each rule accepts any spelling that computes the same thing (linear or matmul with a
transposed weight, einsum with any letters, view/reshape/transpose in between).
"""
import math

from mha_compile.lowering.canonicalize import shape
from mha_compile.lowering.interpret import (ParamRef, Reject, Val, canonical_perm, einsum_roles, ext_ref,
                                            layout_rule, select_rule)

SCALE_RTOL = 1e-6
HEAD_ROLES = ("d.0", "d.1")


def _transposed(ref):
    """The ParamRef read as its transpose (x @ W uses W as [in,out]; nn.Linear stores [out,in])."""
    base = ref.perm or (0, 1)
    perm = (base[1], base[0])
    return ParamRef(ref.node, None if perm == (0, 1) else perm, ref.select)


def _affine(walk, node, x, weight, bias):
    """x Wᵀ + b on the last axis: a projection of the tokens, or the output projection."""
    if x is None or weight is None or x.roles is None or x.roles[-1] != "d":
        return None
    d = walk.axes.sizes.get("d")
    w_shape = shape(weight.node)
    if w_shape is None or len(w_shape) != 2 or shape(node)[-1] != d:
        return None
    if x.kind == "tok":
        return Val("proj", x.roles, {"w": weight, "b": bias})
    if x.kind == "pooled" and x.roles == ("b", "d"):
        return Val("inv", x.roles, dict(x.info, wo=weight, bo=bias))
    return None


def pool_rule(walk, node, op):
    if op.kind in ("reshape", "permute", "expand", "cast"):
        return layout_rule(walk, node, op)
    if op.kind == "getitem":
        return select_rule(walk, node, op)
    args = [walk.val(a) for a in op.args]
    if op.kind == "linear":
        x, w, b = args
        if ext_ref(w) is None or (b is not None and b.kind not in ("ext", "const")):
            return None
        return _affine(walk, node, x, ext_ref(w), ext_ref(b))
    if op.kind == "matmul" and ext_ref(args[1]) is not None and args[0] is not None:
        return _affine(walk, node, args[0], _transposed(ext_ref(args[1])), None)
    if op.kind == "add":
        return _add_bias(walk, node, *args)
    if op.kind in ("mul", "div"):
        return _scale(op.kind, *args)
    if op.kind == "einsum":
        return _einsum(walk, node, op.args[0], args[1:])
    if op.kind == "softmax":
        return _softmax(walk, node, args[0], op.args[1])
    return None


def _add_bias(walk, node, a, b):
    """proj/inv spelled as matmul + bias: the bias is a [D] parameter on the last axis."""
    if a is not None and a.kind == "ext":
        a, b = b, a
    if a is None or b is None or b.kind != "ext" or a.kind not in ("proj", "inv"):
        return None
    key = "b" if a.kind == "proj" else "bo"
    if a.info.get(key) is not None or shape(b.info["ref"].node) != (walk.axes.sizes.get("d"),):
        return None
    return Val(a.kind, a.roles, dict(a.info, **{key: ext_ref(b)}))


def _scale(kind, a, b):
    if a is None or b is None or a.kind != "scores" or b.kind != "const" or not isinstance(b.info["value"], (int, float)):
        return None
    c = float(b.info["value"])
    return Val("scores", a.roles, dict(a.info, scale=a.info["scale"] * (c if kind == "mul" else 1.0 / c)))


def _einsum(walk, node, equation, operands):
    if len(operands) != 2 or any(v is None for v in operands):
        return None
    kinds = [v.kind for v in operands]
    read = einsum_roles(equation, [v.roles for v in operands])
    if read is None:
        return None
    out_roles, letters, contracted, terms = read
    if sorted(kinds) == ["ext", "proj"]:
        k, q = (operands[0], operands[1]) if kinds[0] == "proj" else (operands[1], operands[0])
        q_term = terms[kinds.index("ext")]
        q_roles = tuple(letters.get(l) for l in q_term)
        if {letters.get(l) for l in contracted} != {"d.1"} or set(out_roles) != {"b", "n", "d.0"} or \
                canonical_perm(q_roles, HEAD_ROLES) is False or k.roles[:2] != ("b", "n"):
            return None
        ref = ext_ref(q)
        return Val("scores", out_roles, {"k": k.info, "q": ParamRef(ref.node, canonical_perm(q_roles, HEAD_ROLES)), "scale": 1.0})
    if sorted(kinds) == ["attn", "proj"]:
        attn, v = (operands[0], operands[1]) if kinds[0] == "attn" else (operands[1], operands[0])
        if {letters.get(l) for l in contracted} != {"n"}:
            raise Reject(f"{node.name}: the attention-weighted sum contracts {sorted(letters.get(l) for l in contracted)}; the pool sums over the tokens (n) only")
        if set(out_roles) != {"b", "d.0", "d.1"}:
            return None
        return Val("pooled", out_roles, dict(attn.info, v=v.info))
    return None


def _softmax(walk, node, scores, dim):
    if scores is None or scores.kind != "scores" or not isinstance(dim, int):
        return None
    role = scores.roles[dim]
    if role != "n":
        raise Reject(f"{node.name}: softmax over dim {dim} (the {_ROLE_NAMES.get(role, role)} axis); the pool normalises over the tokens")
    head_dim = walk.axes.sizes.get("d.1")
    expected = 1.0 / math.sqrt(head_dim)
    if abs(scores.info["scale"] - expected) > SCALE_RTOL * expected:
        raise Reject(f"{node.name}: scores are scaled by {scores.info['scale']:.6g}; the pool's scale is 1/√Dh = {expected:.6g}")
    return Val("attn", scores.roles, dict(scores.info))


_ROLE_NAMES = {"b": "batch", "n": "token", "d.0": "head", "d.1": "head-dim", "d": "feature"}


def pool_params(inv):
    """The pool's parameters from the Val of its output: {name: ParamRef or None}."""
    k, v = inv.info["k"], inv.info["v"]
    return {"q": inv.info["q"], "wk": k["w"], "bk": k["b"], "wv": v["w"], "bv": v["b"],
            "wo": inv.info["wo"], "bo": inv.info["bo"]}
