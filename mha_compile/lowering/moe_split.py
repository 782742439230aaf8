"""Reading x·[W1 | W3] split in blocks of columns: SwiGLU's gate and up projections as one product
(Hugging Face's `gate, up = F.linear(x, gate_up_proj[e]).chunk(2, dim=-1)`).

A product u = x·W (+ b) whose columns are split (chunk, split, or a slice of its last axis) has
its hidden axis labelled WIDE instead of "f": moe.py asks `split_later` when it reads one. Each
block of columns [lo, hi) is exactly x·W[..., lo:hi] (+ b[lo:hi]): a "u" over "f" whose
parameters are those views of W and b (an "index" step of their ParamRef, on the axis of the
stored tensor the product's columns come from). The rewrite slices the tensor the user split,
and autograd adds the blocks' gradients into it.
"""
from mha_compile.lowering.canonicalize import canon, shape
from mha_compile.lowering.interpret import ParamRef, Val, known_eq, with_step

WIDE = "fw"


def split_later(node, hops=3):
    """Whether u's columns are split: a chunk, split or slice of its last axis reads u, or reads
    the bias added to it or a view of it (squeeze(-1) of a batched product), within `hops` steps."""
    return any(_splits_columns(user) or hops > 0 and _kind(user) in ("add", "reshape") and split_later(user, hops - 1)
               for user in node.users)


def _kind(node):
    op = canon(node)
    return None if op is None else op.kind


def _splits_columns(node):
    op = canon(node)
    src = shape(op.args[0]) if op is not None and op.args and hasattr(op.args[0], "meta") else None
    if src is None or not src:
        return False
    if op.kind in ("chunk", "split"):
        return isinstance(op.args[2], int) and op.args[2] % len(src) == len(src) - 1
    return op.kind == "getitem" and _last_slice(op.args[1], src) is not None


def split_rule(walk, node, op):
    """u's blocks of columns: chunk or split of a WIDE u (a "ublocks" tuple), an item of one, or a
    slice of a WIDE u's last axis; None for anything else."""
    src = walk.val(op.args[0]) if op.kind in ("chunk", "split", "getitem") else None
    if src is None:
        return None
    if src.kind == "u" and src.roles[-1] == WIDE and op.kind in ("chunk", "split"):
        blocks = _blocks(op, shape(op.args[0]))
        return None if blocks is None else Val("ublocks", None, {"u": src, "blocks": blocks})
    if src.kind == "ublocks" and op.kind == "getitem" and isinstance(op.args[1], int):
        blocks = src.info["blocks"]
        if not -len(blocks) <= op.args[1] < len(blocks):
            return None
        return _block(src.info["u"], *blocks[op.args[1]], width=blocks[-1][1])
    if src.kind == "u" and src.roles[-1] == WIDE and op.kind == "getitem":
        cols = _last_slice(op.args[1], shape(op.args[0]))
        return None if cols is None else _block(src, *cols, width=shape(op.args[0])[-1])
    return None


def _blocks(op, src):
    """[(lo, hi)] of chunk(n, dim=-1) or split(size | sizes, dim=-1), as torch cuts them."""
    if src is None or not isinstance(src[-1], int) or not isinstance(op.args[2], int) or \
            op.args[2] % len(src) != len(src) - 1:
        return None
    width, how = src[-1], op.args[1]
    if isinstance(how, int) and how >= 1:
        size = -(-width // how) if op.kind == "chunk" else how  # chunk(n): blocks of ceil(width / n)
        sizes = [size] * (width // size) + ([width % size] if width % size else [])
    elif op.kind == "split" and isinstance(how, (list, tuple)) and all(isinstance(s, int) and s > 0 for s in how) \
            and sum(how) == width:
        sizes = list(how)
    else:
        return None
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    return [(end - size, end) for end, size in zip(ends, sizes)]


def _last_slice(index, src):
    """(lo, hi) of u[..., lo:hi] (or u[:, :, lo:hi]), a non-empty block of the last axis; else None."""
    items = index if isinstance(index, tuple) else (index,)
    if src is None or not isinstance(src[-1], int) or not items or not isinstance(items[-1], slice):
        return None
    lead = items[1:-1] if items[0] is Ellipsis else items[:-1]
    if any(i != slice(None) for i in lead) or (items[0] is not Ellipsis and len(items) != len(src)):
        return None
    last = items[-1]
    if not all(v is None or isinstance(v, int) for v in (last.start, last.stop)) or last.step not in (None, 1):
        return None
    lo, hi, _ = last.indices(src[-1])
    return (lo, hi) if lo < hi else None


def _block(u, lo, hi, width):
    """x·W[..., lo:hi] (+ b[lo:hi]): u's columns lo:hi (of `width`), over "f"."""
    w1, b1 = (_columns(u.info[k], lo, hi, width) for k in ("w1", "b1"))
    if w1 is None or (u.info["b1"] is not None and b1 is None):
        return None
    return Val("u", u.roles[:-1] + ("f",), dict(u.info, w1=w1, b1=b1))


def _columns(ref, lo, hi, width):
    """A parameter of u read at columns lo:hi of the product: the axis of its stored tensor that
    the read tensor's last axis is (perm is in the stored tensor's numbering, select or not), as
    wide as the product."""
    size = shape(ref.node) if isinstance(ref, ParamRef) and not ref.steps else None
    if size is None:
        return None
    axis = ref.perm[-1] if ref.perm is not None else len(size) - 1
    if not known_eq(size[axis], width):
        return None
    return with_step(ref, ("index", (":",) * axis + (("range", lo, hi),)))
