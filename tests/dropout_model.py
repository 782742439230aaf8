"""The block behind dropout, for the step graphs' tests on the CPU and the GPU."""
import torch


class DroppedTokens(torch.nn.Module):
    """The block on tok after dropout; the dropped tok returned beside the block's output, so a
    test can check the mask each step and the gradients of the block on that dropped tok."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, ctx, tok):
        dropped = torch.nn.functional.dropout(tok, 0.5, training=self.training)
        return self.block(ctx, dropped), dropped
