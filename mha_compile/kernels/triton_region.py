"""The region assembled from the Triton kernel families; fused.py and staged.py pick the merge.

    merge="on_load" (kernels="fused"): y = ctx + inv[b] is formed inside the router's tile
        load and by the MoE's slot-row gather, which writes it once per (row, slot) in expert
        order; it is never written in token order. The backward's token-order pass produces
        ∂ctx and ∂inv = Σ_h ∂y together (triton_router.router_combine_backward, SUM_H).
    merge="cuda" (kernels="staged"): y is materialised in fp32 by the handwritten CUDA merge
        (merge_cuda; its Triton twin on CPU or without nvcc) and every later stage reads it;
        ∂inv = Σ_h ∂y is the CUDA merge's backward.

Both: pool (triton_pool) → router (triton_router) → expert grouping and grouped GEMMs
(triton_moe) → token-order combine; the backward recomputes u = x W1 + b1 rather than keeping
it (but with keep_hidden, the op's argument, or triton_moe.KEEP_HIDDEN), and the grouping and
the pool's weights as its kernels take them (_pool_f32) too unless its caller kept the forward's
(`kept`). Saved tensors mean what they mean in reference.py: inv [B,D] and attn [B,N,P] fp32, the
top-k weights [R,k] fp32 and indices [R,k] int32, and the router's softmax π [R,E] fp32.

`kept` (optional, both directions): a dict, empty for the forward, in which region_forward leaves
what the backward would otherwise compute again from the same inputs, and from which
region_backward takes it: "groups", the expert layout (triton_moe.Groups) of the index it
returns (3 launches and ~8 torch calls: `group` took ~0.2 ms of host a call at large on the
H200, bench/PERF_NOTES.md v15), and "pool", q, Wk, Wv, bv, Wo as _pool_f32 gives them (a bf16
model's weights as they are) with the pool's directions u (their casts and product took ~0.25 ms
of host a call there before session 35, bench/results/host_timers_large.txt), stamped with the
weights they came from. Each is checked
against the backward's own inputs (the same memory, not written since) and refused otherwise.
ops.RegionFunction keeps one on its autograd ctx; the custom op cannot (its outputs are tensors)
and region_graphs does not (a replay overwrites a graph's buffers).

`reuse` (the forward's seventh output, the backward's argument after π): the part of that which
fits in tensors, for the op and region_graphs: one int32 buffer holding, with keep_hidden
(options["keep_hidden"]; off by default), the MoE's pre-activations u = xs W1 + b1 [S,F] in the
compute dtype's bits first, where the buffer's own alignment makes them an operand TMA takes (after
the layout their start was 16-byte aligned only where the sizes happened to make it: at D = 104 the
Triton GEMM1 left its TMA path, and the Gluon kernels' descriptors refuse such a start); then the
expert layout (triton_moe.layout_size), the pool's directions u [P,D] and its heads' output pooled
[B,D] (both fp32 bits): reuse_size elements; empty where the reference ran. The backward reads the
layout and u where `kept` holds nothing, and pooled (for ∂Wo) always: every path saves reuse.
Under mode="reduce-overhead" (the op, traced) the layout and u spare the backward the grouping's
3 launches and the directions' 3 kernels: a medium step's kernels 0.654 → 0.646 ms on the H200,
with session 33's column sums (bench/results/step_profile_medium_reuse_{old,new}.txt); pooled
spares it one of the pool's [B,D]×[D,D]-sized products (~6 us at medium), for 4·B·D bytes kept.

Inputs the kernels do not take (see `why_unsupported`) run on reference.py, which is correct
for all of them; no input is silently approximated.
"""
import collections
import logging

import torch

from mha_compile.kernels import reference, triton_moe, triton_pool, triton_router
from mha_compile.kernels.merge_cuda import merge_backward, merge_forward
from mha_compile.kernels.triton_util import device_reason, dtype_reason, interpreting, on_gpu, stamp

MERGES = ("on_load", "cuda")
log = logging.getLogger("mha_compile")
_SAID = set()  # the reasons a call ran on the reference, said once each


# Triton 3.6's interpreter (TRITON_INTERPRET=1, the CPU) multiplies bf16 tl.dot operands as their raw
# bits (triton-lang/triton#11584: values ~1e10; fp16 and fp32 are exact), so bf16 runs on the
# reference path there: the kernels gave the block's output with relative error ~1e11 (session 44).
# Tests of plumbing that is the same whatever the numbers (a buffer kept and reused) set this.
BF16_UNDER_INTERPRETER = False


def why_unsupported(ctx, tok, w1, top_k, act, mask):
    """None when the Triton kernels take these inputs, else a short reason. Reads only dtype,
    device and shapes, so it works on fake tensors."""
    reason = dtype_reason(ctx) or device_reason(ctx)
    if reason:
        return reason
    if ctx.dtype == torch.bfloat16 and not on_gpu(ctx) and interpreting() and not BF16_UNDER_INTERPRETER:
        return ("bf16 under TRITON_INTERPRET=1 runs on the reference path: Triton's interpreter multiplies bf16 "
                "tl.dot operands as raw bits (triton-lang/triton#11584)")
    if not (_one_dtype(ctx, tok, w1) or autocast_mix(ctx, tok, w1)):
        return (f"mixed dtypes (ctx {ctx.dtype}, tok {tok.dtype}, experts {w1.dtype}) run on the "
                "reference path (the kernels take one dtype, or bf16/fp16 activations with fp32 "
                "tok and parameters, as torch.autocast hands them)")
    if tok.device != ctx.device or w1.device != ctx.device:
        return "inputs on several devices run on the reference path"
    if ctx.numel() == 0:
        return f"an empty batch (ctx {tuple(ctx.shape)}) runs on the reference path"
    D = ctx.shape[-1]
    if D > triton_pool.MAX_POOL_D:
        return f"D={D} > {triton_pool.MAX_POOL_D}: the pool kernel keeps a [P,D] tile in registers"
    E = w1.shape[0]
    if E > triton_router.MAX_EXPERTS:
        return f"E={E} > {triton_router.MAX_EXPERTS} experts: the router keeps one [rows, E] tile"
    if act not in reference.ACTIVATIONS:
        return f"act={act!r} is not one of {reference.ACTIVATIONS}"
    if mask is not None and (mask.dim() != 2 or mask.device != ctx.device):
        return "a key-padding mask must be [B,N] on the inputs' device"
    return None


def _one_dtype(ctx, tok, w1):
    return tok.dtype == ctx.dtype and w1.dtype == ctx.dtype


def autocast_mix(ctx, tok, w1):
    """Under torch.autocast the op receives 16-bit activations (ctx, from an autocast linear)
    with fp32 parameters, and tok in fp32 when a LayerNorm (an fp32 op under autocast) made it."""
    return (ctx.dtype in (torch.bfloat16, torch.float16) and tok.dtype in (ctx.dtype, torch.float32)
            and w1.dtype in (ctx.dtype, torch.float32) and not _one_dtype(ctx, tok, w1))


def _in_compute_dtype(ctx, tok, w1, b1, w2, b2, w3):
    """tok and the expert weights in ctx's dtype: autocast would run every matmul that reads
    them in that dtype, so they are cast as autocast casts them (the kernels then see exactly
    the one-dtype case). Wg stays as given: the router runs in fp32 either way. The gradients
    go back in each input's own dtype (the last line of region_backward)."""
    cast = lambda t: None if t is None else t.to(ctx.dtype)
    return cast(tok), cast(w1), cast(b1), cast(w2), cast(b2), cast(w3)


def _f32(*tensors):
    """The tensors in fp32 (None stays None) for the glue's matmuls, with one cast of one flat
    buffer instead of one per tensor: each cast is a launch and ~40 µs of host time on the H200
    (bench/results/kernel_times_medium.txt: 19 a training step), where a view costs a few. The
    pieces are views of one buffer, so this is for inputs only, never for returned gradients
    (outputs of a custom op must not alias each other)."""
    todo = [t for t in tensors if t is not None and t.dtype != torch.float32]
    if len(todo) < 2:
        return [None if t is None else t.float() for t in tensors]
    pieces = iter(torch.cat([t.reshape(-1) for t in todo]).float().split([t.numel() for t in todo]))
    return [t if t is None or t.dtype == torch.float32 else next(pieces).view(t.shape) for t in tensors]


def _pool_f32(tok, q, wk, wv, bv, wo, bo):
    """(q, Wk, Wv, bv, Wo, bo) as the pool's kernels take them: fp32 (_f32), but each as it is
    where it shares the tokens' dtype and the pool's products run on split dots (bf16,
    triton_pool.split_dot). Every product then reads it exactly: triton_matmul takes a 16-bit
    weight as its own high half (two tensor-core dots of three in each product it enters: the
    projections, the directions and ∂q) and a 16-bit bias as it is, and ∂Wk's mul promotes q.
    No cast then remains: a bf16 model's forward and backward each made one of q, Wk, bv and bo
    (a cat and a copy, ~6 us at medium on the H200, ~4 host calls), and its weight gradients
    come back in the weights' dtype."""
    half = tok.dtype if triton_pool.split_dot(tok.dtype) else None
    weights = (q, wk, wv, bv, wo, bo)
    as_is = [w is not None and w.dtype in (torch.float32, half) for w in weights]
    cast = iter(_f32(*(w for w, keep in zip(weights, as_is) if not keep)))
    return [w.contiguous() if keep else next(cast) for w, keep in zip(weights, as_is)]


def _c(t):
    return None if t is None else t.contiguous()


def _merged_input(ctx, inv, merge):
    """(x, inv or None) as the router and the MoE gather take them: ctx with inv (merged as
    they load it), or y."""
    B, H, D = ctx.shape
    if merge == "cuda":
        return merge_forward(ctx, inv).view(B * H, D), None
    return ctx.reshape(B * H, D).contiguous(), inv.contiguous()


def reuse_size(ctx, tok, q, w1, top_k, act, mask, keep_hidden=False):
    """Elements of region_forward's `reuse` (see the module docstring): 0 where the reference
    runs. Reads only shapes, dtypes and devices, so the op's fake computes it too."""
    if why_unsupported(ctx, tok, w1, top_k, act, mask) is not None:
        return 0
    return _reuse_elements(ctx, q, w1, top_k, _hidden_kept(ctx, w1, top_k, act, keep_hidden))


def _hidden_kept(ctx, w1, top_k, act, keep_hidden):
    """((S, F), dtype) of the MoE's pre-activations u that `reuse` keeps first
    (triton_moe.keeps_hidden: S slots, in the compute dtype, ctx's), or None."""
    if not triton_moe.keeps_hidden(act, keep_hidden):
        return None
    pairs, experts = ctx.shape[0] * ctx.shape[1] * top_k, w1.shape[0]
    return (triton_moe.slot_count(pairs, experts), w1.shape[2]), ctx.dtype


def _int32s(kept):
    return 0 if kept is None else kept[0][0] * kept[0][1] * kept[1].itemsize // 4


def _reuse_elements(ctx, q, w1, top_k, kept):
    """int32 elements of `reuse`; kept: _hidden_kept's."""
    return _moe_reuse_elements(ctx, w1, top_k, kept) + (q.shape[0] + ctx.shape[0]) * ctx.shape[-1]


def _moe_reuse_elements(ctx, w1, top_k, kept):
    """int32 elements of the MoE's part of `reuse` (the MoE's u where kept, the layout)."""
    pairs, experts = ctx.shape[0] * ctx.shape[1] * top_k, w1.shape[0]
    return triton_moe.layout_size(pairs, experts, triton_moe.tile_rows(pairs, experts)) + _int32s(kept)


Reused = collections.namedtuple("Reused", "layout u pooled hidden")


def _reuse_parts(reuse, P, B, D, kept):
    """Reused(the layout's buffer, u [P,D] fp32, pooled [B,D] fp32, the MoE's u [S,F] or None):
    views of `reuse`; kept: _hidden_kept's."""
    moe, u, pooled = reuse.split([reuse.numel() - (P + B) * D, P * D, B * D])
    layout, hidden = _moe_parts(moe, kept)
    return Reused(layout, u.view(torch.float32).view(P, D), pooled.view(torch.float32).view(B, D), hidden)


def _moe_parts(reuse, kept):
    """(the layout's buffer, the MoE's u [S,F] or None): views of the MoE's part of `reuse`."""
    n = _int32s(kept)
    hidden, layout = reuse.split([n, reuse.numel() - n])
    return layout, None if kept is None else hidden.view(kept[1]).view(kept[0])


def moe_reuse_size(ctx, w1, top_k, act, keep_hidden):
    """int32 elements of mha::moe's `reuse` (pool_moe_ops): the MoE's part of region_forward's."""
    return _moe_reuse_elements(ctx, w1, top_k, _hidden_kept(ctx, w1, top_k, act, keep_hidden))


def moe_reuse_parts(reuse, ctx, w1, top_k, act, keep_hidden):
    """(the layout's buffer, the MoE's u [S,F] or None): views of mha::moe's `reuse`, which must
    be of moe_reuse_size's elements (one of another size was made for other inputs)."""
    want = moe_reuse_size(ctx, w1, top_k, act, keep_hidden)
    if reuse.dtype != torch.int32 or reuse.numel() != want:
        raise ValueError(f"mha::moe's backward: reuse holds {reuse.numel()} {reuse.dtype} elements, where the "
                         f"forward of these inputs leaves {want} int32 with keep_hidden={keep_hidden}")
    return _moe_parts(reuse, _hidden_kept(ctx, w1, top_k, act, keep_hidden))


def region_forward(merge, ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3, mask, top_k, renorm, act,
                   keep_hidden=False, kept=None):
    """(out [B,H,D] ctx.dtype, inv [B,D], attn [B,N,P], weight [R,k] fp32, index [R,k] int32,
    π [R,E] fp32, reuse int32). kept: an empty dict, filled for region_backward; reuse: what it
    takes where no dict is kept (both: see the module docstring), with the MoE's u at its start where
    keep_hidden (or triton_moe.KEEP_HIDDEN) asks, but for swiglu. Where the inputs run on the
    reference, kept stays empty and reuse has no elements."""
    why = why_unsupported(ctx, tok, w1, top_k, act, mask)
    if why is not None:
        if why not in _SAID:  # the compile's report, made from shapes and dtypes without the mask, may say otherwise
            _SAID.add(why)
            log.info("mha_compile: kernels=%r ran a region on the reference path: %s",
                     {"on_load": "fused", "cuda": "staged"}[merge], why)
        return reference.region_forward(ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3,
                                        mask, top_k, renorm, act)
    kept_hidden = _hidden_kept(ctx, w1, top_k, act, keep_hidden)
    reuse = torch.empty(_reuse_elements(ctx, q, w1, top_k, kept_hidden), device=ctx.device, dtype=torch.int32)
    tok, w1, b1, w2, b2, w3 = _in_compute_dtype(ctx, tok, w1, b1, w2, b2, w3)
    layout, u, pooled, hidden = _reuse_parts(reuse, q.shape[0], ctx.shape[0], ctx.shape[-1], kept_hidden)
    inv, attn, pool = pool_forward(tok, q, wk, wv, bv, wo, bo, mask, u, pooled)
    out, weight, index, probs, groups = moe_forward(merge, ctx, inv, wg, w1, b1, w2, b2, w3, top_k, renorm, act,
                                                    layout, hidden)
    if kept is not None:
        kept.update(groups=groups, pool=(stamp(q, wk, wv, bv, wo), pool))
    return out, inv, attn, weight, index, probs, reuse


def pool_forward(tok, q, wk, wv, bv, wo, bo, mask, u=None, pooled=None):
    """(inv [B,D] fp32, attn [B,N,P] fp32, the weights as the pool's backward takes them: q, Wk,
    Wv, bv, Wo as _pool_f32 gives them, then the directions u [P,D] fp32): region_forward's pool,
    on tok in the compute dtype. u, pooled: [P,D] and [B,D] fp32 buffers the directions and the
    heads' output (which pool_backward's ∂Wo reads) are written into, or None."""
    pool = _pool_f32(tok, q, wk, wv, bv, wo, bo)
    u = triton_pool.pool_directions(pool[0], pool[1], out=u, split=triton_pool.split_dot(tok.dtype))
    inv, attn = triton_pool.pool_forward(tok, *pool, mask, u=u, pooled=pooled)
    return inv, attn, (*pool[:5], u)


def moe_forward(merge, ctx, inv, wg, w1, b1, w2, b2, w3, top_k, renorm, act, layout=None, hidden=None):
    """(out [B,H,D] ctx.dtype, weight [R,k] fp32, index [R,k] int32, π [R,E] fp32, the expert
    layout): region_forward's router and MoE on y = ctx + inv[b], with the experts' weights in
    ctx's dtype. layout: the int32 buffer the layout is built in, or None; hidden: an [S,F] buffer
    GEMM1 also writes u = xs W1 + b1 into (keep_hidden), or None."""
    B, H, D = ctx.shape
    x, x_inv = _merged_input(ctx, inv, merge)
    weight, index, probs = triton_router.route(x, x_inv, wg.contiguous(), top_k, renorm, H)
    groups = triton_moe.group(index, w1.shape[0], into=layout)
    out = triton_moe.moe_forward(x, x_inv, weight, groups, w1.contiguous(), _c(b1), w2.contiguous(), _c(b2),
                                 _c(w3), act, H, ctx.dtype, hidden=hidden)
    return out.view(B, H, D), weight, index, probs, groups


def _reused(reuse, ctx, q, w1, top_k, act, keep_hidden):
    """_reuse_parts of `reuse` where it holds what region_forward left (None where it is empty,
    as the reference's is); one of another size raises: it was made for other inputs."""
    if reuse is None or reuse.numel() == 0:
        return None
    kept = _hidden_kept(ctx, w1, top_k, act, keep_hidden)
    want = _reuse_elements(ctx, q, w1, top_k, kept)
    if reuse.dtype != torch.int32 or reuse.numel() != want:
        raise ValueError(f"region_backward: reuse holds {reuse.numel()} {reuse.dtype} elements, where the "
                         f"forward of these inputs leaves {want} int32 (or none) with keep_hidden={keep_hidden} "
                         f"and triton_moe.KEEP_HIDDEN {'on' if triton_moe.KEEP_HIDDEN else 'off'}, as it is now")
    return _reuse_parts(reuse, q.shape[0], ctx.shape[0], ctx.shape[-1], kept)


def _layout_of(index, experts, kept, reused):
    """The expert layout of `index`: the one region_forward left in `kept` or in `reuse`, else
    built now. One built from another index, or from this one before it was written to, raises:
    it would send the gradients of some pairs to the wrong expert."""
    groups = kept.get("groups") if kept else None
    if groups is None:
        if reused is not None:  # the op's own saved outputs: index and reuse come from one forward
            return triton_moe.Groups.from_buffer(reused.layout, index, experts)
        return triton_moe.group(index, experts)
    if groups.experts != experts or not groups.built_from(index):
        raise ValueError("region_backward: the expert layout kept in `kept` was not built from this `index` "
                         "(or the index was written to since)")
    return groups


def _pool_weights(tok, q, wk, wv, bv, wo, kept, u):
    """(q, Wk, Wv, bv, Wo as _pool_f32 gives them, u or None) for the pool's backward:
    region_forward's from `kept` (refused if they came from other weights, or from these before a
    write), else _pool_f32's now, with the given u (the forward's, or None)."""
    pool = kept.get("pool") if kept else None
    if pool is None:
        return (*_pool_f32(tok, q, wk, wv, bv, wo, None)[:5], u)
    made_from, weights = pool
    if made_from != stamp(q, wk, wv, bv, wo):
        raise ValueError("region_backward: the pool weights kept in `kept` were not made from these q, wk, wv, bv, "
                         "wo (or they were written to since)")
    return weights


def region_backward(merge, grad_out, ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3, mask,
                    inv, attn, weight, index, probs, reuse, top_k, renorm, act, keep_hidden=False, kept=None):
    """Gradients of (ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3), None for absent.
    reuse and kept: what region_forward returned and filled with `index` (see the module docstring);
    keep_hidden: region_forward's."""
    if why_unsupported(ctx, tok, w1, top_k, act, mask) is not None:
        return reference.region_backward(grad_out, ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3,
                                         mask, inv, attn, weight, index, probs, reuse, top_k, renorm, act)
    reused = _reused(reuse, ctx, q, w1, top_k, act, keep_hidden)
    inputs = (ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3)
    tok, w1, b1, w2, b2, w3 = _in_compute_dtype(ctx, tok, w1, b1, w2, b2, w3)
    index = index.contiguous()
    groups = _layout_of(index, w1.shape[0], kept, reused)
    dctx, dinv, dwg, dw1, db1, dw2, db2, dw3 = moe_backward(
        merge, grad_out, ctx, inv, wg, w1, b1, w2, b2, w3, weight, index, probs, groups,
        None if reused is None else reused.hidden, renorm, act, inputs[9].dtype)
    pool_grads = pool_backward(dinv, tok, q, wk, bk, wv, bv, wo, attn, None if reused is None else reused.u,
                               None if reused is None else reused.pooled, kept, mask)
    grads = (dctx, *pool_grads, dwg, dw1, db1, dw2, db2, dw3)
    return tuple(None if t is None else g.to(t.dtype) for g, t in zip(grads, inputs))


def pool_backward(grad_inv, tok, q, wk, bk, wv, bv, wo, attn, u=None, pooled=None, kept=None, mask=None):
    """(∂tok, ∂q, ∂Wk, ∂bk, ∂Wv, ∂bv, ∂Wo, ∂bo): region_backward's pool from ∂inv [B,D] fp32, on
    tok in the compute dtype; ∂bk is zeros (None without bk: it cancels), the rest as
    triton_pool.pool_backward gives them. u, pooled: the forward's directions and heads' output
    where kept (`reuse`'s views, mha::pool's outputs), else None; kept: region_forward's dict, whose
    pool weights (u among them) are taken where it holds them; mask: the forward's."""
    *weights, u = _pool_weights(tok, q, wk, wv, bv, wo, kept, u)
    grads = triton_pool.pool_backward(grad_inv, tok, *weights, attn.float(), u=u, pooled=pooled, mask=mask)
    return (*grads[:3], None if bk is None else torch.zeros_like(bk), *grads[3:])


def moe_backward(merge, grad_out, ctx, inv, wg, w1, b1, w2, b2, w3, weight, index, probs, groups, hidden, renorm,
                 act, wg_dtype):
    """(∂ctx [B,H,D], ∂inv [B,D] fp32, ∂Wg in wg_dtype, ∂W1, ∂b1, ∂W2, ∂b2, ∂W3): region_backward's
    MoE and router, with the experts' weights in ctx's dtype; groups: the expert layout of index
    (contiguous); hidden: moe_forward's u, or None. ∂ctx is in ctx's dtype, or fp32 where
    merge="cuda" (region_backward rounds every gradient to its input's dtype)."""
    B, H, D = ctx.shape
    x, x_inv = _merged_input(ctx, inv.float(), merge)
    wg = wg.contiguous()
    weight = weight.float().contiguous()
    grad_rows = grad_out.reshape(B * H, D).contiguous()
    dx_slot, gw_part, dw1, db1, dw2, db2, dw3 = triton_moe.moe_backward(
        grad_rows, x, x_inv, weight, groups, w1.contiguous(), _c(b1), w2.contiguous(), _c(b2), _c(w3), act, H,
        hidden=hidden)
    dy, dinv, dlogits = triton_router.router_combine_backward(
        probs.float().contiguous(), wg, weight, index, groups.pair_slot, dx_slot, gw_part, H, renorm,
        torch.float32 if merge == "cuda" else ctx.dtype, triton_router.router_precision(x.dtype),
        sum_h=x_inv is not None)
    del dx_slot, gw_part  # [S,D] (128 MiB at large in bf16): freed before the pool's ∂tok is allocated
    dwg = triton_router.router_weight_grad(dlogits, x, x_inv, H, split=triton_router.split_wgrad(x, x_inv, wg),
                                           dtype=wg_dtype)
    if merge == "cuda":
        dctx, dinv = merge_backward(dy.view(B, H, D), ctx.dtype)
    else:
        dctx = dy.view(B, H, D)
    return dctx, dinv, dwg, dw1, db1, dw2, db2, dw3
