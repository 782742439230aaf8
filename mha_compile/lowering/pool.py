"""Reading the inverted attention pool: tok [B,N,D] -> inv [B,D] (SPEC §1, step 1).

Vals, in the order the pool builds them (roles in brackets):
  tok (b,n,d) -> proj (b,n,d)  an affine map of the tokens (K or V; which one is decided by use)
                 projcat (b,n,kv) one fused K|V linear, read as two projs once split in halves
                                  (chunk, split, slices, or view(B, N, 2, D).unbind(2))
  -> scores (b,d.0,n)          ⟨q_p, K[b,n,p]⟩: d split into heads d.0 and head dim d.1
  -> attn                      softmax over n of scores scaled by exactly 1/√Dh
  -> pooled (b,d.0,d.1)        Σ_n attn · V, then merged back to (b,d)
  -> inv (b,d)                 the output projection.
Size-1 axes (the single query position of matmul and SDPA spellings) may sit anywhere.
Each rule accepts any spelling that computes the same thing: linear or matmul with a
transposed weight, einsum with any letters, q @ Kᵀ with heads moved by transposes,
F.scaled_dot_product_attention with the learned query expanded over the batch, and
F.multi_head_attention_forward (what Dynamo captures for nn.MultiheadAttention), whose learned
query goes through the query projection: the op gets q = Wq·query + bq, computed on the
parameters in the graph. A key-padding mask is read from masked_fill(-inf) on the scores, a
boolean SDPA attn_mask (True = take part, so the op gets its negation) or key_padding_mask;
whether a row with every key masked is NaN (a plain softmax) or attends to nothing (SDPA's and
nn.MultiheadAttention's safe softmax, the op's own) is read too (info "empty_rows").
"""
import dataclasses
import functools
import math

import torch

from mha_compile.lowering.aliases import written_in_place
from mha_compile.lowering.canonicalize import canon, dtype, float_dtype, shape, sum_of_product
from mha_compile.lowering.interpret import (BATCH_HEADS, ONE, ParamRef, Reject, Val, base_layout, broadcast,
                                            canonical_perm, einsum_roles, ext_ref, ext_val, graph_scalar,
                                            graph_value_reason, known_eq, layout_rule, query_ref, ref_shape,
                                            select_rule, with_step)

HEAD_ROLES = ("d.0", "d.1")


def _transposed(ref):
    """The ParamRef read as its transpose (x @ W uses W as [in,out]; nn.Linear stores [out,in])."""
    base = ref.perm or (0, 1)
    perm = (base[1], base[0])
    return dataclasses.replace(ref, perm=None if perm == (0, 1) else perm)


def _unselected(ref):
    """A slice W[i] of a stacked parameter (K's and V's weights kept as one kv_w [2, D, D], read as
    kv_w[0], kv_w.select(0, 1) or kv_w.unbind(0)) as the tensor it is: its select an index step,
    which the rewrite takes as written (a select is an expert's, which it stacks per expert)."""
    if ref is None or ref.select is None:
        return ref
    return dataclasses.replace(ref, select=None, steps=ref.steps + (("index", (ref.select,)),))


def _affine(walk, node, x, weight, bias):
    """x Wᵀ + b on the last axis: a projection of the tokens, or the output projection."""
    if x is None or weight is None or x.roles is None or x.roles[-1] != "d":
        return None
    d = walk.axes.sizes.get("d")
    weight, bias = _unselected(weight), _unselected(bias)
    w_shape = ref_shape(weight)
    if w_shape is None or len(w_shape) != 2:
        return None
    if x.kind == "tok" and shape(node)[-1] == d:
        return Val("proj", x.roles, {"w": weight, "b": bias})
    if x.kind == "tok" and isinstance(d, int) and shape(node)[-1] == 2 * d and weight.perm is None:
        return Val("projcat", x.roles[:-1] + ("kv",), {"w": weight, "b": bias})
    if x.kind == "pooled" and tuple(r for r in x.roles if r != ONE) == ("b", "d") and x.roles[-1] == "d" and \
            shape(node)[-1] == d:  # [B, 1, D] too (one latent projected, then x[:, 0]: a review's)
        return Val("inv", x.roles, dict(x.info, wo=weight, bo=bias))
    if x.kind == "tok" and isinstance(d, int) and isinstance(shape(node)[-1], int) and shape(node)[-1] < d:
        # (a review's: the reason named the linear alone)
        heads = walk.axes.sizes.get("d.0")
        raise Reject(f"{node.name}: a projection of the tokens to {shape(node)[-1]} features, where the pool's K and "
                     f"V keep all D = {d}: K and V with fewer heads than the query (multi-query or grouped-query "
                     f"attention{f', the query having {heads} heads' if heads else ''}) are not the block's pool, "
                     f"whose every query head has a K and V head of its own")
    return None


def pool_rule(walk, node, op):
    if op.kind in ("reshape", "permute", "expand", "cast"):
        return layout_rule(walk, node, op)
    if op.kind == "getitem":
        return select_rule(walk, node, op) or _item(walk, node, op)
    if op.kind == "not":  # ~mask after its broadcast over the heads: elementwise, so it keeps the broadcast
        src = walk.val(op.args[0])
        lay = src.info.get("lay") if src is not None and src.kind == "ext" else None
        return None if lay is None else ext_val(node, ParamRef(node), lay)
    op = sum_of_product(op) or op  # (k * q).sum(-1), (attn[..., None] * v).sum(1): einsums
    args = [walk.val(a) for a in op.args]
    if op.kind in ("add", "sub", "mul", "div") and any(a is not None and a.kind == "tok" for a in args):
        raise Reject(f"{node.name}: the tokens are changed by {op.kind} before a projection of the pool, while "
                     f"another projection reads them as they are; K and V project the same tokens (a forward pre-hook "
                     f"on the key or value projection that changes its input, say)")
    if op.kind == "linear":
        x, w, b = args
        # a bias read as no parameter (b.reshape(D), b.expand(D): a review's, read as no bias, 0.48 off)
        if ext_ref(w) is None or (b is not None and b.kind != "const" and ext_ref(b) is None):
            return None
        if x is not None and x.kind == "ext" and x.info.get("lay") is not None and shape(node) is not None:
            # a batch-invariant tensor projected (a latent query expanded over the batch, then q = Linear(it):
            # timm's and Perceiver's order): a row-wise map keeps its broadcast axes, so it is read as one
            # too, by its row 0 (a review's: read as a tensor of its own, [B, 1, D], the pool was refused)
            lay = x.info["lay"][:-1] + base_layout(node)[-1:]  # the features' axis its own, as a base's
            return ext_val(node, ParamRef(node), lay) if walk.axes.bind_all(lay, shape(node)) else None
        return _affine(walk, node, x, ext_ref(w), ext_ref(b))
    if op.kind == "matmul" and args[0] is not None and args[0].kind != "ext" and ext_ref(args[1]) is not None:
        return _affine(walk, node, args[0], _transposed(ext_ref(args[1])), None)
    if op.kind == "matmul":
        return _matmul(walk, node, *args)
    if op.kind == "add":
        return _add_bias(walk, node, *args)
    if op.kind in ("mul", "div"):
        return _scale(node, op.kind, *args) or _prescaled(walk, node, op.kind, *args)
    if op.kind == "einsum":
        return _einsum(walk, node, op.args[0], args[1:])
    if op.kind == "softmax":
        return _softmax(walk, node, args[0], op.args[1])
    if op.kind == "masked_fill":
        return _masked_fill(walk, node, *args)
    if op.kind in ("chunk", "split"):
        return _split(walk, node, op.kind, args[0], op.args[1], args[2])
    if op.kind == "unbind":
        return _unbind(walk, node, *args)
    if op.kind == "sdpa":
        return _sdpa(walk, node, *args)
    if op.kind == "mha":
        return _mha(walk, node, op, args)
    return None


def _add_bias(walk, node, a, b):
    """proj/inv spelled as matmul + bias: the bias is a [D] parameter on the last axis."""
    if a is not None and a.kind == "ext":
        a, b = b, a
    if a is not None and b is not None and a.kind == "scores" and b.kind == "ext" and a.info.get("mask") is None \
            and _neg_inf_mask(b.info["node"]):
        ref = _mask_ref(b, a.roles, node, invert=False, sizes=walk.axes.sizes)
        return None if ref is None else Val("scores", a.roles, dict(a.info, mask=ref))
    if a is not None and b is not None and a.kind == "scores" and b.kind == "ext":
        # (a review's: a learned position bias was told to become a boolean mask, which changes the model)
        raise Reject(f"{node.name}: a tensor is added to the scores (a position bias, or a float mask not built "
                     f"as zeros.masked_fill(pad, -inf) or torch.where(pad, -inf, 0)); the pool's scores are "
                     f"⟨q, K⟩/√Dh with at most a key-padding mask: a float mask built that way, or "
                     f"scores.masked_fill(pad[:, None, :], float('-inf')) (pad: True = ignore), is read as one; a "
                     f"bias is not the block's")
    if a is None or b is None or b.kind != "ext" or a.kind not in ("proj", "inv") or ext_ref(b) is None:
        return None
    key, bias = "b" if a.kind == "proj" else "bo", _unselected(ext_ref(b))
    if a.info.get(key) is not None or ref_shape(bias) != (walk.axes.sizes.get("d"),):
        return None
    if a.roles[-1] != "d":  # (a review's: (tok @ Wvᵀ).transpose(1, 2) + bv with N = D added bv per token)
        raise Reject(f"{node.name}: a [D] bias is added along the {_ROLE_NAMES.get(a.roles[-1], a.roles[-1])} "
                     f"axis of a projection; the region adds it to the features (the last axis of x Wᵀ)")
    return Val(a.kind, a.roles, dict(a.info, **{key: bias}))


def _scale(node, kind, a, b):
    for val, other, arg in zip((a, b), (b, a), canon(node).args):
        if other is not None and other.kind == "scores" and (val is None or val.kind != "const") and graph_scalar(arg):
            raise Reject(graph_value_reason(node, f"the scores' {'factor' if kind == 'mul' else 'divisor'}", arg))
    if a is not None and a.kind == "const" and kind == "mul":
        a, b = b, a
    if a is None or b is None or a.kind != "scores" or b.kind != "const" or \
            not isinstance(b.info["value"], (int, float)):
        return None
    c = float(b.info["value"])
    if a.info.get("mask") is not None and not c > 0:  # -inf · -1 = +inf: the masked tokens would take all the weight
        raise Reject(f"{node.name}: the masked scores are {'multiplied' if kind == 'mul' else 'divided'} by {c:g}, "
                     f"which turns the mask's -inf into {'+inf' if c < 0 else 'nan'}; the pool scales the scores by "
                     f"1/√Dh > 0 and masks them after (or before) that")
    if kind == "div" and c == 0:  # (a review's: the matcher raised ZeroDivisionError)
        raise Reject(f"{node.name}: the scores are divided by 0; the pool scales them by 1/√Dh")
    return Val("scores", a.roles, dict(a.info, scale=a.info["scale"] * (c if kind == "mul" else 1.0 / c)))


def _prescaled(walk, node, kind, a, b):
    """A parameter times (or over) a constant, outside the region: read like any external tensor
    (the op takes the product as it is), remembering the parameter and the factor, so that a
    query pre-scaled by 1/√Dh (q = self.query / math.sqrt(Dh), scores unscaled) can be read as
    the block with the query itself (see _softmax)."""
    if a is not None and a.kind == "const" and kind == "mul":
        a, b = b, a
    value = None if b is None or b.kind != "const" else b.info["value"]
    if a is None or a.kind != "ext" or isinstance(value, bool) or not isinstance(value, (int, float)) or value == 0:
        return None
    inner, lay = ext_ref(a), base_layout(node)
    if inner is None and a.info.get("lay") is not None and ONE in a.info["lay"] and \
            shape(a.info["node"]) == shape(node):
        # a query expanded over the batch, then scaled (timm's q = q * self.scale): the product keeps the
        # broadcast axes, and the expanded query is the inner one (a review's: refused before)
        inner, lay = ParamRef(a.info["node"]), a.info["lay"]
    if inner is None or lay is None or not walk.axes.bind_all(lay, shape(node)):
        return None
    val = ext_val(node, ParamRef(node), lay)
    val.info["prescaled"] = (inner, float(value) if kind == "mul" else 1.0 / float(value))
    val.info["scaled"] = a.info["node"]  # the tensor scaled, as it is there (a view of the parameter, say)
    return val


def _prescaled_query(query, ref_of):
    """A pre-scaled query's inner query, read as the query itself is (ref_of: an ext Val -> its [P, Dh]
    ParamRef), with the factor; None where the query is not pre-scaled. The matmul and SDPA pools take
    it as the einsum pool does (_softmax moves the factor into the scale)."""
    inner, factor = query.info.get("prescaled", (None, None))
    if inner is None or inner.perm is not None or inner.select is not None or inner.steps:
        return None
    scaled = inner.node if shape(inner.node) == shape(query.info["node"]) else query.info["scaled"]
    if shape(scaled) != shape(query.info["node"]):
        return None
    inner_ref = ref_of(ext_val(scaled, ParamRef(scaled), query.info["lay"]))
    return None if inner_ref is None else (inner_ref, factor)


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
                sorted(k.roles) != ["b", "d.0", "d.1", "n"]:
            return None
        if "b" in q_roles:  # the query expanded over the batch ("bpd,bnpd->bpn"): read where it is a broadcast
            ref = query_ref(q, tuple(None if r == "b" else r for r in q_roles), one_head=_one_head(walk),
                            heads=walk.axes.sizes.get("d.0"))
            info = {"k": k.info, "q": ref, "scale": 1.0, "mask": None}
            return None if ref is None else Val("scores", out_roles, info)
        if canonical_perm(q_roles, HEAD_ROLES) is False or ext_ref(q) is None:
            return None
        ref, perm = ext_ref(q), canonical_perm(q_roles, HEAD_ROLES)
        q_shape = shape(q.info["node"])
        if q_shape is None or len(q_shape) != len(q_roles) or not all(
                known_eq(n, walk.axes.sizes.get(r)) for n, r in zip(q_shape, q_roles)):
            raise Reject(f"{node.name}: the query has shape {list(q_shape or ())}, broadcast to "
                         f"{[walk.axes.sizes.get(r) for r in q_roles]} (heads, head dim); the pool's query is a "
                         f"vector of its own per head, [P, Dh]")  # the op took [1, Dh] for [P, Dh]: a crash
        if ref.select is not None:
            return None  # a slice of a larger parameter (q3[1]): the op got the whole of it and crashed (a review's)
        info = {"k": k.info, "q": dataclasses.replace(ref, perm=_then(ref.perm, perm)), "scale": 1.0, "mask": None}
        inner, factor = q.info.get("prescaled", (None, None))
        if inner is not None and inner.perm is None and inner.select is None and not inner.steps:
            info["prescaled"] = (ParamRef(inner.node, perm), factor)  # a scalar multiple keeps the layout
        return Val("scores", out_roles, info)
    if sorted(kinds) == ["attn", "proj"]:
        attn, v = (operands[0], operands[1]) if kinds[0] == "attn" else (operands[1], operands[0])
        if {letters.get(l) for l in contracted} != {"n"}:
            raise Reject(f"{node.name}: the attention-weighted sum contracts "
                         f"{sorted(letters.get(l) for l in contracted)}; the pool sums over the tokens (n) only")
        if set(out_roles) != {"b", "d.0", "d.1"}:
            return None
        return Val("pooled", out_roles, dict(attn.info, v=v.info))
    return None


def _then(first, second):
    """The permutation of a tensor's axes by `first`, then by `second` (None: identity). The
    einsum's letters put the query in [P, Dh] order from the layout it has at the einsum, which is
    the stored tensor's permuted by its ParamRef's own perm: query.t() read by "dp,..." was
    transposed twice (0.075 off, a review's)."""
    if second is None:
        return first
    if first is None:
        return second
    composed = tuple(first[i] for i in second)
    return None if composed == tuple(range(len(composed))) else composed


def _matmul_roles(a, b):
    """(output roles, (a's contracted role, b's)) of a @ b with broadcast batch axes, or None."""
    if a is None or b is None or len(a) < 2 or len(b) < 2:
        return None
    batch = broadcast(a[:-2], b[:-2])
    return None if batch is None else (batch + (a[-2], b[-1]), (a[-1], b[-2]))


def _wanted(n, k_roles, query_first):
    """What each axis of the query operand of q @ Kᵀ (or K @ qᵀ) must be, aligned with K's roles."""
    batch = tuple(k_roles[:-2])
    batch = batch[len(batch) - (n - 2):] if n > 2 else ()
    return [r if r in HEAD_ROLES or r == BATCH_HEADS else None for r in batch] + \
        ([None, "d.1"] if query_first else ["d.1", None])


def _one_head(walk):
    """The one-head reading (P = 1, the walk's trivial split of d into a size-1 d.0)."""
    return walk.axes.trivial_split == "d" and known_eq(walk.axes.sizes.get("d.0"), 1)


def _matmul(walk, node, a, b):
    """q @ Kᵀ -> scores; attn @ V -> pooled (head axes as batch axes, any size-1 query axis)."""
    if a is None or b is None:
        return None
    for query, k, query_first in ((a, b, True), (b, a, False)):
        if query.kind == "ext" and k.kind == "proj" and query.info.get("lay") is not None:
            lay = query.info["lay"]
            if len(lay) < 2 or len(lay) > len(k.roles) or k.roles[-1 if query_first else -2] != "n":
                return None
            wanted = _wanted(len(lay), k.roles, query_first)
            read = functools.partial(query_ref, wanted=wanted, one_head=_one_head(walk),
                                     heads=walk.axes.sizes.get("d.0"))  # the query, and a pre-scaled one's
            ref = read(query)
            if ref is None:
                return None
            q_roles = tuple(w or ONE for w in wanted)
            roles = _matmul_roles(q_roles, k.roles) if query_first else _matmul_roles(k.roles, q_roles)
            if roles is None:
                return None
            out, contracted = roles
            if contracted != ("d.1", "d.1") or not ({"b", "d.0"} <= set(out) or BATCH_HEADS in out):
                return None
            info = {"k": k.info, "q": ref, "scale": 1.0, "mask": None}
            prescaled = _prescaled_query(query, read)
            return Val("scores", out, dict(info, prescaled=prescaled) if prescaled else info)
    if a.kind == "attn" and b.kind == "proj":
        roles = _matmul_roles(a.roles, b.roles)
        if roles is None:
            return None
        out, contracted = roles
        if contracted != ("n", "n"):
            raise Reject(f"{node.name}: the attention-weighted sum contracts {contracted}; "
                         "the pool sums over the tokens (n) only")
        if sorted(r for r in out if r != ONE) not in (["b", "d.0", "d.1"], [BATCH_HEADS, "d.1"]):
            return None
        return Val("pooled", out, dict(a.info, v=b.info))
    return None


def _neg_inf_mask(node):
    """True when `node` (up to layout ops) is zeros.masked_fill(bool, -inf), or torch.where(bool,
    -inf, 0) either way round: a float mask that holds only 0 and -inf, so it is exactly the
    boolean mask isneginf(node). Not where the graph writes any tensor of that chain in place
    (fm[:, 0] = -1 after the fill: a review's)."""
    chain = [node]
    while True:
        op = canon(node)
        if op is not None and op.kind in ("reshape", "permute", "expand", "cast") and hasattr(op.args[0], "op") and \
                float_dtype(node) is not None:  # .to(int64) of -inf is INT64_MIN, a finite mask (a review's: 0.13 off)
            node = op.args[0]
            chain.append(node)
            continue
        break
    if _where_neg_inf(node):
        return float_dtype(node) is not None and not any(written_in_place(n) for n in chain)
    if op is None or op.kind != "masked_fill" or op.args[2] != float("-inf") or dtype(op.args[1]) != torch.bool or \
            float_dtype(node) is None:
        return False
    base = canon(op.args[0]) if hasattr(op.args[0], "op") else None
    return base is not None and base.kind in ("zeros_like", "zeros") and \
        not any(written_in_place(n, besides={node}) for n in chain + [op.args[0]])  # masked_fill_ fills its zeros


def _where_neg_inf(node):
    """torch.where(bool, -inf, 0) or torch.where(bool, 0, -inf), of numbers (a review's: refused)."""
    if node.op != "call_function" or node.target is not torch.where or len(node.args) != 3 or node.kwargs:
        return False
    cond, *values = node.args
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    return numbers and dtype(cond) == torch.bool and sorted(map(float, values)) == [float("-inf"), 0.0]


def _mask_ref(val, wanted, node, invert, sizes):
    """A boolean key-padding mask [B,N] read from a mask broadcast against roles `wanted`
    (a float mask of only 0 and -inf is read as the boolean where it is -inf). sizes: the walk's;
    a batch or token axis of size 1 is the mask's own there (B = 1: refused before, a review's)."""
    lay = val.info.get("lay") if val is not None and val.kind == "ext" else None
    if lay is None or len(lay) != len(wanted):
        return None
    as_float = dtype(val.info["node"]) != torch.bool and _neg_inf_mask(val.info["node"])
    if dtype(val.info["node"]) != torch.bool and not as_float:
        # SDPA's boolean attn_mask (invert) means True = take part (a review's: the reason gave the other sense)
        sense = "True = take part, as SDPA reads it" if invert else "True = ignore the token"
        raise Reject(f"{node.name}: the attention mask is {dtype(val.info['node'])}, and not built as "
                     f"zeros.masked_fill(pad, -inf) or torch.where(pad, -inf, 0) (a float mask of only 0 and -inf); "
                     f"the region takes a boolean key-padding mask ({sense}) or a float mask built that way")
    for w, r in zip(wanted, lay):
        if (w in ("b", "n")) == (r == ONE) and not (w in ("b", "n") and known_eq(sizes.get(w), 1)):
            raise Reject(f"{node.name}: the mask varies along {[w for w, r in zip(wanted, lay) if r != ONE]}; "
                         f"a key-padding mask varies along batch and tokens only")
    items = tuple(":" if w in ("b", "n") else 0 for w in wanted)
    ref = ParamRef(val.info["node"])
    if items != (":", ":"):
        ref = with_step(ref, ("index", items))
    if [w for w in wanted if w in ("b", "n")] == ["n", "b"]:
        ref = dataclasses.replace(ref, perm=(1, 0))
    if as_float:  # additive: -inf = ignore, whatever the spelling's boolean sense would be
        return with_step(ref, ("isneginf",))
    return with_step(ref, ("not",)) if invert else ref


def _masked_fill(walk, node, scores, mask, value):
    if scores is None or scores.kind != "scores" or mask is None or value is None or value.kind != "const":
        return None
    if value.info["value"] != float("-inf"):
        raise Reject(f"{node.name}: masked scores are filled with {value.info['value']}; a key-padding mask fills -inf")
    if scores.info.get("mask") is not None:
        return None
    ref = _mask_ref(mask, scores.roles, node, invert=False, sizes=walk.axes.sizes)
    return None if ref is None else Val("scores", scores.roles, dict(scores.info, mask=ref))


def _split(walk, node, kind, src, size, dim):
    """One fused K|V projection split in two halves on its last axis (chunk(2), split(D) or
    split([D, D]): the list refused before, a review's). size: the call's own argument."""
    if src is None or src.kind != "projcat" or dim is None or dim.kind != "const":
        return None
    if dim.info["value"] not in (-1, len(src.roles) - 1):
        return None
    d = walk.axes.sizes.get("d")
    if (kind == "chunk" and size == 2) or (kind == "split" and size in (d, [d, d], (d, d))):
        return Val("projparts", src.roles, dict(src.info))
    return None


def _unbind(walk, node, src, dim):
    """kv.view(B, N, 2, D).unbind(2): the fused K|V projection viewed as two halves of D features
    (K first), then unbound along the axis of 2. A view as (D, 2) would interleave K and V
    features instead: the axis unbound must be the halves', followed by the D features."""
    if src is None or src.kind != "projcat" or dim is None or dim.kind != "const" or src.roles is None:
        return None
    in_shape = shape(node.args[0])
    axis = dim.info["value"] % len(src.roles)
    if sorted(r for r in src.roles if r.startswith("kv.")) == ["kv.0", "kv.1", "kv.2"] and \
            src.roles[axis] == "kv.0" and in_shape is not None and in_shape[axis] == 2:
        # timm's kv(x).reshape(B, N, 2, P, Dh).permute(2, 0, 3, 1, 4).unbind(0): the halves' axis,
        # then each half's D features as P heads of Dh, in any order of the other axes (a review's)
        sizes = walk.axes.sizes
        if not (walk.axes.bind("d.0", sizes.get("kv.1")) and walk.axes.bind("d.1", sizes.get("kv.2"))):
            return None
        heads = tuple({"kv.1": "d.0", "kv.2": "d.1"}.get(r, r) for i, r in enumerate(src.roles) if i != axis)
        return Val("projparts", None, dict(src.info, heads=heads))
    if src.roles[-2:] != ("kv.0", "kv.1") or axis != len(src.roles) - 2 or in_shape is None or \
            in_shape[-2] != 2 or in_shape[-1] != walk.axes.sizes.get("d"):
        return None
    return Val("projparts", src.roles[:-2] + ("kv",), dict(src.info))


def _half(info, i, d):
    cut = lambda ref: with_step(ref, ("index", (("range", i * d, (i + 1) * d),)))
    return Val("proj", None, {"w": cut(info["w"]), "b": cut(info["b"])})


def _item(walk, node, op):
    src, index = walk.val(op.args[0]), op.args[1]
    if src is None:
        return None
    d = walk.axes.sizes.get("d")
    if src.kind == "projparts" and index in (0, 1):
        half = _half(src.info, index, d)
        return Val("proj", src.info.get("heads") or src.roles[:-1] + ("d",), half.info)
    if src.kind == "projcat" and index in (0, 1):  # timm's permuted K|V taken as kv[0], kv[1] (older timm)
        parts = _unbind(walk, node, src, Val("const", None, {"value": 0}))
        heads = None if parts is None else parts.info.get("heads")
        return None if heads is None else Val("proj", heads, _half(parts.info, index, d).info)
    if src.kind == "projcat":  # kv[..., :D] / kv[:, :, D:]
        items = index if isinstance(index, tuple) else (index,)
        last = items[-1]
        if not isinstance(last, slice) or last.step not in (None, 1) or not all(
                i == slice(None) or i is Ellipsis for i in items[:-1]) or \
                (Ellipsis not in items and len(items) != len(src.roles)):
            return None
        bounds = (last.start or 0, last.stop if last.stop is not None else 2 * d)
        if bounds not in ((0, d), (d, 2 * d)):
            return None
        return Val("proj", src.roles[:-1] + ("d",), _half(src.info, bounds[0] // d, d).info)
    if src.kind == "mha_out" and index == 0:
        return Val("inv", src.roles, dict(src.info))
    return None


def _const(val, default=None):
    """An argument's constant value: `default` where it was not given (None as written), "?" where it
    is a value of the graph or one the walk cannot read (val None: an unread dropout_p is no 0)."""
    if val is not None and val.kind == "const" and val.info["value"] is None:
        return default
    return val.info["value"] if val is not None and val.kind == "const" else "?"


def _absent(val):
    """Whether an optional argument was not given (None as written). An argument the walk cannot
    read (val None: a mask computed from tok itself) is no absent one: read as absent, SDPA's
    attn_mask was dropped, 0.17 off (a review's)."""
    return val is not None and val.kind == "const" and val.info["value"] is None


def _sdpa(walk, node, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    if k is None or v is None or k.kind != "proj" or v.kind != "proj" or q is None or q.kind != "ext":
        return None
    if k.roles != v.roles or k.roles[-2:] != ("n", "d.1") or sorted(k.roles[:-2]) != ["b", "d.0"]:
        return None
    lay = q.info.get("lay")
    if lay is None or len(lay) != len(k.roles):
        return None
    wanted = [r if r in HEAD_ROLES else None for r in k.roles[:-2]] + [None, "d.1"]
    read = functools.partial(query_ref, wanted=wanted, one_head=_one_head(walk))  # the query, and a pre-scaled one's
    ref = read(q)
    if ref is None:
        return None
    if _const(dropout_p, 0.0) not in (0, 0.0):
        raise Reject(f"{node.name}: attention dropout (dropout_p={_const(dropout_p)}); the pool has none")
    if _const(is_causal, False) is not False:
        raise Reject(f"{node.name}: is_causal=True masks tokens by position; the pool attends to all of them")
    if _const(enable_gqa, False) not in (False, True):
        return None
    # enable_gqa=True where K and V have as many heads as the query (query_ref bound both to d.0): the
    # same attention (a review's: refused with a reason naming SDPA); fewer K/V heads fail that binding
    head_dim = walk.axes.sizes.get("d.1")
    given = _const(scale)
    if given == "?" and graph_scalar(canon(node).args[6]):
        raise Reject(graph_value_reason(node, "its scale", canon(node).args[6]))
    scale = 1.0 / math.sqrt(head_dim) if given is None else given
    if not isinstance(scale, (int, float)):
        return None
    mask = None if _absent(attn_mask) else _mask_ref(attn_mask, k.roles[:-2] + (ONE, "n"), node, invert=True,
                                                         sizes=walk.axes.sizes)
    if not _absent(attn_mask) and mask is None:
        raise Reject(f"{node.name}: its attn_mask could not be read as a key-padding mask given to the region (one "
                     f"computed from tok inside it, say); the op would attend without it")
    info = {"k": k.info, "q": ref, "scale": float(scale), "mask": mask}
    prescaled = _prescaled_query(q, read)
    attn = _softmax(walk, node, Val("scores", k.roles[:-2] + (ONE, "n"),
                                    dict(info, prescaled=prescaled) if prescaled else info), -1, safe=True)
    return Val("pooled", k.roles[:-2] + (ONE, "d.1"), dict(attn.info, v=v.info))


def _mha(walk, node, op, args):
    """F.multi_head_attention_forward(query, tok, tok, ...) with a learned query (L = 1)."""
    names = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
             "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
             "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
             "k_proj_weight", "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal")
    a = dict(zip(names, args))
    key, value, query = a["key"], a["value"], a["query"]
    if key is None or value is None or key.kind != "tok" or value.kind != "tok" or key.roles != ("n", "b", "d") \
            or value.roles != key.roles or query is None or query.kind != "ext":
        return None
    d, heads = walk.axes.sizes.get("d"), _const(a["num_heads"])
    lay = query.info.get("lay")
    if lay is None or len(lay) != 3 or lay[0] != ONE or lay[1] != ONE or lay[2] == ONE:
        raise Reject(f"{node.name}: the attention query is not one learned vector broadcast over the batch "
                     f"(shape {shape(query.info['node'])}); the pool's query is a parameter")
    if shape(query.info["node"])[2] != d:  # (a review's: the reason blamed the query)
        raise Reject(f"{node.name}: the query is {shape(query.info['node'])[2]} wide and the tokens {d} "
                     f"(nn.MultiheadAttention with kdim or vdim other than embed_dim); the block's K and V project "
                     f"tokens as wide as the query")
    for name, ok in (("bias_k", _absent(a["bias_k"])), ("bias_v", _absent(a["bias_v"])),
                     ("add_zero_attn", _const(a["add_zero_attn"], False) is False),
                     ("attn_mask", _absent(a["attn_mask"])), ("is_causal", _const(a["is_causal"], False) is False),
                     ("static_k", _absent(a["static_k"])), ("static_v", _absent(a["static_v"])),
                     ("use_separate_proj_weight", _const(a["use_separate_proj_weight"], False) is False),
                     ("dropout_p", _const(a["dropout_p"], 0.0) in (0, 0.0) or _const(a["training"], True) is False)):
        if not ok and name == "dropout_p" and _const(a["dropout_p"]) == "?":
            raise Reject(f"{node.name}: nn.MultiheadAttention's dropout_p is a value of the graph, not a constant "
                         f"(under dynamic=True Dynamo passes a module's float as a tensor, which may change with no "
                         f"recompile); the pool has no dropout, so in training it runs as written (in eval it is read)")
        if not ok:
            raise Reject(f"{node.name}: nn.MultiheadAttention with {name} set; the pool has no such term")
    projections = ("in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias")
    w_in, b_in, wo, bo = (ext_ref(a[n]) for n in projections)  # None where absent (a None constant's Val)
    if any(not _absent(a[n]) and ext_ref(a[n]) is None for n in projections):
        return None  # given, and not a parameter-like tensor the op can take
    if w_in is None or wo is None or not isinstance(heads, int) or not isinstance(d, int) or d % heads:
        return None
    if not walk.axes.bind("d.0", heads) or not walk.axes.bind("d.1", d // heads):
        return None
    cut = lambda ref, i: with_step(ref, ("index", (("range", i * d, (i + 1) * d),)))
    q_vec = with_step(ParamRef(query.info["node"]), ("index", (0, 0, ":")),
                      ("linear", cut(w_in, 0), cut(b_in, 0)), ("reshape", (heads, d // heads)))
    mask = None if _absent(a["key_padding_mask"]) else _mask_ref(a["key_padding_mask"], ("b", "n"), node, invert=False,
                                                                     sizes=walk.axes.sizes)
    if mask is None and not _absent(a["key_padding_mask"]):  # it was dropped (a review's)
        raise Reject(f"{node.name}: its key_padding_mask could not be read as a mask given to the region (one "
                     f"computed from tok inside it, say); the op would attend without it")
    info = {"k": {"w": cut(w_in, 1), "b": cut(b_in, 1)}, "v": {"w": cut(w_in, 2), "b": cut(b_in, 2)},
            "q": q_vec, "scale": 1.0 / math.sqrt(d // heads), "mask": mask, "wo": wo, "bo": bo,
            # need_weights=False goes through SDPA (safe softmax: a row with every key masked is 0);
            # need_weights=True, nn.MultiheadAttention's default, through a plain softmax (NaN there)
            "empty_rows": "" if mask is None else "zero" if _const(a["need_weights"], True) is False else "nan"}
    return Val("mha_out", (ONE, "b", "d"), info)


def _softmax(walk, node, scores, dim, safe=False):
    """attn from scores. With a mask, info["empty_rows"] says what a batch row whose keys are all
    masked gives: "nan" from a plain softmax (every score -inf), "zero" from SDPA's (safe: torch ≥
    2.5 makes such a row attend to nothing), which is the op's own (reference.pool_forward)."""
    if scores is None or scores.kind != "scores" or not isinstance(dim, int):
        return None
    role = scores.roles[dim]
    if role != "n":
        raise Reject(f"{node.name}: softmax over dim {dim} (the {_ROLE_NAMES.get(role, role)} axis); "
                     "the pool normalises over the tokens")
    head_dim = walk.axes.sizes.get("d.1")
    expected = 1.0 / math.sqrt(head_dim)
    info = dict(scores.info)
    info["empty_rows"] = "" if info.get("mask") is None else "zero" if safe else "nan"
    inner, factor = info.pop("prescaled", (None, None))
    rtol = _scale_rtol(node)
    if abs(info["scale"] - expected) > rtol * expected and inner is not None and \
            abs(info["scale"] * factor - expected) <= rtol * expected:
        info.update(q=inner, scale=info["scale"] * factor)  # q = c·query: the scale lives in the query
    if abs(info["scale"] - expected) > rtol * expected:
        also = "" if inner is None else f" (with the query's own factor {factor:.12g}: {info['scale'] * factor:.12g})"
        raise Reject(f"{node.name}: scores are scaled by {info['scale']:.12g}{also}; the pool's scale is "
                     f"1/√Dh = {expected:.12g}")
    return Val("attn", scores.roles, info)


def _scale_rtol(node):
    """How far the scores' scale may be from 1/√Dh, which the op multiplies by: 4 ulps of the
    precision the scale multiplies in (float32's for 16-bit scores, as torch's opmath). It was 1e-6
    in every dtype, and `/ 2.0000009` (Dh = 4) matched in float64, 3e-8 off (a review's)."""
    kind = float_dtype(node) or torch.float32
    return 4 * torch.finfo(torch.promote_types(kind, torch.float32)).eps


_ROLE_NAMES = {"b": "batch", "n": "token", "d.0": "head", "d.1": "head-dim", "d": "feature", ONE: "size-1"}


def pool_params(inv):
    """The pool's parameters from the Val of its output: {name: ParamRef or None}."""
    k, v = inv.info["k"], inv.info["v"]
    return {"q": inv.info["q"], "wk": k["w"], "bk": k["b"], "wv": v["w"], "bv": v["b"],
            "wo": inv.info["wo"], "bo": inv.info["bo"], "mask": inv.info.get("mask")}
