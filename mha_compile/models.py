"""Reference modules in plain PyTorch, written the way a user would write them.

The inverted attention pool, the top-k MoE (two spellings), the block that joins them and a
small multi-horizon forecaster. These are what the backend must recognise and what the tests
compare against; they use nothing from the rest of the package.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "swiglu")
MOE_SPELLINGS = ("loop", "dense")
MERGES = ("unsqueeze", "none_index", "add")

# Presets of SPEC §5: (B, H, N, D, P, F, E, k).
PRESETS = {
    "tiny": dict(B=4, H=3, N=5, D=32, P=2, F=64, E=4, k=2),
    "small": dict(B=256, H=8, N=32, D=128, P=4, F=512, E=8, k=2),
    "medium": dict(B=1024, H=16, N=64, D=256, P=8, F=1024, E=8, k=2),
    "large": dict(B=4096, H=16, N=128, D=512, P=8, F=2048, E=16, k=2),
}


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {allowed}")


class InvertedAttentionPool(nn.Module):
    """A learned query per head attends over the variate tokens: tok [B,N,D] -> inv [B,D]."""

    def __init__(self, dim, heads):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}")
        self.heads, self.head_dim = heads, dim // heads
        self.query = nn.Parameter(torch.randn(heads, self.head_dim) / math.sqrt(self.head_dim))
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, tok):
        B, N, D = tok.shape
        k = self.key(tok).view(B, N, self.heads, self.head_dim)
        v = self.value(tok).view(B, N, self.heads, self.head_dim)
        scores = torch.einsum("pd,bnpd->bpn", self.query, k) / math.sqrt(self.head_dim)
        attn = torch.softmax(scores, dim=-1)
        pooled = torch.einsum("bpn,bnpd->bpd", attn, v).reshape(B, D)
        return self.out(pooled)


class TopKMoE(nn.Module):
    """Softmax router, top-k experts per row, experts act(x W1 + b1) W2 + b2 stacked over E.

    spelling "loop": a masked loop over all experts; "dense": every expert on every row,
    weighted by a sparse gate built with scatter. swiglu: silu(x W1 + b1) ⊙ (x W3).
    """

    def __init__(self, dim, hidden, experts, top_k, act="gelu", renorm=True, bias=True, spelling="loop"):
        super().__init__()
        _check_choice("act", act, ACTIVATIONS)
        _check_choice("spelling", spelling, MOE_SPELLINGS)
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k={top_k}: expected 1 <= top_k <= experts={experts}")
        self.top_k, self.act, self.renorm, self.spelling = top_k, act, renorm, spelling
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) / math.sqrt(dim))
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) / math.sqrt(hidden))
        self.w3 = nn.Parameter(torch.randn(experts, dim, hidden) / math.sqrt(dim)) if act == "swiglu" else None
        self.b1 = nn.Parameter(0.1 * torch.randn(experts, hidden)) if bias else None
        self.b2 = nn.Parameter(0.1 * torch.randn(experts, dim)) if bias else None

    def _hidden(self, u, x, w3):
        if self.act == "gelu":
            return F.gelu(u)
        if self.act == "gelu_tanh":
            return F.gelu(u, approximate="tanh")
        if self.act == "silu":
            return F.silu(u)
        return F.silu(u) * (x @ w3)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        weight, index = torch.topk(probs, self.top_k, dim=-1)
        if self.renorm:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        weight = weight.to(x.dtype)
        if self.spelling == "loop":
            out = torch.zeros_like(x)
            for e in range(self.w1.shape[0]):
                gate = (weight * (index == e)).sum(dim=-1, keepdim=True)
                u = x @ self.w1[e]
                if self.b1 is not None:
                    u = u + self.b1[e]
                f = self._hidden(u, x, None if self.w3 is None else self.w3[e]) @ self.w2[e]
                if self.b2 is not None:
                    f = f + self.b2[e]
                out = out + gate * f
            return out.reshape(shape)
        gates = torch.zeros_like(x[:, :1]).expand(-1, self.w1.shape[0]).scatter(-1, index, weight)
        u = torch.einsum("rd,edf->ref", x, self.w1)
        if self.b1 is not None:
            u = u + self.b1
        if self.act == "swiglu":
            h = F.silu(u) * torch.einsum("rd,edf->ref", x, self.w3)
        else:
            h = self._hidden(u, x, None)
        f = torch.einsum("ref,efd->red", h, self.w2)
        if self.b2 is not None:
            f = f + self.b2
        return torch.einsum("re,red->rd", gates, f).reshape(shape)


class MHABlock(nn.Module):
    """The region: inv = pool(tok); y = ctx + inv broadcast over horizons; out = MoE(y)."""

    def __init__(self, dim, heads, hidden, experts, top_k, act="gelu", renorm=True, bias=True,
                 spelling="loop", merge="unsqueeze"):
        super().__init__()
        _check_choice("merge", merge, MERGES)
        self.merge = merge
        self.pool = InvertedAttentionPool(dim, heads)
        self.moe = TopKMoE(dim, hidden, experts, top_k, act, renorm, bias, spelling)

    def forward(self, ctx, tok):
        inv = self.pool(tok)
        if self.merge == "unsqueeze":
            y = ctx + inv.unsqueeze(1)
        elif self.merge == "none_index":
            y = ctx + inv[:, None]
        else:
            y = torch.add(ctx, inv.view(inv.shape[0], 1, inv.shape[1]))
        return self.moe(y)

    @classmethod
    def from_preset(cls, name, **kwargs):
        """The block at SPEC §5's widths of preset `name` (one of PRESETS)."""
        _check_choice("preset", name, tuple(PRESETS))
        p = PRESETS[name]
        return cls(p["D"], p["P"], p["F"], p["E"], p["k"], **kwargs)


class Forecaster(nn.Module):
    """A small multi-horizon forecaster: series [B,T,N] -> forecasts [B,H,N].

    Variate tokens (iTransformer-style: each variate's history embedded, then layer-normed),
    a per-horizon context from the whole window, the MHA block, and one linear head per horizon.
    """

    def __init__(self, window, variates, horizons, dim=32, heads=2, hidden=64, experts=4, top_k=2, **block):
        super().__init__()
        self.horizons, self.dim = horizons, dim
        self.embed = nn.Linear(window, dim)
        self.norm = nn.LayerNorm(dim)
        self.context = nn.Linear(window * variates, horizons * dim)
        self.block = MHABlock(dim, heads, hidden, experts, top_k, **block)
        self.head_w = nn.Parameter(torch.randn(horizons, dim, variates) / math.sqrt(dim))
        self.head_b = nn.Parameter(torch.zeros(horizons, variates))

    def forward(self, series):
        B = series.shape[0]
        tok = self.norm(self.embed(series.transpose(1, 2)))
        ctx = self.context(series.flatten(1)).view(B, self.horizons, self.dim)
        out = self.block(ctx, tok)
        return torch.einsum("bhd,hdn->bhn", out, self.head_w) + self.head_b


def block_parameters(block):
    """The block's parameters in the order of the region op (None for absent ones)."""
    pool, moe = block.pool, block.moe
    return (pool.query, pool.key.weight, pool.key.bias, pool.value.weight, pool.value.bias,
            pool.out.weight, pool.out.bias, moe.router.weight, moe.w1, moe.b1, moe.w2, moe.b2, moe.w3)
