"""A gradient penalty through torch.compile(backend="mha"): a backward with create_graph=True whose
gradients are differentiated again (double_backward.py).

The region's kernels record no ops, so a second derivative would take their gradients for
constants; under rest="eager" the region's backward gives them with their graph instead, from the
reference's plain ops at the forward's top-k choice, and the second derivative must be eager's,
every parameter's and input's. Under rest="inductor" AOTAutograd refuses a double backward with
its own error, as torch.compile's default backend does: it must raise, not return constants.
"""
import copy

import pytest
import torch

from mha_compile import models
from numerics import TOLERANCE, needs_interpreter, relative_error


def _block(spelling, dtype):
    torch.manual_seed(0)
    return models.MHABlock(16, 2, 24, 4, 2, act="gelu_tanh", renorm=True, spelling=spelling).to(dtype)


def _penalty_grads(model, ctx, tok, ask="backward"):
    """Gradients of ‖∂L/∂tok‖² + ‖∂L/∂W1‖² (L = Σ out·c) for every parameter, ctx and tok."""
    ctx, tok = ctx.clone().requires_grad_(), tok.clone().requires_grad_()
    out = model(ctx, tok)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    w1 = model.moe.w1  # an OptimizedModule reads its module's attributes
    g_tok, g_w1 = torch.autograd.grad((out * cotangent).sum(), [tok, w1], create_graph=True)
    penalty = g_tok.square().sum() + g_w1.square().sum()
    leaves = [ctx, tok, *model.parameters()]
    if ask == "grad_unused":
        return torch.autograd.grad(penalty, leaves, allow_unused=True)
    penalty.backward()
    return [t.grad for t in leaves]


def _inputs(dtype, B=3, H=2, N=5, D=16):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(B, H, D, generator=gen).to(dtype), torch.randn(B, N, D, generator=gen).to(dtype)


CASES = [("reference", torch.float64, "loop", "backward"), ("reference", torch.float64, "dense", "grad_unused"),
         pytest.param("fused", torch.float32, "loop", "backward", marks=needs_interpreter),
         pytest.param("fused", torch.float32, "dense", "grad_unused", marks=needs_interpreter)]


@pytest.mark.parametrize("kernels,dtype,spelling,ask", CASES)
def test_a_gradient_penalty_trains_as_eager(kernels, dtype, spelling, ask):
    """Every second derivative within the dtype's bound of the eager block's in float64; none
    None (torch.autograd.grad(..., allow_unused=True) returned None for every parameter before,
    silently), none zero; the key bias's is zero by the math, and the region's first ∂bk is
    zeros that depend on nothing, so its second is zero or None (no path), where eager's is
    rounding."""
    model = _block(spelling, dtype)
    compiled = torch.compile(copy.deepcopy(model), backend="mha", options={"kernels": kernels, "strict": True})
    ctx, tok = _inputs(dtype)
    got = _penalty_grads(compiled, ctx, tok, ask)
    want = _penalty_grads(model.double(), ctx.double(), tok.double(), ask)
    names = ["ctx", "tok"] + [n for n, _ in model.named_parameters()]
    for name, g, w in zip(names, got, want):
        if name == "pool.key.bias":  # zero by the math: the region's first ∂bk is zeros with no graph
            assert (g is None or g.abs().max() == 0) and (w is None or w.abs().max() < 1e-9), f"∂{name}"
            continue
        assert g is not None, f"∂{name}: None where eager gives a gradient"
        assert w.abs().max() > 0, f"∂{name} is zero: the comparison would be vacuous"
        assert relative_error(g, w) <= TOLERANCE[dtype], f"∂{name}: {relative_error(g, w):.3g}"


def test_rest_inductor_refuses_a_double_backward():
    """AOTAutograd's own refusal: loud, as under torch.compile's default backend. torch 2.11 words it
    by its donated buffers (the GPU machine's torch, session 67), 2.13 as a double backward."""
    model = _block("loop", torch.float64)
    compiled = torch.compile(model, backend="mha", options={"kernels": "reference", "rest": "inductor"})
    with pytest.raises(RuntimeError, match="double backward|donated buffer.*create_graph=False"):
        _penalty_grads(compiled, *_inputs(torch.float64), ask="grad_unused")


@pytest.mark.parametrize("kernels", ["reference", pytest.param("fused", marks=needs_interpreter)])
def test_a_batch_of_cotangents_is_refused_with_a_clear_error(kernels):
    """torch.autograd.grad(..., is_grads_batched=True): the eager block takes a batch of cotangents
    (torch's legacy vmap over its backward), the region's backward takes one at a time and says so
    (before: "Batching rule not implemented for aten::einsum" from the reference's pool backward)."""
    model = _block("loop", torch.float32)
    ctx, tok = _inputs(torch.float32)
    ctx.requires_grad_()
    cotangents = torch.randn(3, *ctx.shape)
    eager = torch.autograd.grad(model(ctx, tok), ctx, cotangents, is_grads_batched=True)[0]
    assert eager.shape == (3, *ctx.shape)
    compiled = torch.compile(copy.deepcopy(model), backend="mha", options={"kernels": kernels})
    with pytest.raises(NotImplementedError, match="is_grads_batched=True.*once per cotangent"):
        torch.autograd.grad(compiled(ctx, tok), ctx, cotangents, is_grads_batched=True)
