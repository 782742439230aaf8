"""Blocks that are almost the MHA block but compute something else: none may be rewritten."""
import math

import torch
from torch import nn

from loop_moe import loop_experts
from mha_compile import models


class SoftmaxOverHeads(models.InvertedAttentionPool):
    """Pool softmax over the head axis instead of the tokens."""

    def forward(self, tok):
        B, N, D = tok.shape
        k = self.key(tok).view(B, N, self.heads, self.head_dim)
        v = self.value(tok).view(B, N, self.heads, self.head_dim)
        scores = torch.einsum("pd,bnpd->bpn", self.query, k) / math.sqrt(self.head_dim)
        attn = torch.softmax(scores, dim=1)
        return self.out(torch.einsum("bpn,bnpd->bpd", attn, v).reshape(B, D))


class WrongScale(models.InvertedAttentionPool):
    """Scores divided by Dh rather than √Dh."""

    def forward(self, tok):
        B, N, D = tok.shape
        k = self.key(tok).view(B, N, self.heads, self.head_dim)
        v = self.value(tok).view(B, N, self.heads, self.head_dim)
        attn = torch.softmax(torch.einsum("pd,bnpd->bpn", self.query, k) / self.head_dim, dim=-1)
        return self.out(torch.einsum("bpn,bnpd->bpd", attn, v).reshape(B, D))


class Block(nn.Module):
    """The block with a swappable pool and merge, for near-miss variants."""

    def __init__(self, pool=None, merge="unsqueeze", router_dim=-1, topk_on_logits=False, expose_attn=False):
        super().__init__()
        self.pool = pool or models.InvertedAttentionPool(32, 2)
        self.moe = models.TopKMoE(32, 64, 4, 2)
        self.merge, self.router_dim, self.topk_on_logits, self.expose_attn = merge, router_dim, topk_on_logits, expose_attn

    def forward(self, ctx, tok):
        inv = self.pool(tok)
        if self.merge == "unsqueeze":
            y = ctx + inv.unsqueeze(1)
        else:  # no merge at all: the MoE runs on ctx alone
            y = ctx
        moe = self.moe
        x = y.reshape(-1, y.shape[-1])
        logits = moe.router(x)
        if self.topk_on_logits:
            weight, index = torch.topk(logits, moe.top_k, dim=-1)
            weight = torch.sigmoid(weight)
        else:
            probs = torch.softmax(logits, dim=self.router_dim)
            weight, index = torch.topk(probs, moe.top_k, dim=-1)
            weight = weight / weight.sum(-1, keepdim=True)
        out = loop_experts(moe, x, weight, index).reshape(y.shape)
        if self.expose_attn:  # the top-k's renormalised weights leave the region: not a value the op rebuilds
            return out, weight.square().sum(-1)
        return out


NEAR_MISSES = {
    "pool softmax over heads": (lambda: Block(pool=SoftmaxOverHeads(32, 2)), "softmax over dim 1"),
    "pool scale 1/Dh": (lambda: Block(pool=WrongScale(32, 2)), "scale"),
    "no merge": (lambda: Block(merge="none"), "merge"),
    "router softmax over rows": (lambda: Block(router_dim=0), "softmax"),
    "top-k on logits": (lambda: Block(topk_on_logits=True), "top-k is taken on the router logits"),
    "gate weights used outside": (lambda: Block(expose_attn=True), "used outside the region"),
}
