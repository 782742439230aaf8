"""ops.region_call / RegionFunction: the region for graphs that run eagerly, without the custom op.

It must compute exactly what the op computes (same kernel-set calls), forward and every
gradient, with and without the exported inv; give a second derivative that is the math's (a
gradient penalty) as the op does; and leave the op in place wherever something traces the call.
"""
import contextlib

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import mha_compile
from mha_compile import models, ops
from mha_compile.kernels import triton_moe
from numerics import graph_has_region, needs_interpreter, observing, record_calls

def _inputs(act="gelu", bias=True, seed=0, D=8, P=2, F=6, E=3, B=2, H=3, N=4, dtype=torch.float64):
    torch.manual_seed(seed)
    block = models.MHABlock(D, P, F, E, 2, act=act, renorm=True, bias=bias).to(dtype)
    ctx = torch.randn(B, H, D, dtype=dtype, requires_grad=True)
    tok = torch.randn(B, N, D, dtype=dtype, requires_grad=True)
    return [ctx, tok, *models.block_parameters(block)]


def _grads(call, tensors, export_inv, seed=1, kernels="reference"):
    out, inv = call(*tensors, None, 2, True, "gelu", kernels, export_inv)[:2]
    torch.manual_seed(seed)
    outputs, cotangents = (out, inv) if export_inv else (out,), (torch.randn_like(out), torch.randn_like(inv))
    leaves = [t for t in tensors if t is not None]
    return (out, inv), torch.autograd.grad(outputs, leaves, cotangents[:len(outputs)])


@pytest.mark.parametrize("export_inv", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_same_outputs_and_gradients_as_the_op(export_inv, bias):
    tensors = _inputs(bias=bias)
    (out_op, inv_op), grads_op = _grads(ops.region, tensors, export_inv)
    (out_fn, inv_fn), grads_fn = _grads(ops.RegionFunction.apply, tensors, export_inv)
    assert torch.equal(out_fn, out_op) and torch.equal(inv_fn, inv_op)
    names = [n for n, t in zip(ops.REGION_INPUTS, tensors) if t is not None]
    for name, g_fn, g_op in zip(names, grads_fn, grads_op):
        assert torch.equal(g_fn, g_op), f"∂{name}"
        assert name == "bk" or g_fn.abs().max() > 0, f"∂{name} is zero: the comparison would be vacuous"


class _Fills(TorchDispatchMode):
    """(shape, dtype) of every tensor an aten op filled with a constant (zeros, fill_, zero_)."""

    FILLS = {"zeros", "zeros_like", "new_zeros", "fill_", "zero_", "full", "full_like", "new_full"}

    def __init__(self):
        super().__init__()
        self.filled = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket.__name__ in self.FILLS and isinstance(out, torch.Tensor):
            self.filled.append((tuple(out.shape), out.dtype))
        return out


@needs_interpreter
@pytest.mark.parametrize("export_inv", [False, True])
@pytest.mark.parametrize("call", [ops.region, ops.RegionFunction.apply], ids=["op", "RegionFunction"])
def test_only_out_and_inv_take_gradients_and_no_zeros_are_made_for_the_rest(call, export_inv):
    """Of the seven outputs only out (and inv, where the graph reads it) is differentiable, and a
    backward from out alone makes no zero tensor for the others' gradients. The op's own autograd
    (torch.library's) did, each of every output's size, `reuse` among them: 16 us of a medium step
    with keep_hidden's u in it on the H200 (session 37), and ~0.5 GB at large."""
    tensors = _inputs(D=16, F=24, E=4, B=3, H=4, N=5, dtype=torch.float32)
    outputs = call(*tensors, None, 2, True, "gelu", "fused", export_inv)
    assert [t.requires_grad for t in outputs] == [True, export_inv] + [False] * 5
    assert outputs[6].numel() > 0  # the fused set's reuse: what a fill of its size would show
    aux = {(tuple(t.shape), t.dtype) for t in outputs[1 if not export_inv else 2:]}
    with _Fills() as fills:
        torch.autograd.backward(outputs[0], torch.randn_like(outputs[0]))
    assert not aux & set(fills.filled), f"zero gradients made for outputs that take none: {aux & set(fills.filled)}"
    assert all(t.grad is not None for t in tensors if t is not None)


@pytest.mark.parametrize("export_inv", [False, True])
def test_gradcheck(export_inv):
    tensors = _inputs(act="swiglu")
    n_out = 2 if export_inv else 1
    fn = lambda *t: ops.RegionFunction.apply(*t, None, 2, True, "swiglu", "reference", export_inv)[:n_out]
    assert torch.autograd.gradcheck(fn, tuple(tensors))


@pytest.mark.parametrize("export_inv", [False, True])
@pytest.mark.parametrize("call", [ops.region, ops.RegionFunction.apply], ids=["op", "RegionFunction"])
def test_gradgradcheck(call, export_inv):
    """A backward with create_graph=True gives gradients that differentiate as the math does
    (double_backward.py): both paths, out alone and with inv read, every input at once."""
    tensors = _inputs(act="swiglu", B=2, H=2, N=3)
    n_out = 2 if export_inv else 1
    fn = lambda *t: call(*t, None, 2, True, "swiglu", "reference", export_inv)[:n_out]
    assert torch.autograd.gradgradcheck(fn, tuple(t for t in tensors))


def _penalty_grads(call, tensors, ask):
    """Gradients of a gradient penalty, ‖∂L/∂tok‖² + ‖∂L/∂W1‖² with L = Σ out², taken through
    `call` (the region's outputs, or the eager block's out) by `ask`."""
    present = [t for t in tensors if t is not None]
    out = call(*tensors)
    g_tok, g_w1 = torch.autograd.grad(out.square().sum(), [tensors[1], tensors[10]], create_graph=True)
    penalty = g_tok.square().sum() + g_w1.square().sum()
    if ask == "grad_unused":
        return torch.autograd.grad(penalty, present, allow_unused=True)
    for t in present:
        t.grad = None
    penalty.backward()
    return [t.grad for t in present]


def _block_call(tied):
    """The eager block of _inputs' parameters (tied: key and value share one weight) as a call."""
    def call(ctx, tok, q, wk, bk, wv, bv, wo, bo, wg, w1, b1, w2, b2, w3):
        block = models.MHABlock(8, 2, 6, 3, 2, act="gelu", renorm=True).double()
        for module, name, value in ((block.pool, "query", q), (block.pool.key, "weight", wk),
                                    (block.pool.key, "bias", bk), (block.pool.value, "weight", wv),
                                    (block.pool.value, "bias", bv), (block.pool.out, "weight", wo),
                                    (block.pool.out, "bias", bo), (block.moe.router, "weight", wg),
                                    (block.moe, "w1", w1), (block.moe, "b1", b1), (block.moe, "w2", w2),
                                    (block.moe, "b2", b2)):
            delattr(module, name)
            setattr(module, name, value)  # the tensors themselves: their graph reaches the leaves
        return block(ctx, tok)
    return call


@pytest.mark.parametrize("ask", ["backward", "grad_unused"])
@pytest.mark.parametrize("tied", [False, True], ids=["", "tied-kv"])
@pytest.mark.parametrize("call", [ops.region, ops.RegionFunction.apply], ids=["op", "RegionFunction"])
def test_a_gradient_penalty_trains_as_eager(call, tied, ask):
    """The second derivative, every input's, equals the eager block's (float64), asked for by
    .backward() or by torch.autograd.grad(..., allow_unused=True): before double_backward.py the
    first raised and the second returned None for every parameter, silently. Tied weights (wk is
    wv) get each position's part of the gradient, not the whole twice."""
    tensors = _inputs()
    if tied:
        tensors[5] = tensors[3]
    region = lambda *t: call(*t, None, 2, True, "gelu", "reference", False)[0]
    got = _penalty_grads(region, tensors, ask)
    want = _penalty_grads(_block_call(tied), tensors, ask)
    names = [n for n, t in zip(ops.REGION_INPUTS, tensors) if t is not None]
    for name, g, w in zip(names, got, want):
        assert g is not None, f"∂{name}: None where eager gives a gradient"
        if name == "bk":  # exactly zero by the math; eager leaves rounding there
            assert torch.count_nonzero(g) == 0 and (w is None or w.abs().max() < 1e-10)
            continue
        assert w.abs().max() > 0, f"∂{name} is zero: the comparison would be vacuous"
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12, msg=lambda m: f"∂{name}: {m}")


def test_tracing_sees_the_op():
    tensors = [None if t is None else t.detach() for t in _inputs()]
    present = [t for t in tensors if t is not None]

    def fn(*args):
        it = iter(args)
        return ops.region_call(*[None if t is None else next(it) for t in tensors], None, 2, True, "gelu",
                               "reference", False)[0]

    traced = make_fx(fn)(*present)
    assert graph_has_region(traced)
    assert torch.equal(traced(*present), fn(*present))


def test_the_backend_runs_it_and_reports_the_op(monkeypatch):
    """rest="eager": the compiled graph calls region_call; what explain and the dumps show is the op."""
    calls, original = [], ops.RegionFunction

    class Counting(original):
        @staticmethod
        def forward(ctx, *inputs):
            calls.append("forward")
            return original.forward(ctx, *inputs)

    monkeypatch.setattr(ops, "RegionFunction", Counting)
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = models.MHABlock(16, 2, 24, 4, 2)
    ctx, tok = torch.randn(3, 4, 16, requires_grad=True), torch.randn(3, 5, 16)
    reports = []
    with observing(lambda report, gm, lowered: reports.append(lowered)):
        out = torch.compile(block, backend="mha")(ctx, tok)
    out.sum().backward()
    assert calls == ["forward"] and ctx.grad is not None and block.moe.w1.grad.abs().max() > 0
    assert len(reports) == 1 and graph_has_region(reports[0])
    report = mha_compile.explain(block, ctx, tok)
    assert "torch.ops.mha.region" in report.graphs[0].code_after


def test_the_backward_op_only_where_something_traces(monkeypatch):
    """Run eagerly, the backward calls the implementation (the op's dispatch is host time a step
    pays); traced (make_fx, as compiled autograd and AOTAutograd trace), it meets one opaque
    mha::region_backward op, which runs the same implementation."""
    calls = []
    op, impl = ops.region_backward, ops._region_gradients
    monkeypatch.setattr(ops, "region_backward", lambda *a, **k: calls.append("op") or op(*a, **k))
    monkeypatch.setattr(ops, "_region_gradients", lambda *a, **k: calls.append("impl") or impl(*a, **k))
    tensors = _inputs()
    ops.RegionFunction.apply(*tensors, None, 2, True, "gelu", "reference", False)[0].sum().backward()
    assert calls == ["impl"] and tensors[0].grad is not None

    calls.clear()
    leaves = [t for t in _inputs() if t is not None]

    def step(*present):
        it = iter(present)
        args = [None if t is None else next(it) for t in _inputs()]
        out = ops.RegionFunction.apply(*args, None, 2, True, "gelu", "reference", False)[0]
        return torch.autograd.grad(out.sum(), present)

    traced = make_fx(step)(*[t.detach().requires_grad_() for t in leaves])
    assert calls == ["op", "impl"]
    assert traced.graph.find_nodes(op="call_function", target=torch.ops.mha.region_backward.default)


def test_compiled_autograd_meets_the_backward_op(monkeypatch):
    """torch.compile(backend="mha") with compiled autograd on: the traced backward graph holds the
    mha::region_backward op, and the gradients are the eager block's."""
    from torch._dynamo import compiled_autograd

    calls, graphs = [], []
    op = ops.region_backward
    monkeypatch.setattr(ops, "region_backward", lambda *a, **k: calls.append("op") or op(*a, **k))
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = models.MHABlock(16, 2, 24, 4, 2).double()
    ctx = torch.randn(3, 4, 16, dtype=torch.float64, requires_grad=True)
    tok = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    leaves = [ctx, tok, *block.parameters()]
    want = torch.autograd.grad(block(ctx, tok).sum(), leaves)
    out = torch.compile(block, backend="mha")(ctx, tok)
    with compiled_autograd._enable(torch.compile(backend=lambda gm, example: graphs.append(gm) or gm)):
        got = torch.autograd.grad(out.sum(), leaves)
    assert calls == ["op"]
    assert any(gm.graph.find_nodes(op="call_function", target=torch.ops.mha.region_backward.default)
               for gm in graphs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@contextlib.contextmanager
def _enable_grad_under_inference_mode():
    with torch.inference_mode(), torch.enable_grad():
        yield


@pytest.mark.parametrize("kernels", ["reference", pytest.param("fused", marks=needs_interpreter),
                                     pytest.param("staged", marks=needs_interpreter)])
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode, _enable_grad_under_inference_mode])
def test_without_grad(mode, kernels):
    """Eval under no_grad or inference_mode: nothing is recorded, the output is the op's. Under
    inference_mode what the kernel sets make are inference tensors, which have no version counter
    (the kept expert layout and pool weights must not read one). A model's torch.enable_grad()
    under the caller's inference_mode records nothing either, as eager's ops do (the Function
    tried to save inference tensors and raised)."""
    tensors = _inputs(dtype=torch.float32)
    args = (*tensors, None, 2, True, "gelu", kernels, False)
    with mode():
        out = ops.region_call(*args)[0]
        want = ops.region(*args)[0]
    assert not out.requires_grad and torch.equal(out, want)


@needs_interpreter
def test_a_block_made_under_inference_mode():
    """Parameters and inputs that are themselves inference tensors (a model built under
    inference_mode): the fused kernels run, keeping nothing that needs a version counter."""
    with torch.inference_mode():
        tensors = _inputs(dtype=torch.float32)
        args = (*tensors, None, 2, True, "gelu", "fused", False)
        out = ops.region_call(*args)[0]
        want = ops.region(*args)[0]
    assert torch.equal(out, want)


def test_the_kernels_run_with_their_tensors_device_current(monkeypatch):
    """Triton launches on the current CUDA device, so a call whose tensors are on another device
    makes theirs current around the kernel set (and only then). CUDA is stood in for: the tensors'
    device and the current one are what the check reads (a GPU test, two GPUs, runs it for real:
    test_region_graphs_cuda.py)."""
    current = [0]
    entered = []

    class Switch:
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            entered.append(self.index)
            self.saved, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.saved

    class OnCuda:  # what _kernel_call reads of ctx
        is_cuda = True

        def __init__(self, index):
            self.device = torch.device("cuda", index)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", Switch)
    monkeypatch.setattr(ops.region_graphs, "wanted", lambda *args: False)
    seen = []
    kernels = lambda *args: seen.append(current[0]) or "done"  # noqa: E731
    for index in (1, 0):
        ctx = OnCuda(index)
        assert ops._kernel_call(kernels, (ctx,), (ctx, None, None, None), 2, True, "gelu", False, "fused", "off") == "done"
    assert seen == [1, 0] and entered == [1] and current == [0]


@needs_interpreter
@pytest.mark.parametrize("kernels,export_inv", [("fused", False), ("fused", True), ("staged", False)])
def test_the_backward_takes_the_forwards_expert_layout(monkeypatch, kernels, export_inv):
    """RegionFunction keeps the forward's expert layout for the backward (`kept`), and the op (what
    anything that traces meets) carries it in its `reuse` output: one grouping a training step
    either way; the outputs and every gradient are the same, bit for bit."""
    grouped = record_calls(monkeypatch, triton_moe, "group")
    tensors = _inputs(D=16, F=24, E=4, B=3, H=4, dtype=torch.float32)
    (out_fn, inv_fn), grads_fn = _grads(ops.RegionFunction.apply, tensors, export_inv, kernels=kernels)
    assert len(grouped) == 1
    grouped.clear()
    (out_op, inv_op), grads_op = _grads(ops.region, tensors, export_inv, kernels=kernels)
    assert len(grouped) == 1
    assert torch.equal(out_fn, out_op) and torch.equal(inv_fn, inv_op)
    names = [n for n, t in zip(ops.REGION_INPUTS, tensors) if t is not None]
    for name, g_fn, g_op in zip(names, grads_fn, grads_op):
        assert torch.equal(g_fn, g_op), f"∂{name}"
        assert name == "bk" or g_fn.abs().max() > 0, f"∂{name} is zero: the comparison would be vacuous"



@needs_interpreter
@pytest.mark.parametrize("kernels", ["fused", "reference"])
def test_opcheck_region_op_with_its_reuse(kernels):
    """The op's fake promises its `reuse` output's size (the expert layout and u for the fused
    set, none for the reference), checked against the real output under fake, static and dynamic
    shapes (opcheck's aot_dispatch_dynamic: symbolic B), beside the schema and autograd checks."""
    tensors = [None if t is None else t.detach() for t in _inputs(D=16, F=24, E=4, B=3, H=4, N=5, dtype=torch.float32)]
    out = ops.region(*tensors, None, 2, True, "gelu", kernels)
    assert out[6].dtype == torch.int32 and (out[6].numel() > 0) == (kernels == "fused")
    torch.library.opcheck(ops.region, (*tensors, None, 2, True, "gelu", kernels))

@needs_interpreter
def test_a_compiled_training_step_groups_once(monkeypatch):
    """torch.compile(block, backend="mha") with kernels="fused": a training step's forward and
    backward group the routing once, and the gradients are the eager block's (fp32 bounds)."""
    grouped = record_calls(monkeypatch, triton_moe, "group")
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = models.MHABlock(16, 2, 24, 4, 2)
    ctx, tok = torch.randn(3, 4, 16, requires_grad=True), torch.randn(3, 5, 16, requires_grad=True)
    names, params = zip(*block.named_parameters())
    leaves = [ctx, tok, *params]
    cotangent = torch.randn(3, 4, 16)
    want = torch.autograd.grad(block(ctx, tok), leaves, cotangent)
    out = torch.compile(block, backend="mha", options={"kernels": "fused"})(ctx, tok)
    grouped.clear()  # anything compiling or checking the graph grouped too
    got = torch.autograd.grad(out, leaves, cotangent)
    assert grouped == []  # the backward took the forward's layout
    out = torch.compile(block, backend="mha", options={"kernels": "fused"})(ctx, tok)
    torch.autograd.grad(out, leaves, cotangent)
    assert len(grouped) == 1
    for name, g, w in zip(("ctx", "tok", *names), got, want):
        if name == "pool.key.bias":  # exactly zero (SPEC §1); eager's is rounding, ~1e-8
            assert (g == 0).all()
        else:
            assert (g - w).norm() <= 1e-5 * w.norm(), name
