"""The MHA block spelled the many ways users write it (SPEC §2), one switch per family.

`SpelledBlock(pool=..., merge=..., moe=..., experts=..., ...)` computes exactly the math of
SPEC §1 for every combination; the tests compile each with backend="mha" and expect one match.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F

POOLS = ("einsum", "matmul", "sdpa", "sdpa_scale", "mha", "mha_weights", "fused_kv", "fused_kv_unbind", "mul_scale",
         "scaled_query", "bmm", "mul_sum")
MERGES = ("unsqueeze", "none_index", "view_first", "torch_add", "iadd", "expand_as", "repeat", "broadcast_to")
MOES = ("loop", "dense_scatter", "dense_onehot", "dense_inplace", "dense_bcast", "gathered", "gathered_t", "gathered_bmm", "gathered_matmul",
        "mixtral")
EXPERTS = ("stacked", "modules")
ACTS = ("gelu", "gelu_tanh", "silu", "swiglu")


class SpelledBlock(nn.Module):
    def __init__(self, D=32, P=2, F_=64, E=4, k=2, act="gelu", renorm=True, bias=True, pool="einsum",
                 merge="unsqueeze", moe="loop", experts="stacked", mask=False, topk_logits=False, gather_weights=False):
        super().__init__()
        self.D, self.P, self.Dh, self.E, self.k = D, P, D // P, E, k
        self.act, self.renorm, self.bias, self.pool, self.merge = act, renorm, bias, pool, merge
        self.moe, self.experts, self.mask, self.topk_logits = moe, experts, mask, topk_logits
        self.gather_weights = gather_weights
        if pool in ("mha", "mha_weights"):
            self.query = nn.Parameter(torch.randn(1, 1, D) / math.sqrt(D))
            self.attn = nn.MultiheadAttention(D, P, batch_first=True)
        else:
            self.query = nn.Parameter(torch.randn(P, self.Dh) / math.sqrt(self.Dh))
            if pool in ("fused_kv", "fused_kv_unbind"):
                self.kv = nn.Linear(D, 2 * D)
            else:
                self.key, self.value = nn.Linear(D, D), nn.Linear(D, D)
            self.out = nn.Linear(D, D)
        self.router = nn.Linear(D, E, bias=False)
        if experts == "stacked":
            self.w1 = nn.Parameter(torch.randn(E, D, F_) / math.sqrt(D))
            self.w2 = nn.Parameter(torch.randn(E, F_, D) / math.sqrt(F_))
            self.w3 = nn.Parameter(torch.randn(E, D, F_) / math.sqrt(D)) if act == "swiglu" else None
            self.b1 = nn.Parameter(0.1 * torch.randn(E, F_)) if bias else None
            self.b2 = nn.Parameter(0.1 * torch.randn(E, D)) if bias else None
        else:
            self.up = nn.ModuleList(nn.Linear(D, F_, bias=bias) for _ in range(E))
            self.down = nn.ModuleList(nn.Linear(F_, D, bias=bias) for _ in range(E))
            self.gate_proj = nn.ModuleList(nn.Linear(D, F_, bias=False) for _ in range(E)) if act == "swiglu" else None

    # ---- pool -------------------------------------------------------------------------------
    def _kv(self, tok):
        if self.pool == "fused_kv":
            return self.kv(tok).chunk(2, dim=-1)
        if self.pool == "fused_kv_unbind":
            B, N, D = tok.shape
            return self.kv(tok).view(B, N, 2, D).unbind(2)
        return self.key(tok), self.value(tok)

    def pool_forward(self, tok, pad=None):
        B, N, D = tok.shape
        P, Dh = self.P, self.Dh
        if self.pool in ("mha", "mha_weights"):  # mha_weights: need_weights left at its default, True
            out, _ = self.attn(self.query.expand(B, -1, -1), tok, tok, key_padding_mask=pad,
                               **({"need_weights": False} if self.pool == "mha" else {}))
            return out[:, 0]
        k, v = self._kv(tok)
        if self.pool in ("einsum", "fused_kv", "fused_kv_unbind", "mul_scale", "scaled_query"):
            k, v = k.view(B, N, P, Dh), v.view(B, N, P, Dh)
            if self.pool == "scaled_query":  # the query pre-scaled, the scores not
                scores = torch.einsum("pd,bnpd->bpn", self.query / math.sqrt(Dh), k)
            else:
                scores = torch.einsum("pd,bnpd->bpn", self.query, k)
                scores = scores * Dh ** -0.5 if self.pool == "mul_scale" else scores / math.sqrt(Dh)
            if pad is not None:
                scores = scores.masked_fill(pad[:, None, :], float("-inf"))
            attn = torch.softmax(scores, dim=-1)
            return self.out(torch.einsum("bpn,bnpd->bpd", attn, v).reshape(B, D))
        if self.pool == "mul_sum":  # products and sums by broadcasting, no einsum or matmul
            k, v = k.view(B, N, P, Dh), v.view(B, N, P, Dh)
            scores = (k * self.query).sum(-1) / math.sqrt(Dh)  # [B,N,P]
            if pad is not None:
                scores = scores.masked_fill(pad[:, :, None], float("-inf"))
            attn = torch.softmax(scores, dim=1)
            return self.out((attn.unsqueeze(-1) * v).sum(1).reshape(B, D))
        if self.pool == "bmm":  # attention over (B·P) batches, the query broadcast and merged in
            kb = k.view(B, N, P, Dh).permute(0, 2, 3, 1).reshape(B * P, Dh, N)
            vb = v.view(B, N, P, Dh).permute(0, 2, 1, 3).reshape(B * P, N, Dh)
            q = self.query.unsqueeze(0).expand(B, P, Dh).reshape(B * P, 1, Dh)
            scores = torch.bmm(q, kb) / math.sqrt(Dh)
            if pad is not None:
                scores = scores.masked_fill(pad.repeat_interleave(P, dim=0)[:, None, :], float("-inf"))
            return self.out(torch.bmm(scores.softmax(dim=-1), vb).reshape(B, D))
        k = k.view(B, N, P, Dh).transpose(1, 2)  # [B,P,N,Dh]
        v = v.view(B, N, P, Dh).transpose(1, 2)
        if self.pool == "matmul":
            scores = (self.query.unsqueeze(1) @ k.transpose(-2, -1)) / math.sqrt(Dh)  # [B,P,1,N]
            if pad is not None:
                scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
            pooled = scores.softmax(dim=-1) @ v  # [B,P,1,Dh]
        else:
            q = self.query.view(1, P, 1, Dh).expand(B, -1, -1, -1)
            mask = None if pad is None else ~pad[:, None, None, :]  # SDPA: True = take part
            if self.pool == "sdpa_scale":
                pooled = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=Dh ** -0.5)
            else:
                pooled = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(pooled.reshape(B, D))

    # ---- merge ------------------------------------------------------------------------------
    def merge_forward(self, ctx, inv):
        B, D = inv.shape
        if self.merge == "unsqueeze":
            return ctx + inv.unsqueeze(1)
        if self.merge == "none_index":
            return ctx + inv[:, None]
        if self.merge == "view_first":
            return inv.view(B, 1, D) + ctx
        if self.merge == "torch_add":
            return torch.add(ctx, inv[:, None, :])
        if self.merge == "expand_as":
            return inv.unsqueeze(1).expand_as(ctx) + ctx
        if self.merge == "repeat":  # a copy of inv per horizon: the same values as the broadcast
            return ctx + inv.unsqueeze(1).repeat(1, ctx.shape[1], 1)
        if self.merge == "broadcast_to":
            return ctx + torch.broadcast_to(inv[:, None], ctx.shape)
        y = ctx * 1.0  # iadd: a fresh tensor of the graph's own, so the in-place add is unobservable
        y += inv[:, None]
        return y

    # ---- MoE --------------------------------------------------------------------------------
    def _act(self, u, gate_u=None):
        if self.act == "gelu":
            return F.gelu(u)
        if self.act == "gelu_tanh":
            return F.gelu(u, approximate="tanh")
        if self.act == "silu":
            return F.silu(u)
        return F.silu(u) * gate_u

    def expert(self, e, x):
        if self.experts == "modules":
            u3 = self.gate_proj[e](x) if self.gate_proj is not None else None
            return self.down[e](self._act(self.up[e](x), u3))
        u = x @ self.w1[e]
        if self.b1 is not None:
            u = u + self.b1[e]
        f = self._act(u, x @ self.w3[e] if self.w3 is not None else None) @ self.w2[e]
        return f + self.b2[e] if self.b2 is not None else f

    def route(self, x):
        logits = self.router(x)
        if self.topk_logits:  # top-k on logits, softmax over the k values: the renormalised gate
            top, index = logits.topk(self.k, dim=-1)
            return top.softmax(dim=-1), index
        probs = torch.softmax(logits, dim=-1)
        weight, index = probs.topk(self.k, dim=-1)
        if self.gather_weights:  # the chosen experts' probabilities gathered again, not topk's values
            weight = probs.gather(-1, index)
        if self.renorm:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return weight, index

    def moe_forward(self, y):
        shape = y.shape
        x = y.reshape(-1, shape[-1])
        weight, index = self.route(x)
        E = self.E
        if self.moe == "loop":
            out = torch.zeros_like(x)
            for e in range(E):
                gate = (weight * (index == e)).sum(dim=-1, keepdim=True)
                out = out + gate * self.expert(e, x)
        elif self.moe == "mixtral":
            out = torch.zeros_like(x)
            expert_mask = F.one_hot(index, E).permute(2, 1, 0)  # [E,k,R]
            for e in range(E):
                slot, rows = torch.where(expert_mask[e])
                out.index_add_(0, rows, self.expert(e, x[rows]) * weight[rows, slot, None])
        elif self.moe == "gathered":
            u = torch.einsum("rd,rkdf->rkf", x, self.w1[index])
            if self.b1 is not None:
                u = u + self.b1[index]
            gate_u = torch.einsum("rd,rkdf->rkf", x, self.w3[index]) if self.w3 is not None else None
            f = torch.einsum("rkf,rkfd->rkd", self._act(u, gate_u), self.w2[index])
            if self.b2 is not None:
                f = f + self.b2[index]
            out = (weight.unsqueeze(-1) * f).sum(dim=1)
        elif self.moe == "gathered_t":  # W[topi] with its own two axes transposed into the einsum
            u = torch.einsum("rd,rkfd->rkf", x, self.w1[index].transpose(-1, -2))
            if self.b1 is not None:
                u = u + self.b1[index]
            gate_u = torch.einsum("rd,rkfd->rkf", x, self.w3[index].mT) if self.w3 is not None else None
            f = torch.einsum("rkf,rkdf->rkd", self._act(u, gate_u), self.w2[index].transpose(2, 3))
            if self.b2 is not None:
                f = f + self.b2[index]
            out = torch.einsum("rk,rkd->rd", weight, f)
        elif self.moe == "gathered_matmul":  # x [R,1,1,D] @ W1[topi] [R,k,D,F], broadcast over the slots
            xr = x[:, None, None, :]
            u = (xr @ self.w1[index]).squeeze(-2)
            if self.b1 is not None:
                u = u + self.b1[index]
            gate_u = (xr @ self.w3[index]).squeeze(-2) if self.w3 is not None else None
            f = (self._act(u, gate_u).unsqueeze(-2) @ self.w2[index]).squeeze(-2)
            if self.b2 is not None:
                f = f + self.b2[index]
            out = (weight.unsqueeze(-1) * f).sum(dim=1)
        elif self.moe == "gathered_bmm":  # flat (row, slot) pairs: W[topi.reshape(-1)] and torch.bmm
            R, D = x.shape
            k = index.shape[1]
            flat = index.reshape(-1)
            xk = x.unsqueeze(1).expand(R, k, D).reshape(R * k, 1, D)
            u = torch.bmm(xk, self.w1[flat]).squeeze(1)
            if self.b1 is not None:
                u = u + self.b1[flat]
            gate_u = torch.bmm(xk, self.w3[flat]).squeeze(1) if self.w3 is not None else None
            f = torch.bmm(self._act(u, gate_u).unsqueeze(1), self.w2[flat]).squeeze(1)
            if self.b2 is not None:
                f = f + self.b2[flat]
            out = (weight.reshape(-1, 1) * f).view(R, k, D).sum(dim=1)
        else:
            if self.moe in ("dense_scatter", "dense_bcast"):
                gates = torch.zeros(x.shape[0], E, dtype=x.dtype, device=x.device).scatter(1, index, weight)
            elif self.moe == "dense_inplace":  # scattered in place
                gates = torch.zeros(x.shape[0], E, dtype=x.dtype, device=x.device)
                gates.scatter_(1, index, weight)
            else:
                gates = (F.one_hot(index, E).to(x.dtype) * weight.unsqueeze(-1)).sum(dim=1)
            if self.experts == "modules":
                f = torch.stack([self.expert(e, x) for e in range(E)], dim=1)  # [R,E,D]
            else:
                u = torch.einsum("rd,edf->ref", x, self.w1)
                if self.b1 is not None:
                    u = u + self.b1
                gate_u = torch.einsum("rd,edf->ref", x, self.w3) if self.w3 is not None else None
                f = torch.einsum("ref,efd->red", self._act(u, gate_u), self.w2)
                if self.b2 is not None:
                    f = f + self.b2
            if self.moe == "dense_bcast":  # Σ_e gate · f by broadcasting
                out = (gates.unsqueeze(-1) * f).sum(dim=1)
            else:
                out = torch.einsum("re,red->rd", gates, f)
        return out.reshape(shape)

    def forward(self, ctx, tok, pad=None):
        return self.moe_forward(self.merge_forward(ctx, self.pool_forward(tok, pad)))


class GroupedMM(SpelledBlock):
    """The MoE as grouped GEMMs over the (row, slot) pairs sorted by expert (torch._grouped_mm, as
    bench/grouped_mm_moe.py writes it), stacked parameters; each switch another spelling of one
    step. Dynamo's fake _grouped_mm takes bf16 only, so these compile in bf16.
    sort: "argsort" | "sort" (values and indices); select: "getitem" (x[rows], b1[expert]) |
    "index_select"; rows: "floordiv" (order // k) | "div" (rounding_mode="floor"); gate:
    "none_index" (w[order, None]) | "unsqueeze"; offs: "right" (searchsorted(e, arange(E),
    right=True)) | "left" (arange(1, E + 1), side="left") | "other_sort" (searchsorted over another
    sort's experts: the same sequence) | the cumsum of each expert's count:
    "onehot" (one_hot(flat, E).sum(0)), "histc", "scatter" (zeros(E).scatter_add_), "bincount"; inplace:
    out.index_add_ (True) or "scatter_add_" (the rows broadcast over the width);
    stored_t: W1 and W2 stored [E, out, in] (nn.Linear's way) and read transposed; fused (swiglu):
    W1 and W3 as one W13 [E, D, 2F], one grouped GEMM chunked in two (FusedGateUp's loop, the math)."""

    def __init__(self, sort="argsort", select="getitem", rows="floordiv", gate="none_index", offs="right",
                 inplace=False, stored_t=False, fused=False, **block):
        super().__init__(**block)
        self.sort, self.select, self.rows, self.gate, self.offs = sort, select, rows, gate, offs
        self.inplace, self.stored_t, self.fused = inplace, stored_t, fused
        if fused:
            self.w13 = nn.Parameter(torch.cat([self.w1.detach(), self.w3.detach()], dim=-1))
            self.w1 = self.w3 = None
        if stored_t:
            self.w1 = nn.Parameter(self.w1.detach().transpose(1, 2).contiguous())
            self.w2 = nn.Parameter(self.w2.detach().transpose(1, 2).contiguous())

    def weights(self):
        """W1 [E,D,F] and W2 [E,F,D] as the math reads them (views of the stored ones)."""
        if self.stored_t:
            return self.w1.transpose(1, 2), self.w2.transpose(1, 2)
        return self.w1, self.w2

    def _take(self, t, index):
        return t[index] if self.select == "getitem" else t.index_select(0, index)

    def moe_forward(self, y):
        shape = y.shape
        x = y.reshape(-1, shape[-1])
        weight, index = self.route(x)
        flat = index.reshape(-1)
        if self.sort == "argsort":
            order = torch.argsort(flat, stable=True)
            expert = flat[order]
        else:
            expert, order = flat.sort(stable=True)
        rows = order // self.k if self.rows == "floordiv" else torch.div(order, self.k, rounding_mode="floor")
        if self.offs == "right":
            offs = torch.searchsorted(expert, torch.arange(self.E, device=x.device), right=True)
        elif self.offs == "left":
            offs = torch.searchsorted(expert, torch.arange(1, self.E + 1, device=x.device), side="left")
        elif self.offs == "other_sort":  # the experts of another (ascending) sort of the same pairs
            offs = torch.searchsorted(flat.sort().values, torch.arange(self.E, device=x.device), right=True)
        elif self.offs == "bincount":  # a data-dependent size: needs capture_dynamic_output_shape_ops
            offs = torch.bincount(flat, minlength=self.E).cumsum(0)
        elif self.offs == "onehot":
            offs = F.one_hot(flat, self.E).sum(0).cumsum(0)
        elif self.offs == "histc":  # Megatron's counts: bins of width 1 over [0, E]
            offs = torch.histc(flat.float(), bins=self.E, min=0, max=self.E).cumsum(0)
        else:  # "scatter"
            counts = torch.zeros(self.E, dtype=torch.long, device=x.device)
            offs = counts.scatter_add_(0, flat, torch.ones_like(flat)).cumsum(0)
        offs = offs.to(torch.int32)
        w1, w2 = self.weights()
        xs = self._take(x, rows)
        if self.fused:
            u, gate_u = torch._grouped_mm(xs, self.w13, offs=offs).chunk(2, dim=-1)
        else:
            u = torch._grouped_mm(xs, w1, offs=offs)
            gate_u = torch._grouped_mm(xs, self.w3, offs=offs) if self.w3 is not None else None
        if self.b1 is not None:
            u = u + self._take(self.b1, expert)
        f = torch._grouped_mm(self._act(u, gate_u), w2, offs=offs)
        if self.b2 is not None:
            f = f + self._take(self.b2, expert)
        gates = weight.reshape(-1)[order, None] if self.gate == "none_index" else weight.reshape(-1)[order].unsqueeze(-1)
        f = f * gates.to(f.dtype)
        if self.inplace == "scatter_add_":
            out = torch.zeros_like(x).scatter_add_(0, rows[:, None].expand(-1, x.shape[1]), f)
        elif self.inplace:
            out = torch.zeros_like(x)
            out.index_add_(0, rows, f)
        else:
            out = torch.zeros_like(x).index_add(0, rows, f)
        return out.reshape(shape)

    def math_block(self):
        """The same block as the loop spelling in float64, on these (rounded) parameters."""
        common = dict(D=self.D, P=self.P, E=self.E, k=self.k, renorm=self.renorm, bias=self.bias, pool=self.pool)
        if self.fused:
            block = FusedGateUp(F_=self.w13.shape[2] // 2, **common)
        else:
            block = SpelledBlock(F_=self.weights()[0].shape[2], act=self.act, **common)
        state = {name: value.double() for name, value in self.state_dict().items()}
        if self.stored_t:
            state["w1"], state["w2"] = state["w1"].transpose(1, 2), state["w2"].transpose(1, 2)
        block.load_state_dict(state)
        return block.double()


class FusedGateUp(SpelledBlock):
    """SwiGLU with W1 and W3 in one tensor: one product x·[W1 | W3], then split into the gate's and
    the up projection's columns (transformers' MoE experts: `gate, up = F.linear(x,
    gate_up_proj[e]).chunk(2, dim=-1)`). stored: "edf" ([E, D, 2F], x @ W13[e]) | "linear"
    ([E, 2F, D], F.linear) | "modules" (an nn.Linear(D, 2F) per expert); split: "chunk" | "split"
    (split(F)) | "split_list" (split([F, F])) | "slices" (u[..., :F], u[..., F:]) | "interleaved"
    (u[..., ::2], u[..., 1::2]: not the block's halves); up_first: W13 = [W3 | W1]. b1 is added to the
    gate's columns after the split (up_bias: a bias over both halves before it, loop only); moe:
    loop, mixtral, gathered, dense_scatter (stacked storage)."""

    def __init__(self, stored="edf", split="chunk", up_first=False, up_bias=False, F_=64, **block):
        super().__init__(act="swiglu", F_=F_, experts="modules" if stored == "modules" else "stacked", **block)
        self.stored, self.split, self.up_first, self.F = stored, split, up_first, F_
        E, D = self.E, self.D
        if stored == "modules":  # b1 left out: the modules' gate bias would be the fused Linear's
            self.gate_up = nn.ModuleList(nn.Linear(D, 2 * F_, bias=False) for _ in range(E))
            self.up = self.gate_proj = self.b1 = None
        else:
            w13 = torch.randn(E, D, 2 * F_) / math.sqrt(D)
            self.w13 = nn.Parameter(w13 if stored == "edf" else w13.transpose(1, 2).contiguous())
            self.w1 = self.w3 = None
        self.b13 = nn.Parameter(0.1 * torch.randn(E, 2 * F_)) if up_bias else None

    def _halves(self, u13):
        F_ = self.F
        if self.split == "chunk":
            a, b = u13.chunk(2, dim=-1)
        elif self.split == "split":
            a, b = u13.split(F_, dim=-1)
        elif self.split == "split_list":
            a, b = torch.split(u13, [F_, F_], dim=-1)
        elif self.split == "interleaved":
            a, b = u13[..., ::2], u13[..., 1::2]
        else:
            a, b = u13[..., :F_], u13[..., F_:]
        return (b, a) if self.up_first else (a, b)

    def _swiglu(self, u13, b1):
        gate, up = self._halves(u13)
        return F.silu(gate if b1 is None else gate + b1) * up

    def expert(self, e, x):
        if self.stored == "modules":
            h = self._swiglu(self.gate_up[e](x), self.b1[e] if self.b1 is not None else None)
            return self.down[e](h)
        u13 = x @ self.w13[e] if self.stored == "edf" else F.linear(x, self.w13[e])
        u13 = u13 + self.b13[e] if self.b13 is not None else u13
        f = self._swiglu(u13, self.b1[e] if self.b1 is not None else None) @ self.w2[e]
        return f + self.b2[e] if self.b2 is not None else f

    def moe_forward(self, y):
        if self.moe in ("loop", "mixtral"):
            return super().moe_forward(y)
        x = y.reshape(-1, y.shape[-1])
        weight, index = self.route(x)
        if self.moe == "gathered":
            spec = "rd,rkdf->rkf" if self.stored == "edf" else "rd,rkfd->rkf"
            h = self._swiglu(torch.einsum(spec, x, self.w13[index]), self.b1[index] if self.b1 is not None else None)
            f = torch.einsum("rkf,rkfd->rkd", h, self.w2[index])
            out = (weight.unsqueeze(-1) * (f + self.b2[index] if self.b2 is not None else f)).sum(dim=1)
        else:  # dense_scatter
            gates = torch.zeros(x.shape[0], self.E, dtype=x.dtype, device=x.device).scatter(1, index, weight)
            spec = "rd,edf->ref" if self.stored == "edf" else "rd,efd->ref"
            h = self._swiglu(torch.einsum(spec, x, self.w13), self.b1)
            f = torch.einsum("ref,efd->red", h, self.w2)
            out = torch.einsum("re,red->rd", gates, f + self.b2 if self.b2 is not None else f)
        return out.reshape(y.shape)


class TransformersMoE(SpelledBlock):
    """The MoE as transformers (v5) writes Mixtral's: a router nn.Linear whose logits are also
    returned, softmax in float32, top_k_weights /= their sum in place, a one_hot mask under
    no_grad with the experts hit (expert_hit) computed from it, experts stored fused
    (gate_up_proj [E, 2F, D], down_proj [E, D, F], read by F.linear), torch.where and index_add_.
    impl: "hit" loops over expert_hit as transformers does (a graph break: a loop over a tensor);
    "loop" over range(E), expert_hit then left unread ("v4": so, each expert's rows taken as transformers
    4.3x-4.4x did, hidden_states[None, token_idx].reshape(-1, D); "skip": an expert with no rows skipped
    by an if, as transformers 4.36-4.38 and DBRX do); "batched_mm" and "grouped_mm" are its other
    experts implementations (transformers/integrations/moe.py): every (row, slot) pair's row
    gathered by arange(R)[:, None].expand(-1, k).reshape(-1), then W13[expert] @ x as a column by
    torch.bmm, or grouped GEMMs over the pairs sorted by expert, put back in order by the inverse
    sort; added into the rows by index_add_ over the same index. wrong (not the block): "rows" pairs
    pair p with row p % R (arange(R).repeat(k)), "back" puts the grouped outputs back by the sort
    itself instead of its inverse."""

    def __init__(self, impl="loop", F_=64, wrong=None, **block):
        super().__init__(act="swiglu", F_=F_, **block)
        E, D = self.E, self.D
        self.w1 = self.w2 = self.w3 = self.b1 = self.b2 = self.router = None
        self.impl, self.hit, self.wrong = impl, impl == "hit", wrong
        self.gate = nn.Linear(D, E, bias=False)
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * F_, D) / math.sqrt(D))
        self.down_proj = nn.Parameter(torch.randn(E, D, F_) / math.sqrt(F_))
        self.act_fn = nn.SiLU()

    def run_experts(self, hidden_states, top_k_index, top_k_weights):
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=self.E).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit if self.hit else range(self.E):
            if self.hit:
                expert_idx = expert_idx[0]
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            if self.impl == "skip" and token_idx.shape[0] == 0:  # transformers 4.36-4.38, DBRX: a graph break
                continue
            rows = hidden_states[None, token_idx].reshape(-1, self.D) if self.impl == "v4" else hidden_states[token_idx]
            gate, up = F.linear(rows, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current = F.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])
            current = current * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
        return final_hidden_states

    def _pairs(self, x, top_k_index, top_k_weights):
        """Each (row, slot) pair's row, expert and weight, row-major."""
        rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand(-1, top_k_index.shape[-1]).reshape(-1)
        if self.wrong == "rows":
            rows = torch.arange(x.shape[0], device=x.device).repeat(top_k_index.shape[-1])
        return rows, top_k_index.reshape(-1), top_k_weights.reshape(-1)

    def batched_experts(self, x, top_k_index, top_k_weights):
        rows, experts, weights = self._pairs(x, top_k_index, top_k_weights)
        u13 = torch.bmm(self.gate_up_proj[experts], x[rows].unsqueeze(-1)).squeeze(-1)
        gate, up = u13.chunk(2, dim=-1)
        f = torch.bmm(self.down_proj[experts], (self.act_fn(gate) * up).unsqueeze(-1)).squeeze(-1)
        return torch.zeros_like(x).index_add_(0, rows, (f * weights.unsqueeze(-1)).to(x.dtype))

    def grouped_experts(self, x, top_k_index, top_k_weights):
        rows, experts, weights = self._pairs(x, top_k_index, top_k_weights)
        order = torch.argsort(experts, stable=True)
        back = order if self.wrong == "back" else torch.argsort(order, stable=True)
        counts = torch.histc(experts[order].float(), bins=self.E, min=0, max=self.E - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        u13 = torch._grouped_mm(x[rows][order], self.gate_up_proj.transpose(-2, -1), offs=offsets)
        gate, up = u13.chunk(2, dim=-1)
        f = torch._grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1), offs=offsets)
        f = (f * weights[order].unsqueeze(-1))[back]
        return torch.zeros_like(x).index_add_(0, rows, f.to(x.dtype))

    def moe_forward(self, y):
        hidden_states = y.view(-1, y.shape[-1])
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits.float(), dim=-1)
        top_k_weights, top_k_index = torch.topk(routing_weights, self.k, dim=-1)
        top_k_weights /= top_k_weights.sum(dim=-1, keepdim=True)
        top_k_weights = top_k_weights.to(router_logits.dtype)
        run = {"batched_mm": self.batched_experts, "grouped_mm": self.grouped_experts}.get(self.impl, self.run_experts)
        out = run(hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype))
        return out.reshape(y.shape), router_logits

    def forward(self, ctx, tok, pad=None):
        return self.moe_forward(self.merge_forward(ctx, self.pool_forward(tok, pad)))


class GptFastMoE(SpelledBlock):
    """gpt-fast's MOEFeedForward (mixtral-moe/model.py): W1, W3 [E, F, D] and W2 [E, D, F] gathered
    by the top-k indices into einsums, the top-k weights renormalised in place (/=) before the
    indices are read."""

    def __init__(self, F_=64, **block):
        super().__init__(act="swiglu", F_=F_, bias=False, **block)
        E, D = self.E, self.D
        self.w1 = nn.Parameter(torch.randn(E, F_, D) / math.sqrt(D))
        self.w2 = nn.Parameter(torch.randn(E, D, F_) / math.sqrt(F_))
        self.w3 = nn.Parameter(torch.randn(E, F_, D) / math.sqrt(D))

    def moe_forward(self, y):
        x = y.view(-1, self.D)
        expert_weights = F.softmax(self.router(x), dim=-1)
        expert_weights, expert_indices = torch.topk(expert_weights, self.k, dim=-1)
        expert_weights /= expert_weights.sum(dim=-1, keepdim=True)
        x1 = F.silu(torch.einsum("ti,taoi -> tao", x, self.w1[expert_indices]))
        x3 = torch.einsum("ti, taoi -> tao", x, self.w3[expert_indices])
        expert_outs = torch.einsum("tao, taio -> tai", (x1 * x3), self.w2[expert_indices])
        return torch.einsum("tai,ta -> ti", expert_outs, expert_weights).view_as(y)


class MistralMoE(SpelledBlock):
    """mistral-src's MoeLayer (the reference Mixtral code): top-k of the router logits, a softmax of
    the k in float32, torch.where(selected == i) and `results[batch_idx] += w · expert(x[batch_idx])`
    (stored by setitem: each row once an expert, as top-k picks distinct experts), results.view_as.
    store: "iadd" as written | "set" (results[batch_idx] = ..., which drops the earlier experts':
    not the block)."""

    def __init__(self, store="iadd"):
        super().__init__(act="swiglu", experts="modules", bias=False, topk_logits=True)
        self.store = store

    def moe_forward(self, y):
        inputs = y.view(-1, y.shape[-1])
        weights, selected_experts = torch.topk(self.router(inputs), self.k)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(inputs)
        for i in range(self.E):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            term = weights[batch_idx, nth_expert, None] * self.expert(i, inputs[batch_idx])
            if self.store == "iadd":
                results[batch_idx] += term
            else:
                results[batch_idx] = term
        return results.view_as(y)


def inputs(B=4, H=3, N=5, D=32, dtype=torch.float32, mask=False, generator=None):
    ctx = torch.randn(B, H, D, dtype=dtype, generator=generator)
    tok = torch.randn(B, N, D, dtype=dtype, generator=generator)
    if not mask:
        return ctx, tok
    pad = torch.rand(B, N, generator=generator) < 0.4
    pad[:, 0] = False  # every row keeps a token
    return ctx, tok, pad
