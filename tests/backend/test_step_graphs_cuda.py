"""options step_graphs=True on the GPU: the step replayed through mha_compile's own CUDA graphs
(mha_compile/step_graphs.py) must train as the plain compiled step does, through SGD's in-place
updates, a parameter whose storage moves, gradients accumulated without zeroing, micro-batches
whose forwards come before one backward (each at a depth of its own), a retained graph, the pool
run outside the graphs, and dropout (a new mask each replay, the backward reading that replay's);
and its graphs must really be the ones replayed (torch's trees never asked), so that a silent fallback cannot
pass for them."""
import pytest
import torch

from cuda_training import block, train
from dropout_model import DroppedTokens
from mha_compile import models, step_graphs, whole_graph

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
OPTIONS = {"mode": "reduce-overhead", "step_graphs": True}


@pytest.fixture()
def replays(monkeypatch):
    """Counts of the step graphs' forward and backward replays; torch's trees made to fail."""
    counts = {"forward": 0, "backward": 0}
    for name in counts:
        real = getattr(step_graphs._Step, name)

        def counted(self, *args, _real=real, _name=name):
            counts[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(step_graphs._Step, name, counted)

    def no_trees(gm, example_inputs):
        raise AssertionError("step_graphs=True handed the graph to torch's CUDA-graph trees")

    monkeypatch.setattr(whole_graph, "capture", no_trees)
    torch._dynamo.reset()
    yield counts
    torch._dynamo.reset()


def _move_w1(step, model):
    if step == 3:
        with torch.no_grad():
            model.moe.w1.data = model.moe.w1.data * 0.5  # new storage, same Parameter


def test_step_graphs_train_as_the_plain_step(replays):
    """Five SGD steps, W1's storage replaced before step 3 (captured again, W1 copied in from
    then on): the losses and parameters of the plain compiled step, to bf16's rounding of the
    same kernels' results."""
    torch._dynamo.reset()
    plain_losses, plain_params = train(block(), options={"graphs": "off"}, steps=5, before_step=_move_w1)
    torch._dynamo.reset()
    graphed_losses, graphed_params = train(block(), options=OPTIONS, steps=5, before_step=_move_w1)
    assert replays == {"forward": 4, "backward": 4}  # step 0 eager, then 4 replays
    torch.testing.assert_close(torch.tensor(graphed_losses), torch.tensor(plain_losses), rtol=1e-4, atol=0)
    for got, want in zip(graphed_params, plain_params):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-3, atol=1e-5)


def _inputs(step):
    gen = torch.Generator("cuda").manual_seed(300 + step)
    ctx = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    tok = torch.randn(64, 24, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    return ctx, tok


def _gradients(model, fn, steps, zero):
    """Each step's increment of every parameter's .grad, for fn(ctx, tok) summed squared."""
    increments = []
    for step in steps:
        before = {name: p.grad.float().clone() if p.grad is not None else 0 for name, p in model.named_parameters()}
        fn(*_inputs(step)).float().square().mean().backward()
        increments.append({name: p.grad.float() - before[name] for name, p in model.named_parameters()})
        if zero:
            model.zero_grad(set_to_none=True)
    return increments


def test_gradients_accumulate_without_zeroing(replays):
    """.grad summed over three replayed steps without zeroing, as the plain compiled step sums
    it (the same kernels, the same bf16 sums in the same order): a gradient the graphs hand out,
    taken as .grad, would be overwritten by the next replay and added to itself."""
    def accumulated(fn, model):
        fn(*_inputs(0)).float().square().mean().backward()  # the eager call, its .grad dropped
        model.zero_grad(set_to_none=True)
        for step in (1, 2, 3):
            fn(*_inputs(step)).float().square().mean().backward()
        return {name: p.grad.float().clone() for name, p in model.named_parameters()}

    model = block()
    got = accumulated(torch.compile(model, backend="mha", options=OPTIONS), model)
    assert replays["backward"] == 3
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    want = accumulated(torch.compile(model, backend="mha", options={"graphs": "off"}), model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-6, msg=lambda m: f"∂{name}: {m}")
        assert (got[name].abs().max() == 0) == (name == "pool.key.bias"), f"∂{name}"


def test_micro_batches_before_one_backward(replays):
    """Two forwards summed into one backward, two such steps, the gradients accumulated over both:
    the second forward of each replays graphs of its own (the first's saved values are in its
    graphs' memory; a .grad may then lie in either's), and after each step the gradients are the
    plain step's."""
    pairs = ((5, 6), (7, 8))

    def accumulated(fn, model):
        model.zero_grad(set_to_none=True)
        grads = []
        for pair in pairs:
            sum(fn(*_inputs(seed)).float().square().mean() for seed in pair).backward()
            grads.append({name: p.grad.float().clone() for name, p in model.named_parameters()})
        return grads

    model = block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    for step in range(2):
        compiled(*_inputs(step)).float().square().mean().backward()
    got = accumulated(compiled, model)
    assert replays == {"forward": 5, "backward": 5}  # step 1's, then two depths a pair
    torch._dynamo.reset()
    want = accumulated(torch.compile(model, backend="mha", options={"graphs": "off"}), model)
    for pair, grads, plain in zip(pairs, got, want):
        for name in plain:
            torch.testing.assert_close(grads[name], plain[name], rtol=1e-3, atol=1e-6,
                                       msg=lambda m: f"{pair} ∂{name}: {m}")


def test_a_retained_graph_then_another_forward(replays):
    """A backward with retain_graph=True, another forward, then a backward of both (a GAN's
    losses): the second forward takes graphs of its own (the first's values are read again), and
    the gradients are the plain step's."""
    def gan_like(fn, model):
        model.zero_grad(set_to_none=True)
        first = fn(*_inputs(5)).float().square().mean()
        first.backward(retain_graph=True)
        (first + fn(*_inputs(6)).float().square().mean()).backward()
        return {name: p.grad.float().clone() for name, p in model.named_parameters()}

    model = block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    for step in range(2):
        compiled(*_inputs(step)).float().square().mean().backward()
    got = gan_like(compiled, model)
    assert replays == {"forward": 3, "backward": 4}  # step 1's; the first's twice, the second's once
    torch._dynamo.reset()
    want = gan_like(torch.compile(model, backend="mha", options={"graphs": "off"}), model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-6, msg=lambda m: f"∂{name}: {m}")


def test_the_pool_outside_the_step_graphs(monkeypatch, replays):
    """tok read where it is by the eager pool (here at every size), its inv an input of the step
    graphs: the gradients the graphs give with the pool inside them."""
    grads = {}
    for outside in (False, True):
        monkeypatch.setattr(whole_graph, "POOL_OUTSIDE", outside)
        monkeypatch.setattr(whole_graph, "POOL_OUTSIDE_MIN_BYTES", 0)
        torch._dynamo.reset()
        model = block()
        grads[outside] = _gradients(model, torch.compile(model, backend="mha", options=OPTIONS), range(3), zero=True)
    assert replays["backward"] == 4
    for step, (got, want) in enumerate(zip(grads[True], grads[False])):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-6, msg=lambda m: f"{step} ∂{name}: {m}")


def test_inputs_refilled_in_place_and_outputs_kept(replays):
    """The bench's pattern: one ctx and one tok (leaves that take gradients) refilled in place
    each step, so the graphs read them where they are; every step's output, kept by the caller,
    must survive the later replays, and it and the input gradients equal the plain step's."""
    model = block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    ctx = torch.empty(64, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tok = torch.empty(64, 24, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kept = []
    for step in range(4):
        new_ctx, new_tok = _inputs(step)
        with torch.no_grad():
            ctx.copy_(new_ctx)
            tok.copy_(new_tok)
        ctx.grad = tok.grad = None
        out = compiled(ctx, tok)
        out.float().square().mean().backward()
        kept.append((out, ctx.grad.clone(), tok.grad.clone()))  # held as they are, they would send steps eager
        model.zero_grad(set_to_none=True)
    assert replays == {"forward": 3, "backward": 3}
    torch._dynamo.reset()
    plain = torch.compile(model, backend="mha", options={"graphs": "off"})
    for step, (out, ctx_grad, tok_grad) in enumerate(kept):
        new_ctx, new_tok = (t.requires_grad_() for t in _inputs(step))
        want = plain(new_ctx, new_tok)
        want.float().square().mean().backward()
        for name, got, expected in (("out", out, want), ("∂ctx", ctx_grad, new_ctx.grad), ("∂tok", tok_grad, new_tok.grad)):
            torch.testing.assert_close(got.float(), expected.float(), rtol=1e-3, atol=1e-6,
                                       msg=lambda m: f"step {step} {name}: {m}")


def test_the_callers_inputs_are_left_as_they_were(replays):
    """Inputs read in place (one ctx and tok buffer, taking no gradient) hold after each replayed
    step, forward and backward, exactly what the caller put there: no graph writes into them
    (session 51 saw garbage gradients where a freed input's memory was taken by another tensor,
    and did not find why; a write into an input's memory would show here)."""
    model = block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    ctx = torch.empty(64, 8, 128, device="cuda", dtype=torch.bfloat16)
    tok = torch.empty(64, 24, 128, device="cuda", dtype=torch.bfloat16)
    for step in range(4):
        new_ctx, new_tok = _inputs(step)
        ctx.copy_(new_ctx)
        tok.copy_(new_tok)
        compiled(ctx, tok).float().square().mean().backward()
        torch.cuda.synchronize()
        assert torch.equal(ctx, new_ctx) and torch.equal(tok, new_tok), f"step {step}"
        model.zero_grad(set_to_none=True)
    assert replays == {"forward": 3, "backward": 3}


def test_inference_replays_its_own_graph(replays):
    model = block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    with torch.no_grad():
        outs = [compiled(*_inputs(step)) for step in range(4)]
        assert replays == {"forward": 3, "backward": 0}
        torch._dynamo.reset()
        plain = torch.compile(model, backend="mha", options={"graphs": "off"})
        for step, out in enumerate(outs):
            torch.testing.assert_close(out.float(), plain(*_inputs(step)).float(), rtol=1e-3, atol=1e-6)


def test_dropout_draws_anew_each_replay(replays):
    """Dropout from the device's default generator, captured: each replay's mask must be new (a
    graph that did not register the generator would repeat the capture's mask every step), the
    dropped tok tok's kept entries doubled, and the step's output and gradients the plain
    compiled block's on that dropped tok (a backward reading another mask would differ)."""
    model = DroppedTokens(block())
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    steps = []
    for step in range(5):
        ctx, tok = _inputs(step)
        out, dropped = compiled(ctx, tok)
        out.float().square().mean().backward()
        steps.append((ctx, tok, out, dropped, {name: p.grad.float().clone() for name, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    assert replays == {"forward": 4, "backward": 4}
    masks = [dropped != 0 for _, _, _, dropped, _ in steps]
    assert not any(torch.equal(a, b) for a, b in zip(masks, masks[1:]))
    assert all(0.45 < m.float().mean() < 0.55 for m in masks)
    torch._dynamo.reset()
    plain = torch.compile(model.block, backend="mha", options={"graphs": "off"})
    for step, (ctx, tok, out, dropped, got) in enumerate(steps):
        torch.testing.assert_close(dropped, torch.where(dropped != 0, 2 * tok, 0), rtol=0, atol=0)
        want = plain(ctx, dropped)
        want.float().square().mean().backward()
        torch.testing.assert_close(out.float(), want.float(), rtol=1e-3, atol=1e-6, msg=lambda m: f"step {step} out: {m}")
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[name], p.grad.float(), rtol=1e-3, atol=1e-6,
                                       msg=lambda m: f"step {step} ∂{name}: {m}")
        model.zero_grad(set_to_none=True)


def test_autocast_steps_train_as_the_plain_step(replays):
    """fp32 parameters and inputs, each step under torch.autocast(bf16) (a capture records the
    casts the autocast state of its call made; Dynamo guards that state): four SGD steps' losses,
    and every parameter's gradient at each step, the plain compiled step's under autocast."""
    def run(options):
        torch._dynamo.reset()
        torch.manual_seed(5)
        model = models.MHABlock(128, 4, 256, 8, 2, act="gelu", renorm=True).cuda()
        compiled = torch.compile(model, backend="mha", options=options)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, grads = [], []
        for step in range(4):
            ctx, tok = (t.float() for t in _inputs(step))
            with torch.autocast("cuda", torch.bfloat16):
                loss = compiled(ctx, tok).float().square().mean()
            loss.backward()
            grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses, grads

    got_losses, got_grads = run(OPTIONS)
    assert replays == {"forward": 3, "backward": 3}
    want_losses, want_grads = run({"graphs": "off"})
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=1e-4, atol=0)
    for step, (got, want) in enumerate(zip(got_grads, want_grads)):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-6, msg=lambda m: f"{step} ∂{name}: {m}")
            assert name == "pool.key.bias" or got[name].abs().max() > 0, f"step {step} ∂{name} is zero"
