"""What one benchmark row runs on: the model of a spelling, its inputs, and the fp32 reference.

Every spelling of a preset is built from the same seed, so dense, loop and grouped_mm hold the
same parameters and their times and errors compare row for row. Inputs are random normals
(never zeros: a kernel can be fast on zeros and wrong everywhere else).
"""
import torch

from bench.grouped_mm_moe import GroupedMMBlock
from mha_compile.models import PRESETS, MHABlock

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PARAM_SEED, INPUT_SEED = 0, 1


def make_model(preset, spelling, dtype, device):
    """The block in `spelling` (dense | loop | grouped_mm), parameters from PARAM_SEED."""
    torch.manual_seed(PARAM_SEED)
    block = MHABlock.from_preset(preset, spelling="loop" if spelling == "grouped_mm" else spelling)
    block = block.to(device=device, dtype=DTYPES[dtype])
    return GroupedMMBlock(block) if spelling == "grouped_mm" else block


def make_inputs(preset, dtype, device):
    """ctx [B,H,D], tok [B,N,D] and the upstream gradient [B,H,D], from INPUT_SEED."""
    p = PRESETS[preset]
    gen = torch.Generator(device=device).manual_seed(INPUT_SEED)
    draw = lambda *shape: torch.randn(*shape, generator=gen, device=device).to(DTYPES[dtype])
    return draw(p["B"], p["H"], p["D"]), draw(p["B"], p["N"], p["D"]), draw(p["B"], p["H"], p["D"])


def reference(preset, dtype, device):
    """Eager loop spelling in fp32 on the same (dtype-rounded) parameters and inputs.

    Returns the output and the gradients of (ctx, tok, *parameters), on the CPU so that
    they do not count in the peak memory of the rows measured after.
    """
    block = make_model(preset, "loop", dtype, device).float()
    ctx, tok, grad_out = (t.float() for t in make_inputs(preset, dtype, device))
    ctx.requires_grad_(True)
    tok.requires_grad_(True)
    out = block(ctx, tok)
    grads = torch.autograd.grad(out, [ctx, tok, *block.parameters()], grad_out)
    return out.detach().cpu(), [g.cpu() for g in grads]


def relative_error(got, ref):
    """‖got − ref‖ / ‖ref‖ in fp32 on the CPU."""
    got = got.detach().float().cpu()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def gradient_error(grads, refs):
    """Worst relative error over the gradients.

    ∂bk is exactly zero in math (SPEC §1), so a tensor's error is taken relative to the larger of
    its own norm and 1e-3 of the largest gradient norm, not to its own ~1e-8 rounding noise.
    A missing gradient (None) counts as an error of 1: that parameter got nothing.
    """
    scale = max(float(r.norm()) for r in refs)
    worst = 0.0
    for g, r in zip(grads, refs):
        if g is None:
            worst = max(worst, 1.0)
            continue
        err = float((g.detach().float().cpu() - r).norm()) / max(float(r.norm()), 1e-3 * scale)
        worst = max(worst, err)
    return worst
