"""Blocks at the edges of what the matcher reads: a ctx the merge itself broadcasts, top-k of no
expert, and a second block fed by the first one's values. Each was matched and went wrong before
session 67 (a review's)."""
import torch
from torch import nn

from compiled_checks import as_eager_in_every_gradient, compile_and_compare
from numerics import graph_has_region, observing
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
