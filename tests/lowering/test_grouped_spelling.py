"""The MoE spelled as grouped GEMMs over the (row, slot) pairs sorted by expert (torch._grouped_mm):
one match, and the output and every gradient against the block's math in float64 (SPEC §4's bf16
bound: Dynamo's fake _grouped_mm takes bf16 only). Near-misses: no match, a reason, eager's
result."""
import copy

import pytest
import torch

from numerics import compiled_reports, relative_error
from spellings import GroupedMM, TransformersMoE, inputs

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"),
                                reason=f"torch {torch.__version__} has no _grouped_mm")

BF16 = 2e-2  # SPEC §4: bf16 against the reference on the same rounded inputs and parameters


def _observed(run):
    with compiled_reports() as reports:
        torch._dynamo.reset()
        return run(), reports


def compile_against_math(model, B=4, H=3, N=5, seed=1, options=None, device="cpu", dynamic_output=False):
    """Compile a bf16 copy on `device` with backend="mha" (strict: a failed rewrite raises);
    compare its output and every parameter's and input's gradient with the loop spelling in
    float64 on the same bf16 parameters and inputs. Returns the match."""
    model = model.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    ctx, tok = inputs(B, H, N, model.D, dtype=torch.bfloat16, generator=gen)
    compiled = copy.deepcopy(model).to(device)
    ctx_c, tok_c = ctx.to(device, copy=True).requires_grad_(), tok.to(device, copy=True).requires_grad_()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=dynamic_output):
        out, reports = _observed(lambda: torch.compile(compiled, backend="mha",
                                                       options={"strict": True, **(options or {})})(ctx_c, tok_c))
    matches = [m for r in reports for m in r.matches]
    assert len(matches) == 1 and not [m for r in reports for m in r.near_misses], [str(r) for r in reports]
    math = model.math_block()
    ctx_m, tok_m = ctx.double().requires_grad_(), tok.double().requires_grad_()
    want = math(ctx_m, tok_m)
    assert out.dtype == torch.bfloat16 and relative_error(out.cpu(), want) <= BF16, relative_error(out.cpu(), want)
    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    out.backward(grad.to(device, torch.bfloat16))
    want.backward(grad)
    reference = dict(math.named_parameters())
    for name, p in compiled.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0 or name == "key.bias", f"∂{name}: none"
        if name == "key.bias":  # SPEC §1: exactly zero
            assert torch.count_nonzero(p.grad) == 0
            continue
        got = (p.grad.transpose(1, 2) if model.stored_t and name in ("w1", "w2") else p.grad).cpu()
        error = relative_error(got, reference[name].grad)
        assert error <= BF16, f"∂{name}: {error:.3g}"
    for got, ref in ((ctx_c, ctx_m), (tok_c, tok_m)):
        assert relative_error(got.grad.cpu(), ref.grad) <= BF16
    return matches[0]


VARIANTS = [dict(), dict(sort="sort"), dict(select="index_select"), dict(rows="div"), dict(gate="unsqueeze"),
            dict(offs="left"), dict(offs="other_sort"), dict(offs="onehot"), dict(offs="histc"), dict(offs="scatter", sort="sort"), dict(inplace=True),
            dict(inplace="scatter_add_"), dict(stored_t=True), dict(act="gelu_tanh"), dict(act="silu"),
            dict(act="swiglu", bias=False), dict(act="swiglu", fused=True), dict(renorm=False), dict(topk_logits=True), dict(E=5, k=3, F_=48)]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) or "plain")
def test_grouped_spelling_matches_once_and_equals_the_math(variant):
    torch.manual_seed(0)
    match = compile_against_math(GroupedMM(**variant))
    assert match["config"] == {"top_k": variant.get("k", 2), "act": variant.get("act", "gelu"),
                               "renorm": variant.get("renorm", True) or variant.get("topk_logits", False)}
    assert (match["params"]["b1"] is None) == (variant.get("bias", True) is False)
    assert ("permute" in match["params"]["w1"]) == variant.get("stored_t", False), match["params"]["w1"]


def test_grouped_spelling_with_bincount_offsets():
    """offs = bincount(flat, minlength=E).cumsum(0): one graph only with capture_dynamic_output_shape_ops
    (bincount's size depends on the data; the near-miss of the split graphs says to set it)."""
    torch.manual_seed(0)
    match = compile_against_math(GroupedMM(offs="bincount"), dynamic_output=True)  # output, gradients
    assert "bincount" in match["nodes"]  # the counts are the region's, replaced with it


def test_grouped_spelling_one_expert_a_row():
    """k = 1: the flat pairs are the rows themselves (order // 1)."""
    torch.manual_seed(0)
    match = compile_against_math(GroupedMM(k=1, renorm=False))
    assert match["config"]["top_k"] == 1


def test_grouped_spelling_in_bf16_on_the_interpreter_takes_the_reference_path():
    """kernels="fused" asked for in bf16 on the CPU: Triton's interpreter multiplies bf16 dots as raw
    bits (the region's output came out at ~1e10), so the report says why and the math holds
    (test_grouped_spelling_cuda.py runs the fused kernels from this spelling on the GPU)."""
    from mha_compile.kernels import triton_util
    if not triton_util.interpreting():
        pytest.skip("the fused kernels run on the CPU only under TRITON_INTERPRET=1")
    torch.manual_seed(0)
    match = compile_against_math(GroupedMM(), B=2, H=3, N=4, options={"kernels": "fused"})
    assert match["kernels"] == "reference" and "triton-lang/triton#11584" in match["kernels_reason"]


class Miswired(GroupedMM):
    """The grouped spelling with one step wrong, as each near-miss below sets: rows as order //
    (k + rows_extra) (in range, but other rows'); offsets searched over arange(offs_from, E +
    offs_from), right=True (from 1: each group ends where the next expert's does, every row still
    covered); the gates in the pairs' own order, not the sorted one; the pairs sorted descending,
    the offsets searched as if ascending; histc_max: the counts from histc over [0, histc_max]
    (2E: bins two experts wide, so the groups are not the experts')."""

    def __init__(self, rows_extra=0, offs_from=0, gates_sorted=True, descending=False, histc_max=None):
        super().__init__()
        self.rows_extra, self.offs_from, self.histc_max = rows_extra, offs_from, histc_max
        self.gates_sorted, self.descending = gates_sorted, descending

    def moe_forward(self, y):
        shape = y.shape
        x = y.reshape(-1, shape[-1])
        weight, index = self.route(x)
        flat = index.reshape(-1)
        order = flat.argsort(descending=self.descending)
        expert, rows = flat[order], order // (self.k + self.rows_extra)
        span = torch.arange(self.offs_from, self.E + self.offs_from)
        offs = torch.searchsorted(expert, span, right=True).to(torch.int32)
        if self.histc_max is not None:
            offs = torch.histc(flat.float(), bins=self.E, min=0, max=self.histc_max).cumsum(0).to(torch.int32)
        f = torch._grouped_mm(self._act(torch._grouped_mm(x[rows], self.w1, offs=offs) + self.b1[expert]), self.w2,
                              offs=offs) + self.b2[expert]
        gates = weight.reshape(-1)[order, None] if self.gates_sorted else weight.reshape(-1)[:, None]
        return torch.zeros_like(x).index_add(0, rows, f * gates).reshape(shape)


NEAR_MISSES = {
    "rows of another k": (dict(rows_extra=1), "order // 3"),
    "offsets shifted by one expert": (dict(offs_from=1), "not each expert's end"),
    "gates not in the sorted order": (dict(gates_sorted=False), "could not be read"),
    "sorted in descending order": (dict(descending=True), "descending"),
    "counts in bins two experts wide": (dict(histc_max=8), "in a bin of its own"),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_grouped_near_miss_is_reported_and_not_rewritten(name):
    wrong, needle = NEAR_MISSES[name]
    torch.manual_seed(0)
    model = Miswired(**wrong).to(torch.bfloat16)
    ctx, tok = inputs(dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    got, reports = _observed(lambda: torch.compile(copy.deepcopy(model), backend="mha")(ctx, tok))
    assert not any(r.matches for r in reports)
    misses = [m for r in reports for m in r.near_misses]
    assert misses and any(needle in m["reason"] for m in misses), misses
    assert relative_error(got, model(ctx, tok)) <= 1e-6  # the graph as captured: eager's own result


def test_transformers_grouped_mm_experts_match_the_math():
    """transformers' grouped_mm experts: x[pair rows][order] into the grouped GEMMs, histc of the
    sorted experts with max=E-1, W13 chunked, the outputs put back by argsort(order) (the inverse
    sort) and added by index_add_ over the pairs' rows: one match, and the output and every
    gradient against its loop over range(E) in float64 on the same bf16 parameters and inputs."""
    torch.manual_seed(0)
    model = TransformersMoE(impl="grouped_mm").to(torch.bfloat16)
    ctx, tok = inputs(4, 3, 5, model.D, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    compiled = copy.deepcopy(model)
    args_c = [ctx.clone().requires_grad_(), tok.clone().requires_grad_()]
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        (out, logits), reports = _observed(lambda: torch.compile(compiled, backend="mha",
                                                                 options={"strict": True})(*args_c))
    assert [len(r.matches) for r in reports] == [1] and not reports[0].near_misses, [str(r) for r in reports]
    math = TransformersMoE(impl="loop").double()
    math.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    args_m = [ctx.double().requires_grad_(), tok.double().requires_grad_()]
    want, want_logits = math(*args_m)
    assert relative_error(out, want) <= BF16 and relative_error(logits, want_logits) <= BF16
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out.backward(grad.to(torch.bfloat16))
    want.backward(grad)
    for (name, p), p_m in zip(compiled.named_parameters(), math.parameters()):
        if name == "key.bias":  # SPEC §1: exactly zero
            assert torch.count_nonzero(p.grad) == 0
            continue
        assert relative_error(p.grad, p_m.grad) <= BF16, (name, relative_error(p.grad, p_m.grad))
    for a, a_m in zip(args_c, args_m):
        assert relative_error(a.grad, a_m.grad) <= BF16


def test_transformers_grouped_mm_put_back_by_the_sort_itself_is_not_replaced():
    """The grouped outputs put back by the sort instead of its inverse: not the block (the pairs
    land on other rows), so no match, and eager's result."""
    torch.manual_seed(0)
    model = TransformersMoE(impl="grouped_mm", wrong="back").to(torch.bfloat16)
    ctx, tok = inputs(4, 3, 5, model.D, dtype=torch.bfloat16)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        (out, _), reports = _observed(lambda: torch.compile(copy.deepcopy(model), backend="mha")(ctx, tok))
    assert not any(r.matches for r in reports) and any(r.near_misses for r in reports)
    assert torch.equal(out, model(ctx, tok)[0])
