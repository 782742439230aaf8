"""Blocks at the edges of what the matcher reads: a ctx the merge itself broadcasts, top-k of no
expert, and a second block fed by the first one's values. Each was matched and went wrong before
session 67 (a review's)."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compiled_checks import ZERO_GRAD, as_eager_in_every_gradient, assert_one_match, compile_and_compare
from numerics import compiled_reports, graph_has_region, observing, relative_error
from spellings import SpelledBlock, inputs


class OneHorizonCtx(SpelledBlock):
    def merge_forward(self, ctx, inv):
        B, H, D = ctx.shape
        return ctx[:, :1] + inv[:, None].expand(B, H, D)


def test_a_ctx_broadcast_over_the_horizons_by_the_merge_is_not_the_blocks_ctx():
    """The op took ctx[:, :1] for ctx: an output of one horizon, and a backward that raised."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reasons = as_eager_in_every_gradient(OneHorizonCtx().double(), args, torch.float64)
    assert any("broadcasts ctx [4, 1, 32] to [4, 3, 32]" in r for r in reasons), reasons


def test_top_k_of_no_expert_runs_as_written():
    """k = 0: eager's output is zeros; the op divided by k."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reasons = as_eager_in_every_gradient(SpelledBlock(k=0).double(), args, torch.float64)
    assert any("k = 0" in r for r in reasons), reasons


class FedByTheFirst(nn.Module):
    """Block b reads block a's merge output y (or its inv) as its ctx or its tokens."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.a, self.b = SpelledBlock(), SpelledBlock(moe="dense_onehot")

    def forward(self, ctx, tok):
        inv = self.a.pool_forward(tok)
        y = self.a.merge_forward(ctx, inv)
        fed = {"ctx is y": (y, tok), "tokens are y": (ctx, y), "ctx is inv": (inv[:, None].expand_as(ctx), tok)}
        return self.a.moe_forward(y) + self.b(*fed[self.how])


def _replaced(model, args):
    """Per compiled graph: (matches, whether the graph that runs holds the region op)."""
    seen = []
    with observing(lambda report, gm, lowered: seen.append((len(report.matches), graph_has_region(lowered)))):
        torch._dynamo.reset()
        torch.compile(model, backend="mha")(*args)
    return seen


def test_a_block_fed_by_the_firsts_values_is_replaced_with_it():
    """The rewrite of the second region read the first one's y after the first rewrite erased it:
    the rewrite raised, and the whole graph ran as captured (strict: a compile error)."""
    for how in ("ctx is y", "tokens are y", "ctx is inv"):
        torch.manual_seed(0)
        model = FedByTheFirst(how).double()
        args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        reports = compile_and_compare(model, args, torch.float64)  # strict: a failed rewrite raises
        assert sum(len(r.matches) for r in reports) == 2, [str(r) for r in reports]
        assert _replaced(model, args) == [(2, True)], how


class IntegerCastMask(SpelledBlock):
    """A 0/-inf float mask cast to int64 (-inf becomes INT64_MIN, finite) and added to the scores,
    as is or cast back to float for SDPA."""

    def __init__(self, pool):
        super().__init__(pool=pool, mask=True)

    def pool_forward(self, tok, pad=None):
        B, N, D = tok.shape
        P, Dh = self.P, self.Dh
        bias = torch.zeros(B, N, dtype=tok.dtype).masked_fill(pad, float("-inf")).to(torch.int64)
        k, v = self.key(tok).view(B, N, P, Dh), self.value(tok).view(B, N, P, Dh)
        if self.pool == "sdpa":
            q = self.query.view(1, P, 1, Dh).expand(B, -1, -1, -1)
            pooled = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                                    attn_mask=bias.to(tok.dtype)[:, None, None, :])
            return self.out(pooled.reshape(B, D))
        s = torch.einsum("pd,bnpd->bpn", self.query, k) / math.sqrt(Dh) + bias[:, None, :]
        return self.out(torch.einsum("bpn,bnpd->bpd", s.softmax(-1), v).reshape(B, D))


@pytest.mark.parametrize("pool", ["einsum", "sdpa"])
def test_a_float_mask_cast_to_integers_is_not_read_as_its_minus_infinities(pool):
    """The mask reader followed the cast to int64 and read isneginf of a tensor without -inf: the op
    attended to every token (0.128 off, ∂tok 0.648)."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, mask=True, generator=torch.Generator().manual_seed(1))
    reasons = as_eager_in_every_gradient(IntegerCastMask(pool).double(), args, torch.float64)
    assert any("mask" in r for r in reasons), reasons


class CombinedMasks(SpelledBlock):
    def forward(self, ctx, tok, pad):
        return super().forward(ctx, tok, pad | torch.zeros_like(pad))


def test_a_mask_combined_with_or_is_read():
    """operator.or_ was taken for a write in place (its name ends in "_") and refused with that reason."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, mask=True, generator=torch.Generator().manual_seed(1))
    assert_one_match(compile_and_compare(CombinedMasks(pool="sdpa", mask=True).double(), args, torch.float64))


class ScoresOverZero(SpelledBlock):
    def pool_forward(self, tok, pad=None):
        B, N, D = tok.shape
        k, v = self.key(tok).view(B, N, self.P, self.Dh), self.value(tok).view(B, N, self.P, self.Dh)
        s = torch.einsum("pd,bnpd->bpn", self.query, k) / 0.0
        return self.out(torch.einsum("bpn,bnpd->bpd", s.softmax(-1), v).reshape(B, D))


def test_scores_divided_by_zero_are_a_near_miss():
    """The matcher raised ZeroDivisionError (the backend then ran the graph as captured, with a warning)."""
    torch.manual_seed(0)
    model = ScoresOverZero().double()
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with compiled_reports() as reports:
        torch._dynamo.reset()
        torch.compile(model, backend="mha", options={"strict": True})(*args)
    reasons = [m["reason"] for r in reports for m in r.near_misses]
    assert any("divided by 0" in r for r in reasons), reasons


def test_a_recompile_at_a_symbolic_batch_keeps_the_mixtral_spelling_matched():
    """A second batch size makes Dynamo recompile with B symbolic: the pair-row reader hashed a SymInt
    and the matcher raised (the graph then ran as captured; strict: a compile error)."""
    torch.manual_seed(0)
    model = SpelledBlock(moe="mixtral").double()
    compiled = torch.compile(copy.deepcopy(model), backend="mha", options={"strict": True})
    torch._dynamo.reset()
    for B in (4, 3):
        args = inputs(B=B, dtype=torch.float64, generator=torch.Generator().manual_seed(B))
        with compiled_reports() as reports, torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            got = compiled(*args)
        assert relative_error(got, model(*args)) <= 1e-10
        assert sum(len(r.matches) for r in reports) == 1 and all(r.fallback is None for r in reports), B


def _trains_as_eager_under_dynamic_true(model, make_args):
    """One compile under dynamic=True, two batch sizes: one match, and eager's output and every
    parameter gradient (float64). make_args(B) gives the call's arguments."""
    compiled_model = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, backend="mha", dynamic=True)
    with compiled_reports() as reports:
        for B in (4, 3):
            args = make_args(B)
            got, want = compiled(*args), model(*args)
            assert relative_error(got, want) <= 1e-10
            cotangent = torch.randn_like(want)
            got.backward(cotangent)
            want.backward(cotangent)
    assert [len(r.matches) for r in reports] == [1], [str(r) for r in reports]
    for (name, p), q in zip(model.named_parameters(), compiled_model.parameters()):
        if name.endswith(ZERO_GRAD):  # SPEC §1: exactly zero, where eager leaves roundoff
            assert torch.count_nonzero(q.grad) == 0 and p.grad.abs().max() <= 1e-12, name
        else:
            assert relative_error(q.grad, p.grad) <= 1e-10, name


@pytest.mark.parametrize("pool", ["mha", "fused_kv", "fused_kv_unbind"])
def test_dynamic_true_keeps_the_pools_whose_readers_checked_sizes_as_ints(pool):
    """Under torch.compile(dynamic=True) a static width is a SymInt of known value: the readers of
    nn.MultiheadAttention and of the fused K|V projection checked it as an int and refused the
    block (a review's sweep of sizes)."""
    torch.manual_seed(0)
    model = SpelledBlock(pool=pool).double()
    if pool == "mha":  # in training its dropout_p is a tensor of the graph there: refused, below
        model.attn.eval()
    _trains_as_eager_under_dynamic_true(
        model, lambda B: inputs(B=B, dtype=torch.float64, generator=torch.Generator().manual_seed(B)))


class QueryExpandedToTokSizes(SpelledBlock):
    """The learned query expanded with sizes read from tok.shape: query.expand(B, 1, D) into
    nn.MultiheadAttention (batch-first, or sequence-first as expand(1, B, D)), into SDPA as
    expand(B, P, 1, D // P), or a latent expanded so and then projected (timm's order)."""

    def __init__(self, where):
        super().__init__(pool="sdpa")
        self.where = where
        if where.startswith("mha"):
            self.attn = nn.MultiheadAttention(self.D, self.P, batch_first=where == "mha")
            self.query = nn.Parameter(torch.randn(1, 1, self.D) / math.sqrt(self.D))
            del self.key, self.value, self.out
        if where == "latent":
            self.q = nn.Linear(self.D, self.D)
            self.query = nn.Parameter(torch.randn(1, 1, self.D) / math.sqrt(self.D))

    def pool_forward(self, tok, pad=None):
        if self.where == "mha_seq_first":
            N, B, D = tok.shape
            return self.attn(self.query.expand(1, B, D), tok, tok, need_weights=False)[0][0]
        B, N, D = tok.shape
        if self.where == "mha":
            return self.attn(self.query.expand(B, 1, D), tok, tok, need_weights=False)[0][:, 0]
        P, Dh = self.P, D // self.P
        q = self.query.view(1, P, 1, Dh).expand(B, P, 1, D // P) if self.where == "sdpa" else \
            self.q(self.query.expand(B, 1, D)).view(B, 1, P, Dh).transpose(1, 2)
        k, v = (t.view(B, N, P, Dh).transpose(1, 2) for t in (self.key(tok), self.value(tok)))
        return self.out(F.scaled_dot_product_attention(q, k, v).reshape(B, D))


@pytest.mark.parametrize("where", ["mha", "mha_seq_first", "sdpa", "latent"])
def test_dynamic_true_reads_a_query_expanded_to_sizes_read_from_tok(where):
    """Dynamo reads tok.shape's static width as tok.size()[2] there, which made the expanded query
    a descendant of tok, so no longer a parameter's view: the block was refused, and for
    nn.MultiheadAttention the reason named multi_head_attention_forward alone (session 70's note)."""
    torch.manual_seed(0)
    model = QueryExpandedToTokSizes(where).double().eval()  # MultiheadAttention's dropout in training: above

    def make_args(B):
        ctx, tok = inputs(B=B, dtype=torch.float64, generator=torch.Generator().manual_seed(B))
        return ctx, tok.transpose(0, 1).contiguous() if where == "mha_seq_first" else tok

    _trains_as_eager_under_dynamic_true(model, make_args)


class WidthFromTokShape(SpelledBlock):
    """The width unpacked from tok.shape before any projection (B, N, D = tok.shape; Dh = D // P), then
    the scores scaled by Dh ** -0.5 (matmul), SDPA given scale=Dh ** -0.5, the query pre-scaled so
    (timm's), or the fused K|V split at D: kv.split(D), kv[..., :D] and kv[..., D:], kv.narrow, or
    kv.split([D, D]) (the list refused at any shapes before)."""

    def __init__(self, how):
        super().__init__(pool="fused_kv" if how.startswith("kv") else "matmul")
        self.how = how

    def _kv(self, tok):
        B, N, D = tok.shape
        kv = self.kv(tok)
        if self.how == "kv_split":
            return kv.split(D, dim=-1)
        if self.how == "kv_slices":
            return kv[..., :D], kv[..., D:]
        if self.how == "kv_narrow":
            return kv.narrow(-1, 0, D), kv.narrow(-1, D, D)
        return torch.split(kv, [D, D], dim=-1)

    def pool_forward(self, tok, pad=None):
        B, N, D = tok.shape
        P, Dh = self.P, D // self.P
        k, v = (t.view(B, N, P, Dh).transpose(1, 2) for t in (self.key(tok), self.value(tok))) \
            if not self.how.startswith("kv") else (t.view(B, N, P, Dh).transpose(1, 2) for t in self._kv(tok))
        q = self.query.view(1, P, 1, Dh).expand(B, -1, -1, -1)
        if self.how == "sdpa_scale":
            return self.out(F.scaled_dot_product_attention(q, k, v, scale=Dh ** -0.5).reshape(B, D))
        if self.how == "query_prescaled":
            scores = (q * Dh ** -0.5) @ k.transpose(-2, -1)
        else:
            scores = (q @ k.transpose(-2, -1)) * Dh ** -0.5
        return self.out((scores.softmax(-1) @ v).reshape(B, D))


@pytest.mark.parametrize("how", ["scores_pow", "sdpa_scale", "query_prescaled", "kv_split", "kv_slices", "kv_narrow",
                                 "kv_split_list"])
def test_dynamic_true_reads_a_width_from_tok_shape_as_the_number_it_is(how):
    """Under dynamic=True that D is a SymInt whose value the weights pin (32), and Dh ** -0.5 a SymFloat
    of known value: the scale was refused as "a value of the graph" and the K|V split went unread
    (a review's). Both are read as the numbers they are; Dynamo's guards recompile for another."""
    torch.manual_seed(0)
    model = WidthFromTokShape(how).double()
    _trains_as_eager_under_dynamic_true(
        model, lambda B: inputs(B=B, dtype=torch.float64, generator=torch.Generator().manual_seed(B)))


def test_a_fused_kv_split_by_a_list_of_sizes_matches():
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_one_match(compile_and_compare(WidthFromTokShape("kv_split_list").double(), args, torch.float64))


def test_dynamic_true_refuses_multihead_attention_in_training_with_its_dropout_a_graph_value():
    """Its dropout_p comes as a tensor, which a later attn.dropout = 0.1 would change with no
    recompile: the region, which has no dropout, must not take it (the reason said "dropout_p set")."""
    torch.manual_seed(0)
    model = SpelledBlock(pool="mha").double()
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with compiled_reports() as reports:
        torch._dynamo.reset()
        torch.compile(model, backend="mha", dynamic=True)(*args)
    reasons = [m["reason"] for r in reports for m in r.near_misses]
    assert not any(r.matches for r in reports) and any("dropout_p is a value of the graph" in r for r in reasons)


@pytest.mark.parametrize("pool", ["einsum", "sdpa", "mha", "matmul"])
@pytest.mark.parametrize("B, N", [(1, 5), (3, 1)])
def test_a_mask_over_one_batch_row_or_one_token_is_read(pool, B, N):
    """Its batch (or token) axis has size 1, which the mask reader took for a broadcast and refused
    ("the mask varies along ['n']"): single-sample inference lost the region (a review's)."""
    torch.manual_seed(0)
    args = inputs(B=B, N=N, dtype=torch.float64, mask=True, generator=torch.Generator().manual_seed(1))
    model = SpelledBlock(pool=pool, mask=True).double()
    assert_one_match(compile_and_compare(model, args, torch.float64))


class SecondTopKInTheLoss(SpelledBlock):
    """A load-balancing loss that takes its own top-k of the router's softmax (transformers'
    load_balancing_loss_func, computed in the forward), added to the output."""

    def route(self, x):
        probs = torch.softmax(self.router(x), dim=-1)
        weight, index = probs.topk(self.k, dim=-1)
        _, chosen = torch.topk(probs, self.k, dim=-1)
        self.aux = self.E * (F.one_hot(chosen, self.E).to(probs.dtype).mean(0) * probs.mean(0)).sum()
        return weight / weight.sum(-1, keepdim=True), index

    def forward(self, ctx, tok):
        return super().forward(ctx, tok) + self.aux


@pytest.mark.parametrize("moe", ["loop", "mixtral", "dense_scatter"])
def test_a_loss_s_own_top_k_of_the_router_is_no_near_miss(moe):
    """The second top-k was read as a MoE of its own, and its near-miss blamed the matched experts
    ("the expert outputs summed cover experts [3] of 4"), a review's. The block is replaced and
    the loss's gradients are eager's."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reports = compile_and_compare(SecondTopKInTheLoss(moe=moe).double(), args, torch.float64,
                                  dynamic_where=moe == "mixtral")
    assert_one_match(reports)


class LossOnTheRouterLogits(SpelledBlock):
    """transformers' load_balancing_loss_func (Mixtral, Qwen2-MoE, OLMoE) on the router's logits the
    block keeps: its own softmax of them, then its own top-k."""

    def route(self, x):
        self.logits = self.router(x)
        weight, index = torch.softmax(self.logits, dim=-1).topk(self.k, dim=-1)
        return weight / weight.sum(-1, keepdim=True), index

    def forward(self, ctx, tok):
        out = super().forward(ctx, tok)
        probs = F.softmax(self.logits, dim=-1)
        _, chosen = torch.topk(probs, self.k, dim=-1)
        tokens_per_expert = F.one_hot(chosen, self.E).to(probs.dtype).mean(0)
        return out + (tokens_per_expert * probs.mean(0).unsqueeze(0)).sum() * self.E


@pytest.mark.parametrize("moe", ["loop", "dense_scatter"])
def test_a_loss_s_top_k_of_a_softmax_of_the_kept_logits_is_no_near_miss(moe):
    """As above, where the loss takes a softmax of its own of the logits: the near-miss blamed the
    matched experts again (loop: "the expert outputs summed cover experts [3] of 4"), a review's."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_one_match(compile_and_compare(LossOnTheRouterLogits(moe=moe).double(), args, torch.float64))


class SdpaMaskOverHeads(SpelledBlock):
    """SDPA's attn_mask broadcast over the heads before or after its inversion (True = take part)."""

    def __init__(self, how):
        super().__init__(pool="sdpa", mask=True)
        self.how = how

    def pool_forward(self, tok, pad=None):
        B, N, D = tok.shape
        P, Dh = self.P, self.Dh
        k, v = (t.view(B, N, P, Dh).transpose(1, 2) for t in self._kv(tok))
        q = self.query.view(1, P, 1, Dh).expand(B, -1, -1, -1)
        mask = {"invert then expand": lambda: (~pad)[:, None, None, :].expand(B, P, 1, N),
                "expand then invert": lambda: ~pad[:, None, None, :].expand(B, P, 1, N),
                "repeat then invert": lambda: ~pad[:, None, None, :].repeat(1, P, 1, 1)}[self.how]()
        pooled = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(pooled.reshape(B, D))


@pytest.mark.parametrize("how", ["invert then expand", "expand then invert", "repeat then invert"])
def test_an_sdpa_mask_inverted_after_its_broadcast_over_the_heads_matches(how):
    """~ after the broadcast made a tensor of its own, read as varying along the heads: a near-miss
    ("the mask varies along ['b', 'd.0', 'n']") where the mask is constant over them (a review's)."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, mask=True, generator=torch.Generator().manual_seed(1))
    assert_one_match(compile_and_compare(SdpaMaskOverHeads(how).double(), args, torch.float64))


class DetachedGates(SpelledBlock):
    def route(self, x):
        weight, index = super().route(x)
        return weight.detach(), index


@pytest.mark.parametrize("moe", ["loop", "dense_scatter"])
def test_detached_gates_are_refused_naming_the_detach(moe):
    """The router trained by nothing but its aux loss: not the block (its gates carry no gradient).
    The near-miss blamed the activation ("mul_1 (mul) on the expert's output is not part of that
    math (the activations read are ...)"), a review's; it names the detach now."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reasons = as_eager_in_every_gradient(DetachedGates(moe=moe).double(), args, torch.float64)
    assert len(reasons) == 1 and "(detach)" in reasons[0] and "activations read" not in reasons[0], reasons


class HeadOnInvBeforeTheMoE(SpelledBlock):
    """A second head on the pooled vector, computed between the merge and the MoE, added to the output."""

    def __init__(self, how, **kwargs):
        super().__init__(**kwargs)
        self.how = how
        self.head = nn.Sequential(nn.Linear(self.D, 16), nn.ReLU(inplace=True), nn.Linear(16, 3))

    def forward(self, ctx, tok, pad=None):
        inv = self.pool_forward(tok)
        y = ctx + inv[:, None]
        if self.how == "relu(inplace=True)":
            g = self.head(inv)
        elif self.how == "add_ on its own product":
            g = inv * 2
            g.add_(1)
        else:  # "mul_ on a view of inv": writes inv itself, which the region exports
            g = inv.view(inv.shape)
            g.mul_(2)
        return self.moe_forward(y) + g.mean()


@pytest.mark.parametrize("how", ["relu(inplace=True)", "add_ on its own product"])
def test_a_head_on_inv_that_writes_its_own_tensor_in_place_matches(how):
    """Refused before session 68 as a write reordered against the region ("reads the region's
    router"), though the write touches only the head's own tensor (a review's)."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_one_match(compile_and_compare(HeadOnInvBeforeTheMoE(how).double(), args, torch.float64))


def test_a_head_that_writes_inv_itself_in_place_runs_as_written():
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reasons = as_eager_in_every_gradient(HeadOnInvBeforeTheMoE("mul_ on a view of inv").double(), args,
                                         torch.float64)
    assert reasons and any("writes in place" in r for r in reasons), reasons


class SwitchLossOnTheIndices(SpelledBlock):
    """A Switch load-balancing loss on the chosen experts' indices, added to the output."""

    def __init__(self, how, **kwargs):
        super().__init__(**kwargs)
        self.how = how

    def forward(self, ctx, tok, pad=None):
        y = ctx + self.pool_forward(tok)[:, None]
        B, H, D = y.shape
        x = y.transpose(0, 1).reshape(-1, D) if self.how == "horizon-major rows" else y.reshape(-1, D)
        probs = torch.softmax(self.router(x), dim=-1)
        weight, index = probs.topk(self.k, dim=-1, sorted=self.how != "sorted=False")
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.E):
            out = out + (weight * (index == e)).sum(-1, keepdim=True) * self.expert(e, x)
        out = out.reshape(H, B, D).transpose(0, 1) if self.how == "horizon-major rows" else out.reshape(B, H, D)
        return out + self.E * (probs.mean(0) * F.one_hot(index, self.E).to(probs.dtype).sum(1).mean(0)).sum()


def test_indices_the_op_cannot_give_are_refused_saying_why():
    """The reason said only "index is used outside the region" (a review's), where the same loss on
    sorted indices matches."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reasons = as_eager_in_every_gradient(SwitchLossOnTheIndices("sorted=False").double(), args, torch.float64)
    assert len(reasons) == 1 and "is used outside the region" in reasons[0] and "sorted=False" in reasons[0], reasons


@pytest.mark.parametrize("how", ["sorted", "horizon-major rows"])
def test_a_switch_loss_on_sorted_indices_matches(how):
    """Horizon-major rows were refused before session 71 ("the op gives top-k's indices for rows taken
    batch-major"): the op's are transposed to them now."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    match = assert_one_match(compile_and_compare(SwitchLossOnTheIndices(how).double(), args, torch.float64))
    assert match["exports"]["index"], match


class CountsExpertLoad(SpelledBlock):
    """The loop MoE counting the rows each expert takes into a buffer, in place under no_grad
    (monitoring, or balancing without an aux loss), before or after the experts run."""

    def __init__(self, how, where):
        super().__init__()
        self.how, self.where = how, where
        self.register_buffer("load", torch.zeros(self.E, dtype=torch.float64))

    def _count(self, index):
        counts = F.one_hot(index, self.E).sum((0, 1)).to(self.load.dtype)
        with torch.no_grad():
            if self.how == "+=":
                self.load += counts
            else:
                self.load.index_add_(0, torch.arange(self.E), counts)

    def moe_forward(self, y):
        x = y.reshape(-1, self.D)
        weight, index = self.route(x)
        if self.where == "before":
            self._count(index)
        out = torch.zeros_like(x)
        for e in range(self.E):
            out = out + (weight * (index == e)).sum(-1, keepdim=True) * self.expert(e, x)
        if self.where == "after":
            self._count(index)
        return out.reshape(y.shape)


@pytest.mark.parametrize("how, where", [("+=", "after"), ("+=", "before"), ("index_add_", "after")])
def test_an_expert_load_counter_written_in_place_matches(how, where):
    """Refused before session 68 as a write reordered against the region, though nothing in it reads
    the buffer (a review's): the counter moves after the op, and counts as eager's."""
    torch.manual_seed(0)
    model = CountsExpertLoad(how, where).double()
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    eager, compiled = copy.deepcopy(model), copy.deepcopy(model)
    assert_one_match(compile_and_compare(model, args, torch.float64))  # output and every gradient
    with compiled_reports() as reports:
        torch._dynamo.reset()
        got = torch.compile(compiled, backend="mha")(*args)
    want = eager(*args)
    assert_one_match(reports)
    assert relative_error(got, want) <= 1e-12
    assert torch.equal(compiled.load, eager.load) and int(eager.load.sum()) == 4 * 3 * 2, (compiled.load, eager.load)


def _doubled(grad):
    return grad * 2


class HookOnTheKeys(SpelledBlock):
    """A gradient hook on K inside the pool's forward: its gradient is not the block's."""

    def _kv(self, tok):
        k, v = super()._kv(tok)
        k.register_hook(_doubled)
        return k, v


def test_a_gradient_hook_inside_the_pool_is_named():
    """The near-miss named the einsum after the hook ("einsum_1 is not part of the block's math"), a review's.
    Dynamo records the hook as a call of register_hook (torch 2.13) or as autograd_function_apply, the
    function it wraps the hook in (torch 2.11, session 69 on the GPU machine): either is named."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reasons = as_eager_in_every_gradient(HookOnTheKeys().double(), args, torch.float64)
    assert len(reasons) == 1 and reasons[0].startswith(("register_hook", "autograd_function_apply")), reasons
    assert "a gradient hook" in reasons[0], reasons
