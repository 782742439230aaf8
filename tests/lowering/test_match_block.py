"""The matcher on the reference spellings, near-misses and graphs without the region."""
import copy
import operator

import pytest
import torch

from mha_compile import models
from mha_compile.lowering.match import find_regions
from near_misses import NEAR_MISSES
from numerics import graph_has_region, observing, relative_error


def capture_graphs(model, *inputs, dynamic=False):
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=grab, dynamic=dynamic)(*inputs)
    return graphs


def compile_with_reports(model, *inputs, **options):
    reports = []
    with observing(lambda report, gm, lowered: reports.append((report, lowered))):
        torch._dynamo.reset()
        outputs = torch.compile(model, backend="mha", options=options or None)(*inputs)
    return reports, outputs


def _inputs(B=4, H=3, N=5, D=32):
    return torch.randn(B, H, D), torch.randn(B, N, D)


@pytest.mark.parametrize("spelling", models.MOE_SPELLINGS)
@pytest.mark.parametrize("merge", models.MERGES)
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_reference_spellings_match_once(spelling, merge, act):
    model = models.MHABlock(32, 2, 64, 4, 2, act=act, spelling=spelling, merge=merge)
    (gm,) = capture_graphs(model, *_inputs())
    matches, misses = find_regions(gm)
    assert len(matches) == 1 and not misses
    match = matches[0]
    assert match.config == {"top_k": 2, "renorm": True, "act": act}
    covered = {n.name for n in match.nodes}
    assert {"topk", "attn", "probs"} <= covered
    assert (match.params["w3"] is not None) == (act == "swiglu")


def test_rewrite_replaces_the_ops_and_keeps_the_rest():
    """Ops present before and after (vLLM-style): softmax/topk/einsum gone, one mha.region in."""
    model = models.Forecaster(window=12, variates=5, horizons=3)
    reports, _ = compile_with_reports(model, torch.randn(4, 12, 5))
    (report, lowered), = reports
    targets = [str(n.target) for n in lowered.graph.nodes]
    assert graph_has_region(lowered) and len(report.matches) == 1
    assert not any("topk" in t or "softmax" in t for t in targets)
    assert any("layer_norm" in t for t in targets)  # the LayerNorm outside the region stays


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_misses_are_not_rewritten(name):
    make, reason = NEAR_MISSES[name]
    torch.manual_seed(0)
    model = make()
    B, H = 4, 3
    ctx, tok = torch.randn(B, H, 32), torch.randn(B, 5, 32)
    reports, got = compile_with_reports(copy.deepcopy(model), ctx, tok)
    assert not any(r.matches for r, _ in reports)
    misses = [m for r, _ in reports for m in r.near_misses]
    assert len(misses) == 1 and reason in misses[0]["reason"], misses
    want = model(ctx, tok)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert relative_error(g, w) <= 1e-6


def test_graph_without_region_is_untouched():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(3, 8)
    reports, got = compile_with_reports(model, x)
    (report, lowered), = reports
    assert not report.matches and not report.near_misses and report.code_after == report.code_before
    assert relative_error(got, model(x)) == 0.0


def test_dynamic_batch_still_matches():
    model = models.MHABlock(32, 2, 64, 4, 2)
    (gm,) = capture_graphs(model, *_inputs(), dynamic=True)
    symbolic = [n for n in gm.graph.find_nodes(op="placeholder") if isinstance(n.meta["example_value"], torch.SymInt)]
    assert symbolic, "the graph was expected to have symbolic sizes"
    matches, misses = find_regions(gm)
    assert len(matches) == 1 and not misses


def test_dunder_method_spellings_read_as_their_ops():
    """torch 2.11 records `index == e` as call_method "__eq__": the loop MoE must still match."""
    model = models.MHABlock(32, 2, 64, 4, 2, spelling="loop")
    (gm,) = capture_graphs(model, *_inputs())
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.eq:
            node.op, node.target = "call_method", "__eq__"
    gm.recompile()
    assert any(n.target == "__eq__" for n in gm.graph.nodes)
    matches, misses = find_regions(gm)
    assert len(matches) == 1 and not misses


class _PromotingMoE(models.TopKMoE):
    """The loop spelling without casting the fp32 router weights back: the output promotes to fp32."""

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weight, index = torch.topk(probs, self.top_k, dim=-1)
        weight = weight / weight.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            gate = (weight * (index == e)).sum(dim=-1, keepdim=True)
            out = out + gate * (torch.nn.functional.gelu(x @ self.w1[e] + self.b1[e]) @ self.w2[e] + self.b2[e])
        return out.reshape(shape)


def test_replacement_keeps_the_output_dtype_of_the_users_spelling():
    torch.manual_seed(0)
    model = models.MHABlock(32, 2, 64, 4, 2)
    model.moe = _PromotingMoE(32, 64, 4, 2)
    model = model.to(torch.bfloat16)
    ctx, tok = torch.randn(4, 3, 32, dtype=torch.bfloat16), torch.randn(4, 5, 32, dtype=torch.bfloat16)
    want = model(ctx, tok)
    reports, got = compile_with_reports(copy.deepcopy(model), ctx, tok)
    assert want.dtype == torch.float32 and len(reports[0][0].matches) == 1
    assert got.dtype == want.dtype
    assert relative_error(got, want) <= 2e-2  # SPEC §4 bf16 bound: the region computes from bf16 inputs
