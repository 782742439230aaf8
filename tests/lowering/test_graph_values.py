"""Numbers the block fixes at compile time (the scores' scale, top-k's k) that Dynamo hands over as
values of the graph: under automatic dynamic shapes once it has seen two of them, or under
dynamic=True. The op cannot take them, so the graph runs as written; before session 68 the
near-miss blamed the activation ("mul_1 on the expert's output is not part of that math") or said
nothing ("mul is not part of the block's math"), a review's. Each reason now names the value."""
import pytest
import torch

from numerics import compiled_reports, relative_error
from spellings import SpelledBlock, inputs


class ScaledByAnAttribute(SpelledBlock):
    """The scores scaled by a float attribute (self.scale), or SDPA given it as scale=."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scale = self.Dh ** -0.5

    def pool_forward(self, tok, pad=None):
        B, N, D = tok.shape
        k, v = (t.view(B, N, self.P, self.Dh) for t in self._kv(tok))
        if self.pool == "sdpa":
            q = self.query.view(1, self.P, 1, self.Dh).expand(B, -1, -1, -1)
            pooled = torch.nn.functional.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                                                      scale=self.scale)
            return self.out(pooled.reshape(B, D))
        attn = torch.softmax(torch.einsum("pd,bnpd->bpn", self.query, k) * self.scale, dim=-1)
        return self.out(torch.einsum("bpn,bnpd->bpd", attn, v).reshape(B, D))


class TopKArgument(SpelledBlock):
    """k given to the forward as an int (the loop spelling)."""

    def forward(self, ctx, tok, k):
        y = self.merge_forward(ctx, self.pool_forward(tok))
        x = y.reshape(-1, self.D)
        weight, index = torch.softmax(self.router(x), dim=-1).topk(k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.E):
            out = out + (weight * (index == e)).sum(-1, keepdim=True) * self.expert(e, x)
        return out.reshape(y.shape)


def _calls(model, calls):
    """[(the call's reports, output, eager's output)] for each (args, attributes) of calls, on one
    compiled model: the attributes ({name: value}) are set on the model before the call."""
    torch._dynamo.reset()
    compiled, results = torch.compile(model, backend="mha"), []
    for args, attributes in calls:
        for name, value in attributes.items():
            setattr(model, name, value)
        with compiled_reports() as reports:
            got = compiled(*args)
        results.append((reports, got, model(*args)))
    return results


@pytest.mark.parametrize("pool", ["einsum", "sdpa"])
def test_a_float_scale_made_a_value_of_the_graph_is_named(pool):
    torch.manual_seed(0)
    model = ScaledByAnAttribute(pool=pool).double()
    ctx, tok = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    # the second value makes the attribute a value of the graph
    (first, got1, want1), (second, got2, want2) = _calls(model, [((ctx, tok), {"scale": 0.25}),
                                                                 ((ctx, tok), {"scale": 0.5})])
    assert sum(len(r.matches) for r in first) == 1, [str(r) for r in first]
    reasons = [m["reason"] for r in second for m in r.near_misses]
    assert sum(len(r.matches) for r in second) == 0 and len(reasons) == 1, reasons
    what = "its scale" if pool == "sdpa" else "the scores' factor"
    assert f"{what} is " in reasons[0] and "a value of the graph" in reasons[0], reasons
    assert relative_error(got1, want1) <= 1e-12 and relative_error(got2, want2) <= 1e-12


def test_top_k_s_k_made_a_value_of_the_graph_is_named():
    torch.manual_seed(0)
    model = TopKArgument().double()
    ctx, tok = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (first, got1, want1), (second, got2, want2) = _calls(model, [((ctx, tok, 2), {}), ((ctx, tok, 3), {})])
    assert sum(len(r.matches) for r in first) == 1, [str(r) for r in first]
    reasons = [m["reason"] for r in second for m in r.near_misses]
    assert sum(len(r.matches) for r in second) == 0 and len(reasons) == 1, reasons
    assert "top-k's k is " in reasons[0] and "a value of the graph" in reasons[0], reasons
    assert relative_error(got1, want1) <= 1e-12 and relative_error(got2, want2) <= 1e-12


class FlooredByAnAttribute(SpelledBlock):
    """The top-k weights renormalised by Σw clamped at a float attribute (self.floor), or by
    F.normalize with eps=self.floor: a floor far under k/E, which never acts."""

    def __init__(self, how, **kwargs):
        super().__init__(**kwargs)
        self.how, self.floor = how, 1e-6

    def route(self, x):
        weight, index = torch.softmax(self.router(x), dim=-1).topk(self.k, dim=-1)
        if self.how == "clamp":
            return weight / weight.sum(-1, keepdim=True).clamp(min=self.floor), index
        return torch.nn.functional.normalize(weight, p=1, dim=-1, eps=self.floor), index


@pytest.mark.parametrize("how, what", [("clamp", "the floor under Σw is "), ("normalize", "F.normalize's eps is ")])
def test_a_renorm_floor_made_a_value_of_the_graph_is_named(how, what):
    """The reason said the clamp "is not part of the block's math" (a review's)."""
    torch.manual_seed(0)
    model = FlooredByAnAttribute(how).double()
    ctx, tok = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (first, got1, want1), (second, got2, want2) = _calls(model, [((ctx, tok), {"floor": 1e-6}),
                                                                 ((ctx, tok), {"floor": 1e-7})])
    assert sum(len(r.matches) for r in first) == 1, [str(r) for r in first]
    reasons = [m["reason"] for r in second for m in r.near_misses]
    assert sum(len(r.matches) for r in second) == 0 and len(reasons) == 1, reasons
    assert what in reasons[0] and "a value of the graph" in reasons[0], reasons
    assert relative_error(got1, want1) <= 1e-12 and relative_error(got2, want2) <= 1e-12
