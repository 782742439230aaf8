"""Pools over one learned latent written in timm's and Perceiver's order (timm's AttentionPoolLatent
without its MLP): the latent expanded over the batch and then projected by the query's Linear
(q = Linear(latent.expand(B, -1, -1))), and the output projection applied to the one latent's row
[B, 1, D] before x[:, 0]. Before, both were refused (a review's): the projected query was read as a
tensor of its own, varying over the batch, and the [B, 1, D] row hid the tokens from the search.
Each is SPEC §1's pool: output and every gradient are eager's."""
import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from compiled_checks import assert_one_match, compile_and_compare
from numerics import TOLERANCE, compiled_reports, relative_error
from spellings import SpelledBlock, inputs

SIZES = {"tiny": ({}, {}), "odd": (dict(D=21, P=3, F_=13, E=5, k=3), dict(B=3, H=2, N=7, D=21)),
         "B=1": ({}, dict(B=1))}


class LatentPool(SpelledBlock):
    """q = Linear(latent.expand(B, -1, -1)) (`q_after_expand`) or Linear(latent).expand (`q_before`);
    the output projection on [B, 1, D] then [:, 0] (`proj_on_row`) or on [B, D]; SDPA or matmul."""

    def __init__(self, q_after_expand, proj_on_row, attention, **block):
        super().__init__(**block)
        self.q_after_expand, self.proj_on_row, self.attention = q_after_expand, proj_on_row, attention
        self.latent = nn.Parameter(torch.randn(1, 1, self.D) / math.sqrt(self.D))
        self.q = nn.Linear(self.D, self.D)
        del self.query

    def pool_forward(self, tok, pad=None):
        B, N, D = tok.shape
        P, Dh = self.P, self.Dh
        latent = self.q(self.latent.expand(B, -1, -1)) if self.q_after_expand else self.q(self.latent).expand(B, -1, -1)
        q = latent.reshape(B, 1, P, Dh).transpose(1, 2)
        k = self.key(tok).reshape(B, N, P, Dh).transpose(1, 2)
        v = self.value(tok).reshape(B, N, P, Dh).transpose(1, 2)
        if self.attention == "sdpa":
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            x = (q @ k.transpose(-2, -1) / math.sqrt(Dh)).softmax(dim=-1) @ v
        x = x.transpose(1, 2).reshape(B, 1, D)
        return self.out(x)[:, 0] if self.proj_on_row else self.out(x[:, 0])


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
@pytest.mark.parametrize("q_after_expand,proj_on_row", [(True, True), (True, False), (False, True)],
                         ids=["timm", "q_after_expand", "proj_on_row"])
def test_a_latent_pool_in_timm_s_order_matches_and_trains_as_eager(q_after_expand, proj_on_row, attention, sizes):
    torch.manual_seed(0)
    model = LatentPool(q_after_expand, proj_on_row, attention, **SIZES[sizes][0]).double()
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1), **SIZES[sizes][1])
    match = assert_one_match(compile_and_compare(model, args, torch.float64))
    assert match["params"]["q"] is not None, match["params"]


def _runs_as_written(model):
    """No match, a near-miss, and eager's output (float64). Returns the near-misses' reasons."""
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with compiled_reports() as reports:
        torch._dynamo.reset()
        got = torch.compile(copy.deepcopy(model), backend="mha")(*args)
    assert not any(r.matches for r in reports) and any(r.near_misses for r in reports), [str(r) for r in reports]
    assert relative_error(got, model(*args)) <= TOLERANCE[torch.float64]
    return [m["reason"] for r in reports for m in r.near_misses]


class GqaFlag(SpelledBlock):
    """SDPA with enable_gqa=True, K and V with as many heads as the query (`equal`: the same attention),
    or with one head shared by the P query heads (`shared`, multi-query: not the block's pool)."""

    def __init__(self, heads):
        super().__init__(pool="sdpa")
        self.heads = heads
        if heads == "shared":
            self.key, self.value = nn.Linear(self.D, self.Dh), nn.Linear(self.D, self.Dh)

    def pool_forward(self, tok, pad=None):
        B, N, D = tok.shape
        G = self.P if self.heads == "equal" else 1
        k = self.key(tok).view(B, N, G, self.Dh).transpose(1, 2)
        v = self.value(tok).view(B, N, G, self.Dh).transpose(1, 2)
        q = self.query.view(1, self.P, 1, self.Dh).expand(B, -1, -1, -1)
        return self.out(F.scaled_dot_product_attention(q, k, v, enable_gqa=True).reshape(B, D))


def test_sdpa_with_enable_gqa_and_as_many_key_heads_matches():
    """Refused before (a review's), the reason naming scaled_dot_product_attention."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_one_match(compile_and_compare(GqaFlag("equal").double(), args, torch.float64))


def test_sdpa_with_one_key_head_shared_by_the_query_heads_runs_as_written():
    """The reason named the key's linear alone before session 71."""
    torch.manual_seed(0)
    reasons = _runs_as_written(GqaFlag("shared").double())
    assert any("fewer heads than the query" in r for r in reasons), reasons


class TimmFusedKV(SpelledBlock):
    """K and V from one Linear(D, 2D) as timm writes it: kv(x).reshape(B, N, 2, P, Dh).permute(2, 0, 3,
    1, 4).unbind(0) (`take`: or kv[0], kv[1] as older timm writes it, or kv[1], kv[0]: K from the second
    half, another model, which the op must then be given), then SDPA or the scores by einsum;
    `interleaved`: reshape(B, N, P, 2, Dh), K and V alternating per head, which is another weight layout
    and not the block's fused KV."""

    def __init__(self, attention, interleaved=False, take="unbind", **block):
        super().__init__(pool="fused_kv", **block)
        self.attention, self.interleaved, self.take = attention, interleaved, take

    def pool_forward(self, tok, pad=None):
        B, N, D = tok.shape
        P, Dh = self.P, self.Dh
        if self.interleaved:
            kv = self.kv(tok).reshape(B, N, P, 2, Dh).permute(3, 0, 2, 1, 4)
        else:
            kv = self.kv(tok).reshape(B, N, 2, P, Dh).permute(2, 0, 3, 1, 4)
        k, v = kv.unbind(0) if self.take == "unbind" else (kv[0], kv[1]) if self.take == "index" else (kv[1], kv[0])
        if self.attention == "sdpa":
            q = self.query.view(1, P, 1, Dh).expand(B, -1, -1, -1)
            return self.out(F.scaled_dot_product_attention(q, k, v).reshape(B, D))
        scores = torch.einsum("pd,bpnd->bpn", self.query, k) / math.sqrt(Dh)
        return self.out(torch.einsum("bpn,bpnd->bpd", scores.softmax(-1), v).reshape(B, D))


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("attention", ["sdpa", "einsum"])
def test_timm_s_fused_kv_matches_and_trains_as_eager(attention, sizes):
    """Refused before (a review's): the unbind was read only after view(B, N, 2, D)."""
    torch.manual_seed(0)
    model = TimmFusedKV(attention, **SIZES[sizes][0]).double()
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1), **SIZES[sizes][1])
    assert_one_match(compile_and_compare(model, args, torch.float64))


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("take", ["index", "index_swapped"])
def test_timm_s_fused_kv_taken_by_index_matches_and_trains_as_eager(take, sizes):
    """kv[0], kv[1] in place of unbind(0): refused before (session 70's note)."""
    torch.manual_seed(0)
    model = TimmFusedKV("sdpa", take=take, **SIZES[sizes][0]).double()
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1), **SIZES[sizes][1])
    assert_one_match(compile_and_compare(model, args, torch.float64))


@pytest.mark.parametrize("take", ["unbind", "index"])
def test_k_and_v_interleaved_per_head_run_as_written(take):
    torch.manual_seed(0)
    model = TimmFusedKV("einsum", interleaved=True, take=take).double()
    _runs_as_written(model)


class PrescaledQuery(SpelledBlock):
    """The query scaled by 1/√Dh before the scores, which are then not scaled: timm's non-fused path
    (q = q * self.scale after the expand, attn = q @ k.transpose(-2, -1)), the same with SDPA(scale=1.0),
    or the query viewed in heads and scaled before any expand (`viewed`)."""

    def __init__(self, attention, where, **block):
        super().__init__(**block)
        self.attention, self.where = attention, where

    def pool_forward(self, tok, pad=None):
        B, N, D = tok.shape
        P, Dh = self.P, self.Dh
        k = self.key(tok).view(B, N, P, Dh).transpose(1, 2)
        v = self.value(tok).view(B, N, P, Dh).transpose(1, 2)
        if self.where == "viewed":
            q = self.query.view(1, P, 1, Dh) * Dh ** -0.5
        else:
            q = self.query.view(1, P, 1, Dh).expand(B, -1, -1, -1) * Dh ** -0.5
        if self.attention == "sdpa":
            x = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        else:
            x = (q @ k.transpose(-2, -1)).softmax(dim=-1) @ v
        return self.out(x.reshape(B, D))


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("attention,where", [("matmul", "expanded"), ("sdpa", "expanded"), ("matmul", "viewed"),
                                             ("sdpa", "viewed")])
def test_a_query_scaled_before_the_scores_matches_and_trains_as_eager(attention, where, sizes):
    """Refused before (a review's), the reason saying the scores are scaled by 1: the matmul and SDPA
    pools did not carry the query's own factor, which the einsum pool did."""
    torch.manual_seed(0)
    model = PrescaledQuery(attention, where, **SIZES[sizes][0]).double()
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1), **SIZES[sizes][1])
    match = assert_one_match(compile_and_compare(model, args, torch.float64))
    assert "mul" not in match["params"]["q"], match["params"]["q"]  # the query itself, the factor in the scale
