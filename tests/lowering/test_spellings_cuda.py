"""Spellings whose parameters reach the kernels as views (transformers' gate_up_proj [E, 2F, D]
split in columns and read transposed, a fused W13 gathered by the top-k indices) on the GPU: matched,
run on the fused and the staged kernels in bf16, output and every gradient against the same
spelling in float64 on the same bf16-rounded parameters and inputs (SPEC §4)."""
import copy

import pytest
import torch

from numerics import compiled_reports, relative_error
from spellings import FusedGateUp, TransformersMoE, inputs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = 2e-2  # SPEC §4
DEVICE = "cuda"


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("make", [lambda: TransformersMoE(), lambda: FusedGateUp(stored="linear", moe="gathered"),
                                  lambda: FusedGateUp(stored="edf", moe="mixtral", up_first=True)],
                         ids=["transformers", "gathered_linear", "mixtral_up_first"])
@pytest.mark.parametrize("kernels", ["fused", "staged"])
def test_split_gate_up_on_the_gpu_kernels(make, kernels):
    torch.manual_seed(0)
    model = make().to(torch.bfloat16)
    ctx, tok = inputs(8, 5, 7, model.D, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    compiled = copy.deepcopy(model).to(DEVICE)
    args_c = [ctx.to(DEVICE, copy=True).requires_grad_(), tok.to(DEVICE, copy=True).requires_grad_()]
    with compiled_reports() as reports:
        torch._dynamo.reset()
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            got = _first(torch.compile(compiled, backend="mha", options={"strict": True, "kernels": kernels})(*args_c))
    matches = [m for r in reports for m in r.matches]
    assert len(matches) == 1 and matches[0]["kernels"] == kernels, [str(r) for r in reports]
    math = copy.deepcopy(model).double()
    args_m = [ctx.double().requires_grad_(), tok.double().requires_grad_()]
    want = _first(math(*args_m))
    assert got.dtype == torch.bfloat16 and relative_error(got.cpu(), want) <= BF16, relative_error(got.cpu(), want)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got.backward(grad.to(DEVICE, torch.bfloat16))
    want.backward(grad)
    for (name, p), p_m in zip(compiled.named_parameters(), math.parameters()):
        if name == "key.bias":  # SPEC §1: exactly zero
            assert torch.count_nonzero(p.grad) == 0
            continue
        assert p.grad is not None and relative_error(p.grad.cpu(), p_m.grad) <= BF16, name
    for a, a_m in zip(args_c, args_m):
        assert relative_error(a.grad.cpu(), a_m.grad) <= BF16
