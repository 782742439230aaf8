"""The region as PyTorch custom ops: `mha::region` and `mha::region_backward`.

One op covers pool → merge → MoE so that autograd, AOTAutograd and Inductor see a single
node. The op's `kernels` argument picks the implementation ("reference", "fused", "staged");
the lowering resolves "auto" before it builds the call, so the op never guesses.

Forward returns (out, inv, attn, weight, index, probs, reuse); the last six are what the backward
keeps (SPEC §1): the pool output [B,D], the attention [B,N,P], the top-k weights and indices [R,k],
the router's softmax π [R,E] (its backward's pass 1 reads π rather than computing it again from x),
and `reuse`, an int32 buffer of what the kernel set's backward would otherwise compute again from
the same inputs (the expert layout, the pool's directions and heads; kernels/triton_region.py), empty for
the reference.

`region_call` is what a graph that runs eagerly calls instead (backend.run_rest swaps it in):
RegionFunction, a plain autograd.Function over the same kernel-set calls, unless something is
tracing, in which case the op itself. RegionFunction also keeps what the forward computed for the
backward (the expert layout, the pool's fp32 weights: KEEPS); the op carries the part of that
which fits in its tensor outputs (`reuse`: the layout, the pool's directions and heads).
"""
import contextlib
import functools
import hashlib
import importlib
import pathlib
from typing import Optional

import torch
from torch import Tensor
from torch.autograd import forward_ad

from mha_compile.double_backward import differentiating, gradients_with_graph, refuse_batched
from mha_compile.kernels import reference, region_graphs, triton_moe
from mha_compile.kernels.reference import ACTIVATIONS, accumulation_dtype, pool_backward

KERNEL_SETS = ("reference", "fused", "staged")
_KERNEL_MODULES = {
    "reference": "mha_compile.kernels.reference",
    "fused": "mha_compile.kernels.fused",
    "staged": "mha_compile.kernels.staged",
}
# Inputs of the region in op order; the backward returns one gradient for each.
REGION_INPUTS = ("ctx", "tok", "q", "wk", "bk", "wv", "bv", "wo", "bo", "wg", "w1", "b1", "w2", "b2", "w3")
# The inputs whose gradient comes through out alone (inv's reaches the pool's)
MOE_SIDE = ("ctx", "wg", "w1", "b1", "w2", "b2", "w3")
# What reference.pool_backward returns, in its order.
POOL_GRADS = ("tok", "q", "wk", "wv", "bv", "wo", "bo")
# The kernel sets whose region_forward and region_backward take `kept` (kernels/triton_region.py):
# a dict in which the forward leaves what it computed from its inputs (the expert layout of the
# index it returns, the pool's weights in fp32), for the backward to take instead of computing it
# again. RegionFunction passes one, kept on its autograd ctx; the op passes none, nor does a call
# through region_graphs (a replay overwrites a graph's buffers): both have the forward's `reuse`.
KEEPS = ("fused", "staged")


def kernel_set(name):
    """The module implementing `name`: it has region_forward, region_backward and reuse_size."""
    if name not in _KERNEL_MODULES:
        raise ValueError(f"kernels={name!r}: expected one of {KERNEL_SETS}")
    try:
        return importlib.import_module(_KERNEL_MODULES[name])
    except ModuleNotFoundError as error:
        if error.name != _KERNEL_MODULES[name]:
            raise
        raise NotImplementedError(f"kernels={name!r} is not built yet ({_KERNEL_MODULES[name]} is missing)") from None


def _check_shapes(ctx, tok, q, wk, wv, wo, wg, w1, b1, w2, b2, w3, top_k, act):
    B, H, D = ctx.shape
    torch._check(tok.dim() == 3 and tok.shape[0] == B and tok.shape[2] == D,
                 lambda: f"tok must be [B={B},N,D={D}], got {tuple(tok.shape)}")
    P, Dh = q.shape
    torch._check(P * Dh == D, lambda: f"q must be [P,D/P] with P·Dh = D={D}, got {tuple(q.shape)}")
    for name, w in (("wk", wk), ("wv", wv), ("wo", wo)):
        torch._check(tuple(w.shape) == (D, D), lambda: f"{name} must be [{D},{D}], got {tuple(w.shape)}")
    E = wg.shape[0]
    torch._check(tuple(wg.shape) == (E, D), lambda: f"wg must be [E,{D}], got {tuple(wg.shape)}")
    F = w1.shape[2]
    torch._check(tuple(w1.shape) == (E, D, F), lambda: f"w1 must be [{E},{D},F], got {tuple(w1.shape)}")
    torch._check(tuple(w2.shape) == (E, F, D), lambda: f"w2 must be [{E},{F},{D}], got {tuple(w2.shape)}")
    torch._check(b1 is None or tuple(b1.shape) == (E, F), lambda: f"b1 must be [{E},{F}]")
    torch._check(b2 is None or tuple(b2.shape) == (E, D), lambda: f"b2 must be [{E},{D}]")
    torch._check((w3 is not None) == (act == "swiglu"),
                 lambda: f"w3 is required exactly when act='swiglu' (act={act!r})")
    torch._check(w3 is None or tuple(w3.shape) == (E, D, F), lambda: f"w3 must be [{E},{D},{F}]")
    torch._check(1 <= top_k <= E, lambda: f"top_k={top_k}: expected 1 <= top_k <= E={E}")
    torch._check(act in ACTIVATIONS, lambda: f"act={act!r}: expected one of {ACTIVATIONS}")
    return B, H, D, tok.shape[1], P


def _no_autocast(ctx):
    """The kernels pick their own precisions (fp32 accumulation, fp32 router; SPEC §4).

    A custom op has no autocast kernel, so under `torch.autocast` the ops inside its
    implementation would be autocast themselves: the reference's fp32 matmuls ran in bf16, and it
    saved a bf16 `attn` where the fake promises fp32, so the backward failed on a dtype mismatch.
    Where autocast is off already, nothing: the context's enter and exit (Python, and the
    autocast cache's bookkeeping) would be host time twice a training step for no effect.
    """
    device = ctx.device.type
    if device in ("cuda", "cpu") and not torch.is_autocast_enabled(device):
        return contextlib.nullcontext()
    return torch.autocast(device, enabled=False)


@torch.library.custom_op("mha::region", mutates_args=())
def region(ctx: Tensor, tok: Tensor, q: Tensor, wk: Tensor, bk: Optional[Tensor], wv: Tensor,
           bv: Optional[Tensor], wo: Tensor, bo: Optional[Tensor], wg: Tensor, w1: Tensor,
           b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], w3: Optional[Tensor],
           mask: Optional[Tensor], top_k: int, renorm: bool, act: str, kernels: str, export_inv: bool = False,
           graphs: str = "off", keep_hidden: bool = False
           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """out = MoE(ctx + pool(tok)[:, None]); see SPEC §1.

    export_inv: the graph also reads `inv` (output 1), e.g. to rebuild y = ctx + inv for a
    residual; then its gradient flows back through the pool too (see _backward).
    graphs: "auto" | "on" | "off", whether the kernels replay as a CUDA graph per call signature
    (kernels/region_graphs.py); the backward follows the forward's setting.
    keep_hidden: the fused and staged kernels keep the experts' pre-activations u = x W1 + b1 from
    the forward for the backward, at the start of `reuse` (options["keep_hidden"]; not swiglu).
    """
    return _forward((ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3, mask), top_k, renorm, act, kernels,
                    graphs, keep_hidden)


def _forward(tensors, top_k, renorm, act, kernels, graphs, keep_hidden, kept=None):
    """The kernel set's forward (the op's body, and RegionFunction's); kept: see KEEPS."""
    ctx, tok, w1, mask = tensors[0], tensors[1], tensors[10], tensors[15]
    with _no_autocast(ctx):
        out, inv, *rest = _kernel_call(kernel_set(kernels).region_forward, tensors, (ctx, tok, w1, mask), top_k,
                                       renorm, act, keep_hidden, kernels, graphs, kept)
    # The kernel sets give out as a [B,H,D] view of their [B·H, D] rows. Autograd refuses an
    # in-place op on a view made inside a custom Function ("Output 0 of RegionFunction is a view
    # and is being modified inplace"), so a model's `out = block(ctx, tok); out += ctx` failed to
    # train where eager runs it. Those rows are out's alone (nothing saved or kept shares them):
    # out and inv are handed over as plain tensors on the same memory.
    return (_plain(out), _plain(inv), *rest)


def _plain(t):
    return t.detach() if t._is_view() else t


def _kernel_call(fn, tensors, inputs, top_k, renorm, act, keep_hidden, kernels, graphs, kept=None):
    """fn(*tensors, top_k, renorm, act, keep_hidden), a kernel set's region_forward or
    region_backward, through its CUDA graph where region_graphs.wanted says so; inputs = (ctx, tok,
    W1, mask). kept (see KEEPS) goes to fn as a keyword where given, and never into a graph."""
    ctx, tok, w1, mask = inputs
    if ctx.is_cuda and ctx.device.index != torch.cuda.current_device():
        # Triton and Gluon launch on the current device, not on their tensors': a block on cuda:1
        # called while cuda:0 is current would run its kernels on cuda:0 over cuda:1's memory.
        # (Inductor guards its launches likewise; the common case, the tensors' device current,
        # costs one check.)
        with torch.cuda.device(ctx.device):
            return _kernel_call(fn, tensors, inputs, top_k, renorm, act, keep_hidden, kernels, graphs, kept)
    if region_graphs.wanted(graphs, kernels, ctx, tok, w1, top_k, act, mask):
        return region_graphs.call(fn, tensors, (top_k, renorm, act, keep_hidden))
    if kept is None:
        return fn(*tensors, top_k, renorm, act, keep_hidden)
    return fn(*tensors, top_k, renorm, act, keep_hidden, kept=kept)


@region.register_fake
def _region_fake(ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3, mask, top_k, renorm, act, kernels,
                 export_inv=False, graphs="off", keep_hidden=False):
    B, H, D, N, P = _check_shapes(ctx, tok, q, wk, wv, wo, wg, w1, b1, w2, b2, w3, top_k, act)
    acc = accumulation_dtype(ctx.dtype)
    reuse = kernel_set(kernels).reuse_size(ctx, tok, q, w1, top_k, act, mask, keep_hidden)
    return (ctx.new_empty(B, H, D), ctx.new_empty(B, D, dtype=acc), ctx.new_empty(B, N, P, dtype=acc),
            ctx.new_empty(B * H, top_k, dtype=acc), ctx.new_empty(B * H, top_k, dtype=torch.int32),
            ctx.new_empty(B * H, wg.shape[0], dtype=acc), ctx.new_empty(reuse, dtype=torch.int32))


def _region_backward(grad_out: Tensor, ctx: Tensor, tok: Tensor, q: Tensor, wk: Tensor, bk: Optional[Tensor],
                     wv: Tensor, bv: Optional[Tensor], wo: Tensor, bo: Optional[Tensor], wg: Tensor, w1: Tensor,
                     b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], w3: Optional[Tensor],
                     mask: Optional[Tensor], inv: Tensor, attn: Tensor, weight: Tensor, index: Tensor,
                     probs: Tensor, reuse: Tensor, top_k: int, renorm: bool, act: str, kernels: str,
                     grad_inv: Optional[Tensor] = None, graphs: str = "off", keep_hidden: bool = False
                     ) -> list[Tensor]:
    """Gradients of REGION_INPUTS, in order; an absent optional input gets an empty tensor.

    grad_inv: the gradient of the exported `inv` from outside the region, or None. The pool's
    backward is linear in ∂inv, so this part is the reference pool backward of grad_inv added to
    whatever the kernel set computed: exact for every set, no kernel has to know about it.
    graphs, keep_hidden: as for mha::region (the forward's).
    """
    tensors = (grad_out, ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3, mask, inv, attn, weight, index,
               probs, reuse)
    return _region_gradients(tensors, top_k, renorm, act, kernels, grad_inv, graphs, keep_hidden)


def _region_gradients(tensors, top_k, renorm, act, kernels, grad_inv, graphs, keep_hidden, kept=None):
    """_region_backward's body, which RegionFunction's backward calls with its `kept` (see KEEPS;
    not an argument the op's schema can hold). tensors: _region_backward's, in order."""
    grad_out, ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3, mask, inv, attn, *_ = tensors
    with _no_autocast(ctx):
        grads = list(_kernel_call(kernel_set(kernels).region_backward, tensors, (ctx, tok, w1, mask),
                                  top_k, renorm, act, keep_hidden, kernels, graphs, kept))
        if grad_inv is not None:
            acc = accumulation_dtype(ctx.dtype)
            c = lambda t: None if t is None else t.to(acc)
            extra = pool_backward(c(grad_inv), c(tok), c(q), c(wk), c(wv), c(bv), c(wo), attn, mask)
            for name, g in zip(POOL_GRADS, extra):
                position = REGION_INPUTS.index(name)
                if grads[position] is not None:
                    grads[position] = grads[position] + g.to(grads[position].dtype)
    # contiguous, as the fake says: Inductor checks each output's strides against the fake's
    return [ctx.new_empty(0) if g is None else g.contiguous() for g in grads]


# The op, for whatever traces the backward (AOTAutograd, compiled autograd: one opaque node);
# _backward calls _region_gradients itself when nothing does.
region_backward = torch.library.custom_op("mha::region_backward", mutates_args=())(_region_backward)


@region_backward.register_fake
def _region_backward_fake(grad_out, ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3, mask,
                          inv, attn, weight, index, probs, reuse, top_k, renorm, act, kernels, grad_inv=None,
                          graphs="off", keep_hidden=False):
    inputs = (ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3)
    # contiguous whatever the input's strides (a transposed ctx or tok): what _region_gradients returns
    return [ctx.new_empty(0) if t is None else t.new_empty(t.shape) for t in inputs]


def _setup_context(ctx, inputs, output):
    tensors = inputs[:16]
    ctx.absent = [t is None for t in tensors]
    ctx.save_for_backward(*[t for t in tensors if t is not None], *output[1:])
    ctx.config = inputs[16:20]
    ctx.export_inv = bool(inputs[20]) if len(inputs) > 20 else False
    ctx.graphs = inputs[21] if len(inputs) > 21 else "off"
    ctx.keep_hidden = bool(inputs[22]) if len(inputs) > 22 else False
    ctx.kept = None  # the op keeps nothing (RegionFunction's forward sets its own)
    # attn, weight, index, probs and reuse (and inv, unless the graph reads it) take no gradient:
    # marked so, and no zeros made for an output's unused gradient. Without this the op's own
    # autograd (torch.library's) filled a zero tensor of every output's size each backward: 7.5 us
    # of a medium step, 16 more with keep_hidden's u in `reuse` (H200, session 37's kernel_times:
    # aten::fill_ [17632544]), and ~0.5 GB at large with it.
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[2:] if ctx.export_inv else output[1:])


def _backward(ctx, grad_out, grad_inv, *unused_aux_grads):
    """attn, weight, index, probs and reuse are saved for the backward, never read by the graph:
    they take no gradient. inv's is used only when the graph reads inv (export_inv), and comes as
    None when nothing read it (no materialised zeros: a pool backward of zeros would cost a pass);
    likewise out's, when only inv was read."""
    refuse_batched(grad_out, grad_inv)
    saved = list(ctx.saved_tensors)
    out_unread = grad_out is None
    if out_unread:
        grad_out = torch.zeros_like(saved[0])  # out is ctx's shape and dtype
    tensors = [None if absent else saved.pop(0) for absent in ctx.absent]
    extra = grad_inv.contiguous() if ctx.export_inv and grad_inv is not None else None
    args = (grad_out.contiguous(), *tensors, *saved)  # saved: inv, attn, weight, index, probs, reuse
    # The op's dispatch costs ~0.1 ms of host time a medium step (host_time.py's cProfile on the
    # H200), where the step issues in ~1.4 ms for ~1 ms of GPU time.
    if differentiating(grad_out, extra, *tensors) and not _traced(args):
        # create_graph=True: the kernels' gradients carry no graph (double_backward.py)
        top_k, renorm, act, _ = ctx.config
        at = lambda *t: reference.region_at(*t, index=saved[3], renorm=renorm, act=act)
        with _no_autocast(tensors[0]):  # the reference picks its own precisions, as the kernels do
            grads = gradients_with_graph(at, tensors, (None if out_unread else grad_out, extra))[:len(REGION_INPUTS)]
    elif _traced(args):
        grads = region_backward(*args, *ctx.config, grad_inv=extra, graphs=ctx.graphs, keep_hidden=ctx.keep_hidden)
    else:
        grads = _region_gradients(args, *ctx.config, extra, ctx.graphs, ctx.keep_hidden, ctx.kept)
    # Only inv in the loss (the router logits the graph rebuilds from y, say): eager gives the
    # MoE's own inputs no gradient, None and not zeros (an optimizer steps a zero gradient)
    grads = [None if t is None or out_unread and name in MOE_SIDE else g
             for name, g, t in zip(REGION_INPUTS, grads, tensors)]
    return (*grads, None, None, None, None, None, None, None, None)


region.register_autograd(_backward, setup_context=_setup_context)


class RegionFunction(torch.autograd.Function):
    """`mha::region` with its autograd, minus the custom op around it: for a graph that runs
    eagerly (backend rest="eager" without CUDA graphs, or inside mha_compile's own step graphs,
    which record it as the eager graph runs), where nothing traces the call.

    Same arguments, outputs, saved tensors and kernel-set calls as the op (`region_call` picks
    between them); what it leaves out is the op's per-call dispatch, argument filling and
    aliasing checks and its generated autograd wrapper: host time that a training step pays
    (bench/PERF_NOTES.md v4: the op's fwd+bwd issues in ~5 ms at medium on the H200, the kernel
    set's own calls in ~2.5 ms). What it adds: the fused and staged sets' forward leaves its expert
    layout and the pool's fp32 weights on the autograd ctx, and the backward takes them instead of
    computing them again (KEEPS; the gradients are the same bits). The backward is _backward, as the
    op's: under create_graph=True it gives gradients with their graph, so that a second derivative
    (a gradient penalty) is the math's, not one that takes the kernels' gradients for constants.
    """

    @staticmethod
    def forward(ctx, *inputs):
        # inputs[19]: kernels. Under inference_mode nothing runs backward: keep nothing.
        kept = {} if inputs[19] in KEEPS and not torch.is_inference_mode_enabled() else None
        output = _forward(inputs[:16], *inputs[16:20], inputs[21] if len(inputs) > 21 else "off",
                          bool(inputs[22]) if len(inputs) > 22 else False, kept)
        _setup_context(ctx, inputs, output)
        ctx.kept = kept
        return tuple(output)

    @staticmethod
    def backward(ctx, grad_out, grad_inv, *unused_aux_grads):
        """_backward, as the op's own autograd: a backward that is traced (compiled autograd)
        meets the mha::region_backward op, not the kernel set's Python; one with create_graph=True
        gets gradients it can differentiate again."""
        return _backward(ctx, grad_out, grad_inv)


def cache_digest():
    """A short hash of what a trace takes from mha_compile, for torch's compile caches' keys
    (backend.cache_key_tagged), which key a custom op by its name alone:
    - mha::region's and mha::region_backward's schemas: once the forward's outputs grew by π, an
      AOTAutograd entry saved by the earlier build was served, and its backward passed the op four
      saved tensors where five were due;
    - triton_moe.KEEP_HIDDEN (MHA_COMPILE_KEEP_HIDDEN), which sizes the fake's `reuse`: an entry
      compiled without it was served to a process with it, and the compiled graph refused the op's
      longer reuse (H200, session 37: size 207920, expected 11312);
    - the package's source, since the fakes' sizes and the ops' autograd (which outputs take a
      gradient) are its code: a change of meaning at the same schema would not fail at all."""
    text = (f"{torch.ops.mha.region.default._schema}|{torch.ops.mha.region_backward.default._schema}|"
            f"keep_hidden={triton_moe.KEEP_HIDDEN}|{_source_digest()}")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _source_digest():
    """sha256 of every .py file of the package, read once a process (~0.6 MB)."""
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(__file__).parent.rglob("*.py")):
        digest.update(path.relative_to(pathlib.Path(__file__).parent).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def has_tangents(args):
    """Whether forward-mode AD (torch.autograd.forward_ad) carries a tangent on a tensor of args.
    Only inside a dual level: a call outside one reads a global and no tensor."""
    return forward_ad._current_level >= 0 and any(
        isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent is not None for a in args)


def _traced(args, functorch=True):
    """Whether something could be tracing or transforming a call on `args`: Dynamo, a dispatch
    mode (FakeTensor, make_fx), functorch (unless functorch=False), or a tensor subclass. Those
    must see the ops."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or functorch and torch._C._are_functorch_transforms_active()
            or any(type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter for t in tensors))


@torch.library.custom_op("mha::kept_copy", mutates_args=())
def _kept_copy(t: Tensor) -> Tensor:
    """A copy of t that the region keeps for its backward (lowering/match.py, Match.copied): the
    caller may write t in place before the backward, where eager's ops keep none of it. An op of
    its own, not a clone: Inductor's passes dropped a clone that nothing wrote, and AOTAutograd
    then saved t itself for the backward (which raised at the caller's `h += block(h, tok)`)."""
    return t.clone()


_kept_copy.register_fake(torch.empty_like)
_kept_copy.register_autograd(lambda ctx, grad: grad, setup_context=lambda ctx, inputs, output: None)


def kept_copy(t):
    """What the rewrite calls for Match.copied: the op where something traces the call (_traced),
    else a plain clone (an eagerly run graph has no pass that could drop it)."""
    return torch.ops.mha.kept_copy.default(t) if _traced((t,)) else t.clone()


def region_call(*args, graphs="off", keep_hidden=False):
    """The region for a graph that runs eagerly: RegionFunction, or the op itself whenever
    something could be tracing or transforming the call (_traced: Dynamo, a dispatch mode such
    as FakeTensor or make_fx, functorch, a tensor subclass), since those must see `mha::region`;
    or, for a call carrying forward-mode tangents (has_tangents), reference.region_forward.
    args: the op's, up to export_inv; graphs, keep_hidden: as for the op."""
    if _traced(args, functorch=False):
        return torch.ops.mha.region.default(*args, graphs=graphs, keep_hidden=keep_hidden)
    transformed = torch._C._are_functorch_transforms_active()
    if has_tangents(args) or transformed:
        # forward-mode AD: the kernel sets have no jvp (RegionFunction raised "You must implement
        # the jvp function"); the reference's plain ops carry the tangents, and the gradients too.
        # So for torch.func's transforms inside the compiled graph (grad, jvp, vmap of them: a
        # review's per-sample gradients), which the op's autograd does not support (it raised);
        # their experts as a masked loop, whose ops vmap takes.
        # bk cancels in the softmax and the reference never reads it: 0·Σbk gives it the zero
        # gradient the kernel sets give it, not none (an optimizer skips a parameter without one)
        with _no_autocast(args[0]):  # the reference picks its own precisions, as the kernels do
            out, *rest = reference.region_forward(*args[:19], experts=reference.moe_masked if transformed else None)
        bk = args[4]
        return (out if bk is None else out + 0 * bk.sum(), *rest)
    export_inv = args[20] if len(args) > 20 else False
    # A model's enable_grad under the caller's inference_mode: eager's ops record nothing there,
    # where a Function would (and raise, saving inference tensors for a backward)
    recording = not torch.is_inference_mode_enabled()
    if recording and torch.is_grad_enabled():
        # An inference tensor (tok made under inference_mode) cannot be saved for the backward,
        # where a spelling's own copy of it (nn.MultiheadAttention's) let eager train: a review's
        args = tuple(a.clone() if isinstance(a, torch.Tensor) and a.is_inference() else a for a in args)
    with contextlib.nullcontext() if recording else torch.no_grad():
        return RegionFunction.apply(*args[:20], export_inv, graphs, keep_hidden)
