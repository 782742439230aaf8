"""options["verify"] on the GPU, bf16, the fused kernels: a right rewrite is kept (measured against
the captured graph run in fp32, mha_compile/verify.py), a wrong one falls back."""
import copy
import logging

import pytest
import torch

from mha_compile import models, ops
from normed_model import NormedContext
from numerics import compiled_reports, relative_error

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# fp32 through the fused kernels' tf32x3 / split dots against eager's fp32 (SPEC §4: ≤ 5e-4)
FP32_BOUND = 5e-4


def _first_call_report(seed):
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = models.MHABlock(256, 8, 512, 8, 2).cuda().to(torch.bfloat16)
    ctx = torch.randn(256, 8, 256, device="cuda", dtype=torch.bfloat16)
    tok = torch.randn(256, 32, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with compiled_reports() as reports:
        compiled = torch.compile(model, backend="mha", options={"verify": True, "kernels": "fused"})
        compiled(ctx, tok).float().square().mean().backward()
    (report,) = reports
    return report


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verify_keeps_the_fused_bf16_rewrite(caplog, seed):
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        report = _first_call_report(seed)
    assert len(report.matches) == 1 and report.fallback is None, report.fallback


def test_verify_falls_back_from_a_wrong_fused_output(monkeypatch):
    right = ops._forward

    def wrong(*args, **kwargs):
        out, *rest = right(*args, **kwargs)
        return (out * 1.2, *rest)

    monkeypatch.setattr(ops, "_forward", wrong)
    report = _first_call_report(0)
    assert report.fallback is not None and "output 0" in report.fallback


@pytest.mark.parametrize("options", [{}, {"step_graphs": False}], ids=["step_graphs", "trees"])
def test_verify_under_reduce_overhead_writes_the_buffers_once(options):
    """verify's first call under mode="reduce-overhead" (the step graphs refuse a graph that writes
    an input and leave it to torch's trees), then two replayed steps: the BatchNorm's running
    statistics and the counter are eager's after each step, and so are outputs and gradients."""
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = NormedContext(models.MHABlock(128, 4, 256, 8, 2), 8).cuda()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="mha", options={"verify": True, "mode": "reduce-overhead", **options})
    for step in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        gen = torch.Generator("cuda").manual_seed(40 + step)
        ctx = torch.randn(32, 8, 128, device="cuda", generator=gen)
        tok = torch.randn(32, 16, 128, device="cuda", generator=gen)
        outs = []
        for net in (compiled, eager):
            out = net(ctx, tok)
            out.square().mean().backward()
            outs.append(out.detach().clone())
        assert relative_error(outs[0], outs[1]) <= FP32_BOUND, f"step {step} output"
        assert int(model.calls) == int(eager.calls) == step + 1
        assert torch.equal(model.norm.num_batches_tracked, eager.norm.num_batches_tracked), f"step {step}"
        for name in ("running_mean", "running_var"):
            assert relative_error(getattr(model.norm, name), getattr(eager.norm, name)) <= 1e-6, f"step {step} {name}"
        for (name, got), want in zip(model.named_parameters(), eager.parameters()):
            if not name.endswith("key.bias"):  # exactly zero by the math, roundoff in eager's (SPEC §1)
                assert relative_error(got.grad, want.grad) <= FP32_BOUND, f"step {step} ∂{name}"
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
