"""The dtypes a block computes in: where the op's (the accumulation dtype of ctx's) is not the one
eager computes the MoE in, the block runs as written (a bf16 ctx under an autocast around the whole
block still matches: test_spellings.py's test_a_ctx_promoted_by_the_merge_under_autocast_still_matches). Each case was matched and computed otherwise
before session 67 (a review's; errors against eager then)."""
import copy
import math

import pytest
import torch
from torch.nn import functional as F

from compiled_checks import assert_one_match, compile_and_compare
from numerics import compiled_reports, relative_error
from spellings import SpelledBlock, inputs

_BF16_AUTOCAST = dict(device_type="cpu", dtype=torch.bfloat16)


class UnderAutocast(SpelledBlock):
    """The block under a bf16 autocast, its pool's output cast back to the model's dtype; with
    moe_off, its MoE under autocast(enabled=False), the usual guard that keeps a MoE in float32."""

    def __init__(self, moe_off=False):
        super().__init__()
        self.moe_off = moe_off

    def forward(self, ctx, tok, pad=None):
        with torch.autocast(**_BF16_AUTOCAST):
            y = self.merge_forward(ctx, self.pool_forward(tok).to(self.query.dtype))  # the pool's in bf16
            if not self.moe_off:
                return self.moe_forward(y)
            with torch.autocast("cpu", enabled=False):
                return self.moe_forward(y)


def _as_eager(model, ctx, tok):
    """No match, a near-miss, and eager's output and gradients exactly (the block ran as written)."""
    compiled = copy.deepcopy(model)
    with compiled_reports() as reports:
        torch._dynamo.reset()
        got = torch.compile(compiled, backend="mha")(ctx, tok)
    reasons = [m["reason"] for r in reports for m in r.near_misses]
    assert not any(r.matches for r in reports) and reasons, [str(r) for r in reports]
    want = model(ctx, tok)
    assert got.dtype == want.dtype and relative_error(got, want) == 0
    cotangent = torch.randn(want.shape, dtype=want.dtype)
    got.backward(cotangent)
    want.backward(cotangent)
    for (name, p), q in zip(model.named_parameters(), compiled.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
    return reasons


@pytest.mark.parametrize("ctx_dtype", [torch.int64, torch.bool])
def test_an_integer_ctx_is_never_the_blocks(ctx_dtype):
    """Under autocast the promoted-ctx refusal was skipped: the op returned out in ctx's dtype,
    truncated (0.257 off for int64, 3.29 for bool) and with no gradient at all."""
    torch.manual_seed(0)
    ctx, tok = inputs(dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    ctx = (3 * ctx).to(ctx_dtype)
    reasons = _as_eager(UnderAutocast().float(), ctx, tok)
    assert any(f"ctx is {ctx_dtype}" in r for r in reasons), reasons


@pytest.mark.parametrize("dtype, moe_off", [(torch.float64, False), (torch.float32, True)],
                         ids=["float64 model (autocast leaves it)", "MoE under autocast(enabled=False)"])
def test_a_ctx_promoted_by_the_merge_where_the_moe_does_not_run_in_autocasts_dtype(dtype, moe_off):
    """A bf16 ctx promoted by the merge under an autocast, where eager's MoE still runs in y's dtype:
    the op computed it in bf16 (1.5e-3 and 1.7e-3 off)."""
    torch.manual_seed(0)
    ctx, tok = inputs(dtype=dtype, generator=torch.Generator().manual_seed(1))
    reasons = _as_eager(UnderAutocast(moe_off).to(dtype), ctx.bfloat16(), tok)
    assert any("the merge promotes it to" in r for r in reasons), reasons


class ExpertsInBf16(SpelledBlock):
    """A float32 model whose experts round to bf16 (weights stored in bf16), its pool in bf16 too."""

    def expert(self, e, x):
        u = x.to(self.w1.dtype) @ self.w1[e] + self.b1[e]
        return (self._act(u) @ self.w2[e] + self.b2[e]).to(x.dtype)


def test_a_bf16_pool_does_not_excuse_bf16_experts_in_a_float32_moe():
    """The coarser-rounding refusal measured every node against the coarser of ctx and tok: a bf16
    tok let bf16 experts on float32 rows through (3.9e-3 off). The MoE is measured against y's."""
    torch.manual_seed(0)
    model = ExpertsInBf16().float()
    for name in ("w1", "w2", "b1", "b2", "query"):
        getattr(model, name).data = getattr(model, name).data.bfloat16()
    for linear in (model.key, model.value, model.out):
        linear.bfloat16()
    ctx, tok = inputs(dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    reasons = _as_eager(model, ctx, tok.bfloat16())
    assert any("rounds to torch.bfloat16, coarser than the region's torch.float32" in r for r in reasons), reasons


class IntegerRoundTrip(SpelledBlock):
    """One parameter read through an integer or bool dtype and back (`where`: w1, query, key, router):
    its values truncated, and no gradient to it. Read before as the parameter itself (a review's:
    1.64 off with W1 through int64, and a gradient to W1 where eager gives none)."""

    def __init__(self, where, via, cast):
        super().__init__()
        self.where, self.via, self.cast = where, via, cast
        with torch.no_grad():
            self.w1.mul_(3)

    def _rt(self, name, t):
        if name != self.where:
            return t
        return t.type(self.via).type(t.dtype) if self.cast == "type" else t.to(self.via).to(t.dtype)

    def pool_forward(self, tok, pad=None):
        B, N, D = tok.shape
        k = F.linear(tok, self._rt("key", 8 * self.key.weight) / 8, self.key.bias).view(B, N, self.P, self.Dh)
        v = self.value(tok).view(B, N, self.P, self.Dh)
        scores = torch.einsum("pd,bnpd->bpn", self._rt("query", 3 * self.query), k) / math.sqrt(self.Dh)
        return self.out(torch.einsum("bpn,bnpd->bpd", scores.softmax(-1), v).reshape(B, D))

    def route(self, x):
        weight, index = F.linear(x, self._rt("router", 3 * self.router.weight)).softmax(-1).topk(self.k, dim=-1)
        return weight / weight.sum(dim=-1, keepdim=True), index

    def expert(self, e, x):
        return F.gelu(x @ self._rt("w1", self.w1)[e] + self.b1[e]) @ self.w2[e] + self.b2[e]


@pytest.mark.parametrize("cast", ["type", "to"])
@pytest.mark.parametrize("via", [torch.int64, torch.bool])
@pytest.mark.parametrize("where", ["w1", "query", "key", "router"])
def test_a_parameter_through_an_integer_dtype_is_the_truncated_tensor(where, via, cast):
    """Matched now with the round trip's result as the tensor it is: eager's values, and no gradient
    to the parameter, as in eager."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_one_match(compile_and_compare(IntegerRoundTrip(where, via, cast).double(), args, torch.float64))


class CopiedThenWritten(SpelledBlock):
    """W1 or the query copied by .to(dtype, copy=True), the copy then written in place. Read before as
    the parameter itself, the write lost (a review's: 0.527 off for W1, 0.024 for the query)."""

    def __init__(self, where):
        super().__init__()
        self.where = where

    def pool_forward(self, tok, pad=None):
        if self.where != "query":
            return super().pool_forward(tok, pad)
        B, N, D = tok.shape
        q = self.query.to(tok.dtype, copy=True)
        q[0] = 0.0
        k, v = self.key(tok).view(B, N, self.P, self.Dh), self.value(tok).view(B, N, self.P, self.Dh)
        scores = torch.einsum("pd,bnpd->bpn", q, k) / math.sqrt(self.Dh)
        return self.out(torch.einsum("bpn,bnpd->bpd", scores.softmax(-1), v).reshape(B, D))

    def expert(self, e, x):
        if self.where != "w1":
            return super().expert(e, x)
        if e == 0:
            self._w1 = self.w1.to(x.dtype, copy=True)
            self._w1.mul_(2)
        return F.gelu(x @ self._w1[e] + self.b1[e]) @ self.w2[e] + self.b2[e]


@pytest.mark.parametrize("where", ["w1", "query"])
def test_a_parameter_copied_by_to_and_written_is_read_as_the_copy(where):
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_one_match(compile_and_compare(CopiedThenWritten(where).double(), args, torch.float64))
