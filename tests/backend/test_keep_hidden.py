"""options["keep_hidden"]: the fused kernels keep the experts' pre-activations u = x W1 + b1 from the
forward for the backward. The option must reach the kernels on every path (the op, RegionFunction,
the backend's rewrite), hold what the fake says it holds, and change no result beyond the order
of the same sums; where it cannot apply (swiglu, the reference path) it keeps nothing and says so."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mha_compile
from mha_compile import backend, models, ops
from mha_compile.kernels import triton_moe
from numerics import assert_close_rel, needs_interpreter, relative_error

def _spy_keep_u(monkeypatch):
    """The KEEP_U each launch of GEMM1 (_up) and of the hidden kernel (_hidden) was given."""
    seen = {"_up": [], "_hidden": []}
    for name, calls in seen.items():
        real = getattr(triton_moe, name)
        monkeypatch.setattr(triton_moe, name, lambda *a, real=real, calls=calls, **kw: calls.append(kw["KEEP_U"])
                            or real(*a, **kw))
    return seen


def _tensors(act="gelu", seed=0, B=2, H=3, N=5, D=16, P=2, F=24, E=3):
    torch.manual_seed(seed)
    block = models.MHABlock(D, P, F, E, 2, act=act, renorm=True)
    ctx = torch.randn(B, H, D, requires_grad=True)
    tok = torch.randn(B, N, D, requires_grad=True)
    return [ctx, tok, *models.block_parameters(block)]


def _run(call, tensors, act, keep_hidden, seed=1):
    """(outputs, gradients of every present tensor) of one region call with keep_hidden."""
    outputs = call(tensors, act, keep_hidden)
    torch.manual_seed(seed)
    leaves = [t for t in tensors if t is not None]
    return outputs, torch.autograd.grad(outputs[0], leaves, torch.randn_like(outputs[0]))


def _op(tensors, act, keep_hidden):
    return ops.region(*tensors, None, 2, True, act, "fused", False, keep_hidden=keep_hidden)


def _function(tensors, act, keep_hidden):
    return ops.RegionFunction.apply(*tensors, None, 2, True, act, "fused", False, "off", keep_hidden)


@needs_interpreter
@pytest.mark.parametrize("call", [_op, _function], ids=["op", "RegionFunction"])
def test_keep_hidden_reaches_the_kernels_and_changes_no_result(monkeypatch, call):
    """Through the op and through RegionFunction: with keep_hidden every GEMM1 writes u and every
    hidden kernel reads it (KEEP_U), `reuse` holds S·F more fp32 values (what the fake says too),
    and the output and every gradient are the recomputing path's to fp32's bound; without it
    nothing is kept."""
    tensors = _tensors()
    seen = _spy_keep_u(monkeypatch)
    (kept_outputs, kept_grads) = _run(call, tensors, "gelu", True)
    assert seen["_up"] and seen["_hidden"] and set(seen["_up"]) == set(seen["_hidden"]) == {True}
    seen["_up"].clear(), seen["_hidden"].clear()
    (outputs, grads) = _run(call, tensors, "gelu", False)
    assert set(seen["_up"]) == set(seen["_hidden"]) == {False}
    slots = triton_moe.slot_count(2 * 3 * 2, 3)
    assert kept_outputs[6].numel() - outputs[6].numel() == slots * 24  # fp32 u: one int32 a value
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = ops.region(*tensors, None, 2, True, "gelu", "fused", False, keep_hidden=True)
    assert fake[6].shape == kept_outputs[6].shape
    assert_close_rel(kept_outputs[0], outputs[0], torch.float32, "out")
    names = [n for n, t in zip(ops.REGION_INPUTS, tensors) if t is not None]
    for name, got, want in zip(names, kept_grads, grads):
        assert name == "bk" or want.abs().max() > 0, f"∂{name} is zero: the comparison would be vacuous"
        assert relative_error(got, want) <= 1e-5, f"∂{name}"


@needs_interpreter
def test_swiglu_keeps_nothing():
    """swiglu would have to keep u3 too: keep_hidden leaves its `reuse` as it was, and the report
    says why."""
    tensors = _tensors(act="swiglu")
    kept, plain = _op(tensors, "swiglu", True), _op(tensors, "swiglu", False)
    assert kept[6].numel() == plain[6].numel() and torch.equal(kept[0], plain[0])
    block = models.MHABlock(16, 2, 24, 3, 2, act="swiglu")
    report = mha_compile.explain(block, torch.randn(2, 3, 16), torch.randn(2, 5, 16),
                                 options={"kernels": "fused", "keep_hidden": True})
    assert report.matches[0]["kernels"] == "fused"
    assert report.matches[0]["keep_hidden"] == "no: not with swiglu (its u3 would have to be kept too)"


@needs_interpreter
def test_the_backend_passes_it_to_the_region_and_trains_as_eager(monkeypatch):
    """options={"keep_hidden": True}: the rewritten graph's region carries it, the report says what
    is kept, the kernels keep u, and the compiled step's output and every parameter's gradient
    are the eager block's (fp32), each parameter's nonzero."""
    torch.manual_seed(0)
    block = models.MHABlock(16, 2, 24, 3, 2)
    ctx, tok = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    seen = _spy_keep_u(monkeypatch)
    lowered, reports = [], []
    monkeypatch.setattr(backend, "observers", [lambda report, gm, new: reports.append(report) or lowered.append(new)])
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="mha", options={"kernels": "fused", "keep_hidden": True})
    out = compiled(ctx, tok)
    out.square().sum().backward()
    got = {name: p.grad.clone() for name, p in block.named_parameters()}
    block.zero_grad()
    want_out = block(ctx, tok)
    want_out.square().sum().backward()
    torch._dynamo.reset()
    (region,) = [n for n in lowered[0].graph.nodes if n.target is torch.ops.mha.region.default]
    assert region.kwargs.get("keep_hidden") is True
    assert reports[0].matches[0]["keep_hidden"].startswith("yes (keep_hidden=True): u [")
    assert "keeps u: yes" in str(reports[0])
    assert seen["_up"] and set(seen["_up"]) == set(seen["_hidden"]) == {True}
    assert_close_rel(out, want_out, torch.float32, "out")
    for name, p in block.named_parameters():
        if name == "pool.key.bias":  # ∂bk is exactly zero (SPEC §1); eager's is rounding
            assert got[name].abs().max() == 0
            continue
        assert p.grad.abs().max() > 0, f"∂{name} is zero"
        assert_close_rel(got[name], p.grad, torch.float32, f"∂{name}")


def test_off_by_default_and_said_in_the_report():
    """Without the option the region keeps nothing, and explain says why."""
    assert mha_compile.Options().keep_hidden is False
    block = models.MHABlock(16, 2, 24, 3, 2)
    report = mha_compile.explain(block, torch.randn(2, 3, 16), torch.randn(2, 5, 16))
    assert report.matches[0]["keep_hidden"].startswith("no: ")
    assert "keeps u: no" in str(report)
