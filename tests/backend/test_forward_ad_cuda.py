"""Forward-mode AD on the GPU paths that replay compiled code (tests/backend/test_forward_ad.py has
the CPU side): mha_compile's step graphs (reduce-overhead's default), torch's CUDA-graph trees
(step_graphs=False) and rest="inductor". A replay carries no tangent, so a call with tangents must
run the graph eagerly (backend._tangents_eagerly, the region on the reference's plain ops) and give
eager's tangent; the training steps around it keep replaying, and their losses stay the plain
step's."""
import copy

import pytest
import torch
from torch.autograd import forward_ad

from cuda_training import block
from mha_compile import step_graphs
from numerics import relative_error

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PATHS = {"step_graphs": {"mode": "reduce-overhead"},
         "trees": {"mode": "reduce-overhead", "step_graphs": False},
         "inductor": {"rest": "inductor", "mode": "reduce-overhead"}}
# The call runs the graph Dynamo captured, eagerly: eager's own ops in bf16, so its tangent is eager's
# up to the order of a sum. Not a float64 bound: forward-mode AD rounds every tangent it carries to
# bf16, and eager's own tangent is 5.7% from float64's here (measured on the CPU; 6.1% on an H100).
EAGER_BOUND = 1e-3


def _batch(step):
    gen = torch.Generator("cuda").manual_seed(700 + step)
    return (torch.randn(32, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen),
            torch.randn(32, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen))


def _tangent(fn, ctx, tok, t_ctx, t_tok, grad):
    with forward_ad.dual_level(), torch.set_grad_enabled(grad):
        out = fn(forward_ad.make_dual(ctx, t_ctx), forward_ad.make_dual(tok, t_tok))
        return forward_ad.unpack_dual(out).tangent


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_call_with_tangents_between_replayed_steps(path, grad, monkeypatch):
    replays = []
    real = step_graphs._Step.forward
    monkeypatch.setattr(step_graphs._Step, "forward", lambda self, *a: replays.append(1) or real(self, *a))
    torch._dynamo.reset()
    model = block()
    compiled = torch.compile(model, backend="mha", options=PATHS[path])

    def step(i):
        torch.compiler.cudagraph_mark_step_begin()  # the trees' step boundary (the step graphs need none)
        ctx, tok = _batch(i)
        loss = compiled(ctx.requires_grad_(), tok).float().square().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    for i in range(3):  # eager, capture, replay
        step(i)
    replayed = len(replays)
    ctx, tok = _batch(10)
    t_ctx, t_tok = torch.randn_like(ctx), torch.randn_like(tok)
    tangent = _tangent(compiled, ctx, tok, t_ctx, t_tok, grad)
    want = _tangent(model, ctx, tok, t_ctx, t_tok, grad)  # the module itself, uncompiled
    assert tangent is not None, f"{path}: the call dropped the tangent"
    error = relative_error(tangent, want)
    print(f"{path}: tangent's relative error against eager {error:.3g}")
    assert error <= EAGER_BOUND, path
    assert len(replays) == replayed, "a call with tangents replayed the step graphs"
    after = step(3)  # the steps replay on as before
    if path == "step_graphs":
        assert len(replays) == replayed + 1
    torch._dynamo.reset()
    plain = torch.compile(copy.deepcopy(model), backend="mha", options={"graphs": "off"})
    ctx, tok = _batch(3)
    want_loss = plain(ctx, tok).float().square().mean().item()
    assert after == pytest.approx(want_loss, rel=1e-3)
