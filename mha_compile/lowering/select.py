"""Which kernel set runs a matched region, and why: decided from dtype, device and shapes."""
import types

from mha_compile import ops
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
