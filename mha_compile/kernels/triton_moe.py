"""The top-k experts as grouped GEMMs over expert-sorted tiles, forward and backward.

Grouping (`group_by_expert`, torch ops on the device, no host sync): the R·k (row, slot j)
pairs are stable-sorted by expert and laid out in tiles of TILE slots, each tile owned by one
expert, each expert's run padded to a whole number of tiles. The tile count has the host-known
bound T = ceil((R·k + E·(TILE−1)) / TILE), so every grid below is sized from shapes alone and
the whole path can be captured in a CUDA graph. A padding slot holds pair id R·k; the programs
of an all-padding tile skip their K loop and write zeros ("padding rows zero-filled").

Forward, per tile t (expert e) and output block:
    GEMM1   h[s] = act(x[row(s)] W1[e] + b1[e])   (swiglu: silu(u) ⊙ x W3[e])
            x = ctx[r] + inv[r // H] is formed in the A-tile load: y is never written (fused)
    GEMM2   c[s] = w[s] · (h[s] W2[e] + b2[e])   fp32, the routing weight in the epilogue
    combine out[r] = Σ_j c[slot(r, j)]           token order, fixed j order: no atomics
Backward (recomputing u = x W1 + b1 rather than storing it):
    hidden  per (tile, F block), one K loop over D for both u = x W1[e] and g = G W2[e]ᵀ:
            h = act(u); ∂u = (w · g) ⊙ act′(u); per-F-block partial ∂w = Σ_f h g (+ ⟨G, b2[e]⟩)
    dX      ∂x[s] = ∂u W1[e]ᵀ (+ ∂u3 W3[e]ᵀ)        the GEMM2 kernel with other strides
    dW      ∂W2[e] = Σ_{s∈e} h[s]ᵀ (w G)[s], ∂W1[e] = Σ x[s]ᵀ ∂u[s] (∂W3 likewise), biases as
            row sums: one program per (e, block), a fixed-order loop over e's slots
The router gradient, the per-row sums over j and ∂inv = Σ_h ∂y happen in
triton_router.router_combine_backward. All accumulation is fp32; row offsets are int64.
"""
import torch
import triton
import triton.language as tl

from mha_compile.kernels.triton_util import (ACT_CODE, SWIGLU, Launcher, act_bwd, act_fwd, dot_precision,
                                             load_x, pow2)


# ---------------------------------------------------------------------------------------------
# Kernels.


@triton.jit
def _moe_up_kernel(
    x_ptr, inv_ptr, slot_pair_ptr, tile_expert_ptr, w1_ptr, b1_ptr, w3_ptr, h_ptr,
    PAIRS, H, D, F,
    TOP_K: tl.constexpr, HAS_INV: tl.constexpr, HAS_B1: tl.constexpr, ACT: tl.constexpr,
    PRECISION: tl.constexpr, TILE: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """h [S,F] = act(x W1[e] + b1[e]) per slot (x gathered, merged on load); W1 [E,D,F]."""
    t = tl.program_id(0)
    offs_f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = offs_f < F
    offs_s = t.to(tl.int64) * TILE + tl.arange(0, TILE)
    pair = tl.load(slot_pair_ptr + offs_s)
    valid = pair < PAIRS
    rows = pair // TOP_K
    e = tl.load(tile_expert_ptr + t).to(tl.int64)
    # An all-padding tile (its first slot is padding) skips the K loop.
    k_end = tl.where(tl.load(slot_pair_ptr + t.to(tl.int64) * TILE) < PAIRS, D, 0)
    acc = tl.zeros([TILE, BLOCK_F], tl.float32)
    acc3 = tl.zeros([TILE, BLOCK_F], tl.float32)
    w1_e = w1_ptr + e * D * F
    w3_e = w3_ptr + e * D * F
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < D
        a = load_x(x_ptr, inv_ptr, rows, valid, offs_k, k_ok, H, D, HAS_INV).to(w1_ptr.dtype.element_ty)
        w_off = offs_k[:, None].to(tl.int64) * F + offs_f[None, :]
        w_ok = k_ok[:, None] & f_ok[None, :]
        acc = tl.dot(a, tl.load(w1_e + w_off, mask=w_ok, other=0.0), acc, input_precision=PRECISION)
        if ACT == 3:
            acc3 = tl.dot(a, tl.load(w3_e + w_off, mask=w_ok, other=0.0), acc3, input_precision=PRECISION)
    if HAS_B1:
        acc += tl.load(b1_ptr + e * F + offs_f, mask=f_ok, other=0.0).to(tl.float32)[None, :]
    h = tl.where(valid[:, None], act_fwd(acc, acc3, ACT), 0.0)
    tl.store(h_ptr + offs_s[:, None] * F + offs_f[None, :], h.to(h_ptr.dtype.element_ty), mask=f_ok[None, :])


@triton.jit
def _moe_slots_gemm_kernel(
    a_ptr, b_ptr, a2_ptr, b2_ptr, bias_ptr, scale_ptr, slot_pair_ptr, tile_expert_ptr, out_ptr,
    PAIRS, K, NOUT,
    stride_be, stride_bk, stride_bn,
    HAS_A2: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
    PRECISION: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out [S,NOUT] fp32 = scale[pair] · (a[s] B[e] (+ a2[s] B2[e]) + bias[e]); 0 on padding.

    a, a2 [S,K] per slot; B, B2 [E, K, NOUT] addressed through strides, so the GEMM2 of the
    forward (B = W2) and ∂x of the backward (B = W1ᵀ, W3ᵀ) are the same kernel.
    """
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < NOUT
    offs_s = t.to(tl.int64) * TILE + tl.arange(0, TILE)
    pair = tl.load(slot_pair_ptr + offs_s)
    valid = pair < PAIRS
    e = tl.load(tile_expert_ptr + t).to(tl.int64)
    k_end = tl.where(tl.load(slot_pair_ptr + t.to(tl.int64) * TILE) < PAIRS, K, 0)
    acc = tl.zeros([TILE, BLOCK_N], tl.float32)
    b_e = b_ptr + e * stride_be
    b2_e = b2_ptr + e * stride_be
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a_off = offs_s[:, None] * K + offs_k[None, :]
        b_off = offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :] * stride_bn
        b_ok = k_ok[:, None] & n_ok[None, :]
        a = tl.load(a_ptr + a_off, mask=k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.load(b_e + b_off, mask=b_ok, other=0.0), acc, input_precision=PRECISION)
        if HAS_A2:
            a2 = tl.load(a2_ptr + a_off, mask=k_ok[None, :], other=0.0)
            acc = tl.dot(a2, tl.load(b2_e + b_off, mask=b_ok, other=0.0), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * NOUT + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + pair, mask=valid, other=0.0)[:, None]
    acc = tl.where(valid[:, None], acc, 0.0)
    tl.store(out_ptr + offs_s[:, None] * NOUT + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=n_ok[None, :])


@triton.jit
def _combine_fwd_kernel(
    c_ptr, pair_slot_ptr, out_ptr, R, D,
    TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out [R,D] = Σ_j c[slot(r, j)] in j order (deterministic; no atomics)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    r_ok = rows < R
    ok = r_ok[:, None] & (offs_d < D)[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.load(pair_slot_ptr + rows.to(tl.int64) * TOP_K + j, mask=r_ok, other=0).to(tl.int64)
        acc += tl.load(c_ptr + slot[:, None] * D + offs_d[None, :], mask=ok, other=0.0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + offs_d[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _moe_bwd_hidden_kernel(
    x_ptr, inv_ptr, g_ptr, slot_pair_ptr, tile_expert_ptr, weight_ptr,
    w1_ptr, b1_ptr, w3_ptr, w2_ptr, b2_ptr,
    h_ptr, du_ptr, du3_ptr, gw_ptr,
    PAIRS, H, D, F, N_FBLK,
    TOP_K: tl.constexpr, HAS_INV: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr,
    ACT: tl.constexpr, PRECISION: tl.constexpr, TILE: tl.constexpr, BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Per slot s and F block: u = x W1[e] + b1, g = G[row] W2[e]ᵀ (one K loop over D);
    h = act(u) [S,F]; ∂u = (w g) ⊙ act′(u) [S,F] (∂u3 for swiglu); gw [S,N_FBLK] = Σ_f h g
    (+ ⟨G[row], b2[e]⟩ in F block 0), so that ∂w = Σ_blocks gw = ⟨G, h W2 + b2⟩."""
    t = tl.program_id(0)
    pid_f = tl.program_id(1)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = offs_f < F
    offs_s = t.to(tl.int64) * TILE + tl.arange(0, TILE)
    pair = tl.load(slot_pair_ptr + offs_s)
    valid = pair < PAIRS
    rows = pair // TOP_K
    e = tl.load(tile_expert_ptr + t).to(tl.int64)
    k_end = tl.where(tl.load(slot_pair_ptr + t.to(tl.int64) * TILE) < PAIRS, D, 0)
    acc_u = tl.zeros([TILE, BLOCK_F], tl.float32)
    acc_u3 = tl.zeros([TILE, BLOCK_F], tl.float32)
    acc_g = tl.zeros([TILE, BLOCK_F], tl.float32)
    gb2 = tl.zeros([TILE], tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < D
        w_ok = k_ok[:, None] & f_ok[None, :]
        a = load_x(x_ptr, inv_ptr, rows, valid, offs_k, k_ok, H, D, HAS_INV).to(w1_ptr.dtype.element_ty)
        w_off = e * D * F + offs_k[:, None].to(tl.int64) * F + offs_f[None, :]
        acc_u = tl.dot(a, tl.load(w1_ptr + w_off, mask=w_ok, other=0.0), acc_u, input_precision=PRECISION)
        if ACT == 3:
            acc_u3 = tl.dot(a, tl.load(w3_ptr + w_off, mask=w_ok, other=0.0), acc_u3, input_precision=PRECISION)
        g = tl.load(g_ptr + rows.to(tl.int64)[:, None] * D + offs_k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        # W2[e] is [F,D]: read its [BLOCK_K, BLOCK_F] transpose through strides.
        w2t = tl.load(w2_ptr + e * F * D + offs_f[None, :].to(tl.int64) * D + offs_k[:, None], mask=w_ok, other=0.0)
        acc_g = tl.dot(g.to(w2_ptr.dtype.element_ty), w2t, acc_g, input_precision=PRECISION)
        if HAS_B2:
            b2 = tl.load(b2_ptr + e * D + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            gb2 += tl.sum(g.to(tl.float32) * b2[None, :], axis=1)
    if HAS_B1:
        acc_u += tl.load(b1_ptr + e * F + offs_f, mask=f_ok, other=0.0).to(tl.float32)[None, :]
    h = act_fwd(acc_u, acc_u3, ACT)
    gw = tl.sum(tl.where(f_ok[None, :], h * acc_g, 0.0), axis=1)
    gw += tl.where(pid_f == 0, gb2, 0.0)
    tl.store(gw_ptr + offs_s * N_FBLK + pid_f, tl.where(valid, gw, 0.0))
    w = tl.load(weight_ptr + pair, mask=valid, other=0.0)
    du, du3 = act_bwd(w[:, None] * acc_g, acc_u, acc_u3, ACT)
    out_off = offs_s[:, None] * F + offs_f[None, :]
    keep = valid[:, None]
    tl.store(h_ptr + out_off, tl.where(keep, h, 0.0).to(h_ptr.dtype.element_ty), mask=f_ok[None, :])
    tl.store(du_ptr + out_off, tl.where(keep, du, 0.0).to(du_ptr.dtype.element_ty), mask=f_ok[None, :])
    if ACT == 3:
        tl.store(du3_ptr + out_off, tl.where(keep, du3, 0.0).to(du3_ptr.dtype.element_ty), mask=f_ok[None, :])


@triton.jit
def _moe_wgrad_kernel(
    a_ptr, inv_ptr, b_ptr, b2_ptr, weight_ptr, slot_pair_ptr, expert_slots_ptr,
    dw_ptr, dw2_ptr, db_ptr,
    PAIRS, H, I, J, E,
    TOP_K: tl.constexpr, A_GATHER: tl.constexpr, HAS_INV: tl.constexpr, B_GATHER: tl.constexpr,
    HAS_B2: tl.constexpr, HAS_DB: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """∂W[e] [I,J] = Σ_{s ∈ e} A[s]ᵀ B[s] over expert e's slots, in slot order (deterministic).

    A: per-slot rows of a_ptr [S,I], or (A_GATHER) x[row(s)] = a_ptr[row] (+ inv[row // H]).
    B: per-slot rows of b_ptr [S,J], or (B_GATHER) w[pair] · b_ptr[row] (the weighted ∂out).
    HAS_B2: also ∂W2[e] = Σ A[s]ᵀ B2[s] (B2 per slot). HAS_DB: ∂b[e] = Σ_s B[s] (I-block 0).
    """
    e = tl.program_id(0)
    pid_i = tl.program_id(1)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    i_ok = offs_i < I
    j_ok = offs_j < J
    lo = tl.load(expert_slots_ptr + e)
    hi = tl.load(expert_slots_ptr + E + e)
    acc = tl.zeros([BLOCK_I, BLOCK_J], tl.float32)
    acc2 = tl.zeros([BLOCK_I, BLOCK_J], tl.float32)
    db = tl.zeros([BLOCK_J], tl.float32)
    for s0 in range(lo, hi, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S).to(tl.int64)
        pair = tl.load(slot_pair_ptr + offs_s, mask=offs_s < hi, other=PAIRS)
        valid = pair < PAIRS
        rows = pair // TOP_K
        if A_GATHER:
            a = load_x(a_ptr, inv_ptr, rows, valid, offs_i, i_ok, H, I, HAS_INV)
        else:
            a = tl.load(a_ptr + offs_s[:, None] * I + offs_i[None, :], mask=valid[:, None] & i_ok[None, :], other=0.0)
        sj_ok = valid[:, None] & j_ok[None, :]
        if B_GATHER:
            b = tl.load(b_ptr + rows.to(tl.int64)[:, None] * J + offs_j[None, :], mask=sj_ok, other=0.0)
            b = b.to(tl.float32) * tl.load(weight_ptr + pair, mask=valid, other=0.0)[:, None]
        else:
            b = tl.load(b_ptr + offs_s[:, None] * J + offs_j[None, :], mask=sj_ok, other=0.0)
        at = tl.trans(a.to(dw_ptr.dtype.element_ty))
        acc = tl.dot(at, b.to(dw_ptr.dtype.element_ty), acc, input_precision=PRECISION)
        if HAS_B2:
            b2 = tl.load(b2_ptr + offs_s[:, None] * J + offs_j[None, :], mask=sj_ok, other=0.0)
            acc2 = tl.dot(at, b2.to(dw_ptr.dtype.element_ty), acc2, input_precision=PRECISION)
        if HAS_DB:
            db += tl.sum(b.to(tl.float32), axis=0)
    ij_off = e.to(tl.int64) * I * J + offs_i[:, None].to(tl.int64) * J + offs_j[None, :]
    ij_ok = i_ok[:, None] & j_ok[None, :]
    tl.store(dw_ptr + ij_off, acc.to(dw_ptr.dtype.element_ty), mask=ij_ok)
    if HAS_B2:
        tl.store(dw2_ptr + ij_off, acc2.to(dw2_ptr.dtype.element_ty), mask=ij_ok)
    if HAS_DB:
        tl.store(db_ptr + e * J + offs_j, db.to(db_ptr.dtype.element_ty), mask=j_ok & (pid_i == 0))


# ---------------------------------------------------------------------------------------------
# Config lists. The first entry is the default (interpreter, MHA_COMPILE_NO_AUTOTUNE=1).
# Keys: the GEMM's K and N extents, TILE and the flags that change the work per program;
# Launcher adds the tensors' dtypes. TILE comes from the grouping, not from tuning.

_GEMM_CONFIGS = [
    dict(BLOCK_F=64, BLOCK_K=64, num_warps=4, num_stages=3),
    dict(BLOCK_F=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_F=128, BLOCK_K=32, num_warps=4, num_stages=4),
    dict(BLOCK_F=64, BLOCK_K=32, num_warps=4, num_stages=4),
]
_up = Launcher(_moe_up_kernel, _GEMM_CONFIGS, key=["D", "F", "TILE", "ACT", "HAS_INV"])
# One BLOCK_F for all: the ∂w partials [S, F/BLOCK_F] must not depend on the config (a
# config tried while tuning would otherwise leave stale columns behind).
HIDDEN_BLOCK_F = 64
_hidden = Launcher(_moe_bwd_hidden_kernel, [
    dict(BLOCK_K=32, num_warps=4, num_stages=3),
    dict(BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_K=64, num_warps=4, num_stages=4),
], key=["D", "F", "TILE", "ACT", "HAS_INV"])
_slots_gemm = Launcher(_moe_slots_gemm_kernel, [
    dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
    dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=4),
    dict(BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4),
], key=["K", "NOUT", "TILE", "HAS_A2"])
_wgrad = Launcher(_moe_wgrad_kernel, [
    dict(BLOCK_I=64, BLOCK_J=64, BLOCK_S=32, num_warps=4, num_stages=3),
    dict(BLOCK_I=128, BLOCK_J=128, BLOCK_S=32, num_warps=8, num_stages=3),
    dict(BLOCK_I=64, BLOCK_J=128, BLOCK_S=64, num_warps=8, num_stages=3),
    dict(BLOCK_I=128, BLOCK_J=64, BLOCK_S=32, num_warps=4, num_stages=4),
], key=["I", "J", "E", "A_GATHER", "B_GATHER", "HAS_B2"])


# ---------------------------------------------------------------------------------------------
# Grouping and launchers.


def tile_rows(pairs, experts):
    """TILE, the slots per tile (the grouped GEMMs' BLOCK_M): ~mean slots per expert, 16..128."""
    mean = pairs // max(1, experts)
    return 128 if mean >= 1024 else 64 if mean >= 128 else 32 if mean >= 32 else 16


class Groups:
    """The expert-sorted slot layout of one index [R,k] (see the module docstring)."""

    def __init__(self, index, experts, tile):
        pairs = index.numel()
        device = index.device
        flat = index.reshape(-1).long()
        num_tiles = -(-(pairs + experts * (tile - 1)) // tile)
        order = torch.argsort(flat, stable=True)
        sorted_expert = flat[order]
        # Sync-free counts (torch.bincount reads its max back to the host on CUDA).
        start = torch.searchsorted(sorted_expert, torch.arange(experts + 1, device=device))
        counts = start[1:] - start[:-1]
        padded = (counts + tile - 1) // tile * tile
        padded_end = torch.cumsum(padded, 0)
        padded_start = padded_end - padded
        rank = torch.arange(pairs, device=device) - start[sorted_expert]
        slot = padded_start[sorted_expert] + rank
        slot_pair = torch.full((num_tiles * tile,), pairs, dtype=torch.int64, device=device)
        slot_pair[slot] = order
        pair_slot = torch.empty(pairs, dtype=torch.int64, device=device)
        pair_slot[order] = slot
        tile_start = torch.arange(num_tiles, device=device) * tile
        tile_expert = torch.searchsorted(padded_end, tile_start, right=True).clamp_(max=experts - 1)
        self.pairs, self.tile, self.num_tiles, self.experts = pairs, tile, num_tiles, experts
        self.slots = num_tiles * tile
        self.slot_pair = slot_pair.to(torch.int32)
        self.pair_slot = pair_slot.to(torch.int32)
        self.tile_expert = tile_expert.to(torch.int32)
        self.expert_slots = torch.cat([padded_start, padded_end]).to(torch.int32)  # [2E]


def group(index, experts):
    return Groups(index, experts, tile_rows(index.numel(), experts))


def _act(act):
    return ACT_CODE[act]


def experts_up(x, inv, groups, w1, b1, w3, act, horizons):
    """h [S,F] in the weights' dtype (padding slots zero)."""
    D = x.shape[1]
    F = w1.shape[2]
    h = torch.empty(groups.slots, F, device=x.device, dtype=w1.dtype)
    _up(lambda m: (groups.num_tiles, triton.cdiv(F, m["BLOCK_F"])),
        x, x if inv is None else inv, groups.slot_pair, groups.tile_expert, w1,
        w1 if b1 is None else b1, w1 if w3 is None else w3, h, groups.pairs, horizons, D, F,
        TOP_K=groups.pairs // x.shape[0], HAS_INV=inv is not None, HAS_B1=b1 is not None,
        ACT=_act(act), PRECISION=dot_precision(w1.dtype), TILE=groups.tile)
    return h


def slots_gemm(a, b, strides, nout, groups, a2=None, b2=None, bias=None, scale=None):
    """[S, nout] fp32: scale · (a B[e] (+ a2 B2[e]) + bias[e]); `strides` = (e, k, n) of B."""
    K = a.shape[1]
    out = torch.empty(groups.slots, nout, device=a.device, dtype=torch.float32)
    _slots_gemm(lambda m: (groups.num_tiles, triton.cdiv(nout, m["BLOCK_N"])),
                a, b, a if a2 is None else a2, b if b2 is None else b2, b if bias is None else bias,
                out if scale is None else scale, groups.slot_pair, groups.tile_expert, out,
                groups.pairs, K, nout, *strides,
                HAS_A2=a2 is not None, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
                PRECISION=dot_precision(b.dtype), TILE=groups.tile)
    return out


def combine(c, groups, rows, out_dtype):
    """out [R,D] = Σ_j c[slot(r,j)]."""
    D = c.shape[1]
    out = torch.empty(rows, D, device=c.device, dtype=out_dtype)
    block_d = min(128, pow2(D))
    _combine_fwd_kernel[(triton.cdiv(rows, 16), triton.cdiv(D, block_d))](
        c, groups.pair_slot, out, rows, D, TOP_K=groups.pairs // rows, BLOCK_R=16, BLOCK_D=block_d)
    return out


def moe_forward(x, inv, weight, groups, w1, b1, w2, b2, w3, act, horizons, out_dtype):
    """out [R,D] = Σ_j w_j f_{idx_j}(x), x = x (+ inv[r // H] merged on load)."""
    E, F, D = w2.shape
    h = experts_up(x, inv, groups, w1, b1, w3, act, horizons)
    c = slots_gemm(h, w2, (F * D, D, 1), D, groups, bias=b2, scale=weight.reshape(-1))
    return combine(c, groups, x.shape[0], out_dtype)


def moe_backward(grad_out, x, inv, weight, groups, w1, b1, w2, b2, w3, act, horizons):
    """(∂x_slot [S,D] fp32, gw_part [S, F blocks] fp32, ∂W1, ∂b1, ∂W2, ∂b2, ∂W3) — weights' dtypes."""
    E, D, F = w1.shape
    R = x.shape[0]
    top_k = groups.pairs // R
    dev, wdt = x.device, w1.dtype
    h = torch.empty(groups.slots, F, device=dev, dtype=wdt)
    du = torch.empty_like(h)
    du3 = torch.empty_like(h) if w3 is not None else du
    gw = torch.empty(groups.slots, triton.cdiv(F, HIDDEN_BLOCK_F), device=dev, dtype=torch.float32)
    _hidden(lambda m: (groups.num_tiles, gw.shape[1]),
            x, x if inv is None else inv, grad_out, groups.slot_pair, groups.tile_expert, weight,
            w1, w1 if b1 is None else b1, w1 if w3 is None else w3, w2, w2 if b2 is None else b2,
            h, du, du3, gw, groups.pairs, horizons, D, F, gw.shape[1],
            TOP_K=top_k, HAS_INV=inv is not None, HAS_B1=b1 is not None, HAS_B2=b2 is not None,
            ACT=_act(act), PRECISION=dot_precision(wdt), TILE=groups.tile, BLOCK_F=HIDDEN_BLOCK_F)
    if w3 is None:
        dx_slot = slots_gemm(du, w1, (D * F, 1, F), D, groups)
    else:
        dx_slot = slots_gemm(du, w1, (D * F, 1, F), D, groups, a2=du3, b2=w3)
    prec = dot_precision(wdt)
    dw2 = torch.empty_like(w2)
    db2 = torch.empty_like(b2) if b2 is not None else None
    _wgrad(lambda m: (E, triton.cdiv(F, m["BLOCK_I"]), triton.cdiv(D, m["BLOCK_J"])),
           h, h, grad_out, h, weight, groups.slot_pair, groups.expert_slots, dw2, dw2,
           dw2 if db2 is None else db2, groups.pairs, horizons, F, D, E,
           TOP_K=top_k, A_GATHER=False, HAS_INV=False, B_GATHER=True, HAS_B2=False,
           HAS_DB=db2 is not None, PRECISION=prec)
    dw1 = torch.empty_like(w1)
    dw3 = torch.empty_like(w3) if w3 is not None else None
    db1 = torch.empty_like(b1) if b1 is not None else None
    _wgrad(lambda m: (E, triton.cdiv(D, m["BLOCK_I"]), triton.cdiv(F, m["BLOCK_J"])),
           x, x if inv is None else inv, du, du3, weight, groups.slot_pair, groups.expert_slots,
           dw1, dw1 if dw3 is None else dw3, dw1 if db1 is None else db1,
           groups.pairs, horizons, D, F, E,
           TOP_K=top_k, A_GATHER=True, HAS_INV=inv is not None, B_GATHER=False, HAS_B2=w3 is not None,
           HAS_DB=db1 is not None, PRECISION=prec)
    return dx_slot, gw, dw1, db1, dw2, db2, dw3
