"""The block as a savvy user would write it with torch._grouped_mm: a peer to beat, and since
session 44 a spelling the backend reads (mha_compile/lowering/moe_grouped.py), so the table runs
the backend's main modes on it too.

Same parameters as an MHABlock (it wraps one), so its numbers compare row for row. The pool is
the block's own (plain PyTorch, not reassociated: a user would not know to). The MoE sorts the
R·k (row, slot) pairs by expert and runs each expert GEMM as one grouped GEMM over the sorted
rows, with `offs` the cumulative row counts: only the chosen experts are computed, and no count
ever goes back to the host (offs stays on the device), so it compiles without graph breaks.

torch._grouped_mm is fast on CUDA (sm90+) in bf16, which is where the benchmark runs it; the
CPU build computes it too (slowly), which the tests use to check it against the MHABlock.

In bf16 its ∂b1 and ∂b2 are off the fp32 reference: the backward of `b1[expert]` sums each
expert's rows into a bf16 gradient (2.5e-2 at small on the CPU, and the table's grad err of
~1e-1 at large, session 67). The rest of its gradients are within bf16's bound. It stays as a
user would write it; the table flags its rows (!) and says where it is the best peer.
"""
import torch
from torch import nn
from torch.nn import functional as F


def available(device, dtype):
    """None if the spelling can be benchmarked here, else the reason why not."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if torch.device(device).type != "cuda" or dtype != torch.bfloat16:
        return "torch._grouped_mm is benchmarked on CUDA bf16 only"
    return None


class GroupedMMBlock(nn.Module):
    """out = MoE(ctx + pool(tok)[:, None]) with the MoE experts as grouped GEMMs."""

    def __init__(self, block):
        super().__init__()
        self.block = block  # parameters shared, not copied

    def forward(self, ctx, tok):
        B, H, D = ctx.shape
        moe = self.block.moe
        x = (ctx + self.block.pool(tok).unsqueeze(1)).reshape(B * H, D)
        probs = torch.softmax(moe.router(x).float(), dim=-1)
        weight, index = torch.topk(probs, moe.top_k, dim=-1)
        if moe.renorm:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        experts = moe.w1.shape[0]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        expert = flat[order]
        rows = order // moe.top_k
        # offs[e] = rows of experts ≤ e; searchsorted, not bincount, whose output size
        # depends on the data and would break the graph under torch.compile
        offs = torch.searchsorted(expert, torch.arange(experts, device=flat.device), right=True).to(torch.int32)
        xs = x[rows]
        u = torch._grouped_mm(xs, moe.w1, offs=offs)
        if moe.b1 is not None:
            u = u + moe.b1[expert]
        if moe.act == "swiglu":
            h = F.silu(u) * torch._grouped_mm(xs, moe.w3, offs=offs)
        else:
            h = moe._hidden(u, xs, None)
        f = torch._grouped_mm(h, moe.w2, offs=offs)
        if moe.b2 is not None:
            f = f + moe.b2[expert]
        f = f * weight.reshape(-1)[order, None].to(f.dtype)
        out = torch.zeros_like(x).index_add(0, rows, f)
        return out.view(B, H, D)
