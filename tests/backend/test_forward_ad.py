"""Forward-mode AD (torch.autograd.forward_ad) through torch.compile(backend="mha").

The kernel sets have no jvp: a dual input made RegionFunction raise "You must implement the jvp
function". A call carrying tangents now runs the region on the reference's plain ops, and where
the graph would replay CUDA graphs or Inductor's code (neither carries tangents: Inductor's own
gave the tangent None for a compiled x.sin()), the graph as captured runs eagerly. The tangents
must be eager's, with grad on or off, and the gradients of the same call too.
"""
import copy

import pytest
import torch
from torch.autograd import forward_ad

from mha_compile import backend, models, ops
from mha_compile.kernels import reference
from numerics import TOLERANCE, compiled_reports, needs_interpreter, relative_error


def _block(dtype):
    torch.manual_seed(0)
    return models.MHABlock(16, 2, 24, 4, 2, act="gelu", renorm=True, spelling="loop").to(dtype)


def _inputs(dtype, B=3, H=2, N=5, D=16):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(B, H, D, generator=gen).to(dtype), torch.randn(B, N, D, generator=gen).to(dtype),
            torch.randn(B, H, D, generator=gen).to(dtype), torch.randn(B, N, D, generator=gen).to(dtype)]


def _tangent(model, ctx, tok, t_ctx, t_tok, grad):
    """(out, its tangent along (t_ctx, t_tok), and with grad the gradients of Σ out·c of ctx, tok
    and every parameter) from one call."""
    ctx, tok = ctx.clone().requires_grad_(grad), tok.clone().requires_grad_(grad)
    with forward_ad.dual_level(), torch.set_grad_enabled(grad):
        out = model(forward_ad.make_dual(ctx, t_ctx), forward_ad.make_dual(tok, t_tok))
        primal, tangent = forward_ad.unpack_dual(out)
        grads = []
        if grad:
            cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
            grads = torch.autograd.grad((primal * cotangent).sum(), [ctx, tok, *model.parameters()],
                                        allow_unused=True)
    return primal, tangent, grads


CASES = [("reference", torch.float64, "eager"), ("reference", torch.float64, "inductor"),
         pytest.param("fused", torch.float32, "eager", marks=needs_interpreter)]


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("kernels,dtype,rest", CASES)
def test_forward_mode_tangents_are_eagers(kernels, dtype, rest, grad, monkeypatch):
    """rest="eager": the region on its reference; rest="inductor": the graph as captured (no region
    at all: a rewrite verify may have refused is not what the tangents come from)."""
    torch._dynamo.reset()  # a graph compiled by an earlier test would be reused, and none compiled here
    regions = []
    real = reference.region_forward
    monkeypatch.setattr(reference, "region_forward", lambda *a, **k: regions.append(1) or real(*a, **k))
    model = _block(dtype)
    compiled = torch.compile(copy.deepcopy(model), backend="mha",
                             options={"kernels": kernels, "rest": rest, "strict": True})
    ctx, tok, t_ctx, t_tok = _inputs(dtype)
    with compiled_reports() as reports:
        out, tangent, grads = _tangent(compiled, ctx, tok, t_ctx, t_tok, grad)
    assert any(r.matches for r in reports), "the region was not replaced: the test would compare eager with eager"
    assert (len(regions) > 0) == (rest == "eager"), regions
    want_out, want_tangent, want_grads = _tangent(model.double(), *(t.double() for t in (ctx, tok, t_ctx, t_tok)),
                                                  grad)
    assert tangent is not None, "the compiled call dropped the tangent"
    assert relative_error(out, want_out) <= TOLERANCE[dtype]
    assert relative_error(tangent, want_tangent) <= TOLERANCE[dtype]
    assert tangent.abs().max() > 0
    largest = max((g.abs().max() for g in want_grads if g is not None), default=0)
    for got, want, name in zip(grads, want_grads, ["ctx", "tok", *(n for n, _ in model.named_parameters())]):
        assert got is not None, f"∂{name} missing"
        if name == "pool.key.bias":  # zero by the math (SPEC §1); eager's is rounding
            if rest == "eager":  # the region's reference gives it zeros, as the kernels do
                assert not got.any(), f"∂{name}"
            else:  # the graph as captured: eager's rounding
                assert got.abs().max() <= TOLERANCE[dtype] * largest, f"∂{name}"
        else:
            assert relative_error(got, want) <= TOLERANCE[dtype], f"∂{name}"
    assert not grad or len(grads) == 2 + len(list(model.parameters()))


def test_a_call_without_tangents_reads_no_tensor():
    """Outside a dual level has_tangents is False without looking at the tensors; inside one it
    finds the dual among plain tensors."""
    plain = torch.randn(3)
    assert not ops.has_tangents((plain, object(), None))
    with forward_ad.dual_level():
        assert not ops.has_tangents((plain, 2, None))
        assert ops.has_tangents((plain, forward_ad.make_dual(torch.randn(3), torch.randn(3))))


def test_graph_replays_take_tangent_calls_eagerly():
    """The wrapper around a compiled graph that would drop tangents (a CUDA-graph replay, Inductor's
    code; a stand-in here): calls without tangents go to it, calls with them run the graph eagerly."""
    gm = torch.fx.symbolic_trace(lambda x: (x.sin() * 2).sum(-1))
    dropped = []

    def replay(x):  # what a graph replay returns: the values, no tangent
        dropped.append(x)
        return gm(x.detach() if not forward_ad._current_level >= 0 else forward_ad.unpack_dual(x).primal)

    call = backend._tangents_eagerly(replay, gm, name="graph 0")
    x, t = torch.randn(4, 3), torch.randn(4, 3)
    assert torch.equal(call(x), gm(x)) and len(dropped) == 1
    with forward_ad.dual_level():
        out = call(forward_ad.make_dual(x, t))
        tangent = forward_ad.unpack_dual(out).tangent
    assert len(dropped) == 1, "a call with tangents went to the replay"
    torch.testing.assert_close(tangent, (x.cos() * 2 * t).sum(-1))



def test_tangents_under_autocast_take_the_regions_precision(monkeypatch):
    """Under torch.autocast the reference that carries the tangents runs with autocast off, as
    the kernels pick their own precisions (fp32 sums, an fp32 router): checked by the autocast
    state in its calls, since both ways are within bf16's bound of the float64 math here (7.4e-3
    with autocast on inside it, 1.8e-3 off: the region's bf16 inputs and output are rounded either
    way); the tangent is checked at that bound."""
    torch._dynamo.reset()
    seen = []
    real = reference.region_forward
    monkeypatch.setattr(reference, "region_forward",
                        lambda *a, **k: seen.append(torch.is_autocast_enabled("cpu")) or real(*a, **k))
    model = _block(torch.float32)
    compiled = torch.compile(copy.deepcopy(model), backend="mha", options={"kernels": "reference", "strict": True})
    ctx, tok, t_ctx, t_tok = (t.bfloat16() for t in _inputs(torch.float32))
    with torch.autocast("cpu", dtype=torch.bfloat16), compiled_reports() as reports:
        _, tangent, _ = _tangent(compiled, ctx, tok, t_ctx, t_tok, grad=False)
    assert any(r.matches for r in reports) and tangent is not None
    assert seen and not any(seen), f"autocast on in the reference's calls: {seen}"
    _, want, _ = _tangent(model.double(), *(t.double() for t in (ctx, tok, t_ctx, t_tok)), grad=False)
    assert relative_error(tangent, want) <= 2e-2  # SPEC §4's bf16 bound
