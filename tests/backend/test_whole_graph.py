"""whole_graph.capture on the CPU: which inputs of the compiled forward and backward the CUDA-graph
trees would copy before each replay. CUDA graphs need a GPU, so Dynamo's CPU check is stepped
around and cudagraphify_impl stands in by recording its arguments and running the graph as is."""
import contextlib
import copy
import os
import subprocess
import sys

import pytest
import torch

from mha_compile import backend, models, whole_graph
from loop_moe import loop_experts
from lowering.spellings import SpelledBlock, inputs


def _stub_cuda_graphs(monkeypatch):
    """[(is_backward, the inputs, the static indices)] of each cudagraphify_impl call from now on:
    Dynamo's CPU check is stepped around, and the stand-in records its arguments and runs the
    graph as is."""
    from torch._dynamo.backends import cudagraphs as dynamo_cudagraphs
    from torch._inductor import cudagraph_trees

    calls = []

    def record(model, inputs, static_input_idxs, *args, **kwargs):
        calls.append((kwargs.get("is_backward"), list(inputs), sorted(static_input_idxs)))
        return model

    monkeypatch.setattr(cudagraph_trees, "cudagraphify_impl", record)
    monkeypatch.setattr(dynamo_cudagraphs, "check_for_skip", lambda *args: None)
    monkeypatch.setattr(dynamo_cudagraphs, "get_device_index", lambda *args: 0)
    return calls


def _record_pools(monkeypatch):
    """[tok's shape] of each eager mha::pool call (whole_graph's split) from now on."""
    from mha_compile import pool_moe_ops

    pools = []
    real_pool = pool_moe_ops._pool  # the pool's forward, under the op and PoolFunction alike
    monkeypatch.setattr(pool_moe_ops, "_pool", lambda *args: pools.append(args[0].shape) or real_pool(*args))
    return pools


def _capture_calls(monkeypatch, static_params, through_mha=False, tok_static=False, options=None, block=None,
                   model=None):
    """(is_backward, the inputs, the static indices) of each cudagraphify_impl call of a tiny
    block's training step compiled through whole_graph.capture, and the block. through_mha:
    compiled with backend="mha" as under mode="reduce-overhead" on the GPU (the region rewritten
    on a copy of Dynamo's graph, then whole_graph.capture), else with capture as the backend.
    tok_static: tok marked with torch._dynamo.mark_static_address, as a caller who refills one
    input buffer each step would (README). options: backend="mha"'s; block: the tiny block's
    parameters, else fresh ones; model: what is compiled, given the block (the block itself)."""
    monkeypatch.setattr(whole_graph, "STATIC_PARAMS", static_params)
    calls = _stub_cuda_graphs(monkeypatch)
    torch._dynamo.reset()
    block = block or models.MHABlock.from_preset("tiny")
    torch.manual_seed(0)
    ctx = torch.randn(4, 3, 32, requires_grad=True)
    tok = torch.randn(4, 5, 32, requires_grad=True)
    if tok_static:
        torch._dynamo.mark_static_address(tok)
    reports = []
    if through_mha:
        monkeypatch.setattr(backend, "_whole_graph_captured", lambda *args: True)
        monkeypatch.setattr(backend, "observers", [lambda report, *_: reports.append(report)])
    compiled = torch.compile((model or (lambda b: b))(block), backend="mha" if through_mha else whole_graph.capture,
                             options=options if through_mha else None)
    out = compiled(ctx, tok)
    assert not through_mha or [len(r.matches) for r in reports] == [1]
    out.square().sum().backward()
    torch._dynamo.reset()
    return calls, block, (ctx, tok)


@pytest.mark.parametrize("through_mha", [False, True], ids=["capture", "mha"])
@pytest.mark.parametrize("static_params", [False, True])
def test_the_forward_keeps_the_parameters_static(monkeypatch, static_params, through_mha):
    """With STATIC_PARAMS the forward's static inputs are exactly the block's parameters (read in
    place), and ctx and tok are copied; without it Dynamo's backend copies every input, the
    parameters too (what STATIC_PARAMS is for: if this stops holding, torch has fixed it). The
    backward's static inputs (all but its incoming gradient) are the same either way. Through
    backend="mha" too: its rewrite works on a copy of Dynamo's graph, which must keep what
    AOTAutograd reads the static inputs from (whole_graph.copy_graph; on the H200 the copy without it
    left none static)."""
    calls, block, (ctx, tok) = _capture_calls(monkeypatch, static_params, through_mha)
    assert [backward for backward, _, _ in calls] == [False, True]
    _, inputs, static = calls[0]  # fake tensors at compile time: told apart by shape
    users = [i for i, t in enumerate(inputs) if t.shape in (ctx.shape, tok.shape)]
    assert len(users) == 2 and len(inputs) == 2 + 12
    assert sorted(tuple(inputs[i].shape) for i in range(len(inputs)) if i not in users) == \
        sorted(tuple(p.shape) for p in block.parameters())
    assert static == ([i for i in range(len(inputs)) if i not in users] if static_params else [])
    _, b_inputs, b_static = calls[1]
    assert b_static == list(range(len(b_inputs) - 1))


@pytest.mark.parametrize("through_mha", [False, True], ids=["capture", "mha"])
def test_an_input_marked_static_is_read_in_place(monkeypatch, through_mha):
    """An input buffer marked with torch._dynamo.mark_static_address (tok here) joins the
    parameters among the forward's static inputs, through backend="mha" too: under
    reduce-overhead its replays read it where it is instead of copying it (at large, tok is
    512 MiB a step to copy; README, "Speed")."""
    calls, block, (ctx, tok) = _capture_calls(monkeypatch, True, through_mha, tok_static=True)
    _, inputs, static = calls[0]
    assert len(inputs) == 2 + 12 and len(static) == 13
    assert [tuple(inputs[i].shape) for i in range(len(inputs)) if i not in static] == [tuple(ctx.shape)]


def test_static_params_keeps_the_gradients(monkeypatch):
    """The compiled step's gradients through the recorder (the graph run as is) match eager's: the
    wrapper changes which inputs are copied, not what the graphs compute."""
    _, block, (ctx, tok) = _capture_calls(monkeypatch, True)
    compiled = [p.grad.clone() for p in block.parameters()] + [ctx.grad.clone(), tok.grad.clone()]
    for t in [*block.parameters(), ctx, tok]:
        t.grad = None
    block(ctx, tok).square().sum().backward()
    eager = [p.grad for p in block.parameters()] + [ctx.grad, tok.grad]
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value, expected", [(None, True), ("0", False), ("1", True)])
def test_static_params_is_on_unless_turned_off(value, expected):
    """STATIC_PARAMS is the default (session 27: the copies went down on the H200 and the GPU tests
    passed with it); MHA_COMPILE_CUDAGRAPH_STATIC_PARAMS=0 turns it off, read at import."""
    env = {k: v for k, v in os.environ.items() if k != "MHA_COMPILE_CUDAGRAPH_STATIC_PARAMS"}
    if value is not None:
        env["MHA_COMPILE_CUDAGRAPH_STATIC_PARAMS"] = value
    out = subprocess.run([sys.executable, "-c", "from mha_compile import whole_graph; print(whole_graph.STATIC_PARAMS)"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(expected)


def test_inductor_reads_the_parameters_as_static_through_the_rewrite(monkeypatch):
    """rest="inductor": Inductor's reduce-overhead takes its static inputs from AOTAutograd
    (compile_fx.get_static_input_idxs), which finds them only in a graph that carries Dynamo's
    metadata. Through backend="mha" the region is rewritten on a copy of Dynamo's graph
    (whole_graph.copy_graph): the forward's static inputs must still be the block's 12 parameters, not
    none (what the copy without the metadata gave)."""
    from torch._inductor import compile_fx

    found = []
    original = compile_fx.get_static_input_idxs
    monkeypatch.setattr(compile_fx, "get_static_input_idxs",
                        lambda num_fixed: found.append(list(original(num_fixed))) or found[-1])
    torch._dynamo.reset()
    block = models.MHABlock.from_preset("tiny")
    ctx = torch.randn(4, 3, 32, requires_grad=True)
    tok = torch.randn(4, 5, 32, requires_grad=True)
    # compiled here, not served from torch's caches (on disk, across runs), which skip the compile;
    # through the configs' own patch: monkeypatch's undo deletes a torch config entry for good
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(block, backend="mha", options={"rest": "inductor"})(ctx, tok).sum().backward()
    torch._dynamo.reset()
    assert len(found) == 1 and len(found[0]) == len(list(block.parameters())) == 12


needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="kernels='fused' on CPU needs TRITON_INTERPRET=1")


def _split_step(monkeypatch, pool_outside, model=None, min_bytes=0):
    """_capture_calls through backend="mha" with kernels="fused" (the split needs them), with
    whole_graph.POOL_OUTSIDE and POOL_OUTSIDE_MIN_BYTES set (0: the tiny block's tok is split);
    also the eager mha::pool calls and every leaf's gradient."""
    pools = _record_pools(monkeypatch)
    monkeypatch.setattr(whole_graph, "POOL_OUTSIDE", pool_outside)
    monkeypatch.setattr(whole_graph, "POOL_OUTSIDE_MIN_BYTES", min_bytes)
    torch.manual_seed(1)
    block = models.MHABlock.from_preset("tiny")
    calls, block, (ctx, tok) = _capture_calls(monkeypatch, True, True, options={"kernels": "fused"}, block=block,
                                              model=model)
    grads = [t.grad for t in (ctx, tok, *block.parameters())]
    return calls, pools, grads, block, (ctx, tok)


@needs_interpreter
def test_the_pool_runs_outside_the_graphs(monkeypatch):
    """With POOL_OUTSIDE (the default) a region whose tok nothing else reads runs its pool eagerly:
    the graphs' forward takes ctx, the MoE's parameters (static) and the pool's [B,D] inv, never tok
    nor the pool's weights (tok is not copied before each replay), mha::pool runs once a step on
    tok itself, and every gradient is the one the unsplit graphs give, bit for bit, none zero but
    ∂bk's (exactly zero by the math)."""
    calls, pools, grads, block, (ctx, tok) = _split_step(monkeypatch, True)
    assert pools == [tok.shape]
    assert [backward for backward, _, _ in calls] == [False, True]
    _, inputs, static = calls[0]
    names = [name for name, _ in block.named_parameters()]
    moe_params = [p for name, p in block.named_parameters() if name.startswith("moe.")]
    assert len(moe_params) < len(names)  # the pool's weights are left out
    shapes = sorted(tuple(t.shape) for t in inputs)
    assert shapes == sorted([tuple(ctx.shape), (tok.shape[0], tok.shape[2]), *[tuple(p.shape) for p in moe_params]])
    assert sorted(tuple(inputs[i].shape) for i in static) == sorted(tuple(p.shape) for p in moe_params)
    assert not any(tuple(t.shape) == tuple(tok.shape) for t in inputs)

    calls_in, pools_in, grads_in, _, _ = _split_step(monkeypatch, False)
    assert pools_in == [] and any(tuple(t.shape) == tuple(tok.shape) for t in calls_in[0][1])
    for name, got, want in zip(["ctx", "tok", *names], grads, grads_in):
        assert got is not None and torch.equal(got, want), f"∂{name}"
        assert (got.abs().max() == 0) == (name == "pool.key.bias"), f"∂{name}"


def _assert_gradients_are_eagers(model, block, ctx, tok, grads, called_under=contextlib.nullcontext):
    """grads (ctx's, tok's, then the block's parameters', of Σ out² through model(block)) within
    fp32's bound of the eager model's in float64 on the same values, its forward called under
    `called_under`; ∂bk exactly zero (the math's, as the region gives it; eager's is rounding)."""
    eager = model(copy.deepcopy(block).double())
    eager.zero_grad(set_to_none=True)  # what the compiled step accumulated is not copied in
    wide = [t.detach().double().requires_grad_() for t in (ctx, tok)]
    with called_under():
        out = eager(*wide)
    out.square().sum().backward()
    names = ["ctx", "tok", *(name for name, _ in block.named_parameters())]
    for name, got, want in zip(names, grads, [*(t.grad for t in wide), *(p.grad for p in eager.block.parameters())]):
        assert got is not None, f"∂{name}"
        if name == "pool.key.bias":
            assert not got.any(), f"∂{name}"
            continue
        error = float((got.double() - want).norm() / want.norm())
        assert error <= 1e-5, f"∂{name}: {error:.3g}"


@needs_interpreter
def test_a_region_under_the_graphs_own_enable_grad_keeps_its_pool_in_the_graphs(monkeypatch):
    """A model that runs the block under its own torch.enable_grad(), called under no_grad (a
    training step's inner block in an evaluation loop, say): the pool outside would run before the
    graph, in the caller's no_grad, and its weights and tok would get no gradient where eager gives
    them one. So a graph with a grad-mode change keeps the pool inside; every gradient eager's."""

    class GradInside(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, ctx, tok):
            with torch.enable_grad():
                return self.block(ctx, tok)

    pools = _record_pools(monkeypatch)
    _stub_cuda_graphs(monkeypatch)
    monkeypatch.setattr(whole_graph, "POOL_OUTSIDE", True)
    monkeypatch.setattr(whole_graph, "POOL_OUTSIDE_MIN_BYTES", 0)
    monkeypatch.setattr(backend, "_whole_graph_captured", lambda *args: True)
    torch._dynamo.reset()
    torch.manual_seed(1)
    block = models.MHABlock.from_preset("tiny")
    torch.manual_seed(0)
    ctx, tok = torch.randn(4, 3, 32, requires_grad=True), torch.randn(4, 5, 32, requires_grad=True)
    compiled = torch.compile(GradInside(block), backend="mha", options={"kernels": "fused"})
    with torch.no_grad():
        out = compiled(ctx, tok)
    out.square().sum().backward()
    torch._dynamo.reset()
    assert pools == []
    grads = [ctx.grad, tok.grad, *(p.grad for p in block.parameters())]
    _assert_gradients_are_eagers(GradInside, block, ctx, tok, grads, called_under=torch.no_grad)


@needs_interpreter
def test_a_tok_read_elsewhere_keeps_the_pool_in_the_graphs(monkeypatch):
    """Where the graph reads tok outside the region too, tok is copied in anyway: nothing is split
    (the pool stays in the graphs, as mha::region)."""

    class Residual(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, ctx, tok):
            return self.block(ctx, tok) + tok.mean(1, keepdim=True)

    calls, pools, grads, block, (ctx, tok) = _split_step(monkeypatch, True, model=Residual)
    assert pools == [] and any(tuple(t.shape) == tuple(tok.shape) for t in calls[0][1])
    _assert_gradients_are_eagers(Residual, block, ctx, tok, grads)


@needs_interpreter
def test_a_load_balancing_loss_keeps_the_pool_outside(monkeypatch):
    """A load-balancing loss reads the router's π (computed again after the op from the rebuilt y)
    and the op's chosen experts (output 4, mha::moe's 2 once split): the pool still runs outside
    the graphs, and every gradient is the unsplit graphs' to fp32's bound (none zero but ∂bk's):
    not the bits, since the rebuilt y's ∂inv reaches the unsplit op's pool by the reference pool
    backward added to its kernels', and the split's by one pool backward of the summed ∂inv."""

    class WithAux(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, ctx, tok):
            y = ctx + self.block.pool(tok).unsqueeze(1)
            moe = self.block.moe
            x = y.reshape(-1, y.shape[-1])
            probs = torch.softmax(moe.router(x), dim=-1)
            weight, index = torch.topk(probs, moe.top_k, dim=-1)
            weight = weight / weight.sum(-1, keepdim=True)
            share = torch.nn.functional.one_hot(index, moe.w1.shape[0]).to(probs.dtype).sum(1).mean(0)
            return loop_experts(moe, x, weight, index).view(y.shape) + (probs.mean(0) * share).sum()

    calls, pools, grads, block, (ctx, tok) = _split_step(monkeypatch, True, model=WithAux)
    assert pools == [tok.shape]
    _, _, grads_in, _, _ = _split_step(monkeypatch, False, model=WithAux)
    names = ["ctx", "tok"] + [name for name, _ in block.named_parameters()]
    for name, got, want in zip(names, grads, grads_in):
        assert (got.abs().max() == 0) == (name == "pool.key.bias"), f"∂{name}"
        if name != "pool.key.bias":
            assert ((got - want).norm() / want.norm()).item() <= 1e-5, f"∂{name}"


@needs_interpreter
def test_a_failed_split_warns_and_captures_the_graph_whole(monkeypatch, caplog):
    """Running the pool outside the graphs is a speed-up only: where it fails, a warning names the
    error and the graphs capture the region whole (tok copied in, as before), with the same
    gradients; with strict=True the error is raised instead."""
    def broken(*args):
        raise RuntimeError("a split that cannot be built")

    monkeypatch.setattr(whole_graph, "_split_region", broken)
    with caplog.at_level("WARNING", logger="mha_compile"):
        calls, pools, grads, _, (ctx, tok) = _split_step(monkeypatch, True)
    assert "pool outside the CUDA graphs failed (RuntimeError: a split that cannot be built)" in caplog.text
    assert pools == [] and any(tuple(t.shape) == tuple(tok.shape) for t in calls[0][1])
    _, _, grads_in, _, _ = _split_step(monkeypatch, False)
    assert all(torch.equal(got, want) for got, want in zip(grads, grads_in))
    monkeypatch.setattr(whole_graph, "POOL_OUTSIDE", True)
    with pytest.raises(Exception, match="a split that cannot be built"):
        _capture_calls(monkeypatch, True, True, options={"kernels": "fused", "strict": True})


@needs_interpreter
def test_a_small_tok_keeps_the_pool_in_the_graphs(monkeypatch):
    """Below POOL_OUTSIDE_MIN_BYTES (256 MiB by default) the copy is too small to pay for the
    eager pool's host time: the tiny block's tok (2.5 KiB) is copied in, the pool stays inside."""
    assert whole_graph.POOL_OUTSIDE_MIN_BYTES == 256 * 2**20 or os.environ.get("MHA_COMPILE_POOL_OUTSIDE_MIN_MB")
    calls, pools, _, _, (ctx, tok) = _split_step(monkeypatch, True, min_bytes=_TINY_TOK_BYTES + 1)
    assert pools == [] and any(tuple(t.shape) == tuple(tok.shape) for t in calls[0][1])


_TINY_TOK_BYTES = 4 * 5 * 32 * 4  # _capture_calls' tok [4,5,32] fp32


def test_the_pool_outside_size_is_read_with_a_clear_error():
    """MHA_COMPILE_POOL_OUTSIDE_MIN_MB: 256 MiB unset, fractions and 0 allowed; anything else names
    the variable and the value (it was float()'s own "could not convert string to float")."""
    assert [whole_graph.pool_outside_min_bytes(t) for t in (None, "0", "0.5", "64")] == [256 << 20, 0, 1 << 19, 64 << 20]
    for bad in ("-1", "lots", "inf", "nan", ""):
        with pytest.raises(ValueError, match=f"MHA_COMPILE_POOL_OUTSIDE_MIN_MB={bad!r}: expected a number of MiB"):
            whole_graph.pool_outside_min_bytes(bad)


def _inference(monkeypatch, seed, outside, options):
    """A tiny block (parameters and inputs drawn from `seed`) called once under no_grad through
    backend="mha" with `options`, the whole graph captured (CUDA graphs stood in for), with
    POOL_OUTSIDE = `outside` and no size threshold: (its output, its GraphReports)."""
    _stub_cuda_graphs(monkeypatch)
    reports = []
    monkeypatch.setattr(whole_graph, "POOL_OUTSIDE", outside)
    monkeypatch.setattr(whole_graph, "POOL_OUTSIDE_MIN_BYTES", 0)
    monkeypatch.setattr(backend, "_whole_graph_captured", lambda *args: True)
    monkeypatch.setattr(backend, "observers", [lambda report, *_: reports.append(report)])
    torch.manual_seed(seed)
    block = models.MHABlock.from_preset("tiny")
    ctx, tok = torch.randn(4, 3, 32), torch.randn(4, 5, 32)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(block, backend="mha", options=options)(ctx, tok)
    torch._dynamo.reset()
    return out, reports


@needs_interpreter
def test_the_split_runs_inference_too(monkeypatch):
    """Under no_grad (Dynamo guards the grad mode: a graph of its own) the split forward gives
    the unsplit one's output, bit for bit, with the pool run eagerly once a call."""
    pools = _record_pools(monkeypatch)
    outs = [_inference(monkeypatch, 2, outside, {"kernels": "fused"})[0] for outside in (True, False)]
    assert pools == [(4, 5, 32)] and torch.equal(outs[0], outs[1])


def _dumped_inference(monkeypatch, tmp_path, outside):
    """_inference with a dump folder: (its GraphReport, its report.json, its graph folder)."""
    import json
    _, [report] = _inference(monkeypatch, 3, outside, {"kernels": "fused", "dump": str(tmp_path)})
    [folder] = list(tmp_path.glob("run-*/graph_*"))
    return report, json.loads((folder / "report.json").read_text()), folder


@needs_interpreter
def test_the_report_and_the_dump_show_the_pool_outside(monkeypatch, tmp_path):
    """Where the pool runs outside the CUDA graphs, the match's `graphs` says so (explain and the
    dump's report), and the dump holds replayed.py: what the graphs capture, mha::moe on the
    pool's inv, no mha::region and no tok; without the split, the match says the region is
    captured whole and no replayed.py is written."""
    from mha_compile.lowering.select import CAPTURED_WHOLE
    pools = _record_pools(monkeypatch)
    report, doc, folder = _dumped_inference(monkeypatch, tmp_path / "split", True)
    assert pools == [(4, 5, 32)]
    said = report.matches[0]["graphs"]
    assert said.startswith("no: the whole graph is captured") and "its pool runs eagerly before each replay" in said
    assert " KiB not copied into the graphs" in said  # tok [4,5,32]: KiB, not "0 MiB"
    assert doc["matches"][0]["graphs"] == said and "pool runs eagerly" in (folder / "report.txt").read_text()
    assert doc["files"]["replayed"] == "replayed.py"
    replayed = (folder / "replayed.py").read_text()
    assert "torch.ops.mha.moe.default(" in replayed and "torch.ops.mha.region.default(" not in replayed
    assert "torch.ops.mha.region.default(" in (folder / "rewritten.py").read_text()
    run = subprocess.run([sys.executable, str(folder / "replayed.py")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]  # runnable: the inv input rebuilt from its example

    report, doc, folder = _dumped_inference(monkeypatch, tmp_path / "whole", False)
    assert report.matches[0]["graphs"] == CAPTURED_WHOLE and doc["files"]["replayed"] is None
    assert not (folder / "replayed.py").exists()


@needs_interpreter
def test_a_split_that_cannot_be_captured_is_reported_whole(monkeypatch, tmp_path, caplog):
    """A split planned (and dumped) but whose graphs cannot be captured: a warning that says the
    dump disagrees, the region captured whole, and the report (explain's) corrected."""
    from mha_compile.lowering.select import CAPTURED_WHOLE

    def broken(split, compile_graphs):
        raise RuntimeError("graphs that cannot be traced")

    monkeypatch.setattr(whole_graph, "capture_split", broken)
    pools = _record_pools(monkeypatch)
    with caplog.at_level("WARNING", logger="mha_compile"):
        report, doc, _ = _dumped_inference(monkeypatch, tmp_path, True)
    assert "failed (RuntimeError: graphs that cannot be traced)" in caplog.text and "dump, written before" in caplog.text
    assert pools == [] and report.matches[0]["graphs"] == CAPTURED_WHOLE
    assert "pool runs eagerly" in doc["matches"][0]["graphs"]  # the dump was written before the capture


def _inductor_split_step(monkeypatch, pool_outside):
    """A tiny block's training step through backend="mha" with rest="inductor" under
    mode="reduce-overhead" and kernels="fused", POOL_OUTSIDE = `pool_outside` and no size
    threshold (on the CPU Inductor leaves out its CUDA graphs; what it is handed is the same):
    (the input shapes of each graph handed to Inductor, tok's shape, the eager pools' toks, every
    leaf's gradient)."""
    from torch._inductor import compile_fx
    pools = _record_pools(monkeypatch)
    monkeypatch.setattr(whole_graph, "POOL_OUTSIDE", pool_outside)
    monkeypatch.setattr(whole_graph, "POOL_OUTSIDE_MIN_BYTES", 0)
    handed, real = [], compile_fx.compile_fx
    monkeypatch.setattr(compile_fx, "compile_fx",
                        lambda gm, inputs, **kwargs: handed.append([tuple(t.shape) for t in inputs])
                        or real(gm, inputs, **kwargs))
    torch._dynamo.reset()
    torch.manual_seed(1)
    block = models.MHABlock.from_preset("tiny")
    ctx = torch.randn(4, 3, 32, requires_grad=True)
    tok = torch.randn(4, 5, 32, requires_grad=True)
    options = {"rest": "inductor", "kernels": "fused", "mode": "reduce-overhead"}
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(block, backend="mha", options=options)(ctx, tok).square().sum().backward()
    torch._dynamo.reset()
    return handed, tuple(tok.shape), pools, [t.grad for t in (ctx, tok, *block.parameters())]


@needs_interpreter
def test_inductor_under_reduce_overhead_takes_the_pool_outside_too(monkeypatch):
    """rest="inductor" with a mode that replays CUDA graphs: Inductor is handed the graph
    without tok (mha::moe on the pool's [B,D] inv), mha::pool runs eagerly once a step on tok
    itself, and every gradient is the unsplit graph's, bit for bit, none zero but ∂bk's."""
    handed, tok_shape, pools, grads = _inductor_split_step(monkeypatch, True)
    assert handed and pools == [tok_shape]
    assert all(tok_shape not in shapes and (tok_shape[0], tok_shape[2]) in shapes for shapes in handed)
    handed_in, _, pools_in, grads_in = _inductor_split_step(monkeypatch, False)
    assert pools_in == [] and all(tok_shape in shapes for shapes in handed_in)
    names = ["ctx", "tok", *[name for name, _ in models.MHABlock.from_preset("tiny").named_parameters()]]
    for name, got, want in zip(names, grads, grads_in):
        assert got is not None and torch.equal(got, want), f"∂{name}"
        assert (got.abs().max() == 0) == (name == "pool.key.bias"), f"∂{name}"


@pytest.mark.parametrize("captured", [False, True], ids=["plain", "cuda_graphs"])
def test_ctx_is_copied_for_the_backward_under_cuda_graphs_too(monkeypatch, captured):
    """ctx, a graph input, may be written by the caller after the call (h += block(h, tok)), so
    the op keeps a copy of it for its backward (lowering/match.py, Match.copied), where the whole
    graph is captured too: the CUDA graphs' first calls run on the caller's ctx itself."""
    reports = []
    monkeypatch.setattr(backend, "_whole_graph_captured", lambda *args: captured)
    monkeypatch.setattr(backend, "observers", [lambda report, *_: reports.append(report)])
    if captured:
        _stub_cuda_graphs(monkeypatch)
    torch._dynamo.reset()
    block = models.MHABlock.from_preset("tiny")
    ctx, tok = torch.randn(4, 3, 32, requires_grad=True), torch.randn(4, 5, 32)
    torch.compile(block, backend="mha")(ctx, tok).sum().backward()
    torch._dynamo.reset()
    assert [m["copied"] for r in reports for m in r.matches] == [["ctx"]]


@pytest.mark.parametrize("way", ["plain", "inductor", "inductor_masked", "trees", "trees_pool_outside"])
def test_a_callers_residual_into_ctx_trains_as_eager(monkeypatch, way):
    """`h += block(h, tok)` by the caller, the block compiled alone: eager keeps none of h, so the
    op keeps a copy of it; where AOTAutograd traces the graph (rest="inductor", the CUDA-graph
    trees), that copy must survive its passes (a clone there went, and the backward read h itself:
    autograd's "modified by an inplace operation"). inductor_masked: a key-padding mask under a
    plain softmax, where the op takes ctx plus the NaN of rows with every key masked (none here),
    an add a pass could recompute from h."""
    options = {"rest": "inductor"} if way.startswith("inductor") else {}
    if way.startswith("trees"):
        options.update(mode="reduce-overhead", step_graphs=False)
        monkeypatch.setattr(backend, "_whole_graph_captured", lambda *args: True)
        monkeypatch.setattr(whole_graph, "POOL_OUTSIDE", way == "trees_pool_outside")
        monkeypatch.setattr(whole_graph, "POOL_OUTSIDE_MIN_BYTES", 0)
        _stub_cuda_graphs(monkeypatch)
    torch._dynamo.reset()
    torch.manual_seed(3)
    block = SpelledBlock(pool="einsum", mask=True) if way == "inductor_masked" else models.MHABlock.from_preset("tiny")
    eager = copy.deepcopy(block)
    lin = torch.nn.Linear(32, 32)
    grads = []
    for net, params in ((torch.compile(block, backend="mha", options=options), block), (eager, eager)):
        lin.zero_grad(set_to_none=True)
        got = []
        for step in range(2):
            ctx, *rest = inputs(mask=way == "inductor_masked", generator=torch.Generator().manual_seed(step))
            h = lin(ctx)
            h += net(h, *rest)
            h.square().mean().backward()
            got.append([p.grad.clone() for p in (*params.parameters(), *lin.parameters())])
            params.zero_grad(set_to_none=True)
            lin.zero_grad(set_to_none=True)
        grads.append(got)
    torch._dynamo.reset()
    for step, (got, want) in enumerate(zip(*grads)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}: {m}")
