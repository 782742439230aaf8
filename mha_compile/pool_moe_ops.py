"""The fused region as two custom ops, `mha::pool` then `mha::moe`, for a graph replayed whole as
CUDA graphs (whole_graph.plan_pool_split).

Under mode="reduce-overhead" the CUDA-graph trees copy every input that is not static into the
graph's own memory before each replay. tok [B,N,D] is the largest: 512 MiB at the large preset
in bf16, and a large training step took 5.419 ms with it copied against 5.059 with it read in
place (H200, bench/results/step_profile_keep_large_s40.txt). The pool is tok's only reader,
forward and backward, so whole_graph runs the pool eagerly, between the graphs, on tok where it
is, and captures the rest: for that the region is these two ops. They run kernels="fused"'s own
pieces (triton_region.pool_forward, moe_forward, moe_backward and pool_backward), the
kernels mha::region runs, in its order, and so give its outputs and gradients.

    mha::pool(tok, q, wk, bk, wv, bv, wo, bo, mask) -> inv [B,D], attn [B,N,P], u [P,D], pooled [B,D]
    mha::moe(ctx, inv, wg, w1, b1, w2, b2, w3, top_k, renorm, act, keep_hidden)
        -> out [B,H,D], weight [R,k], index [R,k], π [R,E], reuse

inv, attn, u (the directions) and pooled (the heads' output) are fp32; attn, u and pooled are
what the pool's backward reads, as mha::region's `reuse` holds u and pooled. mha::moe's
`reuse` is the MoE's part of mha::region's (the MoE's u with keep_hidden, the expert layout).
Both ops take one dtype (the fused kernels' one-dtype case: whole_graph splits nothing else).
The backward is one op each (mha::pool_backward, mha::moe_backward), as for mha::region, so that
AOTAutograd traces it as one node; ∂inv flows from the MoE's backward to the pool's by autograd.
"""
import contextlib
from typing import Optional

import torch
from torch import Tensor

from mha_compile.double_backward import differentiating, gradients_with_graph, refuse_batched
from mha_compile.kernels import reference, triton_moe, triton_region
from mha_compile.ops import _no_autocast, _plain, _traced

MERGE = "on_load"  # kernels="fused"'s merge (triton_region): y = ctx + inv[b] formed as it is loaded
POOL_INPUTS = ("tok", "q", "wk", "bk", "wv", "bv", "wo", "bo")
MOE_INPUTS = ("ctx", "inv", "wg", "w1", "b1", "w2", "b2", "w3")


def _launching(t):
    """Autocast off (ops._no_autocast) and t's device current: Triton launches on the current
    device, not on its tensors' (ops._kernel_call)."""
    stack = contextlib.ExitStack()
    stack.enter_context(_no_autocast(t))
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        stack.enter_context(torch.cuda.device(t.device))
    return stack


def _check_one_dtype(names, tensors, dtype):
    for name, t in zip(names, tensors):
        torch._check(t is None or t.dtype == dtype,
                     lambda: f"{name} is {t.dtype}: the split region's ops take one dtype ({dtype}), "
                             "as the fused kernels' one-dtype case")


def _pool(tok: Tensor, q: Tensor, wk: Tensor, bk: Optional[Tensor], wv: Tensor, bv: Optional[Tensor], wo: Tensor,
          bo: Optional[Tensor], mask: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(inv, attn, u, pooled): the pool of SPEC §1 on the fused kernels; bk cancels (∂bk = 0)."""
    with _launching(tok):
        pooled = torch.empty(tok.shape[0], tok.shape[2], device=tok.device, dtype=torch.float32)
        inv, attn, weights = triton_region.pool_forward(tok, q, wk, wv, bv, wo, bo, mask, pooled=pooled)
        return inv, attn, weights[-1], pooled


pool = torch.library.custom_op("mha::pool", mutates_args=())(_pool)


@pool.register_fake
def _pool_fake(tok, q, wk, bk, wv, bv, wo, bo, mask):
    B, N, D = tok.shape
    P = q.shape[0]
    torch._check(P * q.shape[1] == D, lambda: f"q must be [P,D/P] with P·Dh = D={D}, got {tuple(q.shape)}")
    _check_one_dtype(POOL_INPUTS[1:], (q, wk, bk, wv, bv, wo, bo), tok.dtype)
    f32 = dict(dtype=torch.float32)
    return tok.new_empty(B, D, **f32), tok.new_empty(B, N, P, **f32), tok.new_empty(P, D, **f32), \
        tok.new_empty(B, D, **f32)


def _pool_backward(grad_inv: Tensor, tok: Tensor, q: Tensor, wk: Tensor, bk: Optional[Tensor], wv: Tensor,
                   bv: Optional[Tensor], wo: Tensor, bo: Optional[Tensor], attn: Tensor, u: Tensor,
                   pooled: Tensor, mask: Optional[Tensor] = None) -> list[Tensor]:
    """Gradients of POOL_INPUTS, in order (an empty tensor for an absent bias), from ∂inv; mask:
    the forward's (its rows with every key masked attend to nothing)."""
    with _launching(tok):
        grads = triton_region.pool_backward(grad_inv, tok, q, wk, bk, wv, bv, wo, attn, u, pooled, mask=mask)
        inputs = (tok, q, wk, bk, wv, bv, wo, bo)
        return [tok.new_empty(0) if t is None else g.to(t.dtype).contiguous() for g, t in zip(grads, inputs)]


pool_backward = torch.library.custom_op("mha::pool_backward", mutates_args=())(_pool_backward)


@pool_backward.register_fake
def _pool_backward_fake(grad_inv, tok, q, wk, bk, wv, bv, wo, bo, attn, u, pooled, mask=None):
    return [tok.new_empty(0) if t is None else t.new_empty(t.shape) for t in (tok, q, wk, bk, wv, bv, wo, bo)]


def _save(ctx, tensors, output):
    """Keep an op's tensor inputs (absent ones noted) and its outputs after the first, which take
    no gradient (and get no materialised zeros: ops._setup_context says what those cost)."""
    ctx.absent = [t is None for t in tensors]
    ctx.save_for_backward(*[t for t in tensors if t is not None], *output[1:])
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[1:])


def _saved(ctx):
    """(the inputs _save kept, None where absent; the outputs it kept)."""
    saved = list(ctx.saved_tensors)
    return [None if absent else saved.pop(0) for absent in ctx.absent], saved


def _pool_setup_context(ctx, inputs, output):
    _save(ctx, inputs[:9], output)  # the mask too: a backward with create_graph=True reads it


def _pool_autograd_backward(ctx, grad_inv, *unused):
    """attn, u and pooled take no gradient; a None ∂inv (inv unused) gives none to the inputs."""
    refuse_batched(grad_inv)
    tensors, saved = _saved(ctx)
    if grad_inv is None:
        return (None,) * 9
    args = (grad_inv.contiguous(), *tensors[:8], *saved)  # saved: attn, u, pooled
    if differentiating(grad_inv, *tensors) and not _traced(args):  # create_graph=True: double_backward.py
        with _no_autocast(tensors[0]):
            grads = gradients_with_graph(reference.pool_at, tensors, (grad_inv,))
    else:
        grads = pool_backward(*args, mask=tensors[8]) if _traced(args) else _pool_backward(*args, mask=tensors[8])
    return (*[None if t is None else g for g, t in zip(grads, tensors[:8])], None)


pool.register_autograd(_pool_autograd_backward, setup_context=_pool_setup_context)


class PoolFunction(torch.autograd.Function):
    """mha::pool's forward and backward without the custom op's dispatch, for a caller that runs
    eagerly and that nothing traces (whole_graph's pool before the CUDA graphs), as
    ops.RegionFunction is for mha::region: the same pieces, outputs and gradients. The op's
    dispatch and autograd wrapper cost a forward and backward 140-180 us more host time than this
    (bench/pool_op_host.py, the kernels stubbed, on session 41's CPU: 467-506 against 288-343 us)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _pool(*inputs)
        _pool_setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, grad_inv, *unused):
        return _pool_autograd_backward(ctx, grad_inv, *unused)


@torch.library.custom_op("mha::moe", mutates_args=())
def moe(ctx: Tensor, inv: Tensor, wg: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
        w3: Optional[Tensor], top_k: int, renorm: bool, act: str, keep_hidden: bool = False
        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, weight, index, π, reuse): the MoE of SPEC §1 on y = ctx + inv[b], on the fused
    kernels; keep_hidden: as mha::region's."""
    with _launching(ctx):
        reuse = torch.empty(triton_region.moe_reuse_size(ctx, w1, top_k, act, keep_hidden), device=ctx.device,
                            dtype=torch.int32)
        layout, hidden = triton_region.moe_reuse_parts(reuse, ctx, w1, top_k, act, keep_hidden)
        out, weight, index, probs, _ = triton_region.moe_forward(MERGE, ctx, inv, wg, w1, b1, w2, b2, w3, top_k,
                                                                 renorm, act, layout, hidden)
        return _plain(out), weight, index, probs, reuse  # not a view: see ops._forward


@moe.register_fake
def _moe_fake(ctx, inv, wg, w1, b1, w2, b2, w3, top_k, renorm, act, keep_hidden=False):
    B, H, D = ctx.shape
    E = wg.shape[0]
    torch._check(tuple(inv.shape) == (B, D) and inv.dtype == torch.float32,
                 lambda: f"inv must be [B={B},D={D}] fp32 (mha::pool's), got {tuple(inv.shape)} {inv.dtype}")
    torch._check(1 <= top_k <= E, lambda: f"top_k={top_k}: expected 1 <= top_k <= E={E}")
    _check_one_dtype(MOE_INPUTS[2:], (wg, w1, b1, w2, b2, w3), ctx.dtype)
    R, f32 = B * H, dict(dtype=torch.float32)
    return (ctx.new_empty(B, H, D), ctx.new_empty(R, top_k, **f32), ctx.new_empty(R, top_k, dtype=torch.int32),
            ctx.new_empty(R, E, **f32),
            ctx.new_empty(triton_region.moe_reuse_size(ctx, w1, top_k, act, keep_hidden), dtype=torch.int32))


def _moe_backward(grad_out: Tensor, ctx: Tensor, inv: Tensor, wg: Tensor, w1: Tensor, b1: Optional[Tensor],
                  w2: Tensor, b2: Optional[Tensor], w3: Optional[Tensor], weight: Tensor, index: Tensor,
                  probs: Tensor, reuse: Tensor, top_k: int, renorm: bool, act: str, keep_hidden: bool = False
                  ) -> list[Tensor]:
    """Gradients of MOE_INPUTS, in order (an empty tensor for an absent one): ∂inv = Σ_h ∂y."""
    with _launching(ctx):
        layout, hidden = triton_region.moe_reuse_parts(reuse, ctx, w1, top_k, act, keep_hidden)
        index = index.contiguous()
        groups = triton_moe.Groups.from_buffer(layout, index, w1.shape[0])
        grads = triton_region.moe_backward(MERGE, grad_out, ctx, inv, wg, w1, b1, w2, b2, w3, weight, index, probs,
                                           groups, hidden, renorm, act, wg.dtype)
        inputs = (ctx, inv, wg, w1, b1, w2, b2, w3)
        return [ctx.new_empty(0) if t is None else g.to(t.dtype).contiguous() for g, t in zip(grads, inputs)]


moe_backward = torch.library.custom_op("mha::moe_backward", mutates_args=())(_moe_backward)


@moe_backward.register_fake
def _moe_backward_fake(grad_out, ctx, inv, wg, w1, b1, w2, b2, w3, weight, index, probs, reuse, top_k, renorm, act,
                       keep_hidden=False):
    return [ctx.new_empty(0) if t is None else t.new_empty(t.shape) for t in (ctx, inv, wg, w1, b1, w2, b2, w3)]


def _moe_setup_context(ctx, inputs, output):
    _save(ctx, inputs[:8], output)
    ctx.config = (*inputs[8:11], bool(inputs[11]) if len(inputs) > 11 else False)  # top_k, renorm, act, keep_hidden


def _moe_autograd_backward(ctx, grad_out, *unused):
    """weight, index, π and reuse take no gradient; a None ∂out gives none to the inputs."""
    refuse_batched(grad_out)
    tensors, saved = _saved(ctx)
    if grad_out is None:
        return (None,) * 12
    args = (grad_out.contiguous(), *tensors, *saved, *ctx.config)  # saved: weight, index, π, reuse
    if differentiating(grad_out, *tensors) and not _traced(args):  # create_graph=True: double_backward.py
        top_k, renorm, act, _ = ctx.config
        at = lambda *t: reference.moe_at(*t, index=saved[1], renorm=renorm, act=act)
        with _no_autocast(tensors[0]):
            grads = gradients_with_graph(at, tensors, (grad_out,))
    else:
        grads = moe_backward(*args) if _traced(args) else _moe_backward(*args)
    return (*[None if t is None else g for g, t in zip(grads, tensors)], None, None, None, None)


moe.register_autograd(_moe_autograd_backward, setup_context=_moe_setup_context)
