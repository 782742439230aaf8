"""mode="reduce-overhead" through whole_graph.capture on the GPU: training under the whole-graph
CUDA graphs must follow the plain compiled step, with the parameters copied before each replay
(Dynamo's backend as it is) or read in place (STATIC_PARAMS), through SGD's in-place updates
and through a parameter whose storage is replaced between steps (the graphs must then read it
where it now is)."""
import pytest
import torch

from mha_compile import models, whole_graph

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _train(mode, steps=5, move_at=3):
    """Losses and final parameters of `steps` SGD steps of a bf16 block compiled with backend="mha"
    under `mode`; before step `move_at` W1's storage is replaced by a scaled copy."""
    torch._dynamo.reset()
    torch.manual_seed(5)
    model = models.MHABlock(128, 4, 256, 8, 2, act="gelu", renorm=True).cuda().to(torch.bfloat16)
    compiled = torch.compile(model, backend="mha", mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        if step == move_at:
            with torch.no_grad():
                model.moe.w1.data = model.moe.w1.data * 0.5  # new storage, same Parameter
        torch.compiler.cudagraph_mark_step_begin()
        gen = torch.Generator("cuda").manual_seed(100 + step)
        ctx = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        tok = torch.randn(64, 24, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        loss = compiled(ctx, tok).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("static_params", [False, True])
def test_reduce_overhead_trains_as_the_plain_step(monkeypatch, static_params):
    monkeypatch.setattr(whole_graph, "STATIC_PARAMS", static_params)
    plain_losses, plain_params = _train(None)
    graphed_losses, graphed_params = _train("reduce-overhead")
    # the same kernels in the same order; a stale parameter (the moved W1, or one read before its
    # update) would change the losses by far more than this
    torch.testing.assert_close(torch.tensor(graphed_losses), torch.tensor(plain_losses), rtol=1e-4, atol=0)
    for got, want in zip(graphed_params, plain_params):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
