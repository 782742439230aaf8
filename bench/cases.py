"""What one benchmark row runs on: the model of a spelling, its inputs, and the fp32 reference.

Every spelling of a preset is built from the same seed, so dense, loop and grouped_mm hold the
same parameters and their times and errors compare row for row. Inputs are random normals
(never zeros: a kernel can be fast on zeros and wrong everywhere else).
"""
import math

import torch

from bench.grouped_mm_moe import GroupedMMBlock
from mha_compile.models import PRESETS, MHABlock

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# OTHER_SEED: the timed steps' second batch (measure._measure), values of its own: a copy of the
# first let a step that computed on a stale batch pass the check (a review's audit).
PARAM_SEED, INPUT_SEED, OTHER_SEED = 0, 1, 2


def make_model(preset, spelling, dtype, device):
    """The block in `spelling` (dense | loop | grouped_mm), parameters from PARAM_SEED."""
    torch.manual_seed(PARAM_SEED)
    block = MHABlock.from_preset(preset, spelling="loop" if spelling == "grouped_mm" else spelling)
    block = block.to(device=device, dtype=DTYPES[dtype])
    return GroupedMMBlock(block) if spelling == "grouped_mm" else block


def make_inputs(preset, dtype, device, seed=INPUT_SEED):
    """ctx [B,H,D], tok [B,N,D] and the upstream gradient [B,H,D], from `seed`."""
    p = PRESETS[preset]
    gen = torch.Generator(device=device).manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=gen, device=device).to(DTYPES[dtype])
    return draw(p["B"], p["H"], p["D"]), draw(p["B"], p["N"], p["D"]), draw(p["B"], p["H"], p["D"])


# Rows whose top-k choice rounding can flip (SPEC §4: counted and reported apart, never hidden by a
# loose tolerance): those where the fp32 reference's k-th and (k+1)-th router probabilities are
# within this fraction of the k-th. Measured with the eager loop spelling in bf16 on the CPU
# (session 62): every row that chose other experts than the reference was within 3.5e-3 at small
# (10 of 2048 rows), 5.6e-3 at medium (53 of 16384) and 6.2e-3 at large (362 of 65536): bf16's
# 2⁻⁵ is 5x the widest, and sets aside 13%, 12% and 16% of the rows. Without the flipped rows its
# error was 5.4e-3 at each, with them 5.9e-2, 4.8e-2 and 6.4e-2 (every bf16 peer's "(!)" of
# session 57's H200 table). fp16's flips were within 1.2e-4 at small (2 rows) and 2.7e-4 at medium
# (4): 2⁻⁸ is 14x. A row outside the margin that came out another expert's stays in rel_err, and
# is counted apart too (rows_off): one such row moves rel_err by ~0.5/√(B·H), 1.1e-2 at small,
# under bf16's bound.
TIE_MARGIN = {"fp32": 2**-16, "bf16": 2**-5, "fp16": 2**-8}
# A set-aside row this far from the reference (‖row − ref‖/‖ref row‖) chose other experts: in the
# runs above a flipped row was 0.50 off at the least, a row of the same experts 0.009 at most.
FLIPPED_ROW_ERROR = 0.1


def reference(preset, dtype, device, seeds=(INPUT_SEED,)):
    """Eager loop spelling in fp32 on the same (dtype-rounded) parameters and inputs: one
    (output, gradients of (ctx, tok, *parameters), ties) for each seed's batch (make_inputs).

    ties [B,H] (bool): the batch's rows near a top-k tie (TIE_MARGIN). The upstream gradient is
    INPUT_SEED's for every batch, as the timed steps share one, and zero in the tie rows of all the
    batches, as it is in the rows' own check (zero_tie_rows_), so that no gradient depends on their
    choice (SPEC §1: each row's contributions are scaled by its G). Computed on `device` and
    returned on the CPU, so that they do not count in the peak memory of the rows measured after.
    """
    block = make_model(preset, "loop", dtype, device).float()
    grad_out = make_inputs(preset, dtype, device)[2].float()
    batches = [[t.float() for t in make_inputs(preset, dtype, device, seed)[:2]] for seed in seeds]
    # every batch's ties first (a forward each), then one batch's graph at a time
    ties = [_tie_rows(block, ctx, tok, dtype) for ctx, tok in batches]
    zero_tie_rows_(grad_out, torch.stack(ties).any(0))
    results = []
    for (ctx, tok), batch_ties in zip(batches, ties):
        ctx.requires_grad_(True)
        tok.requires_grad_(True)
        out = block(ctx, tok)
        grads = torch.autograd.grad(out, [ctx, tok, *block.parameters()], grad_out)
        results.append((out.detach().cpu(), [g.cpu() for g in grads], batch_ties.cpu()))
    return results


def _tie_rows(block, ctx, tok, dtype):
    """[B,H] bool: the rows whose k-th router probability exceeds the (k+1)-th by less than
    TIE_MARGIN[dtype] of the k-th."""
    logits = []
    hook = block.moe.router.register_forward_hook(lambda module, args, out: logits.append(out.detach()))
    with torch.no_grad():
        out = block(ctx, tok)
    hook.remove()
    top = torch.softmax(logits[0], dim=-1).topk(block.moe.top_k + 1, dim=-1).values
    return ((top[:, -2] - top[:, -1]) < TIE_MARGIN[dtype] * top[:, -2]).view(out.shape[:-1])


def zero_tie_rows_(grad_out, ties):
    """The upstream gradient of a check, in place: zero in the rows near a top-k tie."""
    return grad_out.masked_fill_(ties.to(grad_out.device)[..., None], 0)


def errors(out, grads, ref_out, ref_grads, ties):
    """A row's check against the reference (out, grads: the row's, grads None in inference):
    rel_err over the rows away from a top-k tie, grad_rel_err (gradient_error), tie_rows (the rows
    set aside), tie_rows_flipped (those of them that chose other experts: FLIPPED_ROW_ERROR off the
    reference's row or more) and rows_off (rows away from the ties as far off: a flip past the
    margin, or a wrong row)."""
    out = out.detach().float().cpu()
    off = (out - ref_out).norm(dim=-1) / ref_out.norm(dim=-1).clamp_min(1e-30) > FLIPPED_ROW_ERROR
    return dict(rel_err=relative_error(out[~ties], ref_out[~ties]),
                grad_rel_err=None if grads is None else gradient_error(grads, ref_grads),
                tie_rows=int(ties.sum()), tie_rows_flipped=int(off[ties].sum()), rows_off=int(off[~ties].sum()))


def merge_errors(checks):
    """One row's check from each batch's (errors): the worst rel_err and grad_rel_err (a NaN the
    worst of all: max() would pass over it), and the rows counted over every batch."""
    grads = [c["grad_rel_err"] for c in checks]
    return dict(rel_err=_worst(c["rel_err"] for c in checks),
                grad_rel_err=None if None in grads else _worst(grads),
                **{name: sum(c[name] for c in checks) for name in ("tie_rows", "tie_rows_flipped", "rows_off")})


def _worst(errors):
    """The largest error, a NaN above every number (max() keeps whichever came first)."""
    return max(errors, key=lambda error: math.inf if math.isnan(error) else error)


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
    errors = [0.0]
    for g, r in zip(grads, refs):
        if g is None:
            errors.append(1.0)
            continue
        # 1e-30: every gradient is zero where every row is a tie row (its upstream gradient zero)
        errors.append(float((g.detach().float().cpu() - r).norm()) / max(float(r.norm()), 1e-3 * scale, 1e-30))
    return _worst(errors)  # a NaN gradient is the worst (max(0.0, nan) was 0.0)
