"""Tokens sequence-first, [N,B,D]: nn.MultiheadAttention's default layout (batch_first=False), and
the einsum and SDPA pools written over it. Before, each was refused: the matcher read any token
tensor as [B,N,D], and the einsum pool's near-miss said its softmax ran over "the batch axis" (a
review's). The op takes the tokens transposed; output and every gradient are eager's."""
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from compiled_checks import assert_one_match, compile_and_compare
from numerics import needs_interpreter
from spellings import SpelledBlock

# (B, N, D, P): SPEC's tiny preset, odd sizes, as many tokens as batch rows (the axes' sizes
# cannot tell them apart), one batch row, one token
SIZES = {"tiny": (4, 5, 32, 2), "odd": (3, 7, 21, 3), "N=B": (4, 4, 32, 2), "B=1": (1, 5, 32, 2), "N=1": (4, 1, 32, 2)}


class SeqFirst(SpelledBlock):
    """The block with tok [N,B,D] and pad [B,N] (True = ignore, as key_padding_mask takes it)."""

    def __init__(self, pool, D, P):
        super().__init__(D=D, P=P, F_=13, E=5, k=2)
        self.seq_pool = pool
        if pool == "mha":  # batch_first left at its default, False
            self.attn, self.query = nn.MultiheadAttention(D, P), nn.Parameter(torch.randn(1, 1, D) / math.sqrt(D))

    def pool_forward(self, tok, pad=None):
        N, B, D = tok.shape
        P, Dh = self.P, self.Dh
        if self.seq_pool == "mha":
            return self.attn(self.query.expand(1, B, D), tok, tok, key_padding_mask=pad, need_weights=False)[0][0]
        k, v = self.key(tok).view(N, B, P, Dh), self.value(tok).view(N, B, P, Dh)
        if self.seq_pool == "einsum":
            scores = torch.einsum("pd,nbpd->bpn", self.query, k) / math.sqrt(Dh)
            if pad is not None:
                scores = scores.masked_fill(pad[:, None, :], float("-inf"))
            return self.out(torch.einsum("bpn,nbpd->bpd", scores.softmax(-1), v).reshape(B, D))
        q = self.query.view(1, P, 1, Dh).expand(B, -1, -1, -1)
        mask = None if pad is None else ~pad[:, None, None, :]
        pooled = F.scaled_dot_product_attention(q, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), attn_mask=mask)
        return self.out(pooled.reshape(B, D))


def _inputs(B, N, D, mask, dtype=torch.float64):
    gen = torch.Generator().manual_seed(1)
    ctx, tok = torch.randn(B, 3, D, dtype=dtype, generator=gen), torch.randn(N, B, D, dtype=dtype, generator=gen)
    if not mask:
        return ctx, tok
    pad = torch.rand(B, N, generator=gen) < 0.4
    pad[:, 0] = False  # every row keeps a token
    return ctx, tok, pad


@pytest.mark.parametrize("mask", [False, True], ids=["", "mask"])
@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("pool", ["mha", "einsum", "sdpa"])
def test_tokens_sequence_first_match_and_train_as_eager(pool, sizes, mask):
    B, N, D, P = SIZES[sizes]
    torch.manual_seed(0)
    match = assert_one_match(compile_and_compare(SeqFirst(pool, D, P).double(), _inputs(B, N, D, mask),
                                                 torch.float64, token_axis=0))
    assert match["shapes"]["tok"] == [str(N), str(B), str(D)], match["shapes"]


@needs_interpreter
@pytest.mark.parametrize("kernels", ["fused", "staged"])
def test_the_kernels_take_sequence_first_tokens_transposed(kernels):
    """The kernels read the transposed view by its strides: float32 against eager's."""
    B, N, D, P = SIZES["odd"]
    torch.manual_seed(0)
    reports = compile_and_compare(SeqFirst("mha", D, P), _inputs(B, N, D, True, torch.float32), torch.float32,
                                  token_axis=0, options={"kernels": kernels})
    assert assert_one_match(reports)["kernels"] == kernels
