"""The pool's parameters as the op reads them: stored with other size-1 axes than the op takes,
given to F.linear through a view, or added along another axis than the features. Each case was
matched and computed wrong, or crashed the op, before session 67 (a review's); the numbers are
float64 errors against eager then."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compiled_checks import as_eager_in_every_gradient, assert_one_match, compile_and_compare
from spellings import SpelledBlock, inputs


class StoredPool(SpelledBlock):
    """The einsum pool with one parameter stored or given otherwise (`how`)."""

    def __init__(self, how, P=2):
        super().__init__(P=P)
        self.how = how
        D, Dh = self.D, self.Dh
        if how == "query [1,P,Dh] read as query[0]":
            self.query = nn.Parameter(torch.randn(1, P, Dh) / math.sqrt(Dh))
        elif how == "query [Dh,1] read as .view(1,Dh)":  # P = 1: the op had taken Dh heads of width 1
            self.query = nn.Parameter(torch.randn(Dh, 1) / math.sqrt(Dh))
        elif how in ("bo [D,1] read as .view(D)", "bv [1,D] read as b[0]"):
            self.stored_bias = nn.Parameter(0.3 * torch.randn(D, 1) if how.startswith("bo") else 0.3 * torch.randn(1, D))
        elif how in ("bv [P,Dh] given as .reshape(D)", "bo [P,Dh] given as .reshape(D)"):
            self.stored_bias = nn.Parameter(0.3 * torch.randn(P, Dh))
        elif how == "bv [1] given as .expand(D)":
            self.stored_bias = nn.Parameter(0.3 * torch.randn(1))

    def pool_forward(self, tok, pad=None):
        B, N, D = tok.shape
        P, Dh, how = self.P, self.Dh, self.how
        q = {"query [1,P,Dh] read as query[0]": lambda: self.query[0],
             "query [Dh,1] read as .view(1,Dh)": lambda: self.query.view(1, Dh)}.get(how, lambda: self.query)()
        bias = {"bo [D,1] read as .view(D)": lambda: self.stored_bias.view(D),
                "bv [1,D] read as b[0]": lambda: self.stored_bias[0],
                "bv [P,Dh] given as .reshape(D)": lambda: self.stored_bias.reshape(D),
                "bo [P,Dh] given as .reshape(D)": lambda: self.stored_bias.reshape(D),
                "bv [1] given as .expand(D)": lambda: self.stored_bias.expand(D)}.get(how, lambda: None)()
        on_v = how.startswith("bv")
        k = self.key(tok).view(B, N, P, Dh)
        v = F.linear(tok, self.value.weight, bias if on_v else self.value.bias).view(B, N, P, Dh)
        a = torch.softmax(torch.einsum("pd,bnpd->bpn", q, k) / math.sqrt(Dh), dim=-1)
        pooled = torch.einsum("bpn,bnpd->bpd", a, v).reshape(B, D)
        return F.linear(pooled, self.out.weight, self.out.bias if on_v or bias is None else bias)


READ_AS_STORED = ["query [1,P,Dh] read as query[0]", "query [Dh,1] read as .view(1,Dh)", "bo [D,1] read as .view(D)",
                  "bv [1,D] read as b[0]",
                  # since session 68 the reshape itself is the parameter the op takes (a review's: a
                  # parameter stored in another shape lost the block)
                  "bv [P,Dh] given as .reshape(D)", "bo [P,Dh] given as .reshape(D)"]


@pytest.mark.parametrize("how", READ_AS_STORED)
@pytest.mark.parametrize("B", [4, 32])  # B = D = 32: a [D, 1] bias broadcast by B would not raise
def test_a_parameter_stored_with_other_size_one_axes_is_passed_as_the_user_views_it(how, B):
    """query[0] of a [1, P, Dh] query crashed the op; a [Dh, 1] query read as .view(1, Dh) with
    P = 1 was taken as Dh heads of width 1 (0.0137 off, ∂query 0.84); a [D, 1] bo read as .view(D)
    was 0.526 off at B = D, and a [1, D] bv read as b[0] made the backward raise."""
    torch.manual_seed(0)
    model = StoredPool(how, P=1 if "P=1" in how or "view(1,Dh)" in how else 2).double()
    args = inputs(B=B, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_one_match(compile_and_compare(model, args, torch.float64))


@pytest.mark.parametrize("how", ["bv [1] given as .expand(D)"])
def test_a_bias_given_to_linear_through_a_view_it_cannot_read_is_not_dropped(how):
    """F.linear's bias as a reshape or an expand of a parameter was read as no bias (0.48, 0.79
    and 0.15 off); the expand now runs as written, the reshape is read (READ_AS_STORED)."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reasons = as_eager_in_every_gradient(StoredPool(how).double(), args, torch.float64)
    assert any("linear" in r for r in reasons), reasons


class BiasAlongAnotherAxis(SpelledBlock):
    """N = D (or B = D): a [D] bias broadcast onto the tokens (or the batch) of a projection."""

    def __init__(self, where):
        super().__init__(D=4, P=2, F_=8)
        self.where = where

    def pool_forward(self, tok, pad=None):
        B, N, D = tok.shape
        P, Dh = self.P, self.Dh
        k = self.key(tok).view(B, N, P, Dh)
        if self.where == "tokens":
            v = ((tok @ self.value.weight.T).transpose(1, 2) + self.value.bias).transpose(1, 2)
        else:
            v = self.value(tok)
        v = v.reshape(B, N, P, Dh)
        a = torch.softmax(torch.einsum("pd,bnpd->bpn", self.query, k) / math.sqrt(Dh), dim=-1)
        pooled = torch.einsum("bpn,bnpd->bpd", a, v).reshape(B, D)
        if self.where == "batch":
            return ((pooled @ self.out.weight.T).t() + self.out.bias).t()
        return self.out(pooled)


@pytest.mark.parametrize("where, B, N", [("tokens", 3, 4), ("batch", 4, 5)])
def test_a_bias_added_along_another_axis_than_the_features_is_not_the_block(where, B, N):
    """(tok Wvᵀ)ᵀ + bv with N = D added bv[n] to token n (0.187 off); (pooled Woᵀ)ᵀ + bo with B = D
    added bo[b] to batch row b (0.327 off)."""
    torch.manual_seed(0)
    args = inputs(B=B, N=N, D=4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reasons = as_eager_in_every_gradient(BiasAlongAnotherAxis(where).double(), args, torch.float64)
    assert any("bias is added along the" in r for r in reasons), reasons


class ExpandedQueryEinsum(SpelledBlock):
    """The learned query expanded over the batch before the einsum (SPEC §2), in either axis order."""

    def __init__(self, order, P=2):
        super().__init__(P=P)
        self.order = order

    def pool_forward(self, tok, pad=None):
        B, N, D = tok.shape
        P, Dh = self.P, self.Dh
        k, v = self.key(tok).view(B, N, P, Dh), self.value(tok).view(B, N, P, Dh)
        if self.order == "bpd":
            s = torch.einsum("bpd,bnpd->bpn", self.query.expand(B, P, Dh), k)
        else:
            s = torch.einsum("bdp,bnpd->bpn", self.query.t().expand(B, Dh, P), k)
        a = torch.softmax(s / math.sqrt(Dh), dim=-1)
        return self.out(torch.einsum("bpn,bnpd->bpd", a, v).reshape(B, D))


@pytest.mark.parametrize("order", ["bpd", "bdp"])
@pytest.mark.parametrize("P", [2, 1])
def test_a_query_expanded_over_the_batch_in_an_einsum_matches(order, P):
    """Refused before ("einsum ... not part of the block's math", a review's)."""
    torch.manual_seed(0)
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_one_match(compile_and_compare(ExpandedQueryEinsum(order, P).double(), args, torch.float64))
