"""Which tensors of a graph share storage, and which the graph writes in place.

Read from the nodes alone (canon's kinds, Dynamo's example values): a view shares its input's
storage, a call the matcher does not know is taken as one (to be safe), an item of a fresh tuple
and a copy do not. match.py checks the region's writes with them, and the walk refuses to read an
external tensor by how it was made (a query expanded over the batch, a float mask of 0 and -inf)
where the graph writes it in place afterwards.
"""
import torch

from mha_compile.lowering.canonicalize import call_name, canon, dtype, written

# Kinds canon reads that may return their input's storage (a view, or a tuple of views); the
# other kinds it reads compute new tensors
VIEW_KINDS = ("reshape", "permute", "expand", "getitem", "chunk", "split", "unbind")
# Calls canon does not read that always return new tensors (besides names ending in "_like"
# and new_*); any other call the matcher does not know is taken as possibly returning a view of
# its first tensor argument (detach, narrow, select, movedim, diagonal, as_strided, .data, and
# dropout in eval mode, which returns its input itself)
FRESH = frozenset({
    "cat", "concat", "concatenate", "pad", "layer_norm", "rms_norm", "group_norm", "batch_norm", "relu", "gelu", "silu",
    "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "abs", "neg", "square", "pow", "mean", "amax", "amin", "max",
    "min", "norm", "logsumexp", "log_softmax", "einsum", "arange", "full", "ones", "zeros", "empty", "rand", "randn",
    "isnan", "isfinite", "ne", "lt", "gt", "le", "ge", "clamp", "clip", "minimum", "maximum", "logical_and",
    "logical_or", "sign", "reciprocal", "erf", "prod", "var", "std", "truediv", "sub", "mul", "add", "eq",
    "scaled_dot_product_attention", "linear", "softmax", "sum", "matmul", "bmm", "mm", "baddbmm", "addmm",
    "greater", "greater_equal", "less", "less_equal", "not_equal", "any", "all", "count_nonzero",
})


def storage_parent(node):
    """The node whose tensor `node` may be read another way, or None: the input of a view, of a
    cast that changes nothing (contiguous() of a contiguous tensor, to() or float() of its own
    dtype return the tensor itself), of a write in place (h += x returns h), or of a call the
    matcher does not know (taken as a view, to be safe: see FRESH). clone and a cast to another
    dtype copy."""
    target = written(node)
    if target is not None:
        return target
    if node.op not in ("call_method", "call_function"):
        return None
    value = node.meta.get("example_value")
    if not isinstance(value, (torch.Tensor, list, tuple)):
        return None  # a size, a shape: not a tensor
    first = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
    op = canon(node)
    if op is None:
        name = call_name(node)
        fresh = name in FRESH or name.endswith("_like") or name.startswith("new_")
        return None if fresh else first
    if not op.args or not isinstance(op.args[0], torch.fx.Node):
        return None
    if op.kind == "getitem" and isinstance(op.args[0].meta.get("example_value"), (tuple, list)) and \
            storage_parent(op.args[0]) is None:
        return None  # an item of a fresh tuple (topk's values, its indices): a tensor of its own
    if op.kind == "getitem" and indexes_by_rows(op.args[1]):
        return None  # indexed by a tensor of indices or a mask (out[rows]): a copy
    if op.kind in VIEW_KINDS:
        return op.args[0]
    if op.kind != "cast" or node.target in ("clone", torch.clone) or node.kwargs.get("copy") is True:
        return None  # .to(dtype, copy=True) copies too (a review's: a write into it was taken for the parameter's)
    return op.args[0] if dtype(node) is None or dtype(node) == dtype(op.args[0]) else None


def aliases(node):
    """node's storage's tensors in the graph: up its chain of views to the base, then every view
    made of that base (a view may also copy, contiguous() of a strided tensor: taken as sharing,
    to be safe)."""
    base = node
    while (parent := storage_parent(base)) is not None:
        base = parent
    found, stack = set(), [base]
    while stack:
        n = stack.pop()
        if n in found:
            continue
        found.add(n)
        stack.extend(user for user in n.users if storage_parent(user) is n)
    return found


def written_in_place(node, besides=()):
    """Whether the graph writes node's tensor in place, through it or any view of its storage, by
    a call other than those in `besides` (moe_pairs reads an index by the values its calls compute,
    the walk a query or a mask by how it was made: a write would change them)."""
    shared = aliases(node)
    return any(u not in besides and written(u) in shared for a in shared for u in a.users)


def indexes_by_rows(index):
    """Whether an index holds a tensor of one or more axes, which makes t[index] a copy (a 0-dim
    integer tensor indexes as an int does: t[torch.tensor(0)] is a view)."""
    items = index if isinstance(index, (tuple, list)) else (index,)
    values = [i.meta.get("example_value") for i in items if isinstance(i, torch.fx.Node)]
    return any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values)


# Calls that may copy though storage_parent takes them for views, to be safe there (a repeat of
# size-1 axes reads as an expand, contiguous() of an expanded tensor copies, reshape may)
_MAY_COPY = frozenset({"repeat", "contiguous", "reshape", "flatten", "repeat_interleave"})


def may_copy(node):
    """Whether node's tensor may be a copy of its input, not a view: a write into it is then not
    seen in its input, nor one into its input in it."""
    return node.op in ("call_function", "call_method") and (
        storage_parent(node) is None or call_name(node) in _MAY_COPY)
