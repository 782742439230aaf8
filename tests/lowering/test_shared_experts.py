"""The top-k MoE beside experts every row takes, written as transformers writes Qwen2-MoE (one
flattened view x = y.view(-1, D) read by the router and by a sigmoid-gated shared expert; the
routed experts summed by index_add_ into zeros_like(x), and that sum read as it is, + the shared
expert's output), DeepSeek-MoE's shared experts, Arctic's dense residual, and x + MoE(x). The
region is the routed MoE; the rest runs as written on y rebuilt from the op. Before (a review's),
each was refused unless the sum was read through a reshape and the shared expert through a view
of its own, and the reason named the router's linear ("x is used outside the region (by
logits)"). Output and every gradient are eager's (float64)."""
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from compiled_checks import assert_one_match, compile_and_compare
from numerics import TOLERANCE, compiled_reports, relative_error
from spellings import SpelledBlock, inputs


class WithSharedExperts(SpelledBlock):
    """`shared`: "qwen2" (sigmoid-gated shared expert), "deepseek" (two shared experts summed),
    "arctic" (a dense MLP beside the MoE), "residual" (x + MoE(x)); the routed experts by
    index_add_ (moe="mixtral") or the masked loop, on one view x of y that the rest reads too."""

    def __init__(self, shared, **block):
        super().__init__(**block)
        self.shared = shared
        widths = {"qwen2": (48,), "deepseek": (24, 40), "arctic": (56,), "residual": ()}[shared]
        self.up = nn.ModuleList(nn.Linear(self.D, w, bias=False) for w in widths)
        self.down = nn.ModuleList(nn.Linear(w, self.D, bias=False) for w in widths)
        self.shared_gate = nn.Linear(self.D, 1, bias=False)

    def moe_forward(self, y):
        B, H, D = y.shape
        x = y.view(-1, D)
        weight, index = self.route(x)
        out = torch.zeros_like(x)
        if self.moe == "mixtral":
            mask = F.one_hot(index, self.E).permute(2, 1, 0)
            for e in range(self.E):
                slot, rows = torch.where(mask[e])
                out.index_add_(0, rows, self.expert(e, x[rows]) * weight[rows, slot, None])
        else:
            for e in range(self.E):
                out = out + (weight * (index == e)).sum(-1, keepdim=True) * self.expert(e, x)
        if self.shared == "residual":
            return (x + out).view(B, H, D)
        extra = sum(down(F.silu(up(x))) for up, down in zip(self.up, self.down))
        if self.shared == "qwen2":
            extra = torch.sigmoid(self.shared_gate(x)) * extra
        return (out + extra).view(B, H, D)


@pytest.mark.parametrize("moe", ["mixtral", "loop"])
@pytest.mark.parametrize("shared", ["qwen2", "deepseek", "arctic", "residual"])
def test_shared_experts_beside_the_routed_ones_match_and_train_as_eager(shared, moe):
    torch.manual_seed(0)
    model = WithSharedExperts(shared, moe=moe, renorm=shared != "qwen2").double()
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    match = assert_one_match(compile_and_compare(model, args, torch.float64, dynamic_where=moe == "mixtral"))
    assert match["exports"].get("y"), match


class ReadBetweenTheWrites(SpelledBlock):
    """The accumulator read between two experts' index_add_ (a partial sum): not the block's output."""

    def moe_forward(self, y):
        x = y.reshape(-1, y.shape[-1])
        weight, index = self.route(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(index, self.E).permute(2, 1, 0)
        partial = None
        for e in range(self.E):
            slot, rows = torch.where(mask[e])
            out.index_add_(0, rows, self.expert(e, x[rows]) * weight[rows, slot, None])
            if e == 1:
                partial = out * 0.5
        return (out + partial).reshape(y.shape)


def test_an_accumulator_read_between_its_writes_runs_as_written():
    torch.manual_seed(0)
    model = ReadBetweenTheWrites(moe="mixtral").double()
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with compiled_reports() as reports:
        torch._dynamo.reset()
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            got = torch.compile(copy.deepcopy(model), backend="mha")(*args)
    assert not any(r.matches for r in reports) and any(r.near_misses for r in reports), [str(r) for r in reports]
    assert relative_error(got, model(*args)) <= TOLERANCE[torch.float64]


class ViewBeforeTheLoop(SpelledBlock):
    """The accumulator viewed before the experts fill it (o = out.view(B, H, D), then index_add_ or
    mistral-src's out[rows] += ... per expert), o returned, or o + a shared expert. Matched in
    session 71's first version of the shared-expert reading: the region ended at the view, and the
    loop, left after the op, added every expert into the op's output again (a review's: twice
    eager's output and every gradient)."""

    def __init__(self, write, shared):
        super().__init__(moe="mixtral")
        self.write, self.shared = write, shared
        self.up, self.down = nn.Linear(self.D, 48, bias=False), nn.Linear(48, self.D, bias=False)

    def moe_forward(self, y):
        x = y.view(-1, self.D)
        weight, index = self.route(x)
        out = torch.zeros_like(x)
        o = out.view(y.shape)
        mask = F.one_hot(index, self.E).permute(2, 1, 0)
        for e in range(self.E):
            slot, rows = torch.where(mask[e])
            contribution = self.expert(e, x[rows]) * weight[rows, slot, None]
            if self.write == "index_add_":
                out.index_add_(0, rows, contribution)
            else:
                out[rows] += contribution
        return o + self.down(F.silu(self.up(x))).view(y.shape) if self.shared else o


@pytest.mark.parametrize("shared", [False, True], ids=["", "shared"])
@pytest.mark.parametrize("write", ["index_add_", "setitem"])
def test_the_sum_viewed_before_the_experts_write_it_runs_as_written(write, shared):
    torch.manual_seed(0)
    model = ViewBeforeTheLoop(write, shared).double()
    args = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with compiled_reports() as reports:
        torch._dynamo.reset()
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            got = torch.compile(copy.deepcopy(model), backend="mha")(*args)
    reasons = [m["reason"] for r in reports for m in r.near_misses]
    assert not any(r.matches for r in reports) and any("take the view after the loop" in r for r in reasons), reasons
    assert relative_error(got, model(*args)) <= TOLERANCE[torch.float64]
