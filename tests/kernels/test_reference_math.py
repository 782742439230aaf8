"""The reference path (kernels="reference") against autograd through the plain models, in float64."""
import copy
import itertools
import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mha_compile import models, ops
from mha_compile.kernels import reference
from kernel_cases import check_non_finite_experts
from numerics import relative_error

CONFIGS = list(itertools.product(models.ACTIVATIONS, (True, False), (True, False)))


def _block_and_inputs(act, renorm, bias, D=24, P=3, F=40, E=5, k=2, B=3, H=4, N=7, seed=0):
    torch.manual_seed(seed)
    block = models.MHABlock(D, P, F, E, k, act=act, renorm=renorm, bias=bias).double()
    ctx = torch.randn(B, H, D, dtype=torch.float64, requires_grad=True)
    tok = torch.randn(B, N, D, dtype=torch.float64, requires_grad=True)
    return block, ctx, tok


@pytest.mark.parametrize("act,renorm,bias", CONFIGS)
def test_region_op_equals_autograd_of_the_model(act, renorm, bias):
    block, ctx, tok = _block_and_inputs(act, renorm, bias)
    params = models.block_parameters(block)
    expected = block(ctx, tok)
    got = ops.region(ctx, tok, *params, None, block.moe.top_k, renorm, act, "reference")[0]
    assert relative_error(got, expected) <= 1e-12
    grad = torch.randn_like(expected)
    inputs = [t for t in (ctx, tok, *params) if t is not None]
    names = [n for n, t in zip(ops.REGION_INPUTS, (ctx, tok, *params)) if t is not None]
    want = torch.autograd.grad(expected, inputs, grad)
    have = torch.autograd.grad(got, inputs, grad)
    for name, w, h in zip(names, want, have):
        if name == "bk":  # SPEC §1: ∂bk is exactly zero; autograd leaves rounding noise
            assert torch.count_nonzero(h) == 0 and w.abs().max() <= 1e-12
            continue
        assert w.norm() > 0, f"{name}: the model's gradient is zero, the comparison would be vacuous"
        assert relative_error(h, w) <= 1e-10, f"∂{name}"


@pytest.mark.parametrize("act", models.ACTIVATIONS)
def test_gradcheck_region_op(act):
    block, ctx, tok = _block_and_inputs(act, renorm=act != "silu", bias=True, D=8, P=2, F=6, E=3, B=2, H=3, N=4)
    params = models.block_parameters(block)
    fn = lambda c, t, *p: ops.region(c, t, *p, None, 2, act != "silu", act, "reference")[0]
    assert torch.autograd.gradcheck(fn, (ctx, tok, *params))


def test_opcheck_region_op():
    block, ctx, tok = _block_and_inputs("swiglu", True, True)
    args = (ctx, tok, *models.block_parameters(block), None, 2, True, "swiglu", "reference")
    torch.library.opcheck(ops.region, args)


def test_opcheck_region_backward_with_transposed_inputs():
    """The backward op's fake against its real outputs (strides included) where ctx and tok are
    transposed views: the gradients are contiguous, whatever the inputs' strides."""
    block, ctx, tok = _block_and_inputs("gelu", True, True)
    ctx = ctx.detach().transpose(1, 2).contiguous().transpose(1, 2)  # [B,H,D], H innermost
    tok = tok.detach().transpose(1, 2).contiguous().transpose(1, 2)
    params = [None if p is None else p.detach() for p in models.block_parameters(block)]
    out, *saved = ops.region(ctx, tok, *params, None, 2, True, "gelu", "reference")
    args = (torch.randn_like(out), ctx, tok, *params, None, *saved, 2, True, "gelu", "reference")
    torch.library.opcheck(ops.region_backward, args, test_utils=("test_schema", "test_faketensor"))
    assert all(g.is_contiguous() for g in ops.region_backward(*args))


def test_reference_needs_no_host_sync():
    """Under FakeTensorMode any .item()/.nonzero()/bincount-style data-dependent size raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    block, ctx, tok = _block_and_inputs("gelu", True, True)
    params = [None if p is None else p.detach() for p in models.block_parameters(block)]
    with FakeTensorMode(allow_non_fake_inputs=True):
        saved = reference.region_forward(ctx.detach(), tok.detach(), *params, None, 2, True, "gelu")
        grads = reference.region_backward(saved[0], ctx.detach(), tok.detach(), *params, None, *saved[1:], 2, True, "gelu")
    assert saved[0].shape == ctx.shape and grads[10].shape == params[8].shape


def test_moe_computes_only_the_chosen_experts():
    """FLOPs of the grouped MoE scale with k, not with E (the dense spelling computes all E)."""
    torch.manual_seed(0)
    R, D, F, E, k = 512, 32, 64, 16, 2
    x, w1, w2 = torch.randn(R, D), torch.randn(E, D, F), torch.randn(E, F, D)
    _, weight, index = reference.route(x, torch.randn(E, D), k, True)
    with FlopCounterMode(display=False) as counter:
        reference.moe_forward(x, weight, index, w1, None, w2, None, None, "gelu")
    chosen = 4 * R * k * D * F
    assert chosen <= counter.get_total_flops() <= 1.6 * chosen  # tile padding only
    assert counter.get_total_flops() < 4 * R * E * D * F / 4


def test_all_rows_to_one_expert_and_empty_experts():
    torch.manual_seed(1)
    R, D, F, E = 37, 16, 24, 6
    x = torch.randn(R, D, dtype=torch.float64)
    w1, w2 = torch.randn(E, D, F, dtype=torch.float64), torch.randn(E, F, D, dtype=torch.float64)
    b1, b2 = torch.randn(E, F, dtype=torch.float64), torch.randn(E, D, dtype=torch.float64)
    index = torch.full((R, 1), 4)
    weight = torch.rand(R, 1, dtype=torch.float64)
    got = reference.moe_forward(x, weight, index, w1, b1, w2, b2, None, "silu")
    want = weight * (torch.nn.functional.silu(x @ w1[4] + b1[4]) @ w2[4] + b2[4])
    assert relative_error(got, want) <= 1e-12


@pytest.mark.parametrize("kernels", ["reference", "fused"])
def test_exported_inv_gets_its_gradient(kernels):
    """With export_inv the graph reads inv too (a residual y + MoE(y)); gradcheck over both outputs
    fails if the pool does not receive ∂inv from outside the region."""
    import os
    if kernels == "fused" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the fused set runs on CPU tensors only under TRITON_INTERPRET=1")
    block, ctx, tok = _block_and_inputs("gelu", True, True, D=8, P=2, F=6, E=3, B=2, H=3, N=4)
    params = models.block_parameters(block)
    fn = lambda c, t, *p: ops.region(c, t, *p, None, 2, True, "gelu", kernels, True)[:2]
    if kernels == "reference":
        assert torch.autograd.gradcheck(fn, (ctx, tok, *params))
        return
    # fused runs in fp32: compare with autograd through the float64 reference math instead
    tensors = (ctx, tok, *params)
    names = [n for n, t in zip(ops.REGION_INPUTS, tensors) if t is not None]
    args32 = [None if t is None else t.detach().float().requires_grad_(True) for t in tensors]
    out64, inv64 = reference.region_forward(*tensors, None, 2, True, "gelu")[:2]  # plain autograd: the truth
    out32, inv32 = ops.region(*args32, None, 2, True, "gelu", "fused", True)[:2]
    g_out, g_inv = torch.randn_like(out64), torch.randn_like(inv64)
    want = torch.autograd.grad((out64, inv64), [t for t in tensors if t is not None], (g_out, g_inv), allow_unused=True)
    have = torch.autograd.grad((out32, inv32), [t for t in args32 if t is not None], (g_out.float(), g_inv.float()))
    for name, w, h in zip(names, want, have):
        if name == "bk":
            continue
        assert relative_error(h, w) <= 1e-5, f"∂{name}: {relative_error(h, w):.3g}"


def _sdpa_pool(tok, q, wk, bk, wv, bv, wo, bo, mask):
    """The pool as a user writes it with F.scaled_dot_product_attention (mask True = ignore)."""
    B, N, D = tok.shape
    P, Dh = q.shape
    k = (tok @ wk.T + bk).view(B, N, P, Dh).transpose(1, 2)
    v = (tok @ wv.T + bv).view(B, N, P, Dh).transpose(1, 2)
    pooled = torch.nn.functional.scaled_dot_product_attention(q[None, :, None, :].expand(B, P, 1, Dh), k, v,
                                                              attn_mask=~mask[:, None, None, :])
    return pooled.reshape(B, D) @ wo.T + bo


@pytest.mark.parametrize("kernels", ["reference", "fused"])
def test_a_row_with_every_key_masked_attends_to_nothing_as_sdpa(kernels):
    """Batch row 1 has every key masked: torch's SDPA (its safe softmax, torch ≥ 2.5) gives it a
    zero attention output, so inv = bo, with no gradient to anything but bo from that row. The
    region gives the same, forward and every gradient, where 0/0 made the row NaN before (and
    every parameter's gradient with it). fused: the Triton kernels, under the interpreter, fp32."""
    if kernels == "fused" and not os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the fused kernels on CPU need TRITON_INTERPRET=1")
    dtype = torch.float64 if kernels == "reference" else torch.float32
    block, ctx, tok = _block_and_inputs("gelu", True, True, seed=2)
    block, ctx, tok = block.to(dtype), ctx.detach().to(dtype).requires_grad_(), tok.detach().to(dtype).requires_grad_()
    params = models.block_parameters(block)
    mask = torch.rand(tok.shape[:2], generator=torch.Generator().manual_seed(3)) < 0.3
    mask[:, 0] = False
    mask[1] = True
    # the math in float64: SDPA's pool, then the block's MoE, on the same values
    wide = copy.deepcopy(block).double()
    ctx64, tok64 = ctx.detach().double().requires_grad_(), tok.detach().double().requires_grad_()
    params64 = models.block_parameters(wide)
    inv_sdpa = _sdpa_pool(tok64, *params64[:7], mask)
    assert torch.equal(inv_sdpa[1], params64[6]) or relative_error(inv_sdpa[1], params64[6]) < 1e-6  # SDPA's row: bo
    expected = wide.moe(ctx64 + inv_sdpa[:, None, :])
    got = ops.region(ctx, tok, *params, mask, block.moe.top_k, True, "gelu", kernels)[0]
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert got.isfinite().all() and relative_error(got, expected) <= tol
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    names = [n for n, t in zip(ops.REGION_INPUTS, (ctx, tok, *params)) if t is not None]
    have = torch.autograd.grad(got, [t for t in (ctx, tok, *params) if t is not None], grad.to(dtype))
    want = torch.autograd.grad(expected, [t for t in (ctx64, tok64, *params64) if t is not None], grad)
    for name, w, h in zip(names, want, have):
        assert h.isfinite().all(), f"∂{name} is not finite"
        if name == "bk":
            continue
        assert relative_error(h, w) <= tol, f"∂{name}: {relative_error(h, w):.3g}"
    assert torch.count_nonzero(have[names.index("tok")][1]) == 0  # the row's tokens take none


def test_a_non_finite_expert_reaches_only_its_rows():
    """kernel_cases.check_non_finite_experts on the reference (kernels="reference", the CPU's)."""
    check_non_finite_experts(reference, "cpu")
