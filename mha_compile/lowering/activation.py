"""An expert's activation written out in elementwise ops of u = x W1 + b1 and Python numbers
(silu as u · sigmoid(u) or u / (1 + exp(-u)), gelu as 0.5 · u · (1 + erf(u / √2)), the tanh gelu
with its cube), read as the activation it is. The ops ride along as a "ufn" Val (info: "of" the u
node, their sympy expression, their values on POINTS in float64 and in u's dtype), and become the
activation's h where all three checks hold:

1. in float64 on POINTS, to 1e-12 (a cheap filter, run first);
2. in the model's dtype: the same torch ops on POINTS in u's dtype give the activation's values
   there to 2 of that dtype's ulps (of 1 + |u|), so a step that rounds u coarser (u + 256 - 256 in bf16) or
   overflows (· 1e40 / 1e40 in float32) is not taken for the activation;
3. exactly: the sympy expression, each number snapped to the exact constant it stands for where
   it is within 4 ulps of it (integers, 1/2, √2, 1/√2, √(2/π), 0.044715), equals the activation's
   formula. Values alone prove nothing: a bump too narrow to fall on any point tested agreed with
   silu at every point (found by a review), and a constant cut to 8 digits is 1e-9 off.
"""
import functools
import math
import operator

import torch
import torch.nn.functional as F

from mha_compile.lowering.interpret import Val

UNARY = ("erf", "tanh", "sigmoid", "exp", "neg")
KINDS = UNARY + ("add", "sub", "mul", "div", "pow")
_TORCH = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
          "pow": operator.pow, "neg": operator.neg, "erf": torch.erf, "tanh": torch.tanh,
          "sigmoid": torch.sigmoid, "exp": torch.exp}
_ACTS = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}
# Where the activations differ from each other and from their asymptotes, 0 (where a division by
# u gives a NaN), and far out, where a term too small to see on [-6, 6] would not be
POINTS = torch.cat([torch.linspace(-6.0, 6.0, 121, dtype=torch.float64),
                    torch.tensor([10.0, -10.0, 20.0, -20.0, 50.0, -50.0, 1e3, -1e3], dtype=torch.float64)])
# In u's dtype the written-out ops round at each step where the activation rounds once: measured
# at most 1.12 ulps of (1 + |u|) over POINTS for the forms in the tests, in bf16, fp16, float32
# and float64 (the erf gelu in float32); u + 8 - 8 in bf16 (u rounded to 1/16) is off by 3.5
_ULPS = 2


def written_out(node, op, args):
    """The Val of an elementwise op on u, "ufn" or "h" (module docstring), or None where it is not
    one: an operand other than u, a "ufn" of the same u node or a Python number, or operands whose
    axes differ (u · sigmoid(u).t() of a square u)."""
    if len(args) != (1 if op.kind in UNARY else 2):
        return None
    ops = [v for v in args if v is not None and v.kind in ("u", "ufn")]
    if not ops or any(v.roles != ops[0].roles for v in ops):
        return None
    sources, operands = set(), []
    for arg, val in zip(node.args, args):
        if val is not None and val.kind == "const" and type(val.info["value"]) in (int, float):
            number = val.info["value"]
            operands.append((number, number, _snap(number)))
        elif val is not None and val.kind == "u":
            sources.add(arg)
            operands.append((POINTS, POINTS.to(_dtype(arg)), _symbol()))
        elif val is not None and val.kind == "ufn":
            sources.add(val.info["of"])
            operands.append((val.info["wide"], val.info["own"], val.info["expr"]))
        else:
            return None
    if len(sources) != 1:
        return None
    of = next(iter(sources))
    fn = _TORCH[op.kind]
    wide, own = fn(*[o[0] for o in operands]), fn(*[o[1] for o in operands])
    expr = _SYMPY[op.kind](*[o[2] for o in operands])
    info = {k: v for k, v in ops[0].info.items() if k not in ("of", "wide", "own", "expr")}
    act = _which(wide, own, expr, _dtype(of))
    if act is not None:
        return Val("h", ops[0].roles, dict(info, act=act, w3=None))
    return Val("ufn", ops[0].roles, dict(info, of=of, wide=wide, own=own, expr=expr))


def _which(wide, own, expr, dtype):
    """The activation wide, own and expr are (module docstring), or None."""
    if not isinstance(wide, torch.Tensor) or wide.shape != POINTS.shape:
        return None
    for act, fn in _ACTS.items():
        want = fn(POINTS)
        if not bool(((wide - want).abs() <= 1e-12 * (1 + want.abs())).all()):
            continue
        ulp = torch.finfo(dtype).eps
        near = (own.double() - fn(POINTS.to(dtype)).double()).abs() <= _ULPS * ulp * (1 + POINTS.abs())
        if bool(near.all()) and _equal(expr, _formulas()[act]):
            return act
    return None


def _dtype(node):
    value = node.meta.get("example_value")
    return value.dtype if isinstance(value, torch.Tensor) and value.dtype.is_floating_point else torch.float64


def _sympy():
    import sympy  # here: its import takes ~0.3 s, and only a written-out activation needs it
    return sympy


@functools.cache
def _symbol():
    return _sympy().Symbol("u", real=True)


@functools.cache
def _formulas():
    sp, u = _sympy(), _symbol()
    kappa = sp.Rational(44715, 10 ** 6)
    return {"silu": u / (1 + sp.exp(-u)), "gelu": u * (1 + sp.erf(u / sp.sqrt(2))) / 2,
            "gelu_tanh": u * (1 + sp.tanh(sp.sqrt(2 / sp.pi) * (u + kappa * u ** 3))) / 2}


@functools.cache
def _constants():
    sp = _sympy()
    exact = (sp.Rational(1, 2), sp.sqrt(2), 1 / sp.sqrt(2), sp.sqrt(2 / sp.pi), sp.Rational(44715, 10 ** 6))
    return [(float(c), c) for c in exact]


def _snap(number):
    """number as the exact constant it stands for where it is within 4 ulps of one, else as it is."""
    sp = _sympy()
    if float(number).is_integer():
        return sp.Integer(int(number))
    for near, exact in _constants():
        if abs(number - near) <= 4 * math.ulp(near):
            return exact
    return sp.Float(number)


def _equal(expr, formula):
    """Whether sympy shows expr - formula is 0, with the arguments of erf, tanh and exp expanded
    (x·c·(1 + κx²) is c·x + cκx³). A difference it cannot show is 0 counts as not equal."""
    sp = _sympy()
    expand_args = lambda e: e.replace(lambda t: isinstance(t, (sp.erf, sp.tanh, sp.exp)),
                                      lambda t: t.func(sp.expand(t.args[0])))
    difference = sp.expand(expand_args(expr) - expand_args(formula))
    return difference == 0 or sp.simplify(difference) == 0


_SYMPY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
          "pow": operator.pow, "neg": operator.neg,
          "erf": lambda a: _sympy().erf(a), "tanh": lambda a: _sympy().tanh(a),
          "sigmoid": lambda a: 1 / (1 + _sympy().exp(-a)), "exp": lambda a: _sympy().exp(a)}
