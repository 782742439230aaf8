"""The grouped-GEMM peer computes the same block as MHABlock, forward and backward."""
import pytest
import torch

from bench.grouped_mm_moe import GroupedMMBlock, available
from mha_compile.models import MHABlock


def _grads(model, ctx, tok, grad_out, params):
    out = model(ctx, tok)
    return out, torch.autograd.grad(out, [ctx, tok, *params], grad_out)


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_mm_matches_block(act, bias):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    torch.manual_seed(1)
    # odd sizes where _grouped_mm allows (its strides must be multiples of 16 bytes)
    block = MHABlock(dim=32, heads=4, hidden=48, experts=5, top_k=2, act=act, bias=bias)
    ctx = torch.randn(3, 7, 32, requires_grad=True)
    tok = torch.randn(3, 11, 32, requires_grad=True)
    params = list(block.parameters())
    out, grads = _grads(block, ctx, tok, grad_out := torch.randn(3, 7, 32), params)
    got, got_grads = _grads(GroupedMMBlock(block), ctx, tok, grad_out, params)
    assert (got - out).norm() / out.norm() < 1e-5
    scale = max(g.norm() for g in grads)
    for ref, g in zip(grads, got_grads):
        # ∂bk is exactly zero in math (SPEC §1): compare it against the overall scale
        assert (g - ref).norm() / max(ref.norm(), 1e-3 * scale) < 1e-5


def test_availability_says_why():
    assert "CUDA bf16" in available("cpu", torch.float32) or not hasattr(torch, "_grouped_mm")
