"""In-place ops on the region's output on the GPU, in the model's forward (`out += ctx`) and by the
caller on the compiled model's output, under every way the fused kernels run: plain, the region's
own CUDA graphs, and mode="reduce-overhead" (its step graphs and torch's trees) with the pool
inside the graphs and outside. Autograd
refused them (the output was a view made inside the region's Function: tests/backend/
test_backend_e2e.py's CPU tests); here they must train as eager does, in fp32 against fp32."""
import copy

import pytest
import torch

from inplace_model import ResidualInPlace
from mha_compile import models, whole_graph
from numerics import relative_error

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# fp32 through the fused kernels' tf32x3 / split dots against eager's fp32 (SPEC §4: ≤ 5e-4)
BOUND = 5e-4


@pytest.mark.parametrize("options, outside", [
    ({"kernels": "fused", "graphs": "off"}, False),
    ({"kernels": "fused", "graphs": "on"}, False),
    ({"kernels": "fused", "mode": "reduce-overhead"}, False),  # mha_compile's step graphs (the default)
    ({"kernels": "fused", "mode": "reduce-overhead"}, True),
    ({"kernels": "fused", "mode": "reduce-overhead", "step_graphs": False}, False),  # torch's trees
    ({"kernels": "fused", "mode": "reduce-overhead", "step_graphs": False}, True),
])
def test_in_place_ops_on_the_regions_output_train_like_eager(monkeypatch, options, outside):
    monkeypatch.setattr(whole_graph, "POOL_OUTSIDE", outside)
    monkeypatch.setattr(whole_graph, "POOL_OUTSIDE_MIN_BYTES", 0)
    torch._dynamo.reset()
    torch.manual_seed(7)
    model = ResidualInPlace(models.MHABlock(128, 4, 256, 8, 2, act="silu")).cuda()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="mha", options=options)
    for step in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        gen = torch.Generator("cuda").manual_seed(300 + step)
        ctx = torch.randn(32, 8, 128, device="cuda", generator=gen)
        tok = torch.randn(32, 24, 128, device="cuda", generator=gen)
        outs = []
        for net in (compiled, eager):
            out = net(ctx, tok)
            out.add_(1.0)  # the caller's own in-place op on what the model returned
            out.square().mean().backward()
            outs.append(out.detach().clone())
        assert relative_error(outs[0], outs[1]) <= BOUND, f"step {step} output"
        for (name, got), want in zip(model.named_parameters(), eager.parameters()):
            if name.endswith("key.bias"):
                assert got.grad.abs().max() == 0, name  # exactly zero by the math (SPEC §1)
                continue
            assert relative_error(got.grad, want.grad) <= BOUND, f"step {step} ∂{name}"
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)


@pytest.mark.parametrize("options", [
    {"kernels": "fused", "graphs": "off"},
    {"kernels": "fused", "graphs": "on"},
    {"kernels": "fused", "mode": "reduce-overhead", "step_graphs": False},
    {"kernels": "fused", "mode": "reduce-overhead"},
    {"kernels": "fused", "rest": "inductor"},
], ids=["plain", "region_graphs", "trees", "step_graphs", "inductor"])
def test_a_callers_residual_into_ctx_trains_like_eager(options):
    """`h += block(h, tok)` by the caller, h its own activation (a non-leaf) at one address every
    step, the block compiled alone: the op keeps a copy of ctx (Match.copied), the CUDA graphs'
    first calls included (they run on the caller's h), and the step graphs copy h in rather than
    read it in place. Eager keeps none of ctx; each way must train as it does, no
    "modified by an inplace operation" raised."""
    torch._dynamo.reset()
    torch.manual_seed(11)
    model = models.MHABlock(128, 4, 256, 8, 2, act="silu").cuda()
    lin = torch.nn.Linear(128, 128).cuda()
    eager = copy.deepcopy(model)
    runs = []
    for net, block in ((torch.compile(model, backend="mha", options=options), model), (eager, eager)):
        store = torch.zeros(32, 8, 128, device="cuda")  # h lies here every step
        lin_copy = copy.deepcopy(lin)
        params = [*block.parameters(), *lin_copy.parameters()]
        opt = torch.optim.SGD(params, lr=0.1)
        losses = []
        for step in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            gen = torch.Generator("cuda").manual_seed(400 + step)
            ctx = torch.randn(32, 8, 128, device="cuda", generator=gen)
            tok = torch.randn(32, 24, 128, device="cuda", generator=gen)
            h = store.detach().copy_(lin_copy(ctx))
            h += net(h, tok)
            loss = h.square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        runs.append((losses, [p.detach().clone() for p in params]))
    (losses, params), (eager_losses, eager_params) = runs
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=BOUND, atol=0)
    for got, want in zip(params, eager_params):
        assert relative_error(got, want) <= BOUND
