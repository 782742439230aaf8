"""The MoE spelled as grouped GEMMs (torch._grouped_mm) on the GPU: matched, run on the fused kernels
(and under the region's CUDA graphs), output and every gradient against the math in float64."""
import pytest
import torch

from spellings import GroupedMM
from test_grouped_spelling import compile_against_math

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("variant", [dict(), dict(act="swiglu", bias=False), dict(stored_t=True, E=5, k=3, F_=48),
                                     dict(act="swiglu", fused=True, F_=48)],
                         ids=["plain", "swiglu", "stored_t", "swiglu_fused_w13"])
@pytest.mark.parametrize("kernels", ["fused", "staged"])
def test_grouped_spelling_on_the_gpu_kernels(variant, kernels):
    torch.manual_seed(0)
    match = compile_against_math(GroupedMM(**variant), B=8, H=5, N=7, options={"kernels": kernels}, device="cuda")
    assert match["kernels"] == kernels, match["kernels_reason"]
