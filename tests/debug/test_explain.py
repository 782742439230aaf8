"""mha_compile.explain called again and again, beside the user's own torch.compile of the model."""
import itertools
import pathlib
import re
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import mha_compile
from mha_compile.debug import explain as explain_module
from mha_compile.models import MHABlock
from numerics import compiled_reports
from lowering.spellings import SpelledBlock, inputs as spelled_inputs


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()  # the many shapes compiled here would make later compiles of MHABlock's forward dynamic


def _inputs(B, N, D=12, H=3):
    return torch.randn(B, H, D), torch.randn(B, N, D)


def test_explain_any_number_of_times_and_the_models_own_compile_still_compiles():
    """Dynamo's compiled entries on the model's forward count against its recompile limit (8 a
    module): before, the ninth explain was empty and the user's compiled model ran a new shape
    eagerly."""
    torch.manual_seed(0)
    block = MHABlock(12, 3, 8, 3, 2)
    compiled = torch.compile(block, backend="mha")
    compiled(*_inputs(4, 5))
    for i in range(12):
        report = mha_compile.explain(block, *_inputs(2 + i, 1 + i % 4))
        assert len(report.matches) == 1 and not report.note, (i, str(report))
    assert "forward" not in block.__dict__  # the copy was on the instance for the call only
    ctx, tok = _inputs(7, 6)
    with compiled_reports() as reports:
        out = compiled(ctx, tok)
    assert [len(r.matches) for r in reports] == [1]  # compiled, and the region replaced, on the new shape
    torch.testing.assert_close(out, block(ctx, tok))


def test_explain_of_a_function_again_and_again():
    torch.manual_seed(1)
    block = MHABlock(12, 3, 8, 3, 2, spelling="dense")

    def step(ctx, tok):
        return block(ctx, tok) * 2

    for i in range(10):
        assert len(mha_compile.explain(step, *_inputs(3, 2 + i)).matches) == 1, i


def test_the_instances_own_forward_is_put_back_and_hooks_still_run():
    torch.manual_seed(2)
    block = MHABlock(12, 3, 8, 3, 2)
    own = block.forward  # a forward set on the instance (as a wrapper library might)
    block.forward = own
    calls = []
    block.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    report = mha_compile.explain(block, *_inputs(4, 5))
    assert len(report.matches) == 1 and calls == [torch.Size([4, 3, 12])]
    assert block.__dict__["forward"] is own


def test_a_report_with_no_graph_says_so():
    def returns_its_input(ctx):
        return ctx

    report = mha_compile.explain(returns_its_input, torch.randn(2, 3, 12))
    assert report.graphs == [] and report.note == explain_module.NO_GRAPH
    assert str(report).endswith(explain_module.NO_GRAPH) and report.to_json()["note"] == explain_module.NO_GRAPH
    assert mha_compile.explain(MHABlock(12, 3, 8, 3, 2), *_inputs(2, 3)).to_json()["note"] == ""


def test_dynamos_own_wrappers_are_compiled_as_torch_compile_would():
    """torch.compile reads torch.compiler.disable's wrapper by its attributes: a copy of it would
    not be the same function to torch.compile (it compiles a disabled function given it
    directly), so explain passes such a function as it is."""
    torch.manual_seed(3)
    block = MHABlock(12, 3, 8, 3, 2)

    @torch.compiler.disable
    def disabled(ctx, tok):
        return block(ctx, tok)

    assert len(mha_compile.explain(disabled, *_inputs(2, 3)).matches) == 1


def test_explain_reports_what_the_caller_s_grad_mode_compiles():
    """explain runs the forward in the caller's grad mode: a frozen pool (the pool under
    torch.no_grad() inside the model) is a near-miss for training, and a match for inference,
    where Dynamo records no grad-mode change (it ran under no_grad always until session 50, so
    the report said match where training fell back)."""
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "lowering"))
    from test_spellings import PartNoGrad, inputs

    model = PartNoGrad("pool").double()
    args = inputs(dtype=torch.float64)
    training = mha_compile.explain(model, *args)
    with torch.no_grad():
        inference = mha_compile.explain(model, *args)
    assert not training.matches and "runs with grad disabled" in training.near_misses[0]["reason"]
    assert len(inference.matches) == 1 and not inference.near_misses


def test_explain_leaves_the_models_buffers_the_inputs_and_the_random_stream_as_found():
    """explain runs the forward once: a BatchNorm's running statistics and a counter took its
    update, a parameter moved in place under no_grad kept the move (found by a read-through), an
    input the forward writes in place kept the write, and dropout's draws moved the caller's
    random stream. Each must be as before the call, the report still made."""
    from dropout_model import DroppedTokens
    from normed_model import NormedContext

    class WritesItsInput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = NormedContext(DroppedTokens(MHABlock(12, 2, 24, 4, 2)), 3)
            self.scale = torch.nn.Parameter(torch.tensor([1.0, 0.5]))

        def forward(self, ctx, tok):
            with torch.no_grad():
                self.scale.add_(0.25)
            out, dropped = self.inner(ctx, tok)
            tok.mul_(0.5)
            return out * self.scale.sum(), dropped

    model = WritesItsInput()
    ctx, tok = _inputs(4, 5)
    state, tok_before = {k: v.clone() for k, v in model.state_dict().items()}, tok.clone()
    torch.manual_seed(9)
    report = mha_compile.explain(model, ctx, tok)
    after = torch.rand(8)
    assert len(report.matches) == 1
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert torch.equal(tok, tok_before)
    torch.manual_seed(9)
    assert torch.equal(after, torch.rand(8))


def test_explain_at_two_batch_sizes_leaves_the_user_s_compile_static():
    """Dynamo remembers which sizes changed between compiles by the code's file, line and name,
    which explain's copy of the forward shares: two explains at batch 2 and 6 made the user's
    first torch.compile of the model dynamic in the batch (found by a read-through)."""
    torch._dynamo.reset()
    torch.manual_seed(2)
    block = MHABlock(12, 3, 8, 3, 2)
    for batch in (2, 6):
        assert len(mha_compile.explain(block, *_inputs(batch, 5)).matches) == 1
    with compiled_reports() as reports:
        torch.compile(block, backend="mha")(*_inputs(4, 5))
    assert [m["shapes"]["ctx"] for r in reports for m in r.matches] == [["4", "3", "12"]]


def test_explain_of_a_model_without_the_block_says_so():
    """A graph with nothing like the block gave an empty report with no word of why (a read-through's)."""
    report = mha_compile.explain(torch.nn.Linear(12, 12), torch.randn(4, 12))
    assert len(report.graphs) == 1 and not report.matches and report.note == explain_module.NO_BLOCK
    assert explain_module.NO_BLOCK in str(report)


def test_explain_puts_the_buffers_back_when_the_forward_raises():
    from normed_model import NormedContext

    class RaisesAfterTheNorm(NormedContext):
        def forward(self, ctx, tok):
            super().forward(ctx, tok)
            raise ValueError("planted failure after the buffers were written")

    model = RaisesAfterTheNorm(MHABlock(12, 2, 24, 4, 2), 3)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    with pytest.raises(Exception, match="planted failure"):
        mha_compile.explain(model, *_inputs(4, 5))
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name


class _BrokenBetween(MHABlock):
    """The block with a graph break between the pool and the MoE: two graphs, neither the whole region."""

    def forward(self, ctx, tok):
        inv = self.pool(tok)
        torch._dynamo.graph_break()
        return self.moe(ctx + inv.unsqueeze(1))


class _BrokenAfterMerge(MHABlock):
    def forward(self, ctx, tok):
        y = ctx + self.pool(tok).unsqueeze(1)
        torch._dynamo.graph_break()
        return self.moe(y)


def test_a_graph_break_between_the_merge_and_the_moe_is_named():
    torch.manual_seed(4)
    report = mha_compile.explain(_BrokenAfterMerge(12, 3, 8, 3, 2), *_inputs(4, 5))
    assert not report.matches and len(report.graph_breaks) == 1, str(report)
    assert [m["reason"] for m in report.near_misses if "the merge and the pool ran elsewhere" in m["reason"]]


def test_a_graph_break_between_the_pool_and_the_moe_is_named():
    """Before, the MoE's graph read "no [B,N,D] token tensor feeds a projection of the pool", and
    the report did not say that Dynamo had broken the graph, nor where."""
    torch.manual_seed(3)
    block = _BrokenBetween(12, 3, 8, 3, 2)
    for _ in range(2):  # the counters Dynamo keeps for the process: each report has its own breaks only
        report = mha_compile.explain(block, *_inputs(4, 5))
        assert len(report.graphs) == 2 and not report.matches and len(report.near_misses) == 1, str(report)
        assert "is an input of this graph, so its pool ran elsewhere" in report.near_misses[0]["reason"]
        assert len(report.graph_breaks) == 1 and "graph_break()" in report.graph_breaks[0], report.graph_breaks
        assert "Dynamo broke the graph" in str(report) and report.to_json()["graph_breaks"] == report.graph_breaks
        # each graph named by where it comes from: the forward, then its resumption after the break
        assert re.fullmatch(r"Dynamo \d+/0, forward at test_explain\.py:\d+", report.graphs[0].source)
        assert re.fullmatch(r"Dynamo \d+/0, torch_dynamo_resume_in_forward_at_\d+ at test_explain\.py:\d+",
                            report.graphs[1].source), report.graphs[1].source
        assert report.graphs[1].name in str(report) and report.to_json()["graphs"][1]["source"]
        # the first graph says which break ended it, and where; the second ran to the end
        line = _BrokenBetween.forward.__code__.co_firstlineno + 2
        assert report.graphs[0].ended_by == (f"a graph break at test_explain.py:{line}: "
                                             "Call to `torch._dynamo.graph_break()`")
        assert report.graphs[1].ended_by == "" and f"ended by {report.graphs[0].ended_by}" in str(report)
    whole = mha_compile.explain(MHABlock(12, 3, 8, 3, 2), *_inputs(4, 5))
    assert len(whole.matches) == 1 and whole.graph_breaks == [] and "Dynamo broke" not in str(whole)


class _CheckpointedPart(MHABlock):
    """The block with only its pool, or only its MoE, under torch.utils.checkpoint: one graph and no
    break, the checkpointed part in a body of its own. Its near-miss blamed a graph break (a review's)."""

    def __init__(self, part, *sizes):
        super().__init__(*sizes)
        self.part = part

    def forward(self, ctx, tok):
        if self.part == "pool":
            return self.moe(ctx + checkpoint(self.pool, tok, use_reentrant=False).unsqueeze(1))
        if self.part == "moe":
            return checkpoint(self.moe, ctx + self.pool(tok).unsqueeze(1), use_reentrant=False)
        return checkpoint(super().forward, ctx, tok, use_reentrant=False)


@pytest.mark.parametrize("part", ["pool", "moe", "whole"])
def test_a_checkpoint_around_part_of_the_block_is_named(part):
    torch.manual_seed(5)
    report = mha_compile.explain(_CheckpointedPart(part, 12, 3, 8, 3, 2), *_inputs(4, 5))
    assert len(report.graphs) == 1 and report.graph_breaks == [], str(report)
    if part == "whole":
        assert len(report.matches) == 1 and not report.near_misses, str(report)
        return
    assert not report.matches and len(report.near_misses) == 1, str(report)
    miss = report.near_misses[0]
    assert "put the whole block inside that function or outside it" in miss["reason"], miss
    assert "Dynamo ended" not in miss["reason"] and "graph break" not in miss["reason"], miss
    if part == "pool":  # the MoE in the graph itself, its pooled vector out of the checkpoint
        assert miss["graph"] == "<top>" and "comes out of tag_activation_checkpoint" in miss["reason"], miss
    else:  # the MoE in the checkpoint's body
        assert miss["graph"] != "<top>" and "the merge and the pool ran elsewhere" in miss["reason"], miss


class _LogsTheRouter(SpelledBlock):
    """A print of the router's largest probability between the softmax and the top-k: a graph break."""

    def route(self, x):
        probs = torch.softmax(self.router(x), dim=-1)
        print(f"largest router probability {probs.max().item():.3f}")
        weight, index = probs.topk(self.k, dim=-1)
        return weight / weight.sum(-1, keepdim=True), index


def test_a_graph_break_between_the_router_and_its_top_k_is_named(capsys):
    """The near-miss said top-k was not taken on a router's softmax, and advised
    capture_dynamic_output_shape_ops, which does nothing for this break (a review's)."""
    torch.manual_seed(6)
    report = mha_compile.explain(_LogsTheRouter(), *spelled_inputs())
    reasons = [m["reason"] for m in report.near_misses]
    assert not report.matches and report.graph_breaks and len(reasons) == 1, str(report)
    assert "so the router ran elsewhere" in reasons[0] and "capture_dynamic_output_shape_ops" not in reasons[0], reasons


@pytest.mark.parametrize("B, H", [(0, 3), (4, 0)])
def test_an_empty_batch_is_named(B, H):
    """The near-miss blamed the experts ("could not be read as act(x W1 + b1) W2 + b2"), a review's."""
    torch.manual_seed(6)
    report = mha_compile.explain(MHABlock(12, 3, 8, 3, 2), torch.randn(B, H, 12), torch.randn(B, 5, 12))
    reasons = [m["reason"] for m in report.near_misses]
    assert not report.matches and len(reasons) == 1 and "are empty" in reasons[0], reasons


def test_a_graph_that_fell_back_counts_no_match(monkeypatch):
    """A graph that fell back ran as captured, but explain's matches (and its headline, and
    tasks.require_lowered, and the bench's lowering check) counted its region as replaced (a
    review's: require_lowered passed on eager's code)."""
    from mha_compile import backend
    from mha_compile.tasks import require_lowered

    def broken(gm, matches):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(backend, "rewrite", broken)
    torch.manual_seed(7)
    block = MHABlock(12, 3, 8, 3, 2)
    report = mha_compile.explain(block, *_inputs(4, 5))
    assert report.matches == [] and len(report.not_replaced) == 1 and "planted failure" in report.graphs[0].fallback
    assert "0 match(es) (1 more matched, not replaced: see the fallback)" in str(report).splitlines()[0], str(report)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="replaced no region of the block: fallback: RuntimeError: planted"):
        with require_lowered("the block"):
            torch.compile(block, backend="mha")(*_inputs(4, 5))


def test_a_report_of_many_nodes_stays_readable():
    """The covered nodes were one line (~2000 characters at E = 16, a review's); wrapped, every
    name whole."""
    torch.manual_seed(8)
    report = mha_compile.explain(MHABlock(12, 3, 8, 16, 2), *_inputs(4, 5))
    lines = str(report).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    covers "))
    covers = [lines[start]] + list(itertools.takewhile(lambda line: line.startswith("      "), lines[start + 1:]))
    assert len(report.matches) == 1 and len(covers) > 1 and max(len(line) for line in covers) <= 100, covers
    words = set(" ".join(covers).replace(",", " ").split())
    assert all(name in words for name in report.matches[0]["nodes"])


class _WithOptions(MHABlock):
    """A forward with a keyword of its own named `options`, as a user's model may have."""

    def forward(self, ctx, tok, options=None):
        out = super().forward(ctx, tok)
        return out * options["scale"] if options else out


def test_a_forward_s_own_options_keyword_reaches_the_forward():
    """explain took `options=` as the backend's whatever the forward was: a forward with a keyword
    `options` could not be explained with it (session 64's note). Now the forward's own keyword
    goes to the forward, the backend's through mha_options=, and `options=` stays the backend's
    for a forward that does not name it."""
    torch.manual_seed(5)
    block, inputs = _WithOptions(12, 3, 8, 3, 2), _inputs(4, 5)
    seen = []
    block.register_forward_hook(lambda module, args, kwargs, out: seen.append((kwargs, out)), with_kwargs=True)
    report = mha_compile.explain(block, *inputs, options={"scale": 3.0}, mha_options={"kernels": "reference"})
    assert len(report.matches) == 1 and report.graphs[0].options["kernels"] == "reference", str(report)
    assert seen[-1][0] == {"options": {"scale": 3.0}}
    torch.testing.assert_close(seen[-1][1], 3.0 * MHABlock.forward(block, *inputs))
    plain = MHABlock(12, 3, 8, 3, 2)
    assert mha_compile.explain(plain, *inputs, options={"kernels": "reference"}).graphs[0].options["kernels"] == "reference"
    with pytest.raises(ValueError, match="kernels"):
        mha_compile.explain(plain, *inputs, mha_options={"kernels": "fast"})


class _PrintInTheExpertLoop(torch.nn.Module):
    """A print() inside the loop over the experts: Dynamo skips the whole forward and runs it eagerly."""

    def __init__(self):
        super().__init__()
        from lowering.spellings import SpelledBlock
        self.block = SpelledBlock()

    def forward(self, ctx, tok):
        b = self.block
        x = b.merge_forward(ctx, b.pool_forward(tok)).reshape(-1, b.D)
        weight, index = b.route(x)
        out = torch.zeros_like(x)
        for e in range(b.E):
            if e == 1:
                print("expert 1")
            out = out + (weight * (index == e)).sum(-1, keepdim=True) * b.expert(e, x)
        return out.view(ctx.shape)


def test_a_break_that_made_dynamo_skip_the_frame_is_named():
    """Dynamo's reason for a skipped frame goes to its "unimplemented" counter, not "graph_break":
    explain listed no break, and its reason pointed at one (a review's)."""
    from lowering.spellings import inputs
    torch.manual_seed(0)
    report = mha_compile.explain(_PrintInTheExpertLoop().double(), *inputs(dtype=torch.float64))
    assert not report.matches
    assert len(report.graph_breaks) == 1 and "print" in report.graph_breaks[0], report.graph_breaks
    assert "skipped the frame" in report.graph_breaks[0]


class _ReluExperts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from lowering.spellings import SpelledBlock
        self.block = SpelledBlock()
        self.block._act = lambda u, gate_u=None: torch.relu(u)

    def forward(self, ctx, tok):
        return self.block(ctx, tok)


def test_an_expert_off_the_block_names_the_node_that_leaves_it():
    """ReLU experts (not one of the block's activations): the reason said only that the experts
    could not be read (a review's); it names the relu and what it reads now."""
    from lowering.spellings import inputs
    torch.manual_seed(0)
    report = mha_compile.explain(_ReluExperts().double(), *inputs(dtype=torch.float64))
    reasons = [m["reason"] for m in report.near_misses]
    assert not report.matches and any("(relu) on the expert's pre-activation" in r for r in reasons), reasons


def test_mha_dynamic_explains_a_dynamic_true_compile(monkeypatch):
    """mha_dynamic=True compiles as torch.compile(..., dynamic=True): an int k of the forward is then
    a value of the graph, which the op cannot take (before session 69 explain had no way to show it;
    its keywords all went to the model). The next explain, without it, matches again."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "lowering"))  # its `from spellings import`
    from test_graph_values import TopKArgument
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TopKArgument().double()
    ctx, tok = spelled_inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert len(mha_compile.explain(model, ctx, tok, 2).matches) == 1
    report = mha_compile.explain(model, ctx, tok, 2, mha_dynamic=True)
    reasons = [miss["reason"] for miss in report.near_misses]
    assert not report.matches and len(reasons) == 1 and "top-k's k is " in reasons[0], str(report)
    assert len(mha_compile.explain(model, ctx, tok, 2).matches) == 1


class _BreakInside(torch.nn.Module):
    """A graph break inside a submodule's forward: that forward is a frame of its own, on the
    model's code, where each explain adds an entry (README: not fixed, torch cannot drop one)."""

    def __init__(self):
        super().__init__()
        self.block = MHABlock(12, 3, 8, 3, 2)

    def forward(self, ctx, tok):
        torch._dynamo.graph_break()
        return self.block(ctx, tok)


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _BreakInside()

    def forward(self, ctx, tok):
        return self.inner(ctx * 1.0, tok) + 0


def test_explain_past_the_recompile_limit_says_so():
    """Past the limit, Dynamo runs the submodule's frame eagerly and explain saw no block: its note
    said none was found, "nor anything close" (a review's), where the cause is the limit."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Outer()
    notes = [mha_compile.explain(model, *_inputs(4, 5)).note for _ in range(10)]
    assert notes[:8] == [""] * 8, notes
    for note in notes[8:]:  # Dynamo's counter tells the first time only: the frame's entries tell every time
        assert "recompile limit on _BreakInside.forward" in note and "torch._dynamo.reset()" in note, notes
    torch._dynamo.reset()
    assert mha_compile.explain(model, *_inputs(4, 5)).note == ""
