"""What a compiled graph meets when it runs (rest="eager"): a checkpoint whose recomputation must
draw the forward's random numbers again, torch.func's transforms inside the compiled function,
and tokens made under inference_mode. Each failed before session 67 (a review's)."""
import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vmap
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from mha_compile import backend
from numerics import TOLERANCE, compiled_reports, relative_error
from test_whole_graph import _stub_cuda_graphs
from lowering.spellings import SpelledBlock, inputs


class CheckpointedDropout(nn.Module):
    """A Linear and dropout on tok, then the block (or only a Linear), under torch.utils.checkpoint."""

    def __init__(self, how, block=True):
        super().__init__()
        self.how = how
        self.lin, self.block = nn.Linear(32, 32), SpelledBlock() if block else nn.Linear(32, 32)

    def body(self, ctx, tok):
        dropped = nn.functional.dropout(self.lin(tok), 0.3, training=True)
        return self.block(ctx, dropped) if isinstance(self.block, SpelledBlock) else self.block(dropped).mean(1)[:, None] + ctx

    def forward(self, ctx, tok):
        if self.how == "selective":
            return checkpoint(self.body, ctx, tok, use_reentrant=False, context_fn=_recompute_all)
        return checkpoint(self.body, ctx, tok, use_reentrant=self.how == "reentrant")


def _recompute_all():
    """Selective checkpointing's contexts, recomputing every op (Dynamo reads a module-level function)."""
    return create_selective_checkpoint_contexts(lambda ctx, op, *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE)


def _gradients(model, args, seed):
    torch.manual_seed(seed)
    out = model(*args)
    out.backward(torch.ones_like(out))
    return out, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "selective"])
@pytest.mark.parametrize("block", [True, False], ids=["block", "no-block"])
def test_dropout_inside_a_checkpoint_draws_the_same_mask_when_recomputed(how, block):
    """Dynamo's checkpoint op, run eagerly, sets preserve_rng_state=False (Inductor keeps the random
    numbers otherwise): the recomputation drew a new mask, and every gradient was off (0.63 of the
    Linear's), with a block matched or not. The backend runs it as eager's checkpoint does."""
    torch.manual_seed(0)
    model = CheckpointedDropout(how, block).double()
    args = [a.requires_grad_() for a in inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))]
    compiled = copy.deepcopy(model)
    with compiled_reports() as reports:
        torch._dynamo.reset()
        got, got_grads = _gradients(torch.compile(compiled, backend="mha"), args, seed=5)
    want, want_grads = _gradients(model, args, seed=5)
    assert sum(len(r.matches) for r in reports) == int(block), [str(r) for r in reports]
    assert relative_error(got, want) <= TOLERANCE[torch.float64]
    for (name, _), g, w in zip(model.named_parameters(), got_grads, want_grads):
        if name.endswith("key.bias"):  # SPEC §1: ∂bk is exactly zero; eager leaves rounding there
            continue
        assert relative_error(g, w) <= TOLERANCE[torch.float64], f"∂{name}: {relative_error(g, w):.3g}"


def _loss(model, params, ctx, tok, cotangent):
    return (functional_call(model, params, (ctx, tok)) * cotangent).sum()


def _transformed(model, how):
    """A function of (params, ctx, tok, cotangent) that runs `model` under a torch.func transform."""
    if how == "grad":
        return lambda p, c, t, g: grad(lambda p: _loss(model, p, c, t, g))(p)
    if how == "per-sample grad":  # vmap over batch rows of grad
        one = lambda p, c, t, g: _loss(model, p, c[None], t[None], g[None])
        return lambda p, c, t, g: vmap(grad(one), in_dims=(None, 0, 0, 0))(p, c, t, g)
    if how == "jvp":
        return lambda p, c, t, g: jvp(lambda t: functional_call(model, p, (c, t)), (t,), (g[:, :1].expand_as(t),))[1]
    return lambda p, c, t, g: vmap(lambda c: functional_call(model, p, (c, t)))(c[None].expand(2, -1, -1, -1))


@pytest.mark.parametrize("rest", ["eager", "inductor", "trees"])
@pytest.mark.parametrize("how", ["grad", "per-sample grad", "jvp", "vmap"])
def test_torch_func_transforms_inside_the_compiled_function(how, rest, monkeypatch):
    """grad, vmap(grad) and jvp raised inside the op's autograd ("must override the setup_context
    staticmethod", a tangent dropped); with rest="eager" the region now runs its reference under
    them. With rest="inductor" Inductor traces the op itself, which cannot take them: compiling the
    rewritten graph raised out of torch.compile (session 68), where plain Inductor compiles the
    function, and so did the CUDA-graph trees (mode="reduce-overhead", stood in for on the CPU).
    Under grad and jvp both now compile the graph as captured, and the report says why."""
    options = {"rest": rest}
    if rest == "trees":
        monkeypatch.setattr(backend, "_whole_graph_captured", lambda *args: True)
        _stub_cuda_graphs(monkeypatch)
        options = {"mode": "reduce-overhead", "step_graphs": False}
    torch.manual_seed(0)
    model = SpelledBlock().double()
    ctx, tok = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    cotangent = torch.randn_like(ctx)
    params = {name: p.detach() for name, p in model.named_parameters()}
    fn = _transformed(model, how)
    want = fn(params, ctx, tok, cotangent)
    with compiled_reports() as reports:
        torch._dynamo.reset()
        got = torch.compile(fn, backend="mha", options=options)(params, ctx, tok, cotangent)
    assert sum(len(r.matches) for r in reports) == 1, [str(r) for r in reports]
    fallbacks = [r.fallback for r in reports if r.fallback]
    if rest != "eager" and how != "vmap":  # vmap alone does not differentiate: the op runs under it
        assert len(fallbacks) == 1 and fallbacks[0].startswith("NotImplementedError: torch.func's"), fallbacks
    else:
        assert not fallbacks, fallbacks
    pairs = [(k, got[k], want[k]) for k in want if not k.endswith("key.bias")] if isinstance(want, dict) else \
        [("out", got, want)]
    for name, g, w in pairs:
        assert relative_error(g, w) <= TOLERANCE[torch.float64], f"{name}: {relative_error(g, w):.3g}"


def test_tokens_made_under_inference_mode_train_where_the_spelling_copies_them():
    """nn.MultiheadAttention copies tok, so eager trains on an inference tensor; the region saved
    tok itself for its backward and raised ("Inference tensors cannot be saved for backward")."""
    torch.manual_seed(0)
    model = SpelledBlock(pool="mha").double()
    compiled = copy.deepcopy(model)
    ctx, tok = inputs(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        tok = tok.clone()
    with compiled_reports() as reports:
        torch._dynamo.reset()
        got = torch.compile(compiled, backend="mha")(ctx, tok)
    want = model(ctx, tok)
    assert sum(len(r.matches) for r in reports) == 1
    cotangent = torch.randn_like(want)
    got.backward(cotangent)
    want.backward(cotangent)
    for (name, p), q in zip(model.named_parameters(), compiled.parameters()):
        assert relative_error(q.grad, p.grad) <= TOLERANCE[torch.float64], name
