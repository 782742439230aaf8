"""The region's math in plain PyTorch: forward and the explicit backward of SPEC §1.

This is `kernels="reference"`: the CPU path, the float64 oracle of the tests, and the
fallback of every other kernel set. It never synchronises with the host (no `.item()`,
`.nonzero()`, `.tolist()`), so it runs under CUDA graphs and inside compiled graphs.

Shapes: ctx [B,H,D], tok [B,N,D], q [P,Dh], wk/wv/wo [D,D] (nn.Linear: y = x Wᵀ + b),
wg [E,D], w1/w3 [E,D,F], b1 [E,F], w2 [E,F,D], b2 [E,D]. R = B·H rows go through the MoE.

Two rewrites make this path cheap (SPEC §1):
- the pool is reassociated: scores are ⟨tok, u_p⟩ with u_p = Wk_pᵀ q_p / √Dh and the pooled
  value is Wv_p t̄_p + bv_p with t̄_p = Σ_n a_n tok_n: one pass over tok, no [B,N,D] K or V;
- the MoE computes only the chosen experts: (row, slot) pairs are sorted by expert on the
  device into tiles of `tile` rows, each tile owned by one expert, and every tile runs as one
  batched GEMM. The tile count has a host-known upper bound (R·k + E·(tile-1)) / tile, so no
  count ever comes back to the host.
"""
import torch

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "swiglu")


def accumulation_dtype(dtype):
    """fp32 accumulation for every floating dtype but float64, which stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Activations and their derivatives.


def act_forward(act, u, u3=None):
    """Hidden activation. For swiglu, u is the gate pre-activation and u3 = x W3."""
    if act == "gelu":
        return torch.nn.functional.gelu(u)
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(u, approximate="tanh")
    if act == "silu":
        return torch.nn.functional.silu(u)
    if act == "swiglu":
        return torch.nn.functional.silu(u) * u3
    raise ValueError(f"act={act!r}: expected one of {ACTIVATIONS}")


def act_backward(act, grad_h, u, u3=None):
    """Returns (∂u, ∂u3) given ∂h; ∂u3 is None unless act is swiglu.

    aten's fused gelu/silu backward ops make one pass over [slots,F] instead of five or six
    elementwise passes (the CPU reference spends most of its non-GEMM time here).
    """
    if act == "gelu":
        return torch.ops.aten.gelu_backward(grad_h, u, approximate="none"), None
    if act == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad_h, u, approximate="tanh"), None
    if act == "silu":
        return torch.ops.aten.silu_backward(grad_h, u), None
    if act == "swiglu":
        return torch.ops.aten.silu_backward(grad_h * u3, u), grad_h * torch.nn.functional.silu(u)
    raise ValueError(f"act={act!r}: expected one of {ACTIVATIONS}")


# ---------------------------------------------------------------------------------------------
# Inverted attention pool (reassociated).


def pool_directions(q, wk):
    """u [P,D]: u_p = Wk_pᵀ q_p / √Dh. The key bias adds a constant per head and cancels."""
    P, Dh = q.shape
    # einsum("pj,pjd->pd"), spelled as the bmm it becomes: einsum's parsing costs host time
    # on every training step (~40 µs a call on the H200's host, bench/results/kernel_times_medium.txt).
    return torch.bmm(q.unsqueeze(1), wk.view(P, Dh, -1)).squeeze(1) * (Dh**-0.5)


def empty_rows(mask):
    """[B] bool, the batch rows whose keys are all masked (None without a mask)."""
    return None if mask is None else mask.all(1)


def pool_forward(tok, q, wk, wv, bv, wo, bo, mask=None):
    """inv [B,D] and the attention weights attn [B,N,P]. mask [B,N] bool: True = ignore key.

    A batch row whose keys are all masked attends to nothing: its attn and its heads' output are
    zero, so its inv is bo, as F.scaled_dot_product_attention and nn.MultiheadAttention give it
    (their safe softmax, torch ≥ 2.5). A plain softmax of such a row is NaN, and the rewrite adds
    that NaN back where the user's spelling has one (lowering/rewrite.py)."""
    P, Dh = q.shape
    B, N, D = tok.shape
    scores = tok @ pool_directions(q, wk).T  # [B,N,P]
    empty = empty_rows(mask)
    if mask is not None:
        scores = scores.masked_fill(mask[:, :, None], float("-inf"))
    attn = torch.softmax(scores, dim=1)
    if empty is not None:
        attn = attn.masked_fill(empty[:, None, None], 0.0)
    tbar = torch.einsum("bnp,bnd->bpd", attn, tok)  # [B,P,D]
    return pool_project(tbar, wv, bv, wo, bo, empty), attn


def pool_heads(tbar, wv, bv, empty=None):
    """pooled [B,D] from t̄ [B,P,D]: pooled_p = Wv_p t̄_p + bv_p; 0 on the empty rows (pool_forward)."""
    B, P, D = tbar.shape
    # einsum("bpd,pjd->bpj", tbar, Wv as [P,Dh,D]), as one bmm over the heads
    pooled = torch.bmm(tbar.transpose(0, 1), wv.view(P, D // P, D).transpose(1, 2)).transpose(0, 1).reshape(B, D)
    pooled = pooled if bv is None else pooled + bv
    return pooled if empty is None else pooled.masked_fill(empty[:, None], 0.0)


def pool_project(tbar, wv, bv, wo, bo, empty=None):
    """inv [B,D] from t̄ [B,P,D]: pooled Woᵀ + bo, pooled as pool_heads."""
    inv = pool_heads(tbar, wv, bv, empty) @ wo.T
    return inv if bo is None else inv + bo


def pool_backward(grad_inv, tok, q, wk, wv, bv, wo, attn, mask=None):
    """Gradients (tok, q, wk, wv, bv, wo, bo) of the pool. ∂bk is exactly zero. An empty row
    (pool_forward) gives bo its ∂inv and nothing else a gradient: its heads' output is 0."""
    P, Dh = q.shape
    B, N, D = tok.shape
    empty = empty_rows(mask)
    wv_heads = wv.view(P, Dh, D)
    tbar = torch.einsum("bnp,bnd->bpd", attn, tok)
    pooled = pool_heads(tbar, wv, bv, empty)
    grad_bo = grad_inv.sum(0)
    grad_wo = grad_inv.T @ pooled
    grad_pooled = grad_inv @ wo  # [B,D]
    if empty is not None:  # 0 whatever the row's inputs: times 0, so a NaN stays NaN (0·NaN, as in eager)
        grad_pooled = grad_pooled * (~empty)[:, None].to(grad_pooled.dtype)
    grad_bv = grad_pooled.sum(0)
    grad_pooled = grad_pooled.view(B, P, Dh)
    grad_wv = torch.einsum("bpj,bpd->pjd", grad_pooled, tbar).reshape(D, D)
    grad_tbar = torch.einsum("bpj,pjd->bpd", grad_pooled, wv_heads)  # [B,P,D]
    grad_attn = torch.einsum("bpd,bnd->bnp", grad_tbar, tok)
    grad_scores = attn * (grad_attn - (attn * grad_attn).sum(1, keepdim=True))  # 0 where attn is (masked keys)
    u = pool_directions(q, wk)
    grad_tok = torch.einsum("bnp,bpd->bnd", attn, grad_tbar) + grad_scores @ u
    grad_u = torch.einsum("bnp,bnd->pd", grad_scores, tok) * (Dh**-0.5)
    grad_q = torch.einsum("pd,pjd->pj", grad_u, wk.view(P, Dh, D))
    grad_wk = torch.einsum("pj,pd->pjd", q, grad_u).reshape(D, D)
    return grad_tok, grad_q, grad_wk, grad_wv, grad_bv, grad_wo, grad_bo


# ---------------------------------------------------------------------------------------------
# Router.


def route(x, wg, top_k, renorm):
    """Router in fp32 (or fp64): returns probs [R,E], topk weights [R,k] and indices [R,k]."""
    probs = torch.softmax(x @ wg.T, dim=-1)
    weight, index = torch.topk(probs, top_k, dim=-1)
    if renorm:
        weight = weight / weight.sum(-1, keepdim=True)
    return probs, weight, index


def route_backward(grad_weight, x, wg, probs, weight, index, renorm):
    """∂x and ∂Wg through the router, given ∂w [R,k] (SPEC §1)."""
    if renorm:
        chosen = torch.gather(probs, 1, index)
        grad_chosen = (grad_weight - (grad_weight * weight).sum(-1, keepdim=True)) / chosen.sum(
            -1, keepdim=True
        )
    else:
        grad_chosen = grad_weight
    grad_probs = torch.zeros_like(probs).scatter(1, index, grad_chosen)
    grad_logits = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True))
    return grad_logits @ wg, grad_logits.T @ x


# ---------------------------------------------------------------------------------------------
# Grouping (row, slot) pairs by expert into tiles, on the device.


def tile_rows(pairs, experts):
    """A tile height for the grouped GEMMs: a power of two near half the mean rows per expert,
    8 to 128, so that padding (at most E·(tile-1) slots) stays near a third of the work."""
    half_mean = max(1, pairs // max(1, experts) // 2)
    return int(min(128, max(8, 1 << (half_mean.bit_length() - 1))))


def group_by_expert(index, experts, tile):
    """Sort the R·k (row, slot) pairs by expert into tiles of `tile` slots, one expert a tile.

    Returns slot_pair [T·tile] (pair id of each slot, or R·k for a padding slot) and
    tile_expert [T] (the expert of each tile; trailing all-padding tiles repeat the last).
    T = ceil((R·k + E·(tile-1)) / tile) is known on the host from shapes alone.
    """
    pairs = index.numel()
    flat = index.reshape(-1)
    num_tiles = -(-(pairs + experts * (tile - 1)) // tile)
    order = torch.argsort(flat, stable=True)
    # scatter_add rather than bincount: bincount sizes its output from max(flat), a host sync.
    counts = torch.zeros(experts, dtype=torch.long, device=index.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + tile - 1) // tile * tile
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    sorted_expert = flat[order]
    rank = torch.arange(pairs, device=index.device) - start[sorted_expert]
    slot = padded_start[sorted_expert] + rank
    slot_pair = torch.full((num_tiles * tile,), pairs, dtype=torch.long, device=index.device)
    slot_pair[slot] = order
    tile_start = torch.arange(num_tiles, device=index.device) * tile
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True).clamp_(max=experts - 1)
    return slot_pair, tile_expert


def gather_slots(rows, slot_pair, top_k):
    """[pairs, ...] view of `rows` [R, ...] through the slot map; padding slots read zeros."""
    padded = torch.cat([rows, rows.new_zeros((1,) + rows.shape[1:])])
    return padded[slot_pair // top_k]  # padding pair id R·k maps to the zero row R


def scatter_slots(values, slot_pair, pairs):
    """Inverse of the slot map: [slots, ...] -> [pairs, ...], dropping padding slots."""
    out = values.new_zeros((pairs + 1,) + values.shape[1:])
    out[slot_pair] = values
    return out[:pairs]


# ---------------------------------------------------------------------------------------------
# Experts, grouped.


def _sum_tiles(per_tile, sum_index, experts):
    """Σ over tiles of each expert: [T, ...] -> [E, ...], tile t added to expert sum_index[t]; a tile
    of padding alone (sum_index E) to none. By index_add, not a GEMM with the tile->expert one-hot,
    whose 0·NaN gave every expert a NaN of one expert's tiles, one that no row chose among them
    (the trailing tiles of padding take expert E-1's weights: a review's). index_add is also ~3.6x
    faster on the CPU here (torch 2.13, [40, 128, 512] tiles); on CUDA it adds in no fixed order
    unless torch.use_deterministic_algorithms is on, as eager's own index_add spellings do."""
    out = per_tile.new_zeros((experts + 1,) + per_tile.shape[1:])
    return out.index_add(0, sum_index, per_tile)[:experts]


def _expert_tiles(x_slots, tile_expert, w1, b1, w3, act):
    """Pre-activations of every tile: u [T,tile,F] (and u3 for swiglu) and h = act(u)."""
    if b1 is not None:
        u = torch.baddbmm(b1[tile_expert][:, None, :], x_slots, w1[tile_expert])
    else:
        u = torch.bmm(x_slots, w1[tile_expert])
    u3 = torch.bmm(x_slots, w3[tile_expert]) if w3 is not None else None
    return u, u3, act_forward(act, u, u3)


def moe_forward(x, weight, index, w1, b1, w2, b2, w3, act):
    """out [R,D] = Σ_j w_j f_{idx_j}(x), computing only the chosen experts."""
    R, D = x.shape
    E, _, F = w1.shape
    top_k = index.shape[1]
    tile = tile_rows(R * top_k, E)
    slot_pair, tile_expert = group_by_expert(index, E, tile)
    T = tile_expert.numel()
    x_slots = gather_slots(x, slot_pair, top_k).view(T, tile, D)
    w_slots = torch.cat([weight.reshape(-1), weight.new_zeros(1)])[slot_pair].view(T, tile, 1)
    _, _, h = _expert_tiles(x_slots, tile_expert, w1, b1, w3, act)
    if b2 is not None:
        f = torch.baddbmm(b2[tile_expert][:, None, :], h, w2[tile_expert])
    else:
        f = torch.bmm(h, w2[tile_expert])
    contrib = scatter_slots((w_slots * f).view(T * tile, D), slot_pair, R * top_k)
    return contrib.view(R, top_k, D).sum(1)


def moe_masked(x, weight, index, w1, b1, w2, b2, w3, act):
    """moe_forward's out as a loop over the experts, each on every row and kept where the row chose
    it (E/k times the work): out-of-place ops only, which torch.func's transforms take (vmap refuses
    moe_forward's writes into a buffer it made, a review's per-sample gradients in a compiled graph)."""
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        chosen = index == e  # [R,k]
        u = x @ w1[e] if b1 is None else x @ w1[e] + b1[e]
        h = act_forward(act, u, None if w3 is None else x @ w3[e])
        f = h @ w2[e] if b2 is None else h @ w2[e] + b2[e]
        gate = (weight * chosen).sum(-1, keepdim=True)
        out = out + torch.where(chosen.any(-1, keepdim=True), gate * f, 0.0)
    return out


def moe_backward(grad_out, x, weight, index, w1, b1, w2, b2, w3, act):
    """Gradients of the experts: ∂x [R,D], ∂w [R,k], ∂W1, ∂b1, ∂W2, ∂b2, ∂W3 (recomputes u)."""
    R, D = x.shape
    E, _, F = w1.shape
    top_k = index.shape[1]
    tile = tile_rows(R * top_k, E)
    slot_pair, tile_expert = group_by_expert(index, E, tile)
    T = tile_expert.numel()
    x_slots = gather_slots(x, slot_pair, top_k).view(T, tile, D)
    g_slots = gather_slots(grad_out, slot_pair, top_k).view(T, tile, D)
    w_slots = torch.cat([weight.reshape(-1), weight.new_zeros(1)])[slot_pair].view(T, tile, 1)
    u, u3, h = _expert_tiles(x_slots, tile_expert, w1, b1, w3, act)
    # ∂w = ⟨G, h W2 + b2⟩ = ⟨G W2ᵀ, h⟩ + ⟨G, b2⟩: G W2ᵀ is needed for ∂h anyway, so f is
    # never recomputed (one GEMM fewer than the textbook order).
    g_hidden = g_slots @ w2[tile_expert].transpose(1, 2)  # [T,tile,F]
    grad_w_slots = (g_hidden * h).sum(-1)
    if b2 is not None:
        grad_w_slots = grad_w_slots + (g_slots * b2[tile_expert][:, None, :]).sum(-1)
    grad_weight = scatter_slots(grad_w_slots.view(-1), slot_pair, R * top_k)
    grad_f = w_slots * g_slots  # [T,tile,D]
    # a tile's first slot is padding only in the trailing tiles, which hold no pair: their sums
    # (NaN where expert E-1's weights are not finite, which those tiles take) go to no expert
    sum_index = torch.where(slot_pair.view(T, tile)[:, 0] < R * top_k, tile_expert, E)
    grad_w2 = _sum_tiles(h.transpose(1, 2) @ grad_f, sum_index, E)
    grad_b2 = None if b2 is None else _sum_tiles(grad_f.sum(1), sum_index, E)
    grad_h = w_slots * g_hidden
    grad_u, grad_u3 = act_backward(act, grad_h, u, u3)
    grad_w1 = _sum_tiles(x_slots.transpose(1, 2) @ grad_u, sum_index, E)
    grad_b1 = None if b1 is None else _sum_tiles(grad_u.sum(1), sum_index, E)
    grad_x_slots = grad_u @ w1[tile_expert].transpose(1, 2)
    grad_w3 = None
    if w3 is not None:
        grad_w3 = _sum_tiles(x_slots.transpose(1, 2) @ grad_u3, sum_index, E)
        grad_x_slots = grad_x_slots + grad_u3 @ w3[tile_expert].transpose(1, 2)
    grad_x = scatter_slots(grad_x_slots.view(T * tile, D), slot_pair, R * top_k)
    grad_x = grad_x.view(R, top_k, D).sum(1)
    return grad_x, grad_weight.view(R, top_k), grad_w1, grad_b1, grad_w2, grad_b2, grad_w3


# ---------------------------------------------------------------------------------------------
# The whole region.


def reuse_size(ctx, tok, q, w1, top_k, act, mask, keep_hidden=False):
    """Elements of the `reuse` region_forward returns: none (see region_forward)."""
    return 0


def region_forward(ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3, mask, top_k, renorm, act,
                   keep_hidden=False, experts=None):
    """out [B,H,D] and what the backward keeps: inv [B,D], attn [B,N,P], topk weight and index,
    the router's softmax π [R,E], and `reuse`, empty here (int32, no elements): the kernel sets'
    buffer of what their backward takes from the forward (triton_region); this one computes it all
    again, keep_hidden or not (the kernel sets' setting, which keeps the experts' u).
    experts: the MoE's function, moe_forward unless given (moe_masked, for torch.func's transforms).

    Computes in fp32 (fp64 for fp64 inputs) and returns `out` in the input dtype.
    """
    acc = accumulation_dtype(ctx.dtype)
    B, H, D = ctx.shape
    c = lambda t: None if t is None else t.to(acc)
    inv, attn = pool_forward(c(tok), c(q), c(wk), c(wv), c(bv), c(wo), c(bo), mask)
    x = (c(ctx) + inv[:, None, :]).reshape(B * H, D)
    probs, weight, index = route(x, c(wg), top_k, renorm)
    out = (experts or moe_forward)(x, weight, index, c(w1), c(b1), c(w2), c(b2), c(w3), act)
    index = index.to(torch.int32)
    return out.view(B, H, D).to(ctx.dtype), inv, attn, weight, index, probs, index.new_empty(0)


def region_at(ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3, mask, index, renorm, act):
    """(out, inv) of region_forward with the experts already chosen (`index` [R,k], the forward's),
    in plain differentiable ops: what a backward with create_graph=True differentiates
    (double_backward.py). The choice takes no gradient, as top-k's does not in eager."""
    inv = pool_at(tok, q, wk, bk, wv, bv, wo, bo, mask)[0]
    return moe_at(ctx, inv, wg, w1, b1, w2, b2, w3, index, renorm, act)[0], inv


def pool_at(tok, q, wk, bk, wv, bv, wo, bo, mask):
    """(inv,): the pool in tok's accumulation dtype, as region_at reads it (bk cancels)."""
    c = lambda t: None if t is None else t.to(accumulation_dtype(tok.dtype))
    return (pool_forward(c(tok), c(q), c(wk), c(wv), c(bv), c(wo), c(bo), mask)[0],)


def moe_at(ctx, inv, wg, w1, b1, w2, b2, w3, index, renorm, act):
    """(out,): the MoE on y = ctx + inv[b] at the top-k choice `index`, out in ctx's dtype."""
    acc = accumulation_dtype(ctx.dtype)
    c = lambda t: None if t is None else t.to(acc)
    B, H, D = ctx.shape
    x = (c(ctx) + inv[:, None, :].to(acc)).reshape(B * H, D)
    index = index.long()
    weight = torch.softmax(x @ c(wg).T, dim=-1).gather(1, index)
    if renorm:
        weight = weight / weight.sum(-1, keepdim=True)
    out = moe_forward(x, weight, index, c(w1), c(b1), c(w2), c(b2), c(w3), act)
    return (out.view(B, H, D).to(ctx.dtype),)


def region_backward(grad_out, ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3, mask,
                    inv, attn, weight, index, probs, reuse, top_k, renorm, act, keep_hidden=False):
    """Gradients of every input of region_forward, in its order (None for absent optionals);
    `reuse` and keep_hidden are not read (see region_forward)."""
    acc = accumulation_dtype(ctx.dtype)
    B, H, D = ctx.shape
    c = lambda t: None if t is None else t.to(acc)
    index = index.long()
    x = (c(ctx) + inv[:, None, :]).reshape(B * H, D)
    wg_acc = c(wg)
    probs = c(probs)
    grad_x, grad_weight, *grad_experts = moe_backward(
        c(grad_out).reshape(B * H, D), x, weight, index, c(w1), c(b1), c(w2), c(b2), c(w3), act)
    grad_x_router, grad_wg = route_backward(grad_weight, x, wg_acc, probs, weight, index, renorm)
    grad_y = (grad_x + grad_x_router).view(B, H, D)
    grad_inv = grad_y.sum(1)  # the seed's fix: the pool's upstream gradient is Σ_h ∂y
    grad_tok, grad_q, grad_wk, grad_wv, grad_bv, grad_wo, grad_bo = pool_backward(
        grad_inv, c(tok), c(q), c(wk), c(wv), c(bv), c(wo), attn, mask)
    grad_bk = None if bk is None else torch.zeros_like(bk)
    grad_w1, grad_b1, grad_w2, grad_b2, grad_w3 = grad_experts
    grads = (grad_y, grad_tok, grad_q, grad_wk, grad_bk, grad_wv, grad_bv, grad_wo, grad_bo,
             grad_wg, grad_w1, grad_b1, grad_w2, grad_b2, grad_w3)
    inputs = (ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3)
    return tuple(None if t is None else g.to(t.dtype) for g, t in zip(grads, inputs))
