"""An expert's activation written out in elementwise ops of u = x W1 + b1 and Python numbers
(silu as u · sigmoid(u), gelu as 0.5 · u · (1 + erf(u / √2)), the tanh gelu with its cube), read
as the activation it is. The ops ride along as a "ufn" Val (info: "of" the u node, their sympy
expression, their values on POINTS in float64, and on every value of u's dtype up to LIMIT as an
autograd graph from a leaf), and become the activation's h only where all four checks hold:

1. in float64 on POINTS, to 1e-12 (a cheap filter, run first);
2. in the model's dtype, forward: the same torch ops give the activation's values to 3 of that
   dtype's ulps (of 1 + |u|) at every value of a 16-bit dtype with |u| <= LIMIT and at 240k values
   of float32 and float64, so a step that rounds u coarser (u + 256 - 256 in bf16), overflows
   (· 1e40 / 1e40 in float32) or is NaN on a band (1e37 / (u - 0.05) - itself) is refused;
3. the same, backward: their gradients, as eager's autograd gives them, to 4 ulps: u / (1 + exp(-u))
   is silu forward, and NaN backward where exp(-u) overflows (u < -88 in float32), where the op's
   silu is finite (found by a review);
4. exactly: the sympy expression, each number snapped to the exact constant it stands for where it
   is within 4 ulps of it (integers, 1/2, √2, 1/√2, √(2/π), 0.044715), equals the formula; a step
   whose result sympy folds to a number though u was in it (a - a, a · 0) is refused, since its
   floats need not (NaN - NaN). Values alone prove nothing: a bump too narrow to fall on any point
   tested agreed with silu at each of them (a review), and a constant cut to 8 digits is 1e-9 off.

Beyond |u| = LIMIT a written-out form may overflow where the op does not; that is not checked.
Ops that pass none are told, for a near-miss's reason, by refusal: the nearest activation and the
first check failed for it, in numbers (a review found the reason said only "could not be read").
"""
import contextlib
import dataclasses
import functools
import math
import operator
import weakref

import torch
import torch.nn.functional as F

from mha_compile.lowering.canonicalize import float_dtype
from mha_compile.lowering.interpret import Val

UNARY = ("erf", "ndtr", "tanh", "sigmoid", "exp", "neg")
KINDS = UNARY + ("add", "sub", "mul", "div", "pow")
# Python's operators apply alike to tensors (as eager does, numbers on either side) and to sympy's expressions
_OPERATORS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
              "pow": operator.pow, "neg": operator.neg}
_TORCH = {**_OPERATORS, "erf": torch.erf, "ndtr": torch.special.ndtr, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
          "exp": torch.exp}
_ACTS = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}
# Where the activations differ from each other and from their asymptotes, 0 (where a division by
# u gives a NaN), and far out, where a term too small to see on [-6, 6] would not be
POINTS = torch.cat([torch.linspace(-6.0, 6.0, 121, dtype=torch.float64),
                    torch.tensor([10.0, -10.0, 20.0, -20.0, 50.0, -50.0, 1e3, -1e3], dtype=torch.float64)])
LIMIT = 1e4
# In u's dtype the written-out ops round at each step where the activation rounds once: measured
# at most 2.2 ulps of (1 + |u|) forward (the erf gelu in float32) and 2.8 backward (the tanh gelu
# in float64) for the forms in the tests, on _dense's values of bf16, fp16, float32 and float64;
# u + 8 - 8 in bf16 (u rounded to 1/16) is off by 3.5 forward
_ULPS = {"forward": 3, "backward": 4}
_LEAVES = weakref.WeakKeyDictionary()  # u node -> the autograd leaf its written-out ops start from
_MOST_OPS = 40  # a longer expression is not taken for an activation: sympy's time grows fast with it


def written_out(node, op, args):
    """The Val of an elementwise op on u, "ufn" or "h" (module docstring), or None where it is not
    one: an operand other than u, a "ufn" of the same u node or a Python number, or operands whose
    axes differ (u · sigmoid(u).t() of a square u)."""
    if len(args) != (1 if op.kind in UNARY else 2):
        return None
    if any(v is None or not (v.kind in ("u", "ufn") or _number(v)) for v in args):
        return None
    ops = [v for v in args if v.kind in ("u", "ufn")]
    if not ops or any(v.roles != ops[0].roles for v in ops):
        return None
    sources = {val.info["of"] if val.kind == "ufn" else arg for arg, val in zip(node.args, args) if val.kind != "const"}
    if len(sources) != 1:
        return None
    of = next(iter(sources))
    with _autograd():  # the compile may run where the user's call is under no_grad or inference_mode
        if of not in _LEAVES:  # one leaf per u node: u / √2 and 0.5 · u start apart and meet again
            _LEAVES[of] = _dense(float_dtype(of) or torch.float64).clone().requires_grad_()
        leaf = _LEAVES[of]
        operands = [(v.info["value"], v.info["value"], _snap(v.info["value"])) if v.kind == "const"
                    else (POINTS, leaf, _symbol()) if v.kind == "u"
                    else (v.info["wide"], v.info["own"], v.info["expr"]) for v in args]
        fn = _TORCH[op.kind]
        wide, own = fn(*[o[0] for o in operands]), fn(*[o[1] for o in operands])
    expr = _SYMPY[op.kind](*[o[2] for o in operands])
    if not expr.free_symbols:  # u went into it, and sympy folded it to a number (a - a)
        return None
    info = {k: v for k, v in ops[0].info.items() if k not in ("of", "wide", "own", "expr")}
    act = _which(wide, own, leaf, expr)
    if act is not None:
        return Val("h", ops[0].roles, dict(info, act=act, w3=None))
    return Val("ufn", ops[0].roles, dict(info, of=of, wide=wide, own=own, expr=expr))


def _number(val):
    return val.kind == "const" and type(val.info["value"]) in (int, float)


def _which(wide, own, leaf, expr):
    """The activation wide, own (from leaf) and expr are (module docstring), or None."""
    if not isinstance(wide, torch.Tensor) or wide.shape != POINTS.shape or own.shape != leaf.shape:
        return None
    return next((act for act in _ACTS if _checks(act, wide, own, leaf, expr).passed == 4), None)


@dataclasses.dataclass
class _Checked:
    """How far the ops got through the module docstring's checks for `act`: `passed` of the four,
    `off` their largest float64 difference on POINTS (relative to 1 + |act(u)|), `why` the first
    check failed in words, and `at` the index in leaf where a check 2 or 3 failed worst."""
    act: str
    passed: int
    off: float
    why: str = ""
    at: int = None


def _checks(act, wide, own, leaf, expr):
    want = _ACTS[act](POINTS)
    off = torch.nan_to_num((wide - want).abs() / (1 + want.abs()), nan=math.inf)  # for the words only
    if not bool(((wide - want).abs() <= 1e-12 * (1 + want.abs())).all()):
        at = int(off.argmax())
        why = (f"{off[at]:.2g} off it, relative to 1 + |{act}(u)|, at u = {POINTS[at]:g} in float64, where the same "
               f"ops of {act} are within 1e-12")
        return _Checked(act, 0, float(off[at]), why)
    with _autograd():
        x = leaf.detach().requires_grad_()
        theirs = _ACTS[act](x)
        grads = torch.autograd.grad(own.sum(), leaf, retain_graph=True)[0], torch.autograd.grad(theirs.sum(), x)[0]
    for passed, (way, got, want) in enumerate((("forward", own, theirs), ("backward", *grads)), start=1):
        if not _near(got, want, x, way):
            at = int(_ulps(got, want, x).argmax())
            return _Checked(act, passed, float(off.max()), _ulps_off(way, got, want, x, at, act), at)
    if _equal(expr, act):
        return _Checked(act, 4, float(off.max()))
    count = _sympy().count_ops(expr)
    why = (f"{count} ops, more than the {_MOST_OPS} sympy is given to show it equal" if count > _MOST_OPS
           else f"sympy does not show it equal to {_shown(_formulas()[act])}")
    return _Checked(act, 3, float(off.max()), why)


@contextlib.contextmanager
def _autograd():
    with torch.inference_mode(False), torch.enable_grad():
        yield


def _near(got, want, x, way):
    scale = _ULPS[way] * torch.finfo(x.dtype).eps * (1 + x.detach().double().abs())
    return bool(((got.detach().double() - want.detach().double()).abs() <= scale).all())


def _ulps(got, want, x):
    """|got - want| in x's dtype's ulps of (1 + |x|), a NaN as infinitely far: for a reason's numbers."""
    scale = torch.finfo(x.dtype).eps * (1 + x.detach().double().abs())
    return torch.nan_to_num((got.detach().double() - want.detach().double()).abs() / scale, nan=math.inf)


def _ulps_off(way, got, want, x, at, act):
    what = "value" if way == "forward" else "gradient (autograd's)"
    g, w, u = float(got.detach()[at]), float(want.detach()[at]), float(x.detach()[at])
    ulps = f", {float(_ulps(got, want, x)[at]):.3g} ulps off, more than {_ULPS[way]}" if math.isfinite(g) else ""
    return f"in {x.dtype}, its {what} at u = {u:g} is {g:g}, where {act}'s is {w:g}{ulps}"


@functools.cache
def _dense(dtype):
    """The values of u that check 2 and 3 run on: every finite one of a 16-bit dtype with |u| <=
    LIMIT, 240k of a wider one (a fine grid near 0, a coarser one out to LIMIT, both signs)."""
    if torch.finfo(dtype).bits == 16:
        every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
        return every[every.isfinite() & (every.abs() <= LIMIT)]
    near = torch.linspace(-20.0, 20.0, 200001, dtype=torch.float64)
    far = torch.logspace(math.log10(20.0), math.log10(LIMIT), 20000, dtype=torch.float64)
    return torch.cat([near, far, -far]).to(dtype)


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


_PROVEN = {}  # (srepr of an expression, act) -> whether _equal showed it: one proof per expression, not per expert


def _equal(expr, act):
    """Whether sympy shows expr minus act's formula is 0, with the arguments of erf, tanh and exp
    expanded (x·c·(1 + κx²) is c·x + cκx³). A difference it cannot show is 0, or an expression
    past _MOST_OPS, counts as not equal."""
    sp = _sympy()
    key = (sp.srepr(expr), act)
    if key not in _PROVEN:
        expand_args = lambda e: e.replace(lambda t: isinstance(t, (sp.erf, sp.tanh, sp.exp)),
                                          lambda t: t.func(sp.expand(t.args[0])))
        short = sp.count_ops(expr) <= _MOST_OPS
        difference = sp.expand(expand_args(expr) - expand_args(_formulas()[act])) if short else None
        _PROVEN[key] = short and (difference == 0 or (
            sp.count_ops(difference) <= _MOST_OPS and sp.simplify(difference) == 0))
    return _PROVEN[key]


_SYMPY = {**_OPERATORS, "erf": lambda a: _sympy().erf(a), "tanh": lambda a: _sympy().tanh(a),
          "ndtr": lambda a: (1 + _sympy().erf(a / _sympy().sqrt(2))) / 2,
          "sigmoid": lambda a: 1 / (1 + _sympy().exp(-a)), "exp": lambda a: _sympy().exp(a)}


def refusal(steps):
    """Why written-out ops are none of the activations, for a near-miss's reason. steps: the
    (node, "ufn" Val) of each op on u, in graph order, the last the one that a W2 product (or
    SwiGLU's gate) read. Told for the activation they come nearest: the one whose checks they pass
    furthest, then the one they are nearest in float64."""
    node, val = steps[-1]
    info = val.info
    checked = [_checks(act, info["wide"], info["own"], _LEAVES[info["of"]], info["expr"]) for act in _ACTS]
    nearest = max(checked, key=lambda c: (c.passed, -c.off))
    where = "" if nearest.at is None else _first_unfinite(steps, nearest.at)
    return (f"{node.name} gives {_shown(info['expr'])} of u = {info['of'].name} (an expert's x W + b), which is not "
            f"gelu, gelu_tanh or silu; nearest {nearest.act}: {nearest.why}{where}{_cut_constant(info['expr'])}")


def _first_unfinite(steps, at):
    """The first step whose value at the leaf's index `at` is not finite, named, or ""."""
    for node, val in steps:
        value = val.info["own"].detach()
        if value.shape == _LEAVES[val.info["of"]].shape and not math.isfinite(float(value[at])):
            return f"; there {node.name} = {_shown(val.info['expr'])} is {float(value[at]):g}"
    return ""


def _shown(expr, most=100):
    sp = _sympy()  # a large whole number (1e40, snapped to an Integer) shown as 1.0e+40, not in 41 digits
    expr = expr.xreplace({n: sp.Float(n, 6) for n in expr.atoms(sp.Integer) if abs(n) >= 10 ** 6})
    text = sp.sstr(expr, full_prec=False)
    return text if len(text) <= most else text[:most] + "..."


def _cut_constant(expr):
    """A number near a constant of the formulas, but not within the 4 ulps that read it as that
    constant (0.79788456 for √(2/π)): the likeliest cause, said."""
    sp = _sympy()
    for number in sorted(expr.atoms(sp.Float), key=float):
        for near, exact in _constants():
            if 0 < abs(float(number) - near) <= 1e-6 * near:
                return (f"; its number {float(number)!r} stands for {sp.sstr(exact)} = {near!r}, but is "
                        f"{abs(float(number) - near):.1g} from it, and is read as that constant only within 4 ulps")
    return ""
