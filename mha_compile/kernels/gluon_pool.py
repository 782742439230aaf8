"""The pool backward's two passes in one Gluon kernel for Hopper (sm_90), reading tok once.

triton_pool's backward (read its docstring for the math) reads tok twice at large: pass 1 for ∂s,
pass 2 for t̄ and the ∂u partials, since ∂s needs all of D and tok (512 MiB) does not stay in L2
between the passes (PERF_NOTES v31, v32). Here a program holds a batch row's tok[b] [N,D] in shared
memory (TMA, N·D·2 bytes: 128 KiB at large) and runs both passes from it on the tensor cores,
one warpgroup, rows taken in turn (a persistent grid); the next row's tok is loaded as soon as
the last product reading this one's has finished, behind ∂tok's product and stores:
    pass 1   ∂a = tok[b] ∂t̄[b]ᵀ             [N, 16]  (hi and lo halves of ∂t̄, tok exact)
             c = Σ_n a ∂a,  ∂s = a (∂a − c),  ads = [a | ∂s]
    pass 2b  tok[b]ᵀ ads                     [D, 16]  → t̄[b] and the ∂u partials (ads in halves)
    pass 2a  ∂tok[b] = ads R, R = [∂t̄[b]; u] [N, D]   (the three products of the halves)
Each product is triton_util.dot_f32's (or dot_pairs') split form: fp32 operands as bf16 hi + lo
halves, ~2⁻¹⁶ relative, as the Triton kernels compute them. Heads are held in 8 columns (P ≤ 8),
so [a | ∂s] is 16 columns: pass 1 duplicates ∂t̄'s rows to give ∂a in both halves, and every
step to [a | ∂s] is then elementwise in one layout.

Opt-in (MHA_COMPILE_POOL_GLUON=1) until it is timed against the Triton kernels on the H200.
"""
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mha_compile.kernels.triton_util import capability as cuda_capability, interpreting, num_sms

ENABLED = os.environ.get("MHA_COMPILE_POOL_GLUON", "0") == "1"
COLUMNS = 64  # tok's shared-memory tiles: [N, 64] bf16, rows of 128 bytes (the widest TMA swizzle)
HEADS = 8  # heads a kernel holds: [a | ∂s] is 2·HEADS = 16 columns, one wgmma K step
SMEM = 227 * 1024  # an H100/H200 block's shared memory


def smem_bytes(N, D):
    """Shared memory a program takes: tok[b], the directions' hi and lo halves (∂t̄ twice, and
    [∂t̄; u]), [a | ∂s]'s halves and the barrier."""
    return 2 * N * D + 4 * (2 * HEADS) * D * 2 + 2 * N * (2 * HEADS) * 2 + 8


def unsupported(tok, P, capability=None):
    """Why the kernel cannot take this backward (a sentence), or None when it can. capability:
    the GPU's (major, minor), read from tok's device when None."""
    if not ENABLED:
        return "MHA_COMPILE_POOL_GLUON is not 1"
    if capability is None:
        if not tok.is_cuda or interpreting():
            return "not on a CUDA GPU"
        capability = cuda_capability(tok.device)
    if tuple(capability) != (9, 0):
        return f"needs sm_90 (wgmma), this GPU is sm_{capability[0]}{capability[1]}"
    if tok.dtype != torch.bfloat16:
        return f"tok is {tok.dtype}: takes bf16 (the split dots' dtype)"
    B, N, D = tok.shape
    if P > HEADS or N not in (64, 128, 256) or D % COLUMNS or smem_bytes(N, D) > SMEM:
        return (f"N={N}, D={D}, P={P}: needs P ≤ {HEADS}, N of 64, 128 or 256 (a TMA box's rows and wgmma's), "
                f"D a multiple of {COLUMNS}, and {smem_bytes(N, D)} bytes of shared memory within {SMEM}")
    if not tok.is_contiguous() or tok.data_ptr() % 16:
        return "tok must be contiguous and 16-byte aligned (TMA)"
    return None


@gluon.jit
def _halves(x):
    """x (fp32) = hi + lo, both bf16 (triton_util.split16)."""
    hi = x.to(gl.bfloat16)
    return hi, (x - hi.to(gl.float32)).to(gl.bfloat16)


@gluon.jit
def _directions(dtbar_ptr, u_ptr, b, P, D, dtb_hi, dtb_lo, r_hi, r_lo, DK: gl.constexpr):
    """Row b's B operands in shared memory, fp32 as bf16 halves, a [16, 64] tile a column block k:
    dtb rows r hold ∂t̄[b, r mod 8] (pass 1's ∂a in both halves of 16 columns); R rows r < 8 hold
    ∂t̄[b, r] and rows r ≥ 8 u[r − 8] (∂tok = [a | ∂s] R). Heads ≥ P are 0."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, 2 * 8, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    p = rows % 8
    ok = (p < P)[:, None]
    for k in range(DK):
        d = (k * 64 + cols)[None, :]
        dt = gl.load(dtbar_ptr + b * P * D + p[:, None] * D + d, mask=ok, other=0.0)
        u = gl.load(u_ptr + p[:, None] * D + d, mask=ok & (rows >= 8)[:, None], other=0.0)
        hi, lo = _halves(dt)
        dtb_hi.index(k).store(hi)
        dtb_lo.index(k).store(lo)
        hi, lo = _halves(gl.where((rows < 8)[:, None], dt, u))
        r_hi.index(k).store(hi)
        r_lo.index(k).store(lo)


@gluon.jit
def _load_tok(tok_desc, tok_s, bar, b, N: gl.constexpr, DK: gl.constexpr):
    """tok[b] [N, D] into its DK tiles of [N, 64], on bar."""
    mbarrier.expect(bar, DK * tok_desc.block_type.nbytes)
    for k in gl.static_range(DK):
        tma.async_copy_global_to_shared(tok_desc, [b * N, k * 64], bar, tok_s.index(k))


@gluon.jit
def _pool_bwd_gluon_kernel(tok_desc, u_ptr, attn_ptr, dtbar_ptr, tbar_ptr, du_ptr, dtok_ptr, B, P,
                     N: gl.constexpr, D: gl.constexpr):
    """The pool backward for batch rows pid, pid + G, … (G programs): tok_desc over tok [B·N, D]
    bf16 in [N, 64] blocks; u [P,D], attn [B,N,P] and ∂t̄ [B,P,D] fp32 → ∂tok [B,N,D] (bf16), t̄ and
    the ∂u partials [B,P,D] fp32. du_ptr may be dtbar_ptr: a row's ∂t̄ is read before its ∂u
    partials are written, and no other program touches the row."""
    DK: gl.constexpr = D // 64
    Q: gl.constexpr = 16
    tok_s = gl.allocate_shared_memory(gl.bfloat16, [DK, N, 64], tok_desc.layout)
    dir_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q, 64], gl.bfloat16)
    dtb_hi = gl.allocate_shared_memory(gl.bfloat16, [DK, Q, 64], dir_layout)
    dtb_lo = gl.allocate_shared_memory(gl.bfloat16, [DK, Q, 64], dir_layout)
    r_hi = gl.allocate_shared_memory(gl.bfloat16, [DK, Q, 64], dir_layout)
    r_lo = gl.allocate_shared_memory(gl.bfloat16, [DK, Q, 64], dir_layout)
    ads_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, Q], gl.bfloat16)
    ads_hi = gl.allocate_shared_memory(gl.bfloat16, [N, Q], ads_layout)
    ads_lo = gl.allocate_shared_memory(gl.bfloat16, [N, Q], ads_layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)

    # the products' accumulators: [·, 16] for passes 1 and 2b, [N, 64] for 2a; A of 2a from registers
    acc16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    acc64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc64, k_width=2)
    tokens = gl.arange(0, N, layout=gl.SliceLayout(1, acc16))
    q = gl.arange(0, Q, layout=gl.SliceLayout(0, acc16))
    head = q % 8
    head_ok = (head < P)[None, :]
    is_a = (q < 8)[None, :]
    columns = gl.arange(0, 64, layout=gl.SliceLayout(1, acc16))  # pass 2b's rows: D columns of tok
    dtok_rows = gl.arange(0, N, layout=gl.SliceLayout(1, acc64))
    dtok_cols = gl.arange(0, 64, layout=gl.SliceLayout(0, acc64))

    pid = gl.program_id(0)
    step = gl.num_programs(0)
    _load_tok(tok_desc, tok_s, bar, pid, N, DK)
    phase = 0
    for row in range(pid, B, step):
        b = row.to(gl.int64)
        _directions(dtbar_ptr, u_ptr, b, P, D, dtb_hi, dtb_lo, r_hi, r_lo, DK)
        a = gl.load(attn_ptr + b * N * P + tokens[:, None] * P + head[None, :], mask=head_ok, other=0.0)
        fence_async_shared()
        mbarrier.wait(bar, phase)
        phase ^= 1
        # pass 1: ∂a [N, 16], each head in both halves
        da = gl.zeros([N, Q], gl.float32, acc16)
        for k in range(DK):
            da = warpgroup_mma(tok_s.index(k), dtb_hi.index(k).permute((1, 0)), da, is_async=True)
            da = warpgroup_mma(tok_s.index(k), dtb_lo.index(k).permute((1, 0)), da, is_async=True)
            da = warpgroup_mma_wait(num_outstanding=0, deps=(da,))
        c = gl.sum(a * da, axis=0)
        ads = gl.where(is_a, a, a * (da - c[None, :]))  # [a | ∂s]
        ads_h, ads_l = _halves(ads)
        ads_hi.store(ads_h)
        ads_lo.store(ads_l)
        fence_async_shared()
        # pass 2b: tok[b]ᵀ [a | ∂s] by blocks of 64 columns: t̄ in columns < 8, the ∂u partials after
        for k in range(DK):
            g = gl.zeros([64, Q], gl.float32, acc16)
            g = warpgroup_mma(tok_s.index(k).permute((1, 0)), ads_hi, g, is_async=True)
            g = warpgroup_mma(tok_s.index(k).permute((1, 0)), ads_lo, g, is_async=True)
            g = warpgroup_mma_wait(num_outstanding=0, deps=(g,))
            out = b * P * D + head[None, :] * D + (k * 64 + columns)[:, None]
            gl.store(tbar_ptr + out, g, mask=is_a & head_ok)
            gl.store(du_ptr + out, g, mask=(q >= 8)[None, :] & head_ok)
        # every product reading tok[b] is done: the next row's tok loads behind pass 2a
        if row + step < B:
            _load_tok(tok_desc, tok_s, bar, row + step, N, DK)
        # pass 2a: ∂tok [N, 64] a column block, [a | ∂s] R in halves (lo · lo dropped)
        a_hi = gl.convert_layout(ads_h, a_op)
        a_lo = gl.convert_layout(ads_l, a_op)
        for k in range(DK):
            t = gl.zeros([N, 64], gl.float32, acc64)
            t = warpgroup_mma(a_hi, r_hi.index(k), t, is_async=True)
            t = warpgroup_mma(a_hi, r_lo.index(k), t, is_async=True)
            t = warpgroup_mma(a_lo, r_hi.index(k), t, is_async=True)
            t = warpgroup_mma_wait(num_outstanding=0, deps=(t,))
            gl.store(dtok_ptr + b * N * D + dtok_rows[:, None] * D + (k * 64 + dtok_cols)[None, :],
                     t.to(gl.bfloat16))
    mbarrier.invalidate(bar)


def _tok_layout(N):
    return gl.NVMMASharedLayout.get_default_for([N, COLUMNS], gl.bfloat16)


def programs(B, N, D, sms):
    """The grid: every SM its share of programs by shared memory, no more than B."""
    return min(B, sms * max(1, SMEM // smem_bytes(N, D)))


def attend_bwd(tok, u, attn, dtbar, tbar, du, grad_tok):
    """triton_pool.attend_bwd_one's contract (ds not needed): ∂tok into grad_tok (bf16), t̄ and the
    ∂u partials into tbar and du [B,P,D] fp32, from tok [B,N,D] bf16, u [P,D] fp32, attn [B,N,P] and
    ∂t̄ [B,P,D] fp32; du may be dtbar. Callers check `unsupported` first."""
    B, N, D = tok.shape
    P = attn.shape[2]
    desc = TensorDescriptor.from_tensor(tok.view(B * N, D), [N, COLUMNS], _tok_layout(N))
    _pool_bwd_gluon_kernel[(programs(B, N, D, num_sms(tok.device)),)](
        desc, u, attn, dtbar, tbar, du, grad_tok, B, P, N=N, D=D, num_warps=4)
