"""The block behind a BatchNorm and a call counter, buffers a training call writes in place: verify's
tests on the CPU and the GPU and explain's share it."""
import torch


class NormedContext(torch.nn.Module):
    """The block on a BatchNorm of ctx (over horizons), whose running statistics a training call
    writes in place, and a step counter of its own (a buffer bumped each call)."""

    def __init__(self, block, horizons):
        super().__init__()
        self.norm, self.block = torch.nn.BatchNorm1d(horizons), block
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, ctx, tok):
        self.calls += 1
        return self.block(self.norm(ctx), tok)
