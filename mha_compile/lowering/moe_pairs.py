"""The (row, slot) pairs' rows as an index: pair p = r·k + s (topi.reshape(-1)'s order) belongs to
row r = p // k. transformers' batched_mm experts write it

    token_idx = torch.arange(R).unsqueeze(1).expand(-1, k).reshape(-1)
    x[token_idx] ...  out.index_add_(0, token_idx, f · w.reshape(-1, 1))

and others write arange(R·k) // k or arange(R).repeat_interleave(k). Whatever the spelling, the
index is computed from constants alone, so it is read by its values: the calls that compute it
are run here, on the CPU, and the result compared with arange(R·k) // k (`pair_rows`).
"""
import operator

import torch

from mha_compile.lowering.aliases import written_in_place
from mha_compile.lowering.canonicalize import shape

# Calls an index computed from constants may go through: they compute from their arguments only
_FUNCTIONS = {torch.arange, torch.repeat_interleave, operator.floordiv, torch.div, torch.floor_divide}
_METHODS = {"unsqueeze", "expand", "reshape", "view", "flatten", "repeat_interleave", "repeat", "contiguous", "to",
            "long", "int", "squeeze"}
_MAX_NUMEL = 1 << 24  # the index of 16M pairs at most: larger ones are not read


def pair_rows(memo, node, rows, k):
    """Whether `node` is the row of each of rows·k pairs: arange(rows·k) // k, as computed and
    never written in place (rows[0] = R - 1 would move a pair the values read here do not).
    `memo` (a walk's) keeps the answer: the index is read at x[index] and again at index_add_."""
    if not isinstance(rows, int) or not isinstance(k, int):  # a SymInt is no key (a review's: dynamic shapes crashed
        return False  # the matcher); _is_pair_rows takes no symbolic size anyway
    key = ("pair_rows", node, rows, k)
    if key not in memo:
        memo[key] = _is_pair_rows(node, rows, k)
    return memo[key]


def _is_pair_rows(node, rows, k):
    size = shape(node)
    if not isinstance(rows, int) or not isinstance(k, int) or rows * k > _MAX_NUMEL or size is None or \
            len(size) != 1 or not isinstance(size[0], int) or size[0] != rows * k:  # no guard on a symbolic size
        return False
    value = _constant(node)
    return value is not None and value.dtype in (torch.int32, torch.int64) and value.shape == (rows * k,) and \
        torch.equal(value, torch.arange(rows * k) // k)


def _constant(node, seen=None):
    """node's value where it is computed from literals by the calls above (on the CPU, whatever
    device they name) and nothing writes it in place, else None."""
    seen = {} if seen is None else seen
    if node in seen:
        return seen[node]
    seen[node] = None
    pure = (node.op == "call_function" and node.target in _FUNCTIONS) or \
        (node.op == "call_method" and node.target in _METHODS)
    if not pure or written_in_place(node):
        return None
    args = [_literal(a, seen) for a in node.args]
    kwargs = {k: _literal(v, seen) for k, v in node.kwargs.items() if k != "device"}
    if any(a is _NOT for a in args) or any(v is _NOT for v in kwargs.values()):
        return None
    try:
        value = node.target(*args, **kwargs) if node.op == "call_function" else getattr(args[0], node.target)(
            *args[1:], **kwargs)
    except (RuntimeError, TypeError, ValueError):
        return None
    if not isinstance(value, torch.Tensor) or value.numel() > _MAX_NUMEL:
        return None
    seen[node] = value
    return value


_NOT = object()


def _literal(arg, seen):
    """A call's argument as a value: a literal, or the value of a node computed from literals."""
    if isinstance(arg, torch.fx.Node):
        value = _constant(arg, seen)
        return _NOT if value is None else value
    if isinstance(arg, (tuple, list)):
        items = [_literal(a, seen) for a in arg]
        return _NOT if any(i is _NOT for i in items) else (tuple(items) if isinstance(arg, tuple) else items)
    if isinstance(arg, torch.device) or isinstance(arg, str) and _names_device(arg):
        return torch.device("cpu")  # .to("cuda") too (a review's: only torch.device was mapped)
    if arg is None or isinstance(arg, (bool, int, str, torch.dtype)):
        return arg
    return _NOT


def _names_device(text):
    try:
        torch.device(text)
    except (RuntimeError, ValueError):  # "floor", a rounding mode
        return False
    return True
