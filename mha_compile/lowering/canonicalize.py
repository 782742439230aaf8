"""One vocabulary for the many spellings of the same op.

Dynamo graphs spell one operation many ways: `torch.add(a, b)`, `a + b`, `a.add(b)`, `a += b`;
`x.softmax(-1)`, `torch.softmax(x, dim=-1)`, `F.softmax(x, -1)`; `x.view(...)`, `x.reshape(...)`,
`x.unsqueeze(1)`, `x[:, None]`. `canon(node)` reads a node as an `Op` of one kind with its
arguments in one order, without touching the graph. The matcher works on these kinds, shapes and
dataflow, never on a literal spelling, so a new spelling of a known op is one line here.

Kinds that only move or relabel elements are grouped by what they keep:
- "reshape": the row-major sequence of elements is unchanged (view, reshape, flatten,
  unflatten, unsqueeze, squeeze, indexing with only full slices and None);
- "permute": axes reordered (transpose, permute, t, mT);
- "expand": size-1 axes broadcast (expand, expand_as, broadcast_to, and a repeat of size-1 axes);
- "cast": values kept, dtype/memory changed (to(dtype), type(dtype), float, contiguous, clone, type_as).
"""
import dataclasses
import functools
import inspect
import operator

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.nn import functional as F


@dataclasses.dataclass
class Op:
    kind: str
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)


def _fn(*names):
    """Resolve torch attribute paths that exist in this torch build (some are private)."""
    out = []
    for name in names:
        obj = torch
        for part in name.split(".")[1:]:
            obj = getattr(obj, part, None)
        if obj is not None:
            out.append(obj)
    return out


_FUNCTIONS = {}
for kind, targets in {
    "add": [operator.add, operator.iadd, *_fn("torch.add")],
    "sub": [operator.sub, *_fn("torch.sub")],
    "mul": [operator.mul, operator.imul, *_fn("torch.mul")],
    "div": [operator.truediv, operator.itruediv, *_fn("torch.div", "torch.true_divide")],
    "matmul": [operator.matmul, *_fn("torch.matmul", "torch.mm", "torch.bmm")],
    "linear": [F.linear, *_fn("torch._C._nn.linear")],
    "einsum": _fn("torch.einsum", "torch.functional.einsum"),
    "softmax": [F.softmax, *_fn("torch.softmax", "torch.special.softmax")],
    "topk": _fn("torch.topk"),
    "sum": _fn("torch.sum"),
    "getitem": [operator.getitem],
    "setitem": [operator.setitem],
    "eq": [operator.eq, *_fn("torch.eq")],
    "scatter": _fn("torch.scatter"),
    "zeros_like": _fn("torch.zeros_like"),
    "gelu": [F.gelu, *_fn("torch._C._nn.gelu")],
    "silu": [F.silu, *_fn("torch._C._nn.silu")],
    "sigmoid": [F.sigmoid, *_fn("torch.sigmoid", "torch.special.expit")],
    "erf": _fn("torch.erf", "torch.special.erf"),
    "ndtr": _fn("torch.special.ndtr"),  # the normal distribution's cdf, (1 + erf(u / √2)) / 2: u · ndtr(u) is gelu
    "dropout": [F.dropout, *_fn("torch.dropout")],  # read where it draws nothing (_read_dropout)
    "tanh": [F.tanh, *_fn("torch.tanh")],
    "exp": _fn("torch.exp"),
    "neg": [operator.neg, *_fn("torch.neg", "torch.negative")],
    "pow": [operator.pow, *_fn("torch.pow")],
    "clamp": _fn("torch.clamp", "torch.clip", "torch.clamp_min"),
    "normalize": [F.normalize],
    "norm": _fn("torch.norm", "torch.linalg.vector_norm"),  # torch.norm is torch.functional.norm
    "reshape": _fn("torch.reshape", "torch.flatten", "torch.unsqueeze", "torch.squeeze"),
    "permute": _fn("torch.permute", "torch.transpose", "torch.t"),
    "masked_fill": _fn("torch.masked_fill"),
    "sdpa": [F.scaled_dot_product_attention, *_fn("torch._C._nn.scaled_dot_product_attention")],
    "mha": [F.multi_head_attention_forward],
    "chunk": _fn("torch.chunk"),
    "unbind": _fn("torch.unbind"),
    "select": _fn("torch.select"),  # read as the index it takes (_read_select)
    "narrow": _fn("torch.narrow"),
    "split": _fn("torch.split", "torch.functional.split"),
    "one_hot": [F.one_hot, *_fn("torch._C._nn.one_hot")],
    "where": _fn("torch.where"),
    "nonzero": _fn("torch.nonzero"),
    "index_add": _fn("torch.index_add"),
    "stack": _fn("torch.stack"),
    "expand": _fn("torch.broadcast_to"),
    "gather": _fn("torch.gather"),
    "zeros": _fn("torch.zeros"),
    "not": [operator.invert, *_fn("torch.logical_not", "torch.bitwise_not")],
    "argsort": _fn("torch.argsort"),
    "sort": _fn("torch.sort"),
    "floordiv": [operator.floordiv, *_fn("torch.floor_divide")],
    "searchsorted": _fn("torch.searchsorted"),
    "grouped_mm": _fn("torch._grouped_mm"),
    "index_select": _fn("torch.index_select"),
    "histc": _fn("torch.histc"),
    "scatter_add": _fn("torch.scatter_add"),
    "cumsum": _fn("torch.cumsum"),
    "ones_like": _fn("torch.ones_like"),
    "bincount": _fn("torch.bincount"),
}.items():
    for target in targets:
        _FUNCTIONS[target] = kind

_METHODS = {
    # Dunder spellings: torch 2.11's Dynamo records `index == e` as call_method "__eq__"
    # (2.13 records operator.eq); the H200 run found the loop MoE unmatched through this.
    "add": "add", "add_": "add", "__add__": "add", "__radd__": "add", "__iadd__": "add",
    "sub": "sub", "__sub__": "sub", "mul": "mul", "mul_": "mul", "__mul__": "mul", "__rmul__": "mul",
    "div": "div", "__truediv__": "div", "__itruediv__": "div",
    "matmul": "matmul", "mm": "matmul", "bmm": "matmul", "__matmul__": "matmul",
    "softmax": "softmax", "topk": "topk", "sum": "sum", "eq": "eq", "__eq__": "eq", "scatter": "scatter",
    "view": "reshape", "reshape": "reshape", "flatten": "reshape", "unflatten": "reshape", "view_as": "reshape",
    "reshape_as": "reshape",
    "unsqueeze": "reshape", "squeeze": "reshape",
    "transpose": "permute", "permute": "permute", "t": "permute",
    "expand": "expand", "expand_as": "expand", "broadcast_to": "expand", "repeat": "repeat",
    "to": "cast", "float": "cast", "double": "cast", "half": "cast", "bfloat16": "cast",
    "type_as": "cast", "type": "cast", "contiguous": "cast", "clone": "cast",
    "masked_fill": "masked_fill", "masked_fill_": "masked_fill", "chunk": "chunk", "split": "split", "unbind": "unbind",
    "select": "select", "narrow": "narrow",
    "nonzero": "nonzero",
    "index_add_": "index_add", "index_add": "index_add", "new_zeros": "zeros", "zero_": "zeros",
    "logical_not": "not", "bitwise_not": "not", "__invert__": "not", "iadd": "add", "__iadd__": "add",
    "argsort": "argsort", "sort": "sort", "floor_divide": "floordiv", "__floordiv__": "floordiv",
    "index_select": "index_select", "histc": "histc", "scatter_add": "scatter_add", "scatter_add_": "scatter_add",
    "cumsum": "cumsum", "bincount": "bincount", "gather": "gather", "scatter_": "scatter",
    "sigmoid": "sigmoid", "clamp": "clamp", "clip": "clamp", "clamp_min": "clamp",
    "erf": "erf", "tanh": "tanh", "exp": "exp", "neg": "neg", "__neg__": "neg", "pow": "pow", "__pow__": "pow",
    "norm": "norm",
}
_CASTS_BY_FUNCTION = {torch.clone: "cast"}

# Argument names per kind, so positional and keyword spellings read alike.
_SIGNATURES = {
    "linear": ("input", "weight", "bias"),
    "softmax": ("input", "dim", "_stacklevel", "dtype"),
    "topk": ("input", "k", "dim", "largest", "sorted"),
    "sum": ("input", "dim", "keepdim"),
    "scatter": ("input", "dim", "index", "src"),
    "gather": ("input", "dim", "index"),
    "gelu": ("input", "approximate"),
    "masked_fill": ("input", "mask", "value"),
    "sdpa": ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
    "mha": ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
            "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
            "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
            "k_proj_weight", "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal"),
    "chunk": ("input", "chunks", "dim"),
    "split": ("input", "split_size_or_sections", "dim"),
    "unbind": ("input", "dim"),
    "select": ("input", "dim", "index"),
    "narrow": ("input", "dim", "start", "length"),
    "one_hot": ("input", "num_classes"),
    "nonzero": ("input", "as_tuple"),
    "index_add": ("input", "dim", "index", "source", "alpha"),
    "stack": ("tensors", "dim"),
    "argsort": ("input", "dim", "descending", "stable"),
    "sort": ("input", "dim", "descending", "stable"),
    "searchsorted": ("sorted_sequence", "input", "out_int32", "right", "side", "sorter"),
    "grouped_mm": ("mat_a", "mat_b", "offs", "bias", "out_dtype"),
    "index_select": ("input", "dim", "index"),
    "histc": ("input", "bins", "min", "max"),
    "scatter_add": ("input", "dim", "index", "src"),
    "cumsum": ("input", "dim", "dtype"),
    "bincount": ("input", "weights", "minlength"),
    "clamp": ("input", "min", "max"),
    "normalize": ("input", "p", "dim", "eps"),
    "norm": ("input", "p", "dim", "keepdim"),
}
_DEFAULTS = {"chunk": {"dim": 0}, "split": {"dim": 0}, "unbind": {"dim": 0}, "stack": {"dim": 0},
             "one_hot": {"num_classes": -1},
             "sdpa": {"dropout_p": 0.0, "is_causal": False},
             "histc": {"bins": 100, "min": 0, "max": 0}, "normalize": {"p": 2.0, "dim": 1, "eps": 1e-12}}


def canon(node):
    """The node read as an Op, or None when it is not a call we know."""
    if node.op == "call_function" and node.target is getattr:
        return _read_attribute(node)
    if node.op == "call_function":
        kind = _FUNCTIONS.get(node.target) or _CASTS_BY_FUNCTION.get(node.target)
        if kind is None:
            return None
    elif node.op == "call_method":
        kind = _METHODS.get(node.target)
        if kind is None:
            return None
    else:
        return None
    args, kwargs = known_numbers(tuple(node.args)), known_numbers(dict(node.kwargs))
    if kind == "einsum":
        operands = args[1:]
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = tuple(operands[0])
        return Op("einsum", (args[0], *operands))
    if kind in ("add", "sub") and kwargs.pop("alpha", 1) != 1:
        return None
    if kind == "div" and kwargs.get("rounding_mode") is not None:
        # torch.div(a, b, rounding_mode="floor"): a // b (on the non-negative indices it is read on,
        # "trunc" is the same)
        return Op("floordiv", args[:2]) if kwargs["rounding_mode"] in ("floor", "trunc") and len(args) == 2 else None
    kwargs.pop("rounding_mode", None)
    if kind == "dropout":
        return _read_dropout(args, kwargs)
    if kind == "getitem":
        return _read_getitem(node, args)
    if kind == "repeat":
        return _read_repeat(node, args)
    if kind == "permute":
        return _read_permute(node, args, kwargs)
    if kind == "sum" and node.op == "call_method" and len(args) == 1 and "dim" not in kwargs:
        kwargs["dim"] = None
    if kind == "where" and not (len(args) == 1 and not kwargs):
        return None  # only where(cond): the (rows, slots) of the nonzero entries
    if kind == "where":
        return Op("nonzero", (args[0], True))
    if kind == "scatter" and (len(args) > 4 or kwargs.get("reduce") is not None):
        return None  # scatter(..., reduce="multiply" | "add"): not the plain write the gates are
    if kind in ("index_add", "scatter_add", "scatter"):  # out.index_add_(...) changes `out` for its later readers
        kwargs["_inplace"] = node.op == "call_method" and node.target.endswith("_")
    if kind == "norm":  # torch.linalg.vector_norm names p ord; a dtype or out changes what it computes
        if kwargs.get("dtype") is not None or kwargs.get("out") is not None:
            return None
        if "ord" in kwargs:
            kwargs["p"] = kwargs.pop("ord")
    if kind in _SIGNATURES:
        names = _SIGNATURES[kind]
        merged = dict(_DEFAULTS.get(kind, {}))
        merged.update(zip(names, args))
        merged.update({k: v for k, v in kwargs.items() if k in names or k == "dim"})
        args = tuple(merged.get(n) for n in names)
        if kind in ("select", "narrow"):
            return _read_select(node, kind, *args)
        return Op(kind, args, {k: v for k, v in kwargs.items() if k.startswith("_")})
    return Op(kind, args, kwargs)


def _read_select(node, kind, base, dim, index, length=None):
    """x.select(d, i) is x[:, ..., i] and x.narrow(d, start, n) is x[:, ..., start:start + n] (d full
    slices before), read as that getitem: W.select(0, e) as W[e], an expert's slice (it was read as a
    tensor of its own, stacked again on every call). None where an argument is not a constant."""
    in_shape = shape(base) if hasattr(base, "meta") else None
    if in_shape is None or not all(type(a) is int for a in (dim, index) + ((length,) if kind == "narrow" else ())) \
            or not -len(in_shape) <= dim < len(in_shape):
        return None
    dim %= len(in_shape)
    if kind == "narrow":
        if not isinstance(in_shape[dim], int):
            return None
        start = index + in_shape[dim] if index < 0 else index  # narrow's start counts from the end where negative
        index = slice(start, start + length)
    items = (slice(None),) * dim + (index,)
    return _read_getitem(node, (base, items[0] if len(items) == 1 else items))


def _read_dropout(args, kwargs):
    """F.dropout(x, p, training, inplace) or torch.dropout(x, p, train) that draws nothing (in eval
    mode, or p = 0) returns x itself: a "cast" that keeps every value (an attention pool's dropout
    on its weights, in eval mode). In training it draws random numbers: not read."""
    given = dict(zip(("input", "p", "training"), args))
    given.update(kwargs)
    training, p = given.get("training", given.get("train", True)), given.get("p", 0.5)
    if "input" in given and (training is False or type(p) in (int, float) and p == 0):
        return Op("cast", (given["input"],))
    return None


def _read_getitem(node, args):
    """x[:, None] and friends are reshapes; W[e] is a select; anything else stays getitem."""
    base, index = args
    items = index if isinstance(index, tuple) else (index,)
    in_shape = shape(base) if hasattr(base, "meta") else None
    if in_shape is not None and Ellipsis not in items and any(isinstance(i, int) for i in items) and all(
            i is None or i == slice(None) or isinstance(i, int) for i in items):
        # x[:, 0] on a size-1 axis drops it: a reshape, like squeeze
        axis, ok = 0, True
        for i in items:
            if i is None:
                continue
            if isinstance(i, int) and not (axis < len(in_shape) and is_one(in_shape[axis]) and i in (0, -1)):
                ok = False
            axis += 1
        if ok:
            return Op("reshape", (base,))
    if all(i is None or i is Ellipsis or i == slice(None) for i in items if not isinstance(i, int)) and \
            not any(isinstance(i, int) for i in items) and any(i is None for i in items):
        return Op("reshape", (base,))
    first = items[0] if items else None
    if type(first) is int and all(i is Ellipsis or i == slice(None) for i in items[1:]) and in_shape is not None \
            and isinstance(in_shape[0], int) and -in_shape[0] <= first < in_shape[0]:
        # W[e, :, :], W[e, ...] and W[e - E] are W[e] (a review's: mixed with W[e], they lost the block)
        return Op("getitem", (base, first % in_shape[0]))
    return Op("getitem", (base, index))


def sum_of_product(op):
    """A sum `op` (a canonical Op) of (a * b), the product read by nothing else, as the einsum it is:
    (k * q).sum(-1) for the pool's scores, (attn[..., None] * v).sum(1) for its pooled values (the
    pool's rule asks; the MoE reads its own sums of products as they are). Axes are aligned from
    the right, as broadcasting does; a size-1 axis shares its letter with the other operand's (the
    matcher's einsum reading takes it as broadcast). None for any other sum."""
    if op.kind != "sum":
        return None
    product, dims, keepdim = op.args
    if not isinstance(product, torch.fx.Node) or len(product.users) != 1 or keepdim or canon_kind(product) != "mul":
        return None
    a, b = product.args[:2] if len(product.args) >= 2 else (None, None)
    dims = (dims,) if isinstance(dims, int) else dims
    shapes = [shape(t) if isinstance(t, torch.fx.Node) else None for t in (a, b)]
    out = shape(product)
    if None in shapes or out is None or not dims or not all(isinstance(d, int) for d in dims) or len(out) > 26:
        return None
    letters = "abcdefghijklmnopqrstuvwxyz"[:len(out)]
    summed = {d % len(out) for d in dims}
    terms = [letters[len(out) - len(s):] for s in shapes]
    kept = "".join(letter for i, letter in enumerate(letters) if i not in summed)
    return Op("einsum", (f"{terms[0]},{terms[1]}->{kept}", a, b))


def canon_kind(node):
    """The kind canon(node) would give, from its target alone (no argument reading)."""
    if node.op == "call_function":
        return _FUNCTIONS.get(node.target)
    return _METHODS.get(node.target) if node.op == "call_method" else None


def _read_repeat(node, args):
    """x.repeat(1, H, 1) that repeats only size-1 axes is x.expand(...) in values (a copy, which
    the math does not see; its gradient sums the repeats, as expand's does); other repeats: None."""
    base, repeats = args[0], args[1:]
    if len(repeats) == 1 and isinstance(repeats[0], (list, tuple)):
        repeats = tuple(repeats[0])
    in_shape = shape(base) if hasattr(base, "meta") else None
    if in_shape is None or len(repeats) != len(in_shape) or \
            any(not (isinstance(r, int) and r == 1) and not is_one(s) for r, s in zip(repeats, in_shape)):
        return None
    return Op("expand", (base,))


def _read_attribute(node):
    """x.mT (Dynamo records getattr(x, "mT")): the last two axes swapped; x.T: every axis reversed (a
    bias stored [E, F] read as b1.T[:, e]). Other attributes: None."""
    base, name = node.args[:2]
    in_shape = shape(base) if hasattr(base, "meta") else None
    if name not in ("mT", "T") or in_shape is None or len(in_shape) < 2:
        return None
    dims = list(range(len(in_shape)))
    dims[-2], dims[-1] = dims[-1], dims[-2]
    return Op("permute", (base, tuple(dims) if name == "mT" else tuple(reversed(range(len(in_shape))))))


def _read_permute(node, args, kwargs):
    """transpose / t / permute as Op("permute", (x, dims)) with every axis named."""
    base, rest = args[0], args[1:]
    in_shape = shape(base)
    if in_shape is None:
        return None
    ndim = len(in_shape)
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name == "t":
        dims = (1, 0) if ndim == 2 else tuple(range(ndim))
    elif name == "transpose":
        d0, d1 = (list(rest) + [kwargs.get("dim0"), kwargs.get("dim1")])[:2]
        if not isinstance(d0, int) or not isinstance(d1, int):
            return None
        dims = list(range(ndim))
        dims[d0 % ndim], dims[d1 % ndim] = dims[d1 % ndim], dims[d0 % ndim]
    else:
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest or kwargs.get("dims")
        if dims is None or not all(isinstance(d, int) for d in dims) or len(dims) != ndim:
            return None
    return Op("permute", (base, tuple(d % ndim for d in dims)))


def shape(node):
    """The node's shape from Dynamo's example value, or None. A size that is a SymInt of a known
    value (under dynamic=True, D = 32 of a parameter's width) is that int: the readers check sizes
    as ints, and refused nn.MultiheadAttention and the fused K|V projection under dynamic=True."""
    value = node.meta.get("example_value") if hasattr(node, "meta") else None
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(int(s) if isinstance(s, torch.SymInt) and is_concrete_int(s) else s for s in value.shape)


def known_number(node):
    """The int or float a node stands for where it is a SymInt or SymFloat of a known value computed
    from sizes alone (under dynamic=True, D read off tok.shape where a weight's width pins it, and
    Dh ** -0.5 of it: Dynamo's guards on the sizes recompile the graph for another value); None
    where it is none. Refused as "a value of the graph" before (a review's). A number read off a
    tensor's values by .item() is none, whatever its expression: a module's float that Dynamo
    passes as a tensor (nn.MultiheadAttention's dropout_p) may change with no recompile."""
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    expr = getattr(getattr(value, "node", None), "expr", None)
    if not isinstance(value, (torch.SymInt, torch.SymFloat)) or not getattr(expr, "is_number", False) or \
            not _from_sizes(node):
        return None
    return int(expr) if isinstance(value, torch.SymInt) else float(expr)


def _from_sizes(node, depth=8):
    """Whether a number node is computed from tensors' sizes and constants alone: size queries, items
    of them, and arithmetic (operator's, math's and torch's sym_ functions) on such numbers."""
    if not isinstance(node, torch.fx.Node):
        return isinstance(node, (int, float)) and not isinstance(node, bool)
    if node.op == "call_method" and node.target in ("size", "numel", "dim"):
        return True
    if node.op != "call_function" or depth == 0:
        return False
    if node.target is torch.ops.aten.sym_size.int:
        return True
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and \
            node.args[0].op == "call_method" and node.args[0].target == "size":
        return True
    module = getattr(node.target, "__module__", None) or ""
    name = getattr(node.target, "__name__", "")
    arithmetic = module in ("_operator", "operator", "math") or name.startswith("sym_") or name.startswith("_sym_")
    return arithmetic and node.target is not operator.getitem and not node.kwargs and \
        all(_from_sizes(a, depth - 1) for a in node.args)


def known_numbers(args):
    """args with each node that stands for a known number (known_number) replaced by it, in tuples,
    lists, dicts and slices too."""
    if isinstance(args, torch.fx.Node):
        number = known_number(args)
        return args if number is None else number
    if isinstance(args, (tuple, list)):
        return type(args)(known_numbers(a) for a in args)
    if isinstance(args, dict):
        return {k: known_numbers(v) for k, v in args.items()}
    if isinstance(args, slice):
        return slice(known_numbers(args.start), known_numbers(args.stop), known_numbers(args.step))
    return args


def dtype(node):
    value = node.meta.get("example_value") if hasattr(node, "meta") else None
    return value.dtype if isinstance(value, torch.Tensor) else None


def float_dtype(node):
    """The node's dtype where it is a floating-point one, else None (an integer, a bool, unknown)."""
    kind = dtype(node)
    return kind if kind is not None and kind.is_floating_point else None


def is_one(size):
    return isinstance(size, int) and size == 1


# Writes in place: which call writes into which tensor (aliases.py reads storage by them, moe refuses a
# sum into zeros whose rows share memory). x += y and the like, and x[i] = v, as Dynamo records them:
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                       operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor,
                       operator.ilshift, operator.irshift, operator.setitem}


# operator's functions named with a trailing "_" only to avoid a keyword: pad | pad2 (a review's: read
# as a write into pad, and refused with that reason)
_OUT_OF_PLACE_OPERATORS = {operator.and_, operator.or_, operator.not_, operator.is_}


def is_inplace(node):
    """Whether node writes into a tensor it is given (`written` names which): a method or function
    whose name ends in "_" (add_, scatter_, torch.nn.init.normal_, aten's mul_.Scalar), x += y,
    x[i] = v, out=, or inplace=True (F.relu(x, inplace=True))."""
    if node.op not in ("call_method", "call_function"):
        return False
    if node.target in _INPLACE_OPERATORS or node.kwargs.get("out") is not None \
            or _argument(node, "inplace") is True:  # out= a tensor, or a tuple of them (torch.max's)
        return True
    name = call_name(node)
    if name.startswith("__") and name.endswith("__"):  # __iadd__, not __add__ or __getitem__
        return name[2:-2] in {op.__name__.strip("_") for op in _INPLACE_OPERATORS}
    return name.endswith("_") and node.target not in _OUT_OF_PLACE_OPERATORS


def _argument(node, name):
    """A call_function's argument by name, given by keyword or by position (F.dropout(x, 0.5,
    True, True): inplace), or None."""
    if name in node.kwargs or node.op != "call_function":
        return node.kwargs.get(name)
    parameters = _parameters(node.target)
    return node.args[parameters.index(name)] if name in parameters[:len(node.args)] else None


@functools.lru_cache(maxsize=None)
def _parameters(function):
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return ()


def call_name(node):
    """A call's name: the method's, or the function's (an aten overload's without its overload:
    mul_.Scalar is mul_)."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return str(name).split(".")[0]


def written(node):
    """The node whose tensor `node` writes in place, or None."""
    if not is_inplace(node):
        return None
    target = node.kwargs.get("out", node.args[0] if node.args else None)
    if isinstance(target, (tuple, list)):  # torch.max(x, -1, out=(values, indices)): the first, at least
        target = next((t for t in target if isinstance(t, torch.fx.Node)), None)
    return target if isinstance(target, torch.fx.Node) else None
