"""Gradient health through backend="mha" (issue 7): every parameter gets a finite, non-zero
gradient; gradients equal eager's (SPEC §4); a 200-step loss curve tracks eager's.

The pool key bias is the documented exception: SPEC §1 says ∂bk is exactly zero (it shifts every
score of a head equally), and the region's backward returns exact zeros for it.
"""
import copy

import pytest
import torch

from mha_compile import models, tasks
from numerics import TOLERANCE, relative_error
from training_utils import region_matches

BK = "block.pool.key.bias"


def _forecaster(dtype, seed=0, **block):
    torch.manual_seed(seed)
    return models.Forecaster(16, 4, 3, dim=32, heads=2, hidden=64, experts=4, top_k=2, **block).to(dtype)


def _batch(dtype, seed=0):
    series, target = tasks.two_sines(64, 16, 4, 3, torch.Generator().manual_seed(seed))
    return series.to(dtype), target.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block", [dict(), dict(act="swiglu", spelling="dense")], ids=["gelu-loop", "swiglu-dense"])
def test_gradients_are_finite_nonzero_and_equal_eager(dtype, block):
    """Two optimiser steps; at each, every gradient of the compiled model against eager's.

    SGD with momentum between them (its update is linear in the gradient, so the second step's
    parameters differ by rounding only; Adam's ≈ lr·sign(g) first step would not: see
    test_training_modes)."""
    torch._dynamo.reset()
    eager = _forecaster(dtype, **block)
    mine = copy.deepcopy(eager)
    compiled = torch.compile(mine, backend="mha")
    opt_e, opt_c = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (eager, mine))
    series, target = _batch(dtype)
    with region_matches() as matches:
        for step in range(2):
            for model, opt in ((eager, opt_e), (compiled, opt_c)):
                opt.zero_grad(set_to_none=True)
                (model(series) - target).square().mean().backward()
            for (name, p_e), p_c in zip(eager.named_parameters(), mine.parameters()):
                assert p_c.grad is not None, f"step {step}: {name} got no gradient"
                if name == BK:
                    assert torch.count_nonzero(p_c.grad) == 0, f"step {step}: ∂bk must be exactly zero"
                    assert p_e.grad.abs().max() <= 1e-6 * eager.block.pool.key.weight.grad.abs().max()
                    continue
                assert torch.isfinite(p_c.grad).all(), f"step {step}: ∂{name} is not finite"
                assert torch.count_nonzero(p_c.grad) > 0, f"step {step}: ∂{name} is all zero"
                error = relative_error(p_c.grad, p_e.grad)
                assert error <= TOLERANCE[dtype], f"step {step}: ∂{name} relative error {error:.3g} > {TOLERANCE[dtype]:g}"
            opt_e.step(), opt_c.step()
    assert matches == [1], f"expected one graph with the region replaced, got {matches}"


def test_every_parameter_is_named_in_the_check():
    """The check above walks named_parameters(): make sure the block's are all there."""
    names = {n for n, _ in _forecaster(torch.float32).named_parameters()}
    for expected in ("block.pool.query", BK, "block.pool.value.weight", "block.pool.out.weight",
                     "block.moe.router.weight", "block.moe.w1", "block.moe.b1", "block.moe.w2", "block.moe.b2"):
        assert expected in names


# 200 steps, two_sines, fp32, seeds 0-2, measured largest per-step |Δloss| / loss between the
# compiled and the eager run: 7.1e-7, 8.4e-7, 1.1e-6 (1e-7 at step 10, 4e-7 at step 100). The
# two differ only in fp32 rounding (the region reassociates the pool and sums in another order);
# Adam divides each update by √v, so a 1e-7 difference in a gradient becomes a similar relative
# difference in the step, and the gap grows slowly and steadily while no top-k choice flips.
# 1e-4 is ~100x the measured gap and still far below any real defect (a wrong gradient on one
# parameter moves the loss by > 1e-2 within a few steps). A task whose trajectory is chaotic
# (pooled_selection: spiky, routing flips) diverges after ~100 steps in fp32 even between two
# correct implementations (measured gap > 1e-3 from step 95-114), which is why it is not used here.
LOSS_CURVE_RTOL = 1e-4


def test_200_step_loss_curve_tracks_eager():
    torch._dynamo.reset()
    common = dict(seed=0, batch=256)
    eager = tasks.overfit(tasks.two_sines, 200, compile=False, **common)
    with region_matches() as matches:
        compiled = tasks.overfit(tasks.two_sines, 200, compile=True, **common)
    assert matches == [1]
    gaps = [abs(c - e) / abs(e) for c, e in zip(compiled, eager)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    assert gaps[worst] <= LOSS_CURVE_RTOL, (
        f"step {worst}: compiled loss {compiled[worst]:.6g} vs eager {eager[worst]:.6g} (gap {gaps[worst]:.3g})")
    assert eager[-1] < 1e-2 * eager[0], "the reference run did not train: the comparison would be vacuous"
