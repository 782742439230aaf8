"""options["verify"] on the GPU, bf16, the fused kernels: a right rewrite is kept (measured against
the captured graph run in fp32, mha_compile/verify.py), a wrong one falls back."""
import logging

import pytest
import torch

from mha_compile import models, ops
from numerics import compiled_reports

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


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
