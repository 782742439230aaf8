"""A few SGD steps of a small bf16 block compiled with backend="mha", on the GPU: the training
loop the GPU tests of the region's graphs and of mode="reduce-overhead" compare runs with."""
import torch

from mha_compile import models


def block():
    """The block those tests train: D 128, 4 heads, F 256, 8 experts, top-2, bf16 on CUDA."""
    torch.manual_seed(5)
    return models.MHABlock(128, 4, 256, 8, 2, act="gelu", renorm=True).cuda().to(torch.bfloat16)


def train(model, options=None, mode=None, steps=4, before_step=None):
    """(losses, final parameters) of `steps` SGD steps (lr 0.1) on fresh seeded inputs each step;
    before_step(step, model), when given, runs before each step's forward."""
    torch.manual_seed(0)
    compiled = torch.compile(model, backend="mha", options=options, mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        if before_step is not None:
            before_step(step, model)
        torch.compiler.cudagraph_mark_step_begin()
        gen = torch.Generator("cuda").manual_seed(100 + step)
        ctx = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        tok = torch.randn(64, 24, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        loss = compiled(ctx, tok).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]
