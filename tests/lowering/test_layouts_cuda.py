"""Inputs the op takes as views on the GPU: tokens sequence-first ([N,B,D], transposed for the op),
ctx horizon-first ([H,B,D], likewise; the output transposed back), both at once, a latent query in
timm's order (a row of a broadcast tensor) and timm's fused K|V taken by index. Matched and run on
the fused and the staged kernels in bf16: output and every gradient against the same model in
float64 on the same bf16-rounded parameters and inputs (SPEC §4); and three training steps under
mode="reduce-overhead" (the step's own CUDA graphs) in fp32 against eager."""
import copy

import pytest
import torch

from numerics import compiled_reports, relative_error
from test_horizon_first_ctx import AllSequenceFirst, HorizonFirst
from test_latent_pools import LatentPool, TimmFusedKV
from test_seq_first_tokens import SeqFirst

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16, FP32 = 2e-2, 1e-4  # SPEC §4; fp32 against eager's fp32 over three steps of SGD
DEVICE = "cuda"
# name: (model, ctx horizon-first, tok sequence-first)
CASES = {
    "tok [N,B,D] mha": (lambda: SeqFirst("mha", 32, 2), False, True),
    "tok [N,B,D] einsum": (lambda: SeqFirst("einsum", 32, 2), False, True),
    "ctx [H,B,D]": (lambda: HorizonFirst("broadcast", moe="gathered"), True, False),
    "both": (lambda: AllSequenceFirst(), True, True),
    "timm latent": (lambda: LatentPool(True, True, "sdpa"), False, False),
    "timm kv[0], kv[1]": (lambda: TimmFusedKV("sdpa", take="index"), False, False),
}


def _args(B, H, N, D, dtype, ctx_first, tok_first):
    gen = torch.Generator().manual_seed(1)
    ctx, tok = torch.randn(B, H, D, generator=gen), torch.randn(B, N, D, generator=gen)
    ctx = ctx.transpose(0, 1).contiguous() if ctx_first else ctx
    tok = tok.transpose(0, 1).contiguous() if tok_first else tok
    return ctx.to(dtype), tok.to(dtype)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kernels", ["fused", "staged"])
def test_views_the_op_takes_on_the_gpu_kernels(case, kernels):
    make, ctx_first, tok_first = CASES[case]
    torch.manual_seed(0)
    model = make().to(torch.bfloat16)
    ctx, tok = _args(8, 5, 7, model.D, torch.bfloat16, ctx_first, tok_first)
    compiled = copy.deepcopy(model).to(DEVICE)
    args_c = [ctx.to(DEVICE, copy=True).requires_grad_(), tok.to(DEVICE, copy=True).requires_grad_()]
    with compiled_reports() as reports:
        torch._dynamo.reset()
        got = torch.compile(compiled, backend="mha", options={"strict": True, "kernels": kernels})(*args_c)
    matches = [m for r in reports for m in r.matches]
    assert len(matches) == 1 and matches[0]["kernels"] == kernels, [str(r) for r in reports]
    math = copy.deepcopy(model).double()
    args_m = [ctx.double().requires_grad_(), tok.double().requires_grad_()]
    want = math(*args_m)
    assert got.dtype == torch.bfloat16 and relative_error(got.cpu(), want) <= BF16, relative_error(got.cpu(), want)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got.backward(grad.to(DEVICE, torch.bfloat16))
    want.backward(grad)
    for (name, p), p_m in zip(compiled.named_parameters(), math.parameters()):
        if p_m.grad is None:  # a parameter the spelling leaves unused (SpelledBlock's own pool beside MHA)
            assert p.grad is None, name
        elif name == "key.bias":  # SPEC §1: exactly zero
            assert torch.count_nonzero(p.grad) == 0
        else:
            assert p.grad is not None and relative_error(p.grad.cpu(), p_m.grad) <= BF16, name
    for a, a_m in zip(args_c, args_m):
        assert relative_error(a.grad.cpu(), a_m.grad) <= BF16


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("case", ["tok [N,B,D] mha", "ctx [H,B,D]", "both"])
def test_views_the_op_takes_train_under_reduce_overhead(case, no_tf32):
    """Three SGD steps of the compiled model under mode="reduce-overhead" (the step replayed by
    CUDA graphs) against eager's, fp32, TF32 off: each step's output, and the parameters after them."""
    make, ctx_first, tok_first = CASES[case]
    torch.manual_seed(0)
    eager = make().to(DEVICE)
    mine = copy.deepcopy(eager)
    torch._dynamo.reset()
    runs = [(eager, torch.optim.SGD(eager.parameters(), lr=0.05)),
            (torch.compile(mine, backend="mha", mode="reduce-overhead"), torch.optim.SGD(mine.parameters(), lr=0.05))]
    with compiled_reports() as reports:
        for step in range(3):
            ctx, tok = (t.to(DEVICE) for t in _args(8, 5, 7, eager.D, torch.float32, ctx_first, tok_first))
            outs = []
            for run, optim in runs:
                optim.zero_grad()
                out = run(ctx, tok)
                outs.append(out.detach().clone())
                (out.square().mean() + out[..., 0].sum()).backward()
                optim.step()
            assert relative_error(outs[1], outs[0]) <= FP32, (step, relative_error(outs[1], outs[0]))
    assert sum(len(r.matches) for r in reports) >= 1, [str(r) for r in reports]
    for (name, p_e), p_c in zip(eager.named_parameters(), mine.parameters()):
        assert relative_error(p_c.detach(), p_e.detach()) <= FP32, name
