"""Factories for `python -m mha_compile explain tests/debug/factory_script.py:<name>` in the CLI tests."""
import torch

from mha_compile import models


def make_block():
    torch.manual_seed(0)
    return models.MHABlock(32, 2, 64, 4, 2), (torch.randn(4, 3, 32), torch.randn(4, 5, 32))


def make_model_only():
    return models.MHABlock(32, 2, 64, 4, 2)


def make_single_input():
    return torch.nn.Linear(4, 4), torch.randn(2, 4)


class _Printing(models.MHABlock):
    def forward(self, ctx, tok):
        print("the model prints this")
        return super().forward(ctx, tok)


def make_printing():
    torch.manual_seed(0)
    return _Printing(32, 2, 64, 4, 2), (torch.randn(4, 3, 32), torch.randn(4, 5, 32))
