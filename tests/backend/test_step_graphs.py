"""step_graphs (options step_graphs=True) on the CPU, with its CUDA recorder replaced by a
stand-in, and what why_not refuses.

The stand-in (Emulated) keeps a "capture"'s results as the static tensors and makes a replay
run the captured function again and write into them, as a CUDA graph writes into the addresses
it captured; the backward's replay runs through the autograd graph the last forward replay
recorded, so it reads what that replay saved, with the random numbers it drew (a CUDA graph's
backward reads the saved values that replay left in the pool), not the inputs as they are now;
and a forward replay writes NaN over the backward's gradients first, as a CUDA graph may where
the backward's capture took a block the forward's freed. So these tests check what step_graphs adds around the graphs: the first call eager, the inputs
read in place or copied, a capture again when one moves, fresh outputs, gradients handed to
autograd without being taken as .grad, a capture of its own for a call while a backward is
pending, the error
for a backward whose values were overwritten. The real capture and replay are tested on the GPU
(test_step_graphs_cuda.py); what the stand-in cannot show is whether an input's memory must
outlive the forward (its autograd graph holds every input).
"""
import contextlib
import functools
import logging
from unittest import mock

import pytest
import torch

from mha_compile import backend, models, step_graphs
from mha_compile.lowering.select import CAPTURED_WHOLE
from numerics import compiled_reports, needs_interpreter
from dropout_model import DroppedTokens
from mha_compile.step_graphs import CudaGraphs  # the real one: the tests replace the module's


def _write(static, new):
    with torch.no_grad():
        for s, n in zip(static, new):
            if s is not None:
                s.copy_(n)


class Emulated:
    """step_graphs' recorder on the CPU (the module docstring); counts what it did."""

    made = []
    fail = False

    def __init__(self, device):
        self.device, self.forward, self.grads = device, None, []
        self.warm_ups = self.forward_replays = self.backward_replays = 0
        Emulated.made.append(self)

    @staticmethod
    def takes(t):
        return True

    def warm_up(self, forward, backward):
        self.warm_ups += 1
        outputs = forward()
        if backward is not None:
            backward(outputs, [torch.ones_like(o) if o.requires_grad else None for o in outputs])

    def capture_forward(self, forward):
        if Emulated.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.forward = forward
        outputs = forward()

        def replay():
            self.forward_replays += 1
            # the two graphs share a pool: the backward's gradients may lie where the forward
            # keeps its intermediates, and then its replay writes there (written over with NaN)
            _write(self.grads, [torch.full_like(g, float("nan")) for g in self.grads])
            self.recorded = forward()  # its autograd graph: what this replay saved
            _write(outputs, self.recorded)

        return outputs, replay

    def capture_backward(self, backward, outputs):
        grads = backward(outputs)
        self.grads = [g for g in grads if g is not None]

        def replay():
            # a CUDA graph's backward can replay again on the same saved values (a retained
            # graph); the stand-in keeps its recorded autograd graph for that
            self.backward_replays += 1
            with mock.patch.object(torch.autograd, "grad", functools.partial(torch.autograd.grad, retain_graph=True)):
                _write(grads, backward(self.recorded))

        return grads, replay

    def before_replay(self):
        pass

    def synchronize(self):
        pass


def _backward_replays():
    """The backward replays of every stand-in made (each capture makes one)."""
    return sum(r.backward_replays for r in Emulated.made)


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    """The backend's reduce-overhead path taken on the CPU, its step graphs the stand-in's."""
    Emulated.made, Emulated.fail = [], False
    monkeypatch.setattr(step_graphs, "CudaGraphs", Emulated)
    monkeypatch.setattr(backend, "_whole_graph_captured", lambda opts, mode, inputs: mode == "reduce-overhead")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    _held.clear()


OPTIONS = {"mode": "reduce-overhead", "step_graphs": True}


def _block():
    torch.manual_seed(3)
    return models.MHABlock(32, 2, 64, 4, 2, act="gelu", renorm=True)


_held = []


def _inputs(seed, requires_grad=False):
    """Fresh seeded (ctx, tok), held until the test ends: the allocator cannot then hand a later
    call's inputs the address of an earlier one's, which would make a step read them in place
    and capture again when they move (test_inputs_read_in_place_and_copied tests that)."""
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randn(4, 3, 32, generator=gen).requires_grad_(requires_grad)
    tok = torch.randn(4, 5, 32, generator=gen).requires_grad_(requires_grad)
    _held.append((ctx, tok))
    return ctx, tok


def _train(model, compiled, steps, zero=True):
    """(losses, gradients of each step) of SGD steps on fresh inputs."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(steps):
        loss = compiled(*_inputs(step)).square().mean()
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        opt.step()
        if zero:
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


def _assert_trained_alike(run, eager_run):
    """Two _train results: the losses within fp32 of each other, every step's gradients too, and
    none zero but a key bias's (exactly zero by the math): a step graph that dropped a gradient
    would leave its parameter where it was."""
    (losses, grads), (eager_losses, eager_grads) = run, eager_run
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=0)
    for step, (got, want) in enumerate(zip(grads, eager_grads)):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{step} {name}: {m}")
            assert (got[name].abs().max() == 0) == name.endswith("pool.key.bias"), f"step {step} ∂{name}"


def test_a_training_step_replays_what_eager_computes():
    """Four SGD steps: the first eager, the second captured, all four within fp32 of the eager
    model's losses and gradients, every parameter given its gradient (none zero but the key
    bias's, exactly zero by the math): a step graph that dropped a gradient would leave the
    parameter where it was."""
    eager = _block()
    eager_run = _train(eager, eager, 4)
    model = _block()
    run = _train(model, torch.compile(model, backend="mha", options=OPTIONS), 4)
    [recorder] = Emulated.made
    assert (recorder.warm_ups, recorder.forward_replays, recorder.backward_replays) == (1, 3, 3)
    _assert_trained_alike(run, eager_run)


def test_gradients_accumulate_across_steps_without_zeroing():
    """After the eager first step's gradients are dropped (set_to_none), three replayed steps
    without zero_grad: .grad must grow by each step's gradient. A static gradient taken as .grad
    (AccumulateGrad takes a tensor nobody else holds when .grad is None) would be overwritten by
    the next replay and then added to itself."""
    model = _block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    compiled(*_inputs(0)).square().mean().backward()
    model.zero_grad(set_to_none=True)
    per_step = []
    for step in range(1, 4):
        before = {name: p.grad.clone() if p.grad is not None else 0 for name, p in model.named_parameters()}
        compiled(*_inputs(step)).square().mean().backward()
        per_step.append({name: p.grad - before[name] for name, p in model.named_parameters()})
    eager = _block()
    for step in range(1, 4):
        eager(*_inputs(step)).square().mean().backward()
        for name, p in eager.named_parameters():
            torch.testing.assert_close(per_step[step - 1][name], p.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {step} ∂{name}: {m}")
        eager.zero_grad(set_to_none=True)
    assert _backward_replays() == 3


@pytest.mark.parametrize("zero", ["none", "in place"])
def test_clipped_gradients_and_adam_train_as_eager(zero):
    """A usual loop: gradients clipped in place (clip_grad_norm_ scales the .grad tensors, views
    of the graphs' own), then Adam, then zero_grad to None, or (after the eager first step's are
    dropped) to zeros in place, so that .grad keeps sharing the graphs' gradients into the next
    backward. Each step's gradients before the clip and five steps' losses and parameters within
    fp32 of eager's: a .grad the next replay overwrote and then added to itself would double
    (which the clip and Adam, being scale-free, would hide from the losses alone)."""
    def run(model, fn):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses, grads = [], []
        for step in range(5):
            loss = fn(*_inputs(step)).square().mean()
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            assert norm > 0.05  # the clip scales every gradient
            opt.step()
            opt.zero_grad(set_to_none=zero == "none" or step == 0)
            losses.append(loss.item())
        return losses, grads, [p.detach().clone() for p in model.parameters()]

    eager = _block()
    want_losses, want_grads, want_params = run(eager, eager)
    model = _block()
    losses, grads, params = run(model, torch.compile(model, backend="mha", options=OPTIONS))
    assert _backward_replays() == 4
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    names = [name for name, _ in model.named_parameters()]
    for step, (got_step, want_step) in enumerate(zip(grads, want_grads)):
        for name, got, want in zip(names, got_step, want_step):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} ∂{name}: {m}")
    for name, got, want in zip(names, params, want_params):
        if name.endswith("pool.key.bias"):
            continue  # its gradient is zero by the math: Adam scales the rounding left in it (~1e-9) up to lr
        # 1e-4, not 1e-5: Adam divides by √v, which scales the gradients' 1e-6-level rounding up in
        # a parameter's few small-gradient entries (4.4e-5 relative in 1 of 8192, session 54)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_input_gradients_and_outputs_survive_the_next_replay():
    """Outputs and the inputs' gradients are the caller's: a later replay must not change them."""
    model = _block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    kept = []
    for step in range(4):
        ctx, tok = _inputs(step, requires_grad=True)
        out = compiled(ctx, tok)
        out.square().mean().backward()
        kept.append((out, out.detach().clone(), ctx.grad, ctx.grad.clone(), tok.grad, tok.grad.clone()))
    for out, out_then, ctx_grad, ctx_grad_then, tok_grad, tok_grad_then in kept:
        assert torch.equal(out, out_then) and torch.equal(ctx_grad, ctx_grad_then)
        assert torch.equal(tok_grad, tok_grad_then)
    ctx, tok = _inputs(3, requires_grad=True)
    model(ctx, tok).square().mean().backward()
    torch.testing.assert_close(kept[3][3], ctx.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(kept[3][5], tok.grad, rtol=1e-5, atol=1e-7)


def test_inputs_read_in_place_and_copied():
    """An input at the address it had in the first call is read in place (a parameter, or a batch
    buffer refilled in place); one at a new address on the second call is copied in on each
    replay; an input read in place that moves makes the step capture again, copying it."""
    model = _block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    ctx, tok = _inputs(0)
    for step in range(3):
        new_ctx, new_tok = _inputs(step)
        ctx.copy_(new_ctx)  # the same buffer, refilled
        out = compiled(ctx, new_tok)  # tok a new tensor each call
        torch.testing.assert_close(out, model(new_ctx, new_tok), rtol=1e-5, atol=1e-6)
        out.square().mean().backward()
    [recorder] = Emulated.made
    with torch.no_grad():
        model.moe.w1.data = model.moe.w1.data * 0.5  # the same parameter, new storage
    out = compiled(ctx, new_tok)
    torch.testing.assert_close(out, model(ctx, new_tok), rtol=1e-5, atol=1e-6)
    assert len(Emulated.made) == 2  # captured again
    out.sum().backward()  # else the next call, its backward pending, takes a capture of its own
    other = _inputs(7)[0]
    torch.testing.assert_close(compiled(other, new_tok), model(other, new_tok), rtol=1e-5, atol=1e-6)
    assert len(Emulated.made) == 3  # ctx moved too


def test_two_instances_of_one_class_train_alternately_as_eager():
    """Two blocks of one class, each compiled on its own and trained in turn (an ensemble, two
    models of one kind in one loop): Dynamo serves both one graph, so they share its step graphs.
    The first block's second step captures them with its parameters read in place; the second
    block's first step finds them moved and captures again with every parameter copied in. Each
    must still train as its eager twin, none of its steps computed with the other's weights."""
    def two():
        first = _block()
        torch.manual_seed(4)
        return first, models.MHABlock(32, 2, 64, 4, 2, act="gelu", renorm=True)
    eager, blocks = two(), two()
    compiled = [torch.compile(m, backend="mha", options=OPTIONS) for m in blocks]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (*eager, *blocks)]
    for step, i in enumerate((0, 0, 1, 0, 1, 1, 0)):
        inputs = _inputs(step)
        for fn, opt in ((eager[i], opts[i]), (compiled[i], opts[2 + i])):
            fn(*inputs).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        for (name, got), want in zip(blocks[i].named_parameters(), eager[i].parameters()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {step}, block {i}, {name}: {m}")
    assert len(Emulated.made) == 2 and _backward_replays() == 6  # captured twice; every step but the first replayed


def _past_capture():
    """(the block, compiled with step_graphs) after two training steps: the eager one and the one
    that captured its graphs."""
    model = _block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    for step in range(2):
        compiled(*_inputs(step)).square().mean().backward()
    return model, compiled


def _pair_gradients(model, calls):
    """Each parameter's gradient of one backward through the sum of calls' squared means."""
    model.zero_grad(set_to_none=True)
    sum(out.square().mean() for out in calls()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("start", ["copied", "read_in_place", "first_step"])
def test_forwards_before_one_backward_replay_at_depths_of_their_own(caplog, start):
    """Two forwards, then one backward of both (micro-batches summed, a siamese pair), three
    steps: the first forward's saved values live in its graphs' memory, so the second replays
    graphs of its own (a second capture, depth 1), never the busy ones again, and each step's
    gradients are eager's. read_in_place: the first micro-batch comes in one buffer each step,
    read in place, the second in new tensors (on the GPU a capture for them once replaced the
    busy one's: three replays for two); first_step: the pair from the first call on (that one
    eager, the second captured at depth 0)."""
    first = _inputs(10)
    model = _block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    for step in range(2 if start != "first_step" else 0):
        compiled(*(first if start == "read_in_place" else _inputs(step))).square().mean().backward()
    eager = _block()
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        for step in range(3):
            second = _inputs(20 + step)
            got = _pair_gradients(model, lambda: [compiled(*first), compiled(*second)])
            want = _pair_gradients(eager, lambda: [eager(*first), eager(*second)])
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"step {step} ∂{name}: {m}")
    assert not [r.message for r in caplog.records if r.levelno >= logging.WARNING]
    replays = [(r.forward_replays, r.backward_replays) for r in Emulated.made]
    assert replays == ([(3, 3), (2, 2)] if start == "first_step" else [(4, 4), (3, 3)])


def test_gradients_accumulate_across_depths():
    """Pairs of forwards, then a backward of each, three pairs without zeroing: a .grad taken from
    one depth's gradients gets the other depth's added in place, and must survive both depths'
    later replays (each writes NaN over its own gradients here first). One backward of the pair's
    sum would not show it: autograd sums the two gradients into new memory first."""
    model, compiled = _past_capture()
    eager = _block()
    for fn, m in ((compiled, model), (eager, eager)):
        m.zero_grad(set_to_none=True)
        for step in range(3):
            outs = [fn(*_inputs(40 + 2 * step + i)) for i in range(2)]
            for out in outs[::1 - 2 * (step % 2)]:  # depth 0's backward first, then depth 1's first
                out.square().mean().backward()
    for (name, p), e in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, e.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"∂{name}: {m}")
    assert [r.backward_replays for r in Emulated.made] == [4, 3]


def test_a_capture_failed_at_depth_one_leaves_depth_zero_replaying(caplog):
    """A capture at depth 1 that fails (out of memory for a second pool, on a GPU) runs calls that
    deep eagerly, said once; depth 0 keeps replaying, single steps and pairs' first calls alike,
    and every step's gradients are eager's. Before, the failure sent the whole step eagerly."""
    model, compiled = _past_capture()
    eager = _block()
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        for step, calls in enumerate([2, 1, 2, 1]):
            batches = [_inputs(60 + 2 * step + i) for i in range(calls)]
            Emulated.fail = calls == 2 and step == 0  # only depth 1's capture, in the first pair

            def compiled_calls():
                return [compiled(*b) for b in batches]

            got = _pair_gradients(model, compiled_calls)
            Emulated.fail = False
            want = _pair_gradients(eager, lambda: [eager(*b) for b in batches])
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"step {step} ∂{name}: {m}")
    failed = [r.message for r in caplog.records if "capturing the step as CUDA graphs failed" in r.message]
    assert len(failed) == 1 and "while 1 or more earlier ones await their backwards" in failed[0]
    # depth 0's (step 1's replay, then one a step) and the failed one's (none)
    assert [(r.forward_replays, r.backward_replays) for r in Emulated.made] == [(5, 5), (0, 0)]


def test_forwards_past_max_pending_run_eagerly(caplog, monkeypatch):
    """Three forwards before one backward with MAX_PENDING 2: the third runs eagerly, said once,
    and the gradients are eager's; no third capture."""
    monkeypatch.setattr(step_graphs, "MAX_PENDING", 2)
    model, compiled = _past_capture()
    eager = _block()
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        for step in range(2):
            batches = [_inputs(30 + 3 * step + i) for i in range(3)]
            got = _pair_gradients(model, lambda: [compiled(*b) for b in batches])
            want = _pair_gradients(eager, lambda: [eager(*b) for b in batches])
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"step {step} ∂{name}: {m}")
    assert sum("called while 2 earlier calls still awaited their backwards" in r.message for r in caplog.records) == 1
    assert [r.forward_replays for r in Emulated.made] == [3, 2]


@pytest.mark.parametrize("together", [False, True], ids=["apart", "summed"])
def test_a_retained_graph_keeps_its_depth_for_a_later_backward(together):
    """A backward with retain_graph=True, then another forward, then a backward through the first
    again (a GAN's losses): the second forward takes depth 1, since the first's values may be
    read again, and every gradient is eager's. Before, it replayed depth 0 over them and the
    last backward raised ("replayed a later forward")."""
    model, compiled = _past_capture()
    eager = _block()
    grads = []
    for fn, m in ((compiled, model), (eager, eager)):
        m.zero_grad(set_to_none=True)
        first = fn(*_inputs(5)).square().mean()
        first.backward(retain_graph=True)
        second = fn(*_inputs(6)).square().mean()
        if together:
            (first + second).backward()
        else:
            second.backward()
            first.backward()
        grads.append({name: p.grad.clone() for name, p in m.named_parameters()})
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"∂{name}: {m}")
    assert [(r.forward_replays, r.backward_replays) for r in Emulated.made] == [(2, 3), (1, 1)]


def test_a_backward_through_overwritten_values_raises():
    """The safety net behind the depths: a step whose generation moved on refuses a backward for
    an earlier one (its values are overwritten), rather than hand out another forward's."""
    model, compiled = _past_capture()
    first = compiled(*_inputs(5)).square().mean()
    recorder = Emulated.made[-1]
    node = first.grad_fn
    while type(node).__name__ != "_ReplayBackward":
        node = node.next_functions[0][0]
    node.generation -= 1  # as if a later forward had replayed over this one's values
    with pytest.raises(RuntimeError, match="replayed a later forward"):
        first.backward()
    assert recorder.backward_replays == 1  # step 1's only


@pytest.mark.parametrize("ask", ["backward", "grad_unused"])
def test_a_backward_with_create_graph_raises(ask):
    """A replayed backward records no ops, so its gradients would be constants to a second
    derivative: a gradient penalty must not train on them. It raises at once, naming the option,
    however the second derivative is asked for (once_differentiable's error node went unreached
    by torch.autograd.grad(..., allow_unused=True), which returned None where eager gives a
    gradient)."""
    model = _block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    for step in range(2):  # the eager call, then the capture, both with the inputs taking gradients
        inputs = _inputs(step, requires_grad=True)
        compiled(*inputs).square().mean().backward()
        for t in inputs:
            t.grad = None  # held, it would send the next step eagerly (test_a_held_gradient_...)
    [recorder] = Emulated.made
    replays = recorder.forward_replays
    ctx, tok = _inputs(4, requires_grad=True)
    out = compiled(ctx, tok)
    assert recorder.forward_replays == replays + 1  # a replay, not the eager run
    with pytest.raises(RuntimeError, match="create_graph=True .* needs torch.compile without mode='reduce-overhead'"):
        (g_tok,) = torch.autograd.grad(out.square().sum(), tok, create_graph=True)
        penalty = g_tok.square().sum()
        if ask == "backward":
            penalty.backward()
        else:
            torch.autograd.grad(penalty, list(model.parameters()), allow_unused=True)


def test_an_input_changed_in_place_before_the_backward_raises():
    """As eager autograd's saved tensors do: the backward graph would read the changed values."""
    model, compiled = _past_capture()
    loss = compiled(*_inputs(3)).square().mean()
    with torch.no_grad():
        model.moe.w2.mul_(2)
    with pytest.raises(RuntimeError, match="(?s)modified by an inplace operation.*give options step_graphs=False"):
        loss.backward()


def test_inference_calls_replay_their_own_graph():
    model = _block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    with torch.no_grad():
        outs = [compiled(*_inputs(step)) for step in range(3)]
    [recorder] = Emulated.made
    assert (recorder.forward_replays, recorder.backward_replays) == (2, 0)
    for step, out in enumerate(outs):
        assert not out.requires_grad
        torch.testing.assert_close(out, model(*_inputs(step)), rtol=1e-5, atol=1e-6)


def test_a_failed_capture_runs_the_step_eagerly_from_then_on(caplog):
    Emulated.fail = True
    model = _block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        losses, _ = _train(model, compiled, 3)
    assert sum("capturing the step as CUDA graphs failed" in r.message for r in caplog.records) == 1
    assert len(Emulated.made) == 1  # tried once
    eager = _block()
    eager_losses, _ = _train(eager, eager, 3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=0)


def test_a_failed_capture_raises_under_strict():
    """options strict=True: the capture's failure is the user's error, not a step run eagerly
    (a warning only, as without strict)."""
    Emulated.fail = True
    model = _block()
    compiled = torch.compile(model, backend="mha", options={**OPTIONS, "strict": True})
    with pytest.raises(RuntimeError, match="capturing the step as CUDA graphs .* failed .*strict=True") as raised:
        _train(model, compiled, 3)
    assert "operation not permitted when stream is capturing" in str(raised.value)


def test_a_replay_refuses_a_batch_of_cotangents():
    """is_grads_batched=True on a replayed step: a replay copies one cotangent into its graphs'
    buffers, so the step's backward refuses the batch with the region's error."""
    model = _block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    _train(model, compiled, 2)  # the second step replays
    ctx, tok = _inputs(5, requires_grad=True)
    out = compiled(ctx, tok)
    assert Emulated.made and Emulated.made[-1].forward_replays >= 1
    with pytest.raises(NotImplementedError, match="is_grads_batched=True"):
        torch.autograd.grad(out, ctx, torch.randn(2, *out.shape), is_grads_batched=True)


def _captured(fn, *args, **compile_kwargs):
    """(gm, example inputs) Dynamo hands a backend for fn(*args)."""
    seen = []

    def keep(gm, example_inputs):
        seen.append((gm, example_inputs))
        return gm.forward

    torch.compile(fn, backend=keep, **compile_kwargs)(*args)
    [graph] = seen
    return graph


def _why_not(fn, *args, **compile_kwargs):
    return step_graphs.why_not(*_captured(fn, *args, **compile_kwargs), Emulated.takes)


def test_why_not_takes_a_plain_training_graph():
    ctx, tok = _inputs(0, requires_grad=True)
    assert _why_not(_block(), ctx, tok) is None


@pytest.mark.parametrize("fn, reason", [
    (lambda x: x.add_(1) * 2, "writes into input 0 (aten.add_.Tensor, argument self)"),
    (lambda x: (x * 2, torch.rand(3, device="meta")), "draws random numbers on meta (aten.rand.default), not on"),
    (lambda x: x.view(-1), "output 0 is a view of input 0"),
    (lambda x: (x * 2).chunk(2), "outputs 0 and 1 share memory"),
])
def test_why_not_names_what_a_replay_would_get_wrong(fn, reason):
    assert reason in _why_not(fn, torch.randn(4, 3))


def test_why_not_refuses_random_numbers_from_a_generator_of_its_own():
    """Dynamo breaks the graph at a generator given explicitly; a graph traced with one is refused:
    a CUDA graph registers only the device's default generator, so a replay would repeat its draws."""
    generator = torch.Generator().manual_seed(1)
    gm = torch.fx.symbolic_trace(lambda x: x * torch.bernoulli(torch.full_like(x, 0.5), generator=generator))
    assert "from a generator of its own (aten.bernoulli.default)" in step_graphs.why_not(gm, [torch.randn(4, 3)],
                                                                                          Emulated.takes)
    assert "takes no inputs" in step_graphs.why_not(torch.fx.symbolic_trace(lambda: torch.ones(2)), [], Emulated.takes)


def test_dropout_draws_anew_each_replay_and_its_backward_reads_that_draw():
    """Dropout from the default generator replays through the step graphs: each step's mask is
    new (a replay repeating the capture's draws would train on one mask), the dropped tok is
    tok's kept entries doubled, and the step's output and gradients are the eager block's on
    that dropped tok (a backward reading another draw's mask would differ)."""
    model = DroppedTokens(_block())
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    params = list(model.parameters())
    masks = []
    for step in range(5):
        ctx, tok = _inputs(step)
        out, dropped = compiled(ctx, tok)
        out.square().mean().backward()
        got = [p.grad.clone() for p in params]
        model.zero_grad(set_to_none=True)
        kept = dropped != 0
        torch.testing.assert_close(dropped, torch.where(kept, 2 * tok, 0), rtol=0, atol=0)
        masks.append(kept)
        want_out = model.block(ctx, dropped.detach())
        want = torch.autograd.grad(want_out.square().mean(), params)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} out: {m}")
        for (name, _), g, w in zip(model.named_parameters(), got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} ∂{name}: {m}")
            assert (g.abs().max() == 0) == name.endswith("pool.key.bias"), f"step {step} ∂{name}"
    [recorder] = Emulated.made
    assert (recorder.forward_replays, recorder.backward_replays) == (4, 4)  # step 0 eager
    assert not any(torch.equal(a, b) for a, b in zip(masks, masks[1:]))
    assert all(0.3 < m.float().mean() < 0.7 for m in masks)


def test_why_not_refuses_a_batch_norm_that_updates_its_running_stats():
    norm = torch.nn.BatchNorm1d(3)
    assert "writes into input" in _why_not(norm, torch.randn(4, 3))
    assert _why_not(norm.eval(), torch.randn(4, 3)) is None


def test_why_not_refuses_sizes_and_other_devices():
    gm, inputs = _captured(lambda x: x * 2, torch.randn(5, 3), dynamic=True)
    assert "input 0 is a SymInt, not a tensor" in step_graphs.why_not(gm, inputs, Emulated.takes)
    torch._dynamo.reset()
    gm, inputs = _captured(lambda x: x * 2, torch.randn(4, 3))
    assert "input 0 is on cpu, not on a CUDA device" in step_graphs.why_not(gm, inputs, CudaGraphs.takes)


@pytest.mark.parametrize("asked, level", [(True, logging.WARNING), ("auto", logging.INFO)])
def test_a_refused_graph_goes_to_the_trees_said_in_the_log(monkeypatch, caplog, asked, level):
    """A warning where step_graphs=True asked for the step graphs; information under "auto" (the
    default), where the user asked for mode="reduce-overhead" alone."""
    trees = []
    monkeypatch.setattr(backend.whole_graph, "capture", lambda gm, inputs: trees.append(gm) or gm.forward)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    with caplog.at_level(logging.INFO, logger="mha_compile"):
        torch.compile(model, backend="mha", options={**OPTIONS, "step_graphs": asked})(torch.randn(4, 3))
    assert len(trees) == 1 and not Emulated.made
    said = [r for r in caplog.records if "torch's CUDA-graph trees take this graph, not mha_compile's step graphs" in
            r.message and "since it writes into input" in r.message]
    assert [r.levelno for r in said] == [level]


@pytest.mark.parametrize("options, mode, own", [
    ({}, "reduce-overhead", True),  # the default, "auto"
    ({"step_graphs": True}, "reduce-overhead", True),
    ({"step_graphs": False}, "reduce-overhead", False),
    ({"rest": "inductor"}, "reduce-overhead", False),  # Inductor's own graphs
    ({}, None, False),
    ({}, "max-autotune", False),
])
def test_which_steps_replay_through_the_step_graphs(options, mode, own):
    assert backend.Options.parse(options).own_step_graphs(mode) is own


def test_reduce_overhead_alone_replays_through_the_step_graphs(monkeypatch):
    """The default, step_graphs="auto": mode="reduce-overhead" with rest="eager" takes them, and
    trains as eager; step_graphs=False gives the step to torch's trees."""
    eager = _block()
    eager_run = _train(eager, eager, 3)
    model = _block()
    run = _train(model, torch.compile(model, backend="mha", mode="reduce-overhead"), 3)
    assert _backward_replays() == 2
    _assert_trained_alike(run, eager_run)
    trees = []
    monkeypatch.setattr(backend.whole_graph, "capture", lambda gm, inputs: trees.append(gm) or gm.forward)
    torch._dynamo.reset()
    made = len(Emulated.made)
    _train(model, torch.compile(model, backend="mha", options={**OPTIONS, "step_graphs": False}), 1)
    assert len(trees) == 1 and len(Emulated.made) == made


def test_step_graphs_takes_reduce_overhead_and_rest_eager():
    with pytest.raises(ValueError, match="step_graphs=True .* rest='inductor'"):
        backend.Options.parse({"step_graphs": True, "rest": "inductor"})
    with pytest.raises(ValueError, match=r"step_graphs='yes' is not allowed; expected one of \('auto', True, False\)"):
        backend.Options.parse({"step_graphs": "yes"})
    with pytest.raises(ValueError, match="step_graphs=1 is not allowed"):
        backend.Options.parse({"step_graphs": 1})
    with pytest.raises(Exception, match="give it with mode='reduce-overhead', not mode=None"):
        torch.compile(_block(), backend="mha", options={"step_graphs": True})(*_inputs(0))
    assert backend.Options.parse({"rest": "inductor", "mode": "reduce-overhead"}).step_graphs == "auto"


def test_verify_leaves_the_parameters_read_in_place(monkeypatch, caplog):
    """verify=True checks the first call's gradients on stand-ins for its inputs, which is the
    step graphs' second call, so the one that captures: the parameters must stand there at their
    own addresses, or every later replay would copy them all in. Trained as eager, verify keeping
    the rewrite."""
    steps = []
    real_init = step_graphs._Step.__init__

    def noted(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        steps.append(self)

    monkeypatch.setattr(step_graphs._Step, "__init__", noted)
    eager = _block()
    eager_run = _train(eager, eager, 4)
    model = _block()
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        run = _train(model, torch.compile(model, backend="mha", options={**OPTIONS, "verify": True}), 4)
    assert not [r for r in caplog.records if "verify" in r.getMessage()]
    _assert_trained_alike(run, eager_run)
    params = len(list(model.parameters()))
    assert steps and all(sum(step.read_in_place) >= params for step in steps)
    assert _backward_replays() >= 2


@needs_interpreter  # the split takes the fused kernels' pool, which on the CPU runs under the interpreter only
def test_the_pool_outside_the_step_graphs_trains_as_eager(monkeypatch):
    """The pool run eagerly before the step's graphs (whole_graph.plan_pool_split, here at every
    size) hands them its inv as an input: its gradient must reach the pool's backward, and every
    parameter its gradient, as the eager model's."""
    monkeypatch.setattr(backend.whole_graph, "POOL_OUTSIDE_MIN_BYTES", 0)
    pools = []
    real_capture_split = backend.whole_graph.capture_split
    monkeypatch.setattr(backend.whole_graph, "capture_split",
                        lambda split, compile_graphs: pools.append(split) or real_capture_split(split, compile_graphs))
    eager = _block()
    eager_run = _train(eager, eager, 3)
    model = _block()
    run = _train(model, torch.compile(model, backend="mha", options={**OPTIONS, "kernels": "fused"}), 3)
    assert len(pools) == 1 and _backward_replays() == 2
    _assert_trained_alike(run, eager_run)


def test_why_not_refuses_a_graph_that_holds_its_parameters():
    """A graph that reads a parameter as its own attribute (traced by torch.fx, not lifted to an
    input by Dynamo): the backward graph, a gradient of the inputs, would give it none."""
    traced = torch.fx.symbolic_trace(torch.nn.Linear(3, 2))
    assert "holds weight itself rather than taking it as an input" in step_graphs.why_not(
        traced, [torch.randn(4, 3)], Emulated.takes)
    traced.requires_grad_(False)
    assert step_graphs.why_not(traced, [torch.randn(4, 3)], Emulated.takes) is None


def test_a_held_tensor_that_moves_makes_the_step_capture_again():
    """A tensor the graph reads as an attribute is read where it was at the capture: one whose
    storage moves must be captured again where it now is."""
    traced = torch.fx.symbolic_trace(torch.nn.Linear(3, 2).requires_grad_(False))
    graphs = step_graphs.StepGraphs(lambda x: (traced(x),), Emulated,
                                    [t for _, t in step_graphs.held_tensors(traced)])
    x = torch.randn(4, 3, requires_grad=True)
    for _ in range(3):
        graphs(x)
    traced.weight.data = traced.weight.data * 2  # the same tensor, new storage
    [out] = graphs(x)
    torch.testing.assert_close(out, traced(x))
    assert len(Emulated.made) == 2


class _WithBatchNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _block()
        self.norm = torch.nn.BatchNorm1d(3)

    def forward(self, ctx, tok):
        return self.norm(self.block(ctx, tok))


@pytest.mark.parametrize("model, says", [
    (_block, "through mha_compile's own step graphs (options step_graphs)"),
    (_WithBatchNorm, "through torch's CUDA-graph trees, not mha_compile's step graphs, since it writes into input"),
])
def test_the_report_says_whose_graphs_replay_the_step(monkeypatch, model, says):
    monkeypatch.setattr(backend.whole_graph, "capture", lambda gm, inputs: gm.forward)
    with compiled_reports() as reports:
        torch.compile(model(), backend="mha", options=OPTIONS)(*_inputs(0))
    [report] = reports
    [match] = report.matches
    assert match["graphs"].startswith(f"{CAPTURED_WHOLE}; {says}")
    assert says in str(report)


class _TwoGraphs(torch.nn.Module):
    """Two blocks with a graph break between them: two compiled graphs, each with its step graphs,
    the second's inputs the first's output (a gradient through both nodes)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = _block(), _block()

    def forward(self, ctx, tok):
        mid = self.first(ctx, tok)
        torch._dynamo.graph_break()
        return self.second(mid, tok)


def test_graph_breaks_give_each_graph_its_step_graphs():
    torch.manual_seed(0)
    model = _TwoGraphs()
    eager = _TwoGraphs()
    eager.load_state_dict(model.state_dict())
    run = _train(model, torch.compile(model, backend="mha", options=OPTIONS), 4)
    eager_run = _train(eager, eager, 4)
    assert len(Emulated.made) == 2 and all(r.backward_replays == 3 for r in Emulated.made)
    _assert_trained_alike(run, eager_run)


class _Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _block()

    def forward(self, ctx, tok):
        return torch.utils.checkpoint.checkpoint(self.block, ctx, tok, use_reentrant=False)


def test_a_checkpointed_block_trains_as_eager(monkeypatch):
    """Activation checkpointing (Dynamo's higher-order op): its forward again inside the backward
    graph."""
    monkeypatch.setattr(backend.whole_graph, "capture", lambda gm, inputs: pytest.fail("handed to the trees"))
    model = _Checkpointed()
    run = _train(model, torch.compile(model, backend="mha", options=OPTIONS), 3)
    eager = _Checkpointed()
    eager_run = _train(eager, eager, 3)
    assert _backward_replays() == 2
    _assert_trained_alike(run, eager_run)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("captured_before", [False, True])
def test_checkpoint_around_the_compiled_block_trains_as_eager(caplog, reentrant, captured_before):
    """torch.utils.checkpoint around the compiled call: the recomputation must save what the first
    forward saved, which a replay does not (it saves only the inputs read in place), so under the
    saved-tensor hooks of a non-reentrant checkpoint the step runs eagerly, said once. Compiled
    inside the checkpoint, why_not's fake run must save nothing either (it counted: "a different
    number of tensors was saved")."""
    def run(model, fn):
        if captured_before:  # the same signature as below (ctx taking a gradient), run and captured
            for seed in (100, 101):
                ctx, tok = _inputs(seed, requires_grad=True)
                fn(ctx, tok.detach()).square().mean().backward()
            model.zero_grad(set_to_none=True)
        # ctx takes a gradient: a reentrant checkpoint's output takes one only from its inputs
        return _train(model, lambda c, t: torch.utils.checkpoint.checkpoint(fn, c.requires_grad_(), t,
                                                                            use_reentrant=reentrant), 3)

    eager = _block()
    eager_run = run(eager, eager)
    model = _block()
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        got = run(model, torch.compile(model, backend="mha", options=OPTIONS))
    _assert_trained_alike(got, eager_run)
    said = sum("saved-tensor hooks are on" in r.message for r in caplog.records)
    assert said == (0 if reentrant else 1)


def test_the_cuda_recorder_warms_up_captures_and_orders_its_replays(monkeypatch):
    """CudaGraphs against torch.cuda's calls faked on the CPU (what it asks of them, not what CUDA
    does): the warm-up runs a forward and a backward on the side stream, fenced both ways; each
    capture is a graph of the step's pool on that stream, replayed by its replay; a replay on
    another stream than the last waits for it."""
    calls = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            calls.append(f"{self.name} waits for {other.name}")

    class Graph:
        def replay(self):
            calls.append("replay")

    def graph(g, pool=None, stream=None, **kwargs):
        calls.append(f"capture on {stream.name} into {pool}, {kwargs}")
        return contextlib.nullcontext()

    user, side = Stream("user"), Stream("side")
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "the step's pool")
    monkeypatch.setattr(step_graphs.region_graphs, "side_stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: user)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: calls.append(f"on {s.name}") or contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    recorder = CudaGraphs("cuda:0")
    x = torch.randn(3, requires_grad=True)
    recorder.warm_up(lambda: [x * 2], lambda outputs, grads: calls.append(f"backward {grads[0].tolist()}"))
    assert calls == ["side waits for user", "on side", "backward [1.0, 1.0, 1.0]", "user waits for side"]
    calls.clear()
    outputs, replay = recorder.capture_forward(lambda: [x * 2])
    grads, replay_backward = recorder.capture_backward(lambda outs: torch.autograd.grad(outs, [x], [torch.ones(3)]),
                                                       outputs)
    assert calls == ["capture on side into the step's pool, {}"] * 2 and torch.equal(grads[0], torch.full((3,), 2.0))
    calls.clear()
    recorder.before_replay()
    replay()
    other = Stream("other")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: other)
    recorder.before_replay()
    replay_backward()
    assert calls == ["replay", "other waits for user", "replay"]


def test_an_input_read_in_place_is_not_held_past_its_backward():
    """The step reads such an input where it is; holding it (the capture's autograd graph has
    views of it for leaves) would keep a caller's batch alive for good."""
    from torch.multiprocessing.reductions import StorageWeakRef

    class Forgetful(Emulated):  # replays that keep nothing of the step (as a CUDA graph's)
        def capture_forward(self, forward):
            return forward(), lambda: None

        def capture_backward(self, backward, outputs):
            return backward(outputs), lambda: None

    graphs = step_graphs.StepGraphs(lambda x, w: (x @ w,), Forgetful)
    w = torch.randn(3, 2, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    for _ in range(3):  # eager, captured (x and w read in place), replayed
        graphs(x, w)[0].sum().backward()
    storage = StorageWeakRef(x.untyped_storage())
    del x
    assert storage.expired()


@pytest.fixture()
def steps(monkeypatch):
    """Every step_graphs._Step made (its captures), in order."""
    made = []

    class Recorded(step_graphs._Step):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(step_graphs, "_Step", Recorded)
    return made


def test_gradients_are_handed_out_without_copies(steps):
    """With .grad set to None between steps, each parameter's .grad after a replayed backward is
    a view of the graphs' own gradient (AccumulateGrad took it: no copy), and the next step still
    replays."""
    model, compiled = _past_capture()
    [step] = steps
    named = dict(model.named_parameters())
    for seed in (5, 6):
        model.zero_grad(set_to_none=True)
        compiled(*_inputs(seed)).square().mean().backward()
        ours = {g.untyped_storage().data_ptr() for g in step.grad_of if g is not None}
        assert all(p.grad.untyped_storage().data_ptr() in ours for p in named.values())
    assert Emulated.made[0].backward_replays == 3


def test_a_held_gradient_keeps_its_values_and_the_steps_replay(steps, caplog):
    """A gradient of an earlier step kept by the caller (an input's .grad, the input not read in
    place) would be overwritten by the next replay: before it, the tensor gets memory of its own,
    the same values in the same object, and the steps go on replaying. A view of it made by the
    caller cannot be moved: steps run eagerly, said once, while it is held, and replay again
    once it is not."""
    model, compiled = _past_capture()
    for seed in (3, 4):  # inputs taking gradients: a graph of their own, run eagerly, then captured
        compiled(*_inputs(seed, requires_grad=True)).square().mean().backward()

    ctx, tok = _inputs(5, requires_grad=True)
    compiled(ctx, tok).square().mean().backward()
    kept, kept_then = ctx.grad, ctx.grad.clone()
    replays = _backward_replays()
    compiled(*_inputs(6, requires_grad=True)).square().mean().backward()
    assert _backward_replays() == replays + 1 and ctx.grad is kept and torch.equal(kept, kept_then)
    ctx, tok = _inputs(7, requires_grad=True)
    compiled(ctx, tok).square().mean().backward()
    view, view_then = ctx.grad[0], ctx.grad[0].clone()
    replays = _backward_replays()
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        for seed in (8, 9):
            new_ctx, new_tok = _inputs(seed, requires_grad=True)
            compiled(new_ctx, new_tok).square().mean().backward()
            eager_ctx = new_ctx.detach().requires_grad_()
            model(eager_ctx, new_tok.detach()).square().mean().backward()
            torch.testing.assert_close(new_ctx.grad, eager_ctx.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(view, view_then) and _backward_replays() == replays
    assert sum("still held" in r.message for r in caplog.records) == 1
    del view
    compiled(*_inputs(10, requires_grad=True)).square().mean().backward()
    assert _backward_replays() == replays + 1


def _micro_batches_keeping_grad(model, fn):
    """Two micro-batches a step; the caller keeps [p.grad] (the objects) after the first and reads
    them after the second, as eager's same tensors, accumulated."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    got = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        fn(*_inputs(2 * step)).square().mean().backward()
        kept = [p.grad for p in params]
        fn(*_inputs(2 * step + 1)).square().mean().backward()
        got += [k.clone() for k in kept] + [k is p.grad for k, p in zip(kept, params)]
        opt.step()
    return got


def _gradients_cached_and_zeroed_in_place(model, fn):
    """[p.grad] taken once after a backward (a replayed one: the third), then zeroed in place and
    read each step."""
    params = list(model.parameters())
    for step in range(3):
        model.zero_grad(set_to_none=True)
        fn(*_inputs(step)).square().mean().backward()
    grads, got = [p.grad for p in params], []
    for step in range(3, 7):
        for g in grads:
            g.zero_()
        fn(*_inputs(step)).square().mean().backward()
        got += [g.clone() for g in grads] + [g is p.grad for g, p in zip(grads, params)]
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(0.1 * g)
    return got


def _two_losses_through_a_retained_graph(model, fn):
    """Two losses of one output, torch.autograd.grad of each in turn through a retained graph
    (multi-task gradient surgery), then an input's gradient (a saliency) before the backward."""
    params, got = list(model.parameters()), []
    for step in range(3):
        out = fn(*_inputs(step))
        first = torch.autograd.grad(out[..., :16].square().mean(), params, retain_graph=True)
        second = torch.autograd.grad(out[..., 16:].abs().mean(), params)
        got += [a.clone() for a in first] + [b.clone() for b in second]
        with torch.no_grad():
            for p, a, b in zip(params, first, second):
                p.sub_(0.1 * (a + b))
        ctx, tok = _inputs(10 + step, requires_grad=True)
        loss = fn(ctx, tok).square().mean()
        (saliency,) = torch.autograd.grad(loss, ctx, retain_graph=True)
        loss.backward()
        got += [saliency.clone(), ctx.grad.clone(), *[p.grad.clone() for p in params]]
        model.zero_grad(set_to_none=True)
    return got


@pytest.mark.parametrize("loop", [_micro_batches_keeping_grad, _gradients_cached_and_zeroed_in_place,
                                  _two_losses_through_a_retained_graph])
def test_gradients_the_caller_keeps_are_eagers(loop):
    """Gradients the caller holds past a replay (p.grad's objects across micro-batches, a cached
    [p.grad] zeroed in place, torch.autograd.grad's results through a retained graph) are eager's,
    objects and values: before session 52's review a replay wrote over them (NaN here) or the
    backward raised."""
    eager = _block()
    want = loop(eager, eager)
    model = _block()
    got = loop(model, torch.compile(model, backend="mha", options=OPTIONS))
    assert _backward_replays() >= 3
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, bool):
            assert g == w, f"{i}: the same tensor object as eager's"
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{i}: {m}")


def test_a_callers_residual_written_in_place_trains_as_eager(steps):
    """`h += block(h, tok)` with h the caller's activation (a non-leaf) at one address every step:
    the step copies h in rather than reading it in place, since the caller writes it before the
    backward, which reads it (read in place, the version check raised where eager trains)."""
    torch.manual_seed(5)
    lin = torch.nn.Linear(32, 32)

    def run(block, compiled):
        params = [*block.parameters(), *lin.parameters()]
        opt = torch.optim.SGD(params, lr=0.1)
        store = torch.zeros(4, 3, 32)  # refilled each step: h lies at one address
        losses, grads = [], []
        for step in range(4):
            ctx, tok = _inputs(step)
            h = store.detach().copy_(lin(ctx))  # a non-leaf at store's address (copy_ records it)
            h += compiled(h, tok)
            loss = h.square().mean()
            loss.backward()
            grads.append({name: p.grad.clone() for name, p in block.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses, grads

    lin_state = {k: v.clone() for k, v in lin.state_dict().items()}
    model = _block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    got = run(model, compiled)
    lin.load_state_dict(lin_state)
    eager = _block()
    _assert_trained_alike(got, run(eager, eager))
    assert [s.read_in_place[0] for s in steps] == [False]  # h copied in
    assert Emulated.made[0].forward_replays == 3  # steps 1-3: the replays were ours


def test_a_batch_read_in_place_refilled_before_the_backward_raises(steps):
    """A batch buffer read in place (ctx, taking no gradient) refilled by the caller before the
    backward: eager trains (its ops keep none of ctx; the op keeps a copy), but the step holds
    every input it reads in place until the backward (module docstring, 3.: holding fewer gave
    garbage gradients on the H200), so the refill raises autograd's error, never a wrong result."""
    model = _block()
    compiled = torch.compile(model, backend="mha", options=OPTIONS)
    ctx, tok = _inputs(0)
    for step in range(2):
        compiled(ctx, tok).square().mean().backward()
    assert [s.read_in_place[:2] for s in steps] == [[True, True]]
    loss = compiled(ctx, tok).square().mean()
    with torch.no_grad():
        ctx.mul_(-3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
