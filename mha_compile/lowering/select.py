"""Which kernel set runs a matched region, and why: decided from dtype, device and shapes."""
import types

from mha_compile import ops
from mha_compile.kernels import region_graphs, triton_moe
from mha_compile.lowering.interpret import StackRef

# Explicit requests fall back along this order: the staged set is the fused set's fallback,
# the reference path everyone's (SPEC §3, issue 3).
FALLBACKS = {"auto": ("fused", "staged"), "fused": ("fused", "staged"), "staged": ("staged",), "reference": ()}


def _example(node):
    return None if node is None else node.meta.get("example_value")


def _expert_weights(ref):
    """What the kernels' checks read of W1 [E,D,F]: dtype, device, shape (stacked or not)."""
    if isinstance(ref, StackRef):
        one = _example(ref.refs[0].node)
        return types.SimpleNamespace(dtype=one.dtype, device=one.device, shape=(len(ref.refs), *one.shape))
    return _example(ref.node)


def choose_kernels(match, requested):
    """(kernel set name, reason) for the match; the reference path when nothing else fits."""
    if requested == "reference":
        return "reference", "kernels='reference' was requested"
    ctx, tok = _example(match.ctx), _example(match.tok)
    if match.tok_seq_first:  # [N,B,D]: the op takes it transposed
        tok = tok.transpose(0, 1)
    w1 = _expert_weights(match.params["w1"])
    if requested == "auto" and ctx.device.type != "cuda":
        return "reference", (f"inputs are on {ctx.device.type}; the Triton kernels need CUDA "
                             f"(kernels='fused' or 'staged' also run on CPU under TRITON_INTERPRET=1)")
    reasons = []
    for name in FALLBACKS[requested]:
        try:
            module = ops.kernel_set(name)
        except NotImplementedError as error:
            reasons.append(str(error))
            continue
        why = module.why_unsupported(ctx, tok, w1, match.config["top_k"], match.config["act"], None)
        if why is None:
            chosen = f"kernels={requested!r}" + ("" if name == requested else f" -> {name}")
            how = f"supports {ctx.dtype} on {ctx.device.type}"
            if tok.dtype != ctx.dtype or w1.dtype != ctx.dtype:
                how += f" (tok {tok.dtype} and experts {w1.dtype} cast to {ctx.dtype}, as autocast does)"
            return name, "; ".join(reasons + [f"{chosen}: {how}"])
        reasons.append(f"{name}: {why}")
    return "reference", "; ".join(reasons) + " -> reference path"


# describe_graphs' answer where the whole graph is captured (the backend's pool split may amend it)
CAPTURED_WHOLE = "no: the whole graph is captured as a CUDA graph (mode), the region with it"


def describe_graphs(match, graphs, whole_graph_captured):
    """Whether the region will replay its own CUDA graphs (options graphs=), and why: what
    region_graphs.wanted decides per call, told from the example shapes for the report."""
    if whole_graph_captured:
        return CAPTURED_WHOLE
    if graphs == "off":
        return "no: graphs='off'"
    if match.kernels == "reference":
        return "no: the reference path (graphs replay the fused and staged kernels)"
    ctx = _example(match.ctx)
    if ctx.device.type != "cuda":
        return f"no: inputs are on {ctx.device.type}"
    if graphs == "on":
        return "yes (graphs='on'): captured on a call signature's second call, replayed after"
    w1 = _expert_weights(match.params["w1"])
    (B, H, D), (E, _, F) = ctx.shape, w1.shape
    if not all(isinstance(d, int) for d in (B, H, D, E, F)):
        return (f"decided per call (symbolic shapes): yes where the slot buffers fit one run of "
                f"{size_text(region_graphs.AUTO_SLOT_BYTES)}")
    top_k, act = match.config["top_k"], match.config["act"]
    slot_bytes = region_graphs.slot_buffer_bytes(ctx, w1, top_k, act)
    fits = region_graphs.auto_wanted(ctx, w1, top_k, act)
    return (f"{'yes' if fits else 'no'} (graphs='auto'): the backward's slot buffers, {size_text(slot_bytes)}, "
            f"{'fit' if fits else 'do not fit'} one run of whole tiles within "
            f"{size_text(region_graphs.AUTO_SLOT_BYTES)}"
            + (": captured on a call signature's second call, replayed after" if fits else ""))


def size_text(nbytes):
    """nbytes for a report: whole MiB from 1 MiB up, whole KiB below (a tiny model's "0 MiB" said nothing)."""
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.0f} MiB"
    return f"{nbytes / 2**10:.0f} KiB" if nbytes >= 2**10 else f"{nbytes:.0f} bytes"


def describe_keep_hidden(match, keep_hidden):
    """Whether the region keeps the experts' pre-activations u from its forward for its backward
    (options keep_hidden=), and what that holds, for the report."""
    if not keep_hidden and not triton_moe.KEEP_HIDDEN:
        return "no: keep_hidden=False (the backward computes u = x W1 + b1 again)"
    if match.kernels == "reference":
        return "no: the reference path computes u again"
    if not triton_moe.keeps_hidden(match.config["act"], keep_hidden):  # asked for: swiglu is refused
        return "no: not with swiglu (its u3 would have to be kept too)"
    why = "keep_hidden=True" if keep_hidden else "MHA_COMPILE_KEEP_HIDDEN=1"
    ctx, w1 = _example(match.ctx), _expert_weights(match.params["w1"])
    (B, H, _), (E, _, F) = ctx.shape, w1.shape
    if not all(isinstance(d, int) for d in (B, H, E, F)):
        return f"yes ({why}): u [R·k slots, F] kept from the forward for the backward"
    slots = triton_moe.slot_count(B * H * match.config["top_k"], E)
    held = slots * F * ctx.dtype.itemsize
    return f"yes ({why}): u [{slots}, {F}] kept from the forward for the backward, {size_text(held)}"


def describe_slot_runs(match):
    """How the fused and staged MoE walk their slot rows (triton_moe.tile_runs): in one run, or
    in runs of whole tiles whose backward buffers fit SLOT_CHUNK_BYTES (MHA_COMPILE_SLOT_CHUNK_MB),
    or with the backward's hidden layer in passes of its columns (triton_moe.column_passes,
    MHA_COMPILE_HIDDEN_COLUMNS), told from the example shapes for the report: the runs or the
    passes are what set the MoE's training peak. Reads match.keep_hidden (the option)."""
    if match.kernels == "reference":
        return "none: the reference path has no slot rows"
    ctx, w1 = _example(match.ctx), _expert_weights(match.params["w1"])
    (B, H, D), (E, _, F) = ctx.shape, w1.shape
    bound = f"{size_text(triton_moe.SLOT_CHUNK_BYTES)} a run ({triton_moe.SLOT_CHUNK_ENV})"
    top_k, act = match.config["top_k"], match.config["act"]
    columns = f"{triton_moe.HIDDEN_COLUMNS_ENV}={triton_moe.HIDDEN_COLUMNS}"
    passes = triton_moe.column_passes(F) if isinstance(F, int) else [(0, F)]
    kept = triton_moe.keeps_hidden(act, match.keep_hidden)
    if not all(isinstance(d, int) for d in (B, H, D, E, F)):
        return (f"decided per call (symbolic shapes): runs of whole tiles within {bound}"
                + (f"; the backward's hidden layer in {len(passes)} passes ({columns})" if len(passes) > 1 and not kept
                   else ""))
    runs = region_graphs.slot_runs(ctx, w1, top_k, act)
    held = region_graphs.slot_buffer_bytes(ctx, w1, top_k, act)
    text = (f"{len(runs)} run{'s' * (len(runs) > 1)} of whole tiles: the backward's slot buffers, "
            f"{size_text(held)}, within {bound}")
    if len(passes) == 1:
        return text
    if kept:
        return f"{text}; {columns} is not taken: the region keeps u [slots, F] for its backward (keep_hidden)"
    widest = passes[0][1]
    per_pass = (triton_moe.slot_count(B * H * top_k, E)
                * triton_moe.backward_slot_bytes(D, widest, act == "swiglu", ctx.dtype.itemsize))
    return (f"the backward over all slots at once, its hidden layer in {len(passes)} passes of at most {widest} of "
            f"F = {F} columns ({columns}): its slot buffers {size_text(per_pass)} a pass, ∂x's slot rows in fp32; "
            f"the forward in runs within {bound}")
