"""mha::pool then mha::moe (pool_moe_ops): the fused region split in two, for whole_graph.plan_pool_split.

They run the fused kernel set's own pieces in its order, so they must give exactly what mha::region
with kernels="fused" gives, forward and every gradient (the same bits), and that within SPEC §4's
fp32 bound of the float64 reference; the fakes must promise what the ops return (opcheck)."""
import os

import pytest
import torch

from mha_compile import ops, pool_moe_ops
from mha_compile.kernels import reference, triton_moe, triton_pool

from kernels.kernel_cases import GRAD_NAMES, make_case
from numerics import record_calls, relative_error

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the fused kernels on CPU need TRITON_INTERPRET=1")


def _split_call(ctx, tok, params, mask, top_k, renorm, act, keep_hidden, export_inv):
    q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3 = params
    inv, _, _, _ = pool_moe_ops.pool(tok, q, wk, bk, wv, bv, wo, bo, mask)
    out = pool_moe_ops.moe(ctx, inv, wg, w1, b1, w2, b2, w3, top_k, renorm, act, keep_hidden)[0]
    return out, inv


def _region_call(ctx, tok, params, mask, top_k, renorm, act, keep_hidden, export_inv):
    outputs = ops.region(ctx, tok, *params, mask, top_k, renorm, act, "fused", export_inv, keep_hidden=keep_hidden)
    return outputs[0], outputs[1]


def _outputs_and_grads(call, ctx, tok, params, mask, top_k, renorm, act, keep_hidden, export_inv):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (ctx, tok, *params)]
    out, inv = call(leaves[0], leaves[1], leaves[2:], mask, top_k, renorm, act, keep_hidden, export_inv)
    gen = torch.Generator().manual_seed(7)
    g_out = torch.randn(out.shape, generator=gen).to(out.dtype)
    loss = (out * g_out).sum()
    if export_inv:  # the graph reads inv too: its gradient reaches the pool beside the MoE's
        loss = loss + (inv * torch.randn(inv.shape, generator=gen).to(inv.dtype)).sum()
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(loss, present))
    return out.detach(), inv.detach(), [None if t is None else next(grads) for t in leaves]


@pytest.mark.parametrize("export_inv", [False, True], ids=["", "inv-read"])
@pytest.mark.parametrize("act,bias,keep_hidden,masked", [
    ("gelu", True, False, False), ("swiglu", False, False, True), ("silu", True, True, False)])
def test_the_split_ops_give_the_fused_region_s_bits(act, bias, keep_hidden, masked, export_inv):
    """Odd sizes (B=3, H=5, N=7, D=24, F=40, E=5, k=2), fresh inputs; every gradient the region's,
    bit for bit, none of them zero (but ∂bk, exactly zero by the math), and the forward within
    fp32's bound of the float64 reference. Where the graph reads inv too, the region adds the
    reference pool backward of inv's own gradient to its kernels' (ops._region_gradients) where the
    split sums the two ∂inv before one pool backward: the same math, summed in another order, so
    the pool's gradients are held to fp32's bound (SPEC §4) there instead of the bits."""
    ctx, tok, params = make_case(3, 5, 7, 24, 2, 40, 5, 2, act=act, bias=bias)
    mask = (torch.rand(3, 7) < 0.3) if masked else None
    if mask is not None:
        mask[:, 0] = False  # every row keeps a token
    args = (ctx, tok, params, mask, 2, True, act, keep_hidden, export_inv)
    out_s, inv_s, grads_s = _outputs_and_grads(_split_call, *args)
    out_r, inv_r, grads_r = _outputs_and_grads(_region_call, *args)
    assert torch.equal(out_s, out_r) and torch.equal(inv_s, inv_r)
    for name, g_s, g_r in zip(GRAD_NAMES, grads_s, grads_r):
        assert (g_s is None) == (g_r is None), name
        if g_s is None:
            continue
        assert g_s.dtype == g_r.dtype, f"∂{name}"
        if export_inv and name in ops.POOL_GRADS:
            assert ((g_s - g_r).norm() / g_r.norm()).item() <= 1e-5, f"∂{name}"
        else:
            assert torch.equal(g_s, g_r), f"∂{name}"
        assert (g_s.abs().max() == 0) == (name == "bk"), f"∂{name}: zero where it must not be, or ∂bk not zero"
    c64 = lambda t: None if t is None else t.double()
    ref = reference.region_forward(c64(ctx), c64(tok), *map(c64, params), mask, 2, True, act)[0]
    assert ((out_s.double() - ref).norm() / ref.norm()).item() <= 1e-5


@pytest.mark.parametrize("masked", [False, True])
def test_pool_function_gives_the_op_s_bits(masked):
    """PoolFunction (whole_graph's eager pool, without the op's dispatch) runs the op's pieces: its
    four outputs and the gradients of every pool input from a fresh ∂inv are the op's, bit for bit,
    none zero but ∂bk (exactly zero)."""
    _, tok, params = make_case(3, 5, 7, 24, 2, 40, 5, 2, act="gelu", bias=True)
    mask = (torch.rand(3, 7) < 0.3) if masked else None
    if mask is not None:
        mask[:, 0] = False
    results = []
    for call in (pool_moe_ops.pool, pool_moe_ops.PoolFunction.apply):
        leaves = [t.detach().requires_grad_() for t in (tok, *params[:7])]
        outputs = call(*leaves, mask)
        grad_inv = torch.randn(outputs[0].shape, generator=torch.Generator().manual_seed(3))
        results.append(([o.detach() for o in outputs], torch.autograd.grad(outputs[0], leaves, grad_inv)))
    (outs_op, grads_op), (outs_fn, grads_fn) = results
    assert all(torch.equal(a, b) for a, b in zip(outs_op, outs_fn))
    for name, g_op, g_fn in zip(pool_moe_ops.POOL_INPUTS, grads_op, grads_fn):
        assert torch.equal(g_op, g_fn), f"∂{name}"
        assert (g_fn.abs().max() == 0) == (name == "bk"), f"∂{name}"


@pytest.mark.parametrize("call", [pool_moe_ops.pool, pool_moe_ops.PoolFunction.apply], ids=["op", "PoolFunction"])
def test_the_pool_s_backward_hands_its_heads_to_the_single_pass(monkeypatch, call):
    """mha::pool and PoolFunction save the heads' output (pooled) for their backward, which the single
    pass's c needs: with tok past the GPU's L2 (an L2 of 64 bytes here, as the large preset's tok on
    the GPU) and split dots (fp16 standing in for bf16) the default runs it, once, with those heads;
    every pool gradient (each in fp16, the inputs' dtype) within two fp16 roundings of the two
    passes' (fp32 sums in another order, each rounded once: 5e-5 seen on ∂Wk)."""
    monkeypatch.setattr(triton_pool, "l2_bytes", lambda device: 64)
    monkeypatch.setattr(triton_pool, "SPLIT_DOT_DTYPES", {torch.float16: 2})
    launched = record_calls(monkeypatch, triton_pool, "attend_bwd_single")
    _, tok, params = make_case(3, 5, 7, 24, 2, 40, 5, 2, act="gelu", bias=True, dtype=torch.float16)
    grad_inv = torch.randn(3, 24, generator=torch.Generator().manual_seed(3))
    grads = {}
    for single in (None, False):  # the default, then the two passes
        monkeypatch.setattr(triton_pool, "SINGLE_PASS", single)
        leaves = [t.detach().requires_grad_() for t in (tok, *params[:7])]
        grads[single] = torch.autograd.grad(call(*leaves, None)[0], leaves, grad_inv)
        assert len(launched) == 1, single
        assert launched[0][3] is not None  # pooled: the forward's heads, not computed again
    bound = 2 * torch.finfo(torch.float16).eps
    for name, one, two in zip(pool_moe_ops.POOL_INPUTS, grads[None], grads[False]):
        assert one.dtype == torch.float16 and (relative_error(one, two) < bound or name == "bk"), name
        assert (one.abs().max() == 0) == (name == "bk"), name  # ∂bk exactly zero, the rest not


def _penalty_grads(call, ctx, tok, params, mask):
    """Gradients of ‖∂L/∂tok‖² + ‖∂L/∂W1‖² (L = Σ out·c) through `call`, for every input."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (ctx, tok, *params)]
    out = call(leaves[0], leaves[1], leaves[2:], mask, 2, True, "gelu", False, False)[0]
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    g_tok, g_w1 = torch.autograd.grad((out * cotangent).sum(), [leaves[1], leaves[10]], create_graph=True)
    present = [t for t in leaves if t is not None]
    return torch.autograd.grad(g_tok.square().sum() + g_w1.square().sum(), present, allow_unused=True)


def _pool_function_call(ctx, tok, params, mask, top_k, renorm, act, keep_hidden, export_inv):
    q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3 = params
    inv = pool_moe_ops.PoolFunction.apply(tok, q, wk, bk, wv, bv, wo, bo, mask)[0]
    return pool_moe_ops.moe(ctx, inv, wg, w1, b1, w2, b2, w3, top_k, renorm, act, keep_hidden)[0], inv


@pytest.mark.parametrize("split", [_split_call, _pool_function_call], ids=["ops", "PoolFunction"])
def test_a_gradient_penalty_through_the_split_is_the_region_s(split):
    """A backward with create_graph=True through mha::pool (or PoolFunction) then mha::moe gives
    gradients with their graph (double_backward.py), so a second derivative is mha::region's,
    every input's (masked keys too); before, the split's kernels handed out gradients with none.
    Within fp32's bound, not the bits: the MoE's part differentiates at the pool kernel's inv,
    the region's at the reference pool's."""
    ctx, tok, params = make_case(3, 5, 7, 24, 2, 40, 5, 2, act="gelu", bias=True)
    mask = torch.rand(3, 7) < 0.3
    mask[:, 0] = False
    got = _penalty_grads(split, ctx, tok, params, mask)
    want = _penalty_grads(_region_call, ctx, tok, params, mask)
    names = [n for n, t in zip(GRAD_NAMES, (ctx, tok, *params)) if t is not None]
    for name, g, w in zip(names, got, want):
        if name == "bk":  # zero by the math (None where no path reaches it)
            assert all(t is None or t.abs().max() == 0 for t in (g, w)), f"∂{name}"
            continue
        assert w is not None and w.abs().max() > 0, f"∂{name}: the comparison would be vacuous"
        assert relative_error(g, w) <= 1e-5, f"∂{name}: {relative_error(g, w):.3g}"  # SPEC §4's fp32 bound


def test_opcheck_the_split_ops():
    """Each fake's shapes and dtypes against the real ops (fake, static and dynamic shapes),
    their schemas and autograd registrations; the backward ops under the fake and schema checks."""
    ctx, tok, params = make_case(3, 4, 5, 16, 2, 24, 4, 2, act="gelu")
    q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3 = params
    pool_args = (tok, q, wk, bk, wv, bv, wo, bo, None)
    torch.library.opcheck(pool_moe_ops.pool, pool_args)
    inv, attn, u, pooled = pool_moe_ops.pool(*pool_args)
    moe_args = (ctx, inv, wg, w1, b1, w2, b2, w3, 2, True, "gelu", True)
    torch.library.opcheck(pool_moe_ops.moe, moe_args)
    out, weight, index, probs, reuse = pool_moe_ops.moe(*moe_args)
    kept = triton_moe.keeps_hidden("gelu", True)
    assert reuse.dtype == torch.int32 and reuse.numel() > (0 if not kept else out.shape[0] * out.shape[1] * 2 * 24 // 2)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(pool_moe_ops.pool_backward, (torch.randn_like(inv), *pool_args[:8], attn, u, pooled),
                          test_utils=checks)
    torch.library.opcheck(pool_moe_ops.moe_backward, (torch.randn_like(out), *moe_args[:8], weight, index, probs,
                                                      reuse, 2, True, "gelu", True), test_utils=checks)


def test_the_ops_refuse_mixed_dtypes_by_name():
    """The split takes the fused kernels' one-dtype case only; a traced call with another dtype
    names the input."""
    ctx, tok, params = make_case(2, 3, 5, 16, 2, 24, 4, 2)
    q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3 = params
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError, match="wv is torch.float64"):
            pool_moe_ops.pool(tok, q, wk, bk, wv.double(), bv, wo, bo, None)
        inv = torch.empty(2, 16)
        with pytest.raises(RuntimeError, match="w2 is torch.float16"):
            pool_moe_ops.moe(ctx, inv, wg, w1, b1, w2.half(), b2, w3, 2, True, "gelu")


@pytest.mark.parametrize("piece", ["moe", "pool", "PoolFunction"])
def test_each_piece_refuses_a_batch_of_cotangents(piece):
    """is_grads_batched=True through mha::moe, mha::pool or PoolFunction alone: each backward
    refuses the batch with double_backward.refuse_batched's error, as mha::region's does."""
    ctx, tok, params = make_case(3, 5, 7, 24, 2, 40, 5, 2, act="gelu", bias=True)
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (ctx, tok, *params)]
    q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3 = leaves[2:]
    if piece == "moe":
        inv = torch.randn(3, 24)
        out, wrt = pool_moe_ops.moe(leaves[0], inv, wg, w1, b1, w2, b2, w3, 2, True, "gelu")[0], leaves[0]
    else:
        call = pool_moe_ops.pool if piece == "pool" else pool_moe_ops.PoolFunction.apply
        out, wrt = call(leaves[1], q, wk, bk, wv, bv, wo, bo, None)[0], leaves[1]
    with pytest.raises(NotImplementedError, match="is_grads_batched=True"):
        torch.autograd.grad(out, wrt, torch.randn(2, *out.shape), is_grads_batched=True)
