"""ctx horizon-first, [H,B,D] (nn.Transformer's default layout, batch_first=False), with inv added
along its batch axis: ctx + inv[None], ctx + inv (broadcasting), inv.unsqueeze(0) + ctx,
inv.expand_as(ctx). Before, each was refused (session 70's note: the reason said so, and that the
region takes ctx batch-first). The op takes ctx transposed and its output is transposed back; a
y the rest reads is rebuilt [H,B,D], and top-k's indices read outside (a load-balancing loss) in
the rows' horizon-major order. Output and every gradient are eager's."""
import copy

import pytest
import torch
from torch import nn

from compiled_checks import ZERO_GRAD, assert_one_match, compile_and_compare
from numerics import TOLERANCE, compiled_reports, needs_interpreter, relative_error
from spellings import SpelledBlock, inputs
from test_spellings import WithAuxLoss

# (B, H, N, D, P): SPEC's tiny preset, odd sizes, as many horizons as batch rows (the axes' sizes
# cannot tell them apart: the broadcast's layout does; a [B,H,D] ctx + inv.unsqueeze(0) with B = H,
# a near-miss "along the batch axis" before, is such a ctx, and eager's sums are the op's), one
# batch row, one horizon
SIZES = {"tiny": (4, 3, 5, 32, 2), "odd": (3, 5, 7, 21, 3), "B=H": (4, 4, 5, 32, 2), "B=1": (1, 3, 5, 32, 2),
         "H=1": (4, 1, 5, 32, 2)}


def _merge(how, ctx, inv):
    if how == "none_index":
        return ctx + inv[None]
    if how == "broadcast":  # inv [B,D] broadcasts over the leading horizon axis by itself
        return ctx + inv
    if how == "unsqueeze0":
        return inv.unsqueeze(0) + ctx
    return ctx + inv.expand_as(ctx)


class HorizonFirst(SpelledBlock):
    def __init__(self, how="none_index", D=32, P=2, **block):
        super().__init__(D=D, P=P, F_=13, E=5, **block)
        self.how = how

    def forward(self, ctx, tok, pad=None):
        return self.moe_forward(_merge(self.how, ctx, self.pool_forward(tok, pad)))


def _inputs(B, H, N, D, dtype=torch.float64, mask=False):
    ctx, tok, *pad = inputs(B=B, H=H, N=N, D=D, dtype=dtype, mask=mask, generator=torch.Generator().manual_seed(1))
    return (ctx.transpose(0, 1).contiguous(), tok, *pad)


@pytest.mark.parametrize("moe", ["loop", "dense_scatter", "gathered"])
@pytest.mark.parametrize("how", ["none_index", "broadcast", "unsqueeze0", "expand_as"])
def test_a_horizon_first_ctx_matches_and_trains_as_eager(how, moe):
    torch.manual_seed(0)
    match = assert_one_match(compile_and_compare(HorizonFirst(how, moe=moe).double(), _inputs(4, 3, 5, 32),
                                                 torch.float64))
    assert match["transposed"] == ["ctx"] and match["shapes"]["ctx"] == ["3", "4", "32"], match


@pytest.mark.parametrize("pool", ["einsum", "sdpa"])
@pytest.mark.parametrize("sizes", list(SIZES))
def test_a_horizon_first_ctx_at_every_size_and_with_a_mask(sizes, pool):
    B, H, N, D, P = SIZES[sizes]
    torch.manual_seed(0)
    model = HorizonFirst(D=D, P=P, pool=pool, mask=True).double()
    assert_one_match(compile_and_compare(model, _inputs(B, H, N, D, mask=True), torch.float64))


class AllSequenceFirst(SpelledBlock):
    """nn.Transformer's layout throughout: tok [N,B,D] into nn.MultiheadAttention(batch_first=False),
    ctx [H,B,D], the pooled row added as inv[None]."""

    def __init__(self):
        super().__init__(pool="mha")
        self.attn = nn.MultiheadAttention(self.D, self.P)

    def forward(self, ctx, tok, pad=None):
        N, B, D = tok.shape
        inv = self.attn(self.query.expand(1, B, D), tok, tok, need_weights=False)[0][0]
        return self.moe_forward(ctx + inv[None])


def test_tokens_and_ctx_both_sequence_first():
    torch.manual_seed(0)
    ctx, tok = _inputs(4, 3, 5, 32)
    reports = compile_and_compare(AllSequenceFirst().double(), (ctx, tok.transpose(0, 1).contiguous()), torch.float64,
                                  token_axis=0)
    assert assert_one_match(reports)["transposed"] == ["ctx", "tok"]
    text = "\n".join(str(r) for r in reports)
    assert "takes ctx transposed (horizon-first, [H, B, D]) and tok transposed (sequence-first, [N, B, D])" in text, text


class ResidualHorizonFirst(SpelledBlock):
    """y + MoE(y): y is read outside the region, rebuilt from the op as the merge wrote it, [H,B,D]."""

    def forward(self, ctx, tok, pad=None):
        y = ctx * 1.0 + self.pool_forward(tok, pad)[None]
        return y + self.moe_forward(y)


def test_a_residual_reads_y_rebuilt_horizon_first():
    torch.manual_seed(0)
    match = assert_one_match(compile_and_compare(ResidualHorizonFirst().double(), _inputs(4, 3, 5, 32),
                                                 torch.float64))
    assert list(match["exports"]) == ["y"], match


class AuxLossHorizonFirst(WithAuxLoss):
    def forward(self, ctx, tok, pad=None):
        out = self.moe_forward(ctx + self.pool_forward(tok, pad)[None])
        return out, self.routed if self.early else self._aux()


@pytest.mark.parametrize("moe", ["loop", "dense_scatter"])
@pytest.mark.parametrize("B, H", [(4, 3), (3, 3)])
def test_a_load_balancing_loss_reads_the_op_s_experts_in_the_rows_horizon_major_order(B, H, moe):
    """The loss reads top-k's indices [H·B, k]: the op's, batch-major, are transposed to them (before,
    refused: "the op gives top-k's indices for rows taken batch-major")."""
    torch.manual_seed(0)
    model = AuxLossHorizonFirst(False, moe=moe).double()
    compiled_model = copy.deepcopy(model)
    ctx, tok = _inputs(B, H, 5, 32)
    with compiled_reports() as reports:
        torch._dynamo.reset()
        compiled = torch.compile(compiled_model, backend="mha", options={"strict": True})
        results = []
        for m, params in ((model, model), (compiled, compiled_model)):
            out, aux = m(ctx, tok)
            cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
            ((out * cotangent).sum() + 3 * aux).backward()
            results.append((out.detach(), aux.detach(), dict(params.named_parameters())))
    assert assert_one_match(reports)["exports"]["index"], [str(r) for r in reports]
    (out_e, aux_e, params_e), (out_c, aux_c, params_c) = results
    assert relative_error(out_c, out_e) <= TOLERANCE[torch.float64]
    assert relative_error(aux_c, aux_e) <= TOLERANCE[torch.float64]
    for name, p_e in params_e.items():
        if not name.endswith(ZERO_GRAD):
            assert relative_error(params_c[name].grad, p_e.grad) <= TOLERANCE[torch.float64], name


def test_a_batch_row_with_every_key_masked_is_nan_in_its_column_as_eager():
    """The einsum pool's plain softmax is NaN over such a row: the rewrite adds the NaN to the op's
    (transposed) ctx, so the output is NaN at [:, b] as the user's, and finite elsewhere as eager's."""
    torch.manual_seed(0)
    model = HorizonFirst(pool="einsum", mask=True).double()
    ctx, tok, pad = _inputs(4, 3, 5, 32, mask=True)
    pad[1] = True
    with compiled_reports() as reports:
        torch._dynamo.reset()
        got = torch.compile(copy.deepcopy(model), backend="mha", options={"strict": True})(ctx, tok, pad)
    assert assert_one_match(reports)["empty_rows"] == "nan"
    want = model(ctx, tok, pad)
    bad = ~want.isfinite().all(-1)
    assert bad[:, 1].all() and not bad[:, [0, 2, 3]].any()
    assert torch.equal(bad, ~got.isfinite().all(-1))
    assert relative_error(got[~bad], want[~bad]) <= TOLERANCE[torch.float64]


class HorizonAddedAlongTheWrongAxis(SpelledBlock):
    """ctx [H,B,D] with inv[:, None]: inv [B,D] added as [B,1,D], over ctx's first axis, H ≠ B."""

    def forward(self, ctx, tok, pad=None):
        return self.moe_forward(ctx + self.pool_forward(tok, pad)[:, None])


def test_inv_broadcast_against_a_horizon_first_ctx_s_horizons_runs_as_written():
    torch.manual_seed(0)
    model = HorizonAddedAlongTheWrongAxis().double()
    ctx, tok = _inputs(4, 1, 5, 32)  # [1, 4, D] + [4, 1, D] broadcasts to [4, 4, D]: not the block's merge
    with compiled_reports() as reports:
        torch._dynamo.reset()
        got = torch.compile(copy.deepcopy(model), backend="mha")(ctx, tok)
    reasons = [m["reason"] for r in reports for m in r.near_misses]
    assert not any(r.matches for r in reports) and any("broadcasts ctx [1, 4, 32]" in r for r in reasons), reasons
    assert relative_error(got, model(ctx, tok)) <= TOLERANCE[torch.float64]


@needs_interpreter
@pytest.mark.parametrize("kernels", ["fused", "staged"])
def test_the_kernels_take_a_horizon_first_ctx_transposed(kernels):
    """The kernels read the transposed ctx by its strides: float32 against eager's."""
    B, H, N, D, P = SIZES["odd"]
    torch.manual_seed(0)
    reports = compile_and_compare(HorizonFirst(D=D, P=P), _inputs(B, H, N, D, torch.float32), torch.float32,
                                  options={"kernels": kernels})
    assert assert_one_match(reports)["kernels"] == kernels
