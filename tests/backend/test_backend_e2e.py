"""torch.compile(backend="mha") end to end on the CPU: results, gradients, training, options."""
import copy
import logging
import re
import subprocess
import sys

import pytest
import torch

import mha_compile
from mha_compile import backend, models
from dropout_model import DroppedTokens
from inplace_model import ResidualInPlace
from normed_model import NormedContext
from numerics import TOLERANCE, assert_close_rel, compiled_reports, needs_interpreter, record_calls, relative_error
from test_whole_graph import _stub_cuda_graphs

BK = "pool.key.bias"  # SPEC §1: its gradient is exactly zero (it shifts every score of a head)


def _block(dtype, spelling="loop", act="gelu", seed=0):
    torch.manual_seed(seed)
    return models.MHABlock(32, 2, 64, 4, 2, act=act, spelling=spelling).to(dtype)


def _train_side_by_side(model, make_batch, dtype, steps=3, **compile_kwargs):
    """Train eager and compiled copies in lockstep; compare outputs, every gradient, parameters."""
    eager, compiled_model = model, copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend="mha", **compile_kwargs)
    opt_e = torch.optim.Adam(eager.parameters(), lr=1e-2)
    opt_c = torch.optim.Adam(compiled_model.parameters(), lr=1e-2)
    for step in range(steps):
        inputs = make_batch(step)
        out_e, out_c = eager(*inputs), compiled(*inputs)
        assert_close_rel(out_c, out_e, dtype, f"step {step} output")
        loss_e, loss_c = out_e.square().mean(), out_c.square().mean()
        loss_e.backward()
        loss_c.backward()
        largest = max(p.grad.abs().max() for p in eager.parameters() if p.grad is not None)
        for (name, p_e), p_c in zip(eager.named_parameters(), compiled_model.parameters()):
            if name.endswith(BK):  # zero by the math: the region's exactly, eager's rounding of its largest
                assert torch.count_nonzero(p_c.grad) == 0 and p_e.grad.abs().max() <= TOLERANCE[dtype] * largest
                continue
            assert p_c.grad is not None and torch.isfinite(p_c.grad).all(), name
            assert_close_rel(p_c.grad, p_e.grad, dtype, f"step {step} ∂{name}")
        opt_e.step(), opt_c.step()
        opt_e.zero_grad(), opt_c.zero_grad()
    return eager, compiled_model


def assert_same_parameters(eager, compiled_model, dtype):
    """After the optimizer steps both copies hold the same parameters.

    Except the key bias: its gradient is exactly zero (SPEC §1), but eager's carries rounding
    noise that Adam normalises into real steps, so eager's drifts while ours stays put.
    """
    for (name, p_e), p_c in zip(eager.named_parameters(), compiled_model.parameters()):
        if not name.endswith(BK):
            assert_close_rel(p_c, p_e, dtype, f"parameter {name} after training")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spelling", models.MOE_SPELLINGS)
def test_block_trains_like_eager(dtype, spelling):
    torch._dynamo.reset()
    model = _block(dtype, spelling, act="swiglu")
    gen = torch.Generator().manual_seed(1)
    batch = lambda step: (torch.randn(4, 3, 32, generator=gen, dtype=dtype), torch.randn(4, 5, 32, generator=gen, dtype=dtype))
    assert_same_parameters(*_train_side_by_side(model, batch, dtype), dtype)


@pytest.mark.parametrize("dtype, kernels", [
    (torch.float64, "auto"),
    pytest.param(torch.float32, "fused", marks=needs_interpreter)])
def test_in_place_ops_on_the_regions_output_train_like_eager(dtype, kernels):
    """Autograd refused them ("Output 0 of RegionFunction is a view and is being modified
    inplace"): the region's output was a view made inside its Function, so this model trained
    eagerly and failed compiled."""
    torch._dynamo.reset()
    model = ResidualInPlace(_block(dtype))
    gen = torch.Generator().manual_seed(4)
    batch = lambda step: (torch.randn(4, 3, 32, generator=gen, dtype=dtype), torch.randn(4, 5, 32, generator=gen, dtype=dtype))
    assert len(mha_compile.explain(model, *batch(0), options={"kernels": kernels}).matches) == 1
    eager, compiled_model = _train_side_by_side(model, batch, dtype, options={"kernels": kernels})
    assert_same_parameters(eager, compiled_model, dtype)


@needs_interpreter
@pytest.mark.parametrize("rest", ["eager", "inductor"])
def test_the_hidden_layer_in_passes_through_torch_compile_matches_eager(monkeypatch, rest):
    """MHA_COMPILE_HIDDEN_COLUMNS through torch.compile: kernels="fused", F = 192 in three passes of
    64 (each a call of the hidden layer, counted); the output and every gradient against eager,
    fp32. One step: Adam's next steps turn roundoff in near-zero gradients into lr-sized moves
    (this block drifts 1.3e-5 from eager by step 1 in one pass too), which says nothing of the passes."""
    from mha_compile.kernels import triton_moe

    monkeypatch.setattr(triton_moe, "HIDDEN_COLUMNS", 64)
    layers = record_calls(monkeypatch, triton_moe, "_hidden_layer")
    torch._dynamo.reset()
    torch.manual_seed(2)
    model = models.MHABlock(32, 2, 192, 4, 2, act="silu")
    gen = torch.Generator().manual_seed(5)
    batch = lambda step: (torch.randn(4, 3, 32, generator=gen), torch.randn(4, 5, 32, generator=gen))  # noqa: E731
    _train_side_by_side(model, batch, torch.float32, steps=1, options={"kernels": "fused", "rest": rest})
    assert [args[4].shape[2] for args in layers] == [64] * 3


def test_the_compiled_blocks_output_can_be_changed_in_place_by_its_caller():
    torch._dynamo.reset()
    block = _block(torch.float64)
    twin = copy.deepcopy(block)
    ctx, tok = torch.randn(4, 3, 32, dtype=torch.float64), torch.randn(4, 5, 32, dtype=torch.float64)
    assert len(mha_compile.explain(block, ctx, tok).matches) == 1
    outs = []
    for model in (torch.compile(block, backend="mha"), twin):
        out = model(ctx, tok)
        out.add_(ctx).mul_(0.5)
        out.square().mean().backward()
        outs.append(out)
    assert_close_rel(outs[0], outs[1], torch.float64, "output")
    for (name, p), p_twin in zip(block.named_parameters(), twin.parameters()):
        if not name.endswith(BK):
            assert_close_rel(p.grad, p_twin.grad, torch.float64, f"∂{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forecaster_trains_like_eager(dtype):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = models.Forecaster(window=12, variates=5, horizons=3).to(dtype)
    gen = torch.Generator().manual_seed(2)
    batch = lambda step: (torch.randn(6, 12, 5, generator=gen, dtype=dtype),)
    assert_same_parameters(*_train_side_by_side(model, batch, dtype, steps=4), dtype)


def test_every_block_parameter_gets_gradient_through_the_compiled_path():
    torch._dynamo.reset()
    model = _block(torch.float32, "dense", act="swiglu")
    compiled = torch.compile(model, backend="mha")
    compiled(torch.randn(4, 3, 32), torch.randn(4, 5, 32)).square().mean().backward()
    for name, p in model.named_parameters():
        if name.endswith(BK):
            assert torch.count_nonzero(p.grad) == 0
        else:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_pool_contributes_to_the_compiled_output():
    """The seed's bug: a branch that adds nothing. Zeroing the pool's output projection must matter."""
    torch._dynamo.reset()
    model = _block(torch.float32)
    compiled = torch.compile(model, backend="mha")
    ctx, tok = torch.randn(4, 3, 32), torch.randn(4, 5, 32)
    before = compiled(ctx, tok).detach()
    with torch.no_grad():
        model.pool.out.weight.zero_()
        model.pool.out.bias.zero_()
    after = compiled(ctx, tok).detach()
    assert relative_error(after, before) > 1e-2
    assert_close_rel(after, model(ctx, tok), torch.float32, "zeroed pool")
    assert_close_rel(after, model.moe(ctx), torch.float32, "zeroed pool = MoE of ctx alone")


def test_smaller_second_batch_is_dynamic_and_correct():
    torch._dynamo.reset()
    model = _block(torch.float32)
    with compiled_reports() as reports:
        compiled = torch.compile(model, backend="mha")
        for B in (6, 3):
            ctx, tok = torch.randn(B, 3, 32), torch.randn(B, 5, 32)
            assert_close_rel(compiled(ctx, tok), model(ctx, tok), torch.float32, f"B={B}")
    assert len(reports) == 2 and all(len(r.matches) == 1 for r in reports)
    assert "s" in "".join(reports[1].matches[0]["shapes"]["ctx"])  # a symbolic batch size


def test_rest_inductor_matches_eager():
    torch._dynamo.reset()
    model = models.Forecaster(window=12, variates=5, horizons=3)
    trained = _train_side_by_side(model, lambda step: (torch.randn(4, 12, 5),), torch.float32, steps=2,
                                  options={"rest": "inductor"})
    assert_same_parameters(*trained, torch.float32)


def test_rest_inductor_trains_with_transposed_ctx_and_tok(tmp_path, monkeypatch):
    """ctx and tok made by projections over other axes, then transposed (not contiguous): Inductor
    checks the backward op's gradients against its fake's strides, which said the inputs' (it
    raised "expected size 3==3, stride 32==1"); both are contiguous now."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # no backward compiled before the fix
    torch._dynamo.reset()
    torch.manual_seed(0)

    class Transposed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.horizons, self.tokens = torch.nn.Linear(6, 3), torch.nn.Linear(7, 5)
            self.block = _block(torch.float32)

        def forward(self, x, z):  # x [B, D, 6] -> ctx [B, 3, D]; z [B, D, 7] -> tok [B, 5, D]
            return self.block(self.horizons(x).transpose(1, 2), self.tokens(z).transpose(1, 2))

    batch = lambda step: (torch.randn(4, 32, 6), torch.randn(4, 32, 7))  # noqa: E731
    trained = _train_side_by_side(Transposed(), batch, torch.float32, steps=2, options={"rest": "inductor"})
    assert_same_parameters(*trained, torch.float32)


def test_explain_counts():
    block = _block(torch.float32)
    report = mha_compile.explain(block, torch.randn(4, 3, 32), torch.randn(4, 5, 32))
    assert len(report.matches) == 1 and not report.near_misses and len(report.graphs) == 1
    assert report.matches[0]["kernels"] == "reference" and "cpu" in report.matches[0]["kernels_reason"]
    assert "1 match" in str(report) and "topk" in report.matches[0]["nodes"]

    class TwoBlocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = _block(torch.float32, "loop"), _block(torch.float32, "dense", seed=1)

        def forward(self, ctx, tok):
            return self.b(self.a(ctx, tok), tok)

    two = TwoBlocks()
    ctx, tok = torch.randn(4, 3, 32), torch.randn(4, 5, 32)
    report = mha_compile.explain(two, ctx, tok)
    assert len(report.matches) == 2 and not report.near_misses
    assert report.matches[1]["ctx"] == report.matches[0]["output"]  # the second block reads the first
    torch._dynamo.reset()
    assert_close_rel(torch.compile(two, backend="mha")(ctx, tok), two(ctx, tok), torch.float32, "two blocks")


@pytest.mark.parametrize("options,needle", [
    ({"kernel": "auto"}, "unknown key(s) ['kernel']"),
    ({"kernels": "fastest"}, "kernels='fastest'"),
    ({"rest": "tvm"}, "rest='tvm'"),
    ({"verify": "yes"}, "verify='yes'"),
    ({"graphs": True}, "graphs=True"),
    ({"keep_hidden": "yes"}, "keep_hidden='yes'"),
    ({"mode": "fast"}, "mode='fast'"),
    ("fused", "options='fused' must be a mapping"),  # read as a sequence of pairs before (a read-through's)
    ({"dump": ""}, "dump='' names no folder"),  # no dumps and nothing said before (a read-through's)
])
def test_bad_options_raise_clear_errors(options, needle):
    with pytest.raises(Exception) as info:
        mha_compile.Options.parse(options)
    assert needle in str(info.value)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="mha"):
        torch.compile(_block(torch.float32), backend="mha", options=options)(torch.randn(2, 3, 32), torch.randn(2, 5, 32))


def test_options_take_any_mapping():
    """A mapping that is not a dict (a read-only view, a config object's) reads as the dict would:
    the check that refuses options="fused" must not refuse it (a read-through's)."""
    import collections
    import types
    for options in (types.MappingProxyType({"verify": True}), collections.UserDict({"verify": True})):
        assert mha_compile.Options.parse(options).verify is True


def _captured(block):
    """Dynamo's graph of `block` on fresh (ctx, tok), its example inputs as a backend receives them
    (the parameters among them), and (ctx, tok)."""
    captured = []
    torch._dynamo.reset()
    inputs = (torch.randn(4, 3, 32), torch.randn(4, 5, 32))
    torch.compile(block, backend=lambda gm, example: captured.append((gm, example)) or gm.forward)(*inputs)
    return (*captured[0], inputs)


@pytest.mark.parametrize("mode, given", [("reduce-overhead", None), ("max-autotune-no-cudagraphs", "default"),
                                         (None, None)])
def test_mode_in_the_options_reaches_inductor(monkeypatch, mode, given):
    """torch.compile refuses mode= and options= together, so options["mode"] is how rest="inductor"
    gets a mode: Inductor must receive that mode's config patches (none without a mode)."""
    from torch._inductor import compile_fx
    patches = []
    monkeypatch.setattr(compile_fx, "compile_fx", lambda gm, inputs, config_patches: patches.append(config_patches)
                        or gm.forward)
    gm, example, _ = _captured(_block(torch.float32))
    backend.mha_backend(gm, example, options={"rest": "inductor", "mode": mode}, mode=given)
    assert patches == [torch._inductor.list_mode_options(mode) if mode else {}]
    if mode == "reduce-overhead":
        assert patches[0]["triton.cudagraphs"] is True


def test_mode_given_twice_must_agree():
    block = _block(torch.float32)
    gm, example, inputs = _captured(block)
    with pytest.raises(ValueError, match="mode='reduce-overhead' and options\\['mode'\\]='max-autotune' disagree"):
        backend.mha_backend(gm, example, options={"mode": "max-autotune"}, mode="reduce-overhead")
    with pytest.raises(ValueError, match="mode='fastest' is not supported"):
        backend.mha_backend(gm, example, mode="fastest")
    # the same mode both ways is no conflict
    out = backend.mha_backend(gm, example, options={"mode": "reduce-overhead"}, mode="reduce-overhead")(*example)
    assert_close_rel(out[0] if isinstance(out, (tuple, list)) else out, block(*inputs), torch.float32,
                     "same mode twice")


@pytest.mark.parametrize("mode, says", [("reduce-overhead", "without CUDA inputs: running without CUDA graphs"),
                                        ("max-autotune", "runs eagerly, without the mode's autotuning or CUDA graphs")])
def test_a_mode_rest_eager_cannot_honour_is_said(caplog, mode, says):
    """rest="eager" on CPU inputs: neither mode's CUDA graphs nor max-autotune's tuning apply; the
    logger says so rather than taking the mode silently."""
    gm, example, inputs = _captured(_block(torch.float32))
    with caplog.at_level(logging.INFO, logger="mha_compile"):
        backend.mha_backend(gm, example, options={"mode": mode})
    assert says in caplog.text


@pytest.mark.parametrize("asked", [True, "auto"])
def test_step_graphs_asked_by_name_without_cuda_inputs_is_a_warning(caplog, asked):
    """step_graphs=True on CPU inputs: the step graphs cannot apply, and what was asked by name is
    not dropped at INFO (README: True elsewhere is an error); "auto" there stays at INFO."""
    gm, example, inputs = _captured(_block(torch.float32))
    with caplog.at_level(logging.INFO, logger="mha_compile"):
        backend.mha_backend(gm, example, options={"mode": "reduce-overhead", "step_graphs": asked})
    said = [r for r in caplog.records if "without CUDA inputs" in r.getMessage()]
    assert len(said) == 1
    assert said[0].levelno == (logging.WARNING if asked is True else logging.INFO)
    assert ("step_graphs=True does not apply" in said[0].getMessage()) == (asked is True)


def test_rest_inductor_under_a_mode_in_the_options_matches_eager():
    """On the CPU reduce-overhead's CUDA graphs do not apply; the step must still train as eager."""
    torch._dynamo.reset()
    trained = _train_side_by_side(_block(torch.float32), lambda step: (torch.randn(4, 3, 32), torch.randn(4, 5, 32)),
                                  torch.float32, steps=2, options={"rest": "inductor", "mode": "reduce-overhead"})
    assert_same_parameters(*trained, torch.float32)


def test_failure_falls_back_with_a_warning_and_strict_raises(monkeypatch, caplog):
    def broken(gm, matches):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(backend, "rewrite", broken)
    torch._dynamo.reset()
    model = _block(torch.float32)
    ctx, tok = torch.randn(4, 3, 32), torch.randn(4, 5, 32)
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        out = torch.compile(model, backend="mha")(ctx, tok)
    assert "planted failure" in caplog.text
    # the warning names where the graph comes from: Dynamo's compile id, and the model's forward
    assert re.search(r"rewriting graph \d+ \(Dynamo \d+/0, forward at models\.py:\d+\) failed", caplog.text), caplog.text
    assert_close_rel(out, model(ctx, tok), torch.float32, "fallback")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="planted failure"):
        torch.compile(model, backend="mha", options={"strict": True})(ctx, tok)


def test_verify_falls_back_when_the_replacement_is_wrong(monkeypatch, caplog):
    from mha_compile.kernels import reference
    right = reference.region_forward

    def wrong(*args):
        out, *saved = right(*args)
        return (out + 1.0, *saved)

    monkeypatch.setattr(reference, "region_forward", wrong)
    torch._dynamo.reset()
    model = _block(torch.float32)
    ctx, tok = torch.randn(4, 3, 32), torch.randn(4, 5, 32)
    compiled = torch.compile(model, backend="mha", options={"verify": True})
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        first = compiled(ctx, tok)
    assert "disagrees" in caplog.text
    assert_close_rel(first, model(ctx, tok), torch.float32, "verified fallback")
    assert_close_rel(compiled(ctx, tok), model(ctx, tok), torch.float32, "second call")


@pytest.mark.parametrize("fault", ["output", "gradient"])
def test_verify_under_strict_raises_instead_of_falling_back(monkeypatch, fault):
    _plant_wrong_rewrite(monkeypatch, fault)
    torch._dynamo.reset()
    model = _block(torch.float32)
    ctx, tok = torch.randn(4, 3, 32), torch.randn(4, 5, 32, requires_grad=True)
    compiled = torch.compile(model, backend="mha", options={"verify": True, "strict": True})
    with pytest.raises(Exception, match="disagrees with the original.*strict=True raises") as raised:
        compiled(ctx, tok)
    assert ("gradient of input" in str(raised.value)) == (fault == "gradient")


def _verify_first_call(model, ctx, tok, kernels, caplog, level=logging.WARNING):
    """The report of verify's first training call; caplog holds what was logged at `level`."""
    with compiled_reports() as reports, caplog.at_level(level, logger="mha_compile"):
        compiled = torch.compile(model, backend="mha", options={"verify": True, "kernels": kernels})
        compiled(ctx, tok.requires_grad_(True)).float().square().mean().backward()
    (report,) = reports
    return report


@pytest.mark.parametrize("dtype, kernels", [
    (torch.float32, "auto"), (torch.bfloat16, "auto"),
    pytest.param(torch.float32, "fused", marks=needs_interpreter),
    pytest.param(torch.bfloat16, "fused", marks=needs_interpreter)])
def test_verify_keeps_a_right_rewrite_in_fp32_and_bf16(request, caplog, dtype, kernels):
    """The key bias's gradient is exactly zero in the math, which the kernels give, and roundoff in
    the original graph (fp32: ~1e-9 of the largest gradient, bf16 ~1e-5): compared against a floor
    of 1e-6 of the largest, a right rewrite fell back in bf16 always and in fp32 on each seed here.
    bf16 with kernels="fused": the Triton kernels (the interpreter's bf16 mended,
    conftest.bf16_interpreter) held by verify to the original graph run in fp32, output and every gradient."""
    if kernels == "fused" and dtype == torch.bfloat16:
        request.getfixturevalue("bf16_interpreter")
    for seed in range(3):
        torch._dynamo.reset()
        caplog.clear()
        model = _block(dtype, seed=seed)
        gen = torch.Generator().manual_seed(10 + seed)
        ctx, tok = torch.randn(4, 3, 32, generator=gen).to(dtype), torch.randn(4, 5, 32, generator=gen).to(dtype)
        report = _verify_first_call(model, ctx, tok, kernels, caplog)
        assert len(report.matches) == 1 and report.fallback is None, (seed, report.fallback)
        assert report.matches[0]["kernels"] == ("fused" if kernels == "fused" else "reference")
        assert "disagrees" not in caplog.text


def test_verify_still_catches_a_wrong_key_bias_gradient(monkeypatch, caplog):
    from mha_compile.kernels import reference
    right = reference.region_backward

    def wrong(*args):
        grads = list(right(*args))
        grads[4] = torch.ones_like(grads[4])  # ∂bk, exactly zero in the math
        return tuple(grads)

    monkeypatch.setattr(reference, "region_backward", wrong)
    torch._dynamo.reset()
    model = _block(torch.float32)
    ctx, tok = torch.randn(4, 3, 32), torch.randn(4, 5, 32)
    report = _verify_first_call(model, ctx, tok, "auto", caplog)
    assert report.fallback is not None and "gradient of input" in report.fallback and "disagrees" in caplog.text


def _parameters_as_attributes(model, *inputs):
    """Dynamo's graph of model with each parameter read with get_attr, not passed in, as torch 2.11
    captures it under inline_inbuilt_nn_modules=False (from 2.12 on the flag does nothing), and the
    graph's other inputs."""
    captured = []
    torch._dynamo.reset()
    torch.compile(model, backend=lambda gm, examples: captured.append((gm, examples)) or gm)(*inputs)
    ((gm, examples),) = captured
    others = []
    for node, example in zip(list(gm.graph.find_nodes(op="placeholder")), examples):
        if not isinstance(example, torch.nn.Parameter):
            others.append(example)
            continue
        gm.register_parameter(node.name, example)
        with gm.graph.inserting_after(node):
            attribute = gm.graph.get_attr(node.name)
        attribute.meta["example_value"] = node.meta["example_value"]  # Dynamo's, which the matcher reads
        node.replace_all_uses_with(attribute)
        gm.graph.erase_node(node)
    gm.recompile()
    return gm, others


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fault", [None, "W1"])
def test_verify_compares_the_gradients_of_parameters_held_as_attributes(monkeypatch, caplog, dtype, fault):
    """A graph that reads its parameters with get_attr: verify compared input gradients only, so a
    wrong ∂W1 passed it, and with no input taking a gradient it compared no gradient at all."""
    _plant_wrong_rewrite(monkeypatch, fault)
    model = _block(dtype)
    gen = torch.Generator().manual_seed(3)
    ctx, tok = torch.randn(4, 3, 32, generator=gen).to(dtype), torch.randn(4, 5, 32, generator=gen).to(dtype)
    gm, others = _parameters_as_attributes(model, ctx, tok)
    assert len(others) == 2 and len(gm.graph.find_nodes(op="get_attr")) == len(list(model.parameters()))
    with compiled_reports() as reports, caplog.at_level(logging.WARNING, logger="mha_compile"):
        compiled = backend.mha_backend(gm, others, {"verify": True})
        (out,) = compiled(*others)
    (report,) = reports
    assert len(report.matches) == 1
    if fault:
        assert report.fallback is not None and "gradient of parameter" in report.fallback, report.fallback
        assert "w1" in report.fallback and "disagrees" in caplog.text
    else:
        assert report.fallback is None, report.fallback
    if fault or dtype == torch.float32:  # the graph verify kept gives eager's gradients (bf16's: its own ops)
        out.float().square().mean().backward()
        eager = copy.deepcopy(model)
        eager.zero_grad()
        eager(ctx, tok).float().square().mean().backward()
        for (name, got), want in zip(model.named_parameters(), eager.parameters()):
            if name != BK:
                assert relative_error(got.grad, want.grad) <= TOLERANCE[torch.float32], name


def _bf16_block_and_inputs(seed):
    """A bf16 block whose eager graph is 5e-2 to 8e-2 from its own fp32 run (top-k choices that
    flip through rounding) at seeds 1 and 2, where the rewrite is 1.6e-3 from it."""
    torch.manual_seed(seed)
    model = models.MHABlock(64, 4, 128, 8, 2).to(torch.bfloat16)
    return model, torch.randn(64, 4, 64, dtype=torch.bfloat16), torch.randn(64, 16, 64, dtype=torch.bfloat16)


@pytest.mark.parametrize("seed", [1, 2])
def test_verify_measures_bf16_against_the_captured_graph_in_fp32(caplog, seed):
    """Compared directly, the rewrite (fp32 router and sums) and the captured bf16 graph were 4.8e-2
    and 8.2e-2 apart here, over the bf16 bound of 3e-2: verify fell back from a right rewrite."""
    torch._dynamo.reset()
    model, ctx, tok = _bf16_block_and_inputs(seed)
    report = _verify_first_call(model, ctx, tok, "auto", caplog)
    assert len(report.matches) == 1 and report.fallback is None, report.fallback


def _plant_wrong_rewrite(monkeypatch, fault):
    """The reference kernels made wrong: fault "output" scales the region's output by 1.2,
    "gradient" its ∂tok, "W1" its ∂W1; None leaves them right."""
    from mha_compile.kernels import reference
    if fault == "output":
        right = reference.region_forward
        monkeypatch.setattr(reference, "region_forward", lambda *a: (right(*a)[0] * 1.2, *right(*a)[1:]))
    elif fault is not None:
        wrong = {"gradient": 1, "W1": 10}[fault]  # the position of tok, of w1 among region_forward's inputs
        right_backward = reference.region_backward
        monkeypatch.setattr(reference, "region_backward",
                            lambda *a: tuple(g * 1.2 if i == wrong else g for i, g in enumerate(right_backward(*a))))


@pytest.mark.parametrize("fault", ["output", "gradient"])
def test_verify_catches_a_wrong_bf16_rewrite(monkeypatch, caplog, fault):
    _plant_wrong_rewrite(monkeypatch, fault)
    torch._dynamo.reset()
    model, ctx, tok = _bf16_block_and_inputs(1)
    report = _verify_first_call(model, ctx, tok, "auto", caplog)
    assert report.fallback is not None and "from the captured graph run in fp32" in report.fallback
    assert ("gradient of input" in report.fallback) == (fault == "gradient")


@pytest.mark.parametrize("fault", [None, "output"])
def test_verify_under_bf16_autocast_measures_against_fp32(monkeypatch, caplog, fault):
    """fp32 parameters and inputs under torch.autocast(bf16): the graph's products run in bf16, and
    compared directly (to fp32's bound: its outputs are fp32) every seed here fell back (4.7e-2 to
    6.8e-2 apart)."""
    _plant_wrong_rewrite(monkeypatch, fault)
    for seed in range(3):
        torch._dynamo.reset()
        torch.manual_seed(seed)
        model = models.MHABlock(64, 4, 128, 8, 2)
        ctx, tok = torch.randn(64, 4, 64), torch.randn(64, 16, 64)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            report = _verify_first_call(model, ctx, tok, "auto", caplog)
        assert len(report.matches) == 1
        assert (report.fallback is None) == (fault is None), (seed, report.fallback)


@pytest.mark.parametrize("fault", [None, "output", "gradient"])
def test_verify_gives_each_run_the_same_dropout_masks(monkeypatch, caplog, fault):
    """Dropout before the block: every run verify compares draws from the state the call found, so
    the same masks (drawn anew in each, a right rewrite fell back: outputs 0.335 apart); a wrong
    rewrite still falls back; and the caller's random stream moves by the call's own draws only
    (its next draw is the one after an eager call)."""
    _plant_wrong_rewrite(monkeypatch, fault)
    torch._dynamo.reset()
    model = DroppedTokens(_block(torch.float32, seed=2))
    gen = torch.Generator().manual_seed(12)
    ctx, tok = torch.randn(4, 3, 32, generator=gen), torch.randn(4, 5, 32, generator=gen)
    torch.manual_seed(7)
    with compiled_reports() as reports, caplog.at_level(logging.WARNING, logger="mha_compile"):
        out, dropped = torch.compile(model, backend="mha", options={"verify": True})(ctx, tok.requires_grad_(True))
        out.square().mean().backward()
    after_verified = torch.rand(8)
    (report,) = reports
    assert len(report.matches) == 1
    assert (report.fallback is None) == (fault is None), report.fallback
    torch.manual_seed(7)
    want_out, want_dropped = model(ctx, tok)
    torch.testing.assert_close(dropped, want_dropped, rtol=0, atol=0)
    if fault is None:
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    assert torch.equal(after_verified, torch.rand(8))


@pytest.mark.parametrize("fault", [None, "gradient"])
@pytest.mark.parametrize("rest", ["eager", "inductor"])
def test_verify_writes_the_caller_s_buffers_once(monkeypatch, caplog, rest, fault):
    """verify runs the graph four times on its first training call (the captured graph, the
    rewrite, and each one's backward): every run wrote the BatchNorm's running statistics and the
    counter, so the model left its first step with four updates (num_batches_tracked 4), and the
    runs after the first read statistics the first had moved. Each buffer must come out as one
    eager call leaves it, on a right rewrite and on a wrong one that falls back."""
    _plant_wrong_rewrite(monkeypatch, fault)
    torch._dynamo.reset()
    eager = NormedContext(_block(torch.float32, seed=4), 3)
    model = copy.deepcopy(eager)
    gen = torch.Generator().manual_seed(14)
    batches = [(torch.randn(4, 3, 32, generator=gen), torch.randn(4, 5, 32, generator=gen).requires_grad_())
               for _ in range(2)]
    compiled = torch.compile(model, backend="mha", options={"verify": True, "rest": rest})
    with compiled_reports() as reports, caplog.at_level(logging.WARNING, logger="mha_compile"):
        for ctx, tok in batches:
            got = compiled(ctx, tok)
            got.square().mean().backward()
            want = eager(ctx, tok)
            want.square().mean().backward()
            assert_close_rel(got, want, torch.float32, "output")
    assert len(reports[0].matches) == 1 and (reports[0].fallback is None) == (fault is None), reports[0].fallback
    for name, buffer in eager.named_buffers():
        assert torch.equal(model.get_buffer(name), buffer) if buffer.dtype == torch.long else \
            relative_error(model.get_buffer(name), buffer) <= TOLERANCE[torch.float32], name
    for (name, param), want in zip(model.named_parameters(), eager.parameters()):
        if name != "block." + BK:
            assert_close_rel(param.grad, want.grad, torch.float32, name)


class BumpsItsScale(torch.nn.Module):
    """The block's output times a trained scale, which the forward first moves in place under
    no_grad, spelled `how` (as a decay or a step counter kept in a parameter would be)."""

    def __init__(self, block, how):
        super().__init__()
        self.block, self.how = block, how
        self.scale = torch.nn.Parameter(torch.tensor([1.0, 0.5]))

    def forward(self, ctx, tok):
        with torch.no_grad():
            if self.how == "add_":
                self.scale.add_(0.25)
            elif self.how == "iadd":
                self.scale += 0.25
            elif self.how == "view":
                self.scale.view(-1)[0:1].mul_(1.5)
            else:
                self.scale.data.add_(0.25)
        return self.block(ctx, tok) * self.scale.sum()


@pytest.mark.parametrize("fault", [None, "gradient"])
@pytest.mark.parametrize("how, rest, dtype", [("add_", "eager", torch.float32), ("iadd", "eager", torch.float32),
                                              ("view", "eager", torch.float32), ("data", "eager", torch.float32),
                                              ("add_", "inductor", torch.float32), ("add_", "eager", torch.bfloat16)])
def test_verify_writes_a_parameter_the_graph_writes_once(monkeypatch, caplog, how, rest, dtype, fault):
    """A forward that moves a parameter in place: verify ran the graph as captured, then the rewrite,
    then each one's backward, and every run moved it (a scale of 1 came out of one call at 2 for
    1.25 under add_), and the runs, each reading another scale, disagreed: a right rewrite fell back.
    Now verify keeps a copy of such a parameter (step_graphs.written_inputs) as of a buffer: it comes out
    of each call as one eager call leaves it, on a right rewrite (kept) and on a wrong one (which
    falls back), with eager's output and gradients (fp32: bf16's own top-k flips would move
    those), and nothing is said about writes it did not keep. bf16 runs verify's fp32 copy of the
    graph too."""
    _plant_wrong_rewrite(monkeypatch, fault)
    torch._dynamo.reset()
    eager = BumpsItsScale(_block(dtype, seed=6), how)
    model = copy.deepcopy(eager)
    gen = torch.Generator().manual_seed(16)
    batches = [(torch.randn(4, 3, 32, generator=gen).to(dtype), torch.randn(4, 5, 32, generator=gen).to(dtype))
               for _ in range(2)]
    compiled = torch.compile(model, backend="mha", options={"verify": True, "rest": rest})
    with compiled_reports() as reports, caplog.at_level(logging.WARNING, logger="mha_compile"):
        for ctx, tok in batches:
            tok.requires_grad_()
            got, want = compiled(ctx, tok), eager(ctx, tok)
            got.float().square().mean().backward()
            want.float().square().mean().backward()
            assert torch.equal(model.scale, eager.scale), (model.scale, eager.scale)
            if dtype == torch.float32:
                assert_close_rel(got, want, torch.float32, "output")
    assert len(reports[0].matches) == 1 and (reports[0].fallback is None) == (fault is None), reports[0].fallback
    assert not [r for r in caplog.records if "did not find it writing" in r.getMessage()]
    for (name, param), want in zip(model.named_parameters(), eager.parameters()):
        if name != "block." + BK and dtype == torch.float32:
            assert_close_rel(param.grad, want.grad, torch.float32, name)


@pytest.mark.parametrize("rest, mode", [("inductor", "default"), ("eager", "reduce-overhead")], ids=["inductor", "trees"])
@pytest.mark.parametrize("writes", [True, False])
def test_rest_inductor_runs_eagerly_where_a_trained_parameter_is_written(monkeypatch, caplog, writes, rest, mode):
    """rest="inductor" on a forward that moves a trained parameter in place under no_grad: through
    AOTAutograd's min-cut partitioner, which Inductor uses, the backward recomputed from the
    parameter after the forward had written it, and ∂tok came out 25% off (torch 2.13, plain
    torch.compile too). Such a graph runs with rest="eager", with a warning naming the parameter;
    output, scale and every gradient as eager's. A graph that writes none keeps Inductor, and
    nothing is said. The CUDA-graph trees (mode="reduce-overhead" with rest="eager", stood in for on
    the CPU) go through AOTAutograd with its default partitioner: they train it as eager as they
    are, and keep their graphs, with nothing said."""
    calls = []
    if mode == "reduce-overhead":
        monkeypatch.setattr(backend, "_whole_graph_captured", lambda *args: True)
        calls = _stub_cuda_graphs(monkeypatch)
    torch._dynamo.reset()
    eager = BumpsItsScale(_block(torch.float32, seed=7), "add_") if writes else _block(torch.float32, seed=7)
    model = copy.deepcopy(eager)
    gen = torch.Generator().manual_seed(18)
    ctx, tok = torch.randn(4, 3, 32, generator=gen), torch.randn(4, 5, 32, generator=gen)
    got_tok, want_tok = tok.clone().requires_grad_(), tok.clone().requires_grad_()
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        got = torch.compile(model, backend="mha", options={"rest": rest, "mode": mode})(ctx, got_tok)
    want = eager(ctx, want_tok)
    got.square().mean().backward()
    want.square().mean().backward()
    said = [r.getMessage() for r in caplog.records if "this graph runs with rest='eager'" in r.getMessage()]
    assert len(said) == int(writes and rest == "inductor") and all("scale" in m for m in said), said
    assert [is_backward for is_backward, *_ in calls] == ([False, True] if mode == "reduce-overhead" else [])
    assert_close_rel(got, want, torch.float32, "output")
    assert_close_rel(got_tok.grad, want_tok.grad, torch.float32, "∂tok")
    for (name, param), want_param in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(param, want_param), name
        if not name.endswith(BK):
            assert_close_rel(param.grad, want_param.grad, torch.float32, name)


@pytest.mark.parametrize("rest", ["eager", "inductor"])
def test_verify_leaves_a_first_backward_free_to_retain_its_graph(rest):
    """A first training call whose backward retains its graph (a gradient penalty's
    autograd.grad(..., retain_graph=True), then the loss's backward): under rest="inductor" verify's
    own backward ran first, AOTAutograd compiled the backward with its buffers donated, and the
    user's raised "compiled with non-empty donated buffers", where it runs without verify. Both
    backwards now run, on this call and the next, with eager's gradients, and verify keeps the rewrite."""
    torch._dynamo.reset()
    eager = _block(torch.float32, seed=8)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="mha", options={"verify": True, "rest": rest})
    gen = torch.Generator().manual_seed(19)
    with compiled_reports() as reports:
        for _ in range(2):
            ctx, tok = torch.randn(4, 3, 32, generator=gen), torch.randn(4, 5, 32, generator=gen)
            penalties = []
            for fn in (compiled, eager):
                ctx_leaf = ctx.clone().requires_grad_()
                loss = fn(ctx_leaf, tok).square().mean()
                penalties.append(torch.autograd.grad(loss, ctx_leaf, retain_graph=True)[0])
                loss.backward()
            assert_close_rel(*penalties, torch.float32, "∂ctx")
    assert len(reports[0].matches) == 1 and reports[0].fallback is None, reports[0].fallback
    for (name, param), want in zip(model.named_parameters(), eager.parameters()):
        if not name.endswith(BK):
            assert_close_rel(param.grad, want.grad, torch.float32, name)


def test_written_inputs_are_found_in_every_spelling_and_only_they():
    """step_graphs.written_inputs on a graph as Dynamo captures it: the inputs written in place
    directly, through a view, by `+=`, by an aten overload through an aten view, through out= (one
    tensor or a tuple), by item assignment, by a _foreach_ op, by inplace=True and through .data;
    not an input only read, nor one whose copy is written."""
    from mha_compile import step_graphs

    def fn(a, b, c, d, e, f, g, h, i, j, k, m, n):
        a.add_(1)
        b.view(-1)[0:1].mul_(2)
        c += 1
        d.clone().zero_()
        torch.ops.aten.mul_.Tensor(torch.ops.aten.view.default(f, [9]), 3.0)
        torch.mul(a, 2, out=g)
        h[0] = 5.0
        torch._foreach_add_([i], 1.0)
        torch.nn.functional.relu(j, inplace=True)
        torch.max(e, dim=0, out=(k, m))
        n.data.add_(1)
        return a + b + c + d + e

    graphs = []
    torch._dynamo.reset()
    tensors = [*(torch.randn(3, 3) for _ in range(10)), torch.empty(3), torch.empty(3, dtype=torch.long),
               torch.randn(3, 3)]
    torch.compile(fn, backend=lambda gm, inputs: graphs.append((gm, inputs)) or gm.forward)(*tensors)
    ((gm, inputs),) = graphs
    names = [node.name for node in gm.graph.find_nodes(op="placeholder")]
    assert sorted(names[i] for i in step_graphs.written_inputs(gm, inputs)) == [
        "l_a_", "l_b_", "l_c_", "l_f_", "l_g_", "l_h_", "l_i_", "l_j_", "l_k_", "l_m_", "l_n_"], names
    # inputs that share memory (views of one tensor): a write into one is a write into each
    shared = torch.randn(13, 3, 3)
    assert step_graphs.written_inputs(gm, list(shared[:10]) + inputs[10:]) == set(range(10)) | {10, 11, 12}


def test_the_fake_run_leaves_grad_mode_autocast_and_held_tensors_as_found():
    """step_graphs.written_inputs runs the graph's _set_grad_enabled and _enter_autocast for real: a
    run that raised midway (a nonzero, whose size a fake cannot know, under no_grad and autocast)
    left grad mode off and autocast on, and the compile after it built an inference graph for
    training. And a tensor the graph holds itself (get_attr) that it writes is a fake copy there,
    the real one untouched."""
    from mha_compile import step_graphs

    def fn(x):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.nonzero(x > 0)
        return x * 2 + y.sum()

    graphs = []
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch.compile(fn, backend=lambda gm, inputs: graphs.append((gm, inputs)) or gm.forward)(torch.randn(5))
    (gm, inputs), *_ = graphs
    assert gm.graph.find_nodes(op="call_function", target=torch.nonzero)
    with pytest.raises(Exception):
        step_graphs.written_inputs(gm, inputs)
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16  # the default, as found

    root, graph = torch.nn.Module(), torch.fx.Graph()
    root.register_buffer("calls", torch.zeros(()))
    x, calls = graph.placeholder("x"), graph.get_attr("calls")
    graph.output(graph.call_function(torch.add, (x, graph.call_method("add_", (calls, 1)))))
    held = torch.fx.GraphModule(root, graph)
    assert step_graphs.written_inputs(held, [torch.randn(3)]) == set() and float(held.calls) == 0
    assert float(held(torch.zeros(3))[0]) == 1 and float(held.calls) == 1  # the graph does write it


def test_verify_says_where_a_parameter_was_written_without_a_copy(monkeypatch, caplog):
    """Where a run wrote a parameter that step_graphs.written_inputs did not name (so verify kept no copy of it,
    and each run it compares writes it again), a warning says so and names the graph's input."""
    from mha_compile import step_graphs

    monkeypatch.setattr(step_graphs, "written_inputs", lambda gm, args: set())
    torch._dynamo.reset()
    model = BumpsItsScale(_block(torch.float32, seed=6), "add_")
    gen = torch.Generator().manual_seed(17)
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        torch.compile(model, backend="mha", options={"verify": True})(torch.randn(4, 3, 32, generator=gen),
                                                                       torch.randn(4, 5, 32, generator=gen))
    said = [r.getMessage() for r in caplog.records if "did not find it writing" in r.getMessage()]
    assert len(said) == 1 and "scale" in said[0], said


class HalvesItsContext(torch.nn.Module):
    """The block, then ctx halved in place (the caller's activation, as eager allows) and added."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, ctx, tok):
        out = self.block(ctx, tok)
        ctx.mul_(0.5)
        return out + ctx


def test_verify_keeps_a_right_rewrite_of_a_graph_writing_its_non_leaf_input(caplog):
    """verify's backward runs stood a leaf in for the caller's non-leaf ctx, and the graph's
    in-place write into it raised there ("a leaf Variable that requires grad is being used in an
    in-place operation"): a right rewrite fell back."""
    torch._dynamo.reset()
    model = HalvesItsContext(_block(torch.float32, seed=5))
    gen = torch.Generator().manual_seed(15)
    x, tok = torch.randn(4, 3, 32, generator=gen, requires_grad=True), torch.randn(4, 5, 32, generator=gen)
    with compiled_reports() as reports, caplog.at_level(logging.WARNING, logger="mha_compile"):
        got = torch.compile(model, backend="mha", options={"verify": True})(x * 2, tok)
        (got_x,) = torch.autograd.grad(got.square().sum(), x)
    (report,) = reports
    assert len(report.matches) == 1 and report.fallback is None, report.fallback
    (want_x,) = torch.autograd.grad(model(x * 2, tok).square().sum(), x)
    assert_close_rel(got_x, want_x, torch.float32, "∂x")


def test_verify_compares_directly_where_the_captured_graph_does_not_run_in_fp32(monkeypatch, caplog):
    from mha_compile import verify

    def refuses(gm):
        raise RuntimeError("planted: no fp32 run")

    monkeypatch.setattr(verify, "promoted", refuses)
    torch._dynamo.reset()
    model, ctx, tok = _bf16_block_and_inputs(1)
    report = _verify_first_call(model, ctx, tok, "auto", caplog, level=logging.INFO)
    assert "does not run in fp32 (RuntimeError: planted: no fp32 run)" in caplog.text
    assert report.fallback is not None and "output 0: relative error" in report.fallback  # as before: 8.2e-2


def test_promoted_runs_a_graphs_low_precision_casts_in_fp32():
    from mha_compile import verify

    def f(x):
        y = x.to(torch.bfloat16) * 3 + torch.ones(3, dtype=torch.float16).half()
        return y.float() + x.bfloat16().to(dtype=torch.float16)

    gm = torch.fx.symbolic_trace(f)
    x = torch.full((3,), 1 + 2.0 ** -12)  # rounds to 1 in bf16 and fp16
    got = verify.promoted(gm)(x)
    assert got.dtype == torch.float32 and torch.equal(got, x * 3 + 1 + x)
    assert not torch.equal(gm(x), got)  # as captured, the casts round


def test_fresh_interpreter_finds_the_backend_by_name():
    code = ("import sys, torch\n"
            "assert 'mha' in torch._dynamo.list_backends(), torch._dynamo.list_backends()\n"
            "assert 'mha_compile' not in sys.modules\n"
            "m = torch.nn.Linear(4, 4)\n"
            "torch.compile(m, backend='mha')(torch.randn(2, 4))\n"
            "assert 'mha_compile.backend' in sys.modules\n"
            "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def test_dump_writes_graphs_and_reports(tmp_path, monkeypatch):
    import json
    monkeypatch.setenv("MHA_COMPILE_DUMP", str(tmp_path))
    torch._dynamo.reset()
    model = _block(torch.float32)
    torch.compile(model, backend="mha")(torch.randn(4, 3, 32), torch.randn(4, 5, 32))
    (run,) = list(tmp_path.iterdir())
    (graph,) = list(run.glob("graph_*"))  # beside index.html
    report = json.loads((graph / "report.json").read_text())
    assert len(report["matches"]) == 1 and "topk" in report["matches"][0]["nodes"]
    assert "mha.region" in (graph / "rewritten.py").read_text()
    assert "torch.topk" in (graph / "captured.py").read_text() or "topk" in (graph / "captured.py").read_text()


class _Residual(models.MHABlock):
    """y = ctx + inv[:, None]; returns y + MoE(y) (and, with `expose_inv`, inv too)."""

    def __init__(self, *args, expose_inv=False, early_read=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.expose_inv, self.early_read = expose_inv, early_read
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, ctx, tok):
        inv = self.pool(tok)
        y = ctx + inv.unsqueeze(1)
        early = y.mean() if self.early_read else 0.0  # read before the MoE runs
        if self.early_read == "in place":
            self.seen.add_(early.detach())
        out = y + self.moe(y) + early
        return (out, inv * 2.0) if self.expose_inv else out


@pytest.mark.parametrize("expose_inv", [False, True])
def test_residual_exports_y_and_inv_with_their_gradients(expose_inv):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Residual(32, 2, 64, 4, 2, expose_inv=expose_inv).double()
    ctx, tok = torch.randn(4, 3, 32, dtype=torch.float64), torch.randn(4, 5, 32, dtype=torch.float64)
    report = mha_compile.explain(model, ctx, tok)
    assert len(report.matches) == 1 and not report.near_misses
    assert set(report.matches[0]["exports"]) == ({"y", "inv"} if expose_inv else {"y"})
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend="mha")
    args_e = [t.clone().requires_grad_(True) for t in (ctx, tok)]
    args_c = [t.clone().requires_grad_(True) for t in (ctx, tok)]
    outs_e, outs_c = model(*args_e), compiled(*args_c)
    outs_e = outs_e if isinstance(outs_e, tuple) else (outs_e,)
    outs_c = outs_c if isinstance(outs_c, tuple) else (outs_c,)
    loss_e = sum((o * torch.randn(o.shape, generator=torch.Generator().manual_seed(i), dtype=o.dtype)).sum()
                 for i, o in enumerate(outs_e))
    loss_c = sum((o * torch.randn(o.shape, generator=torch.Generator().manual_seed(i), dtype=o.dtype)).sum()
                 for i, o in enumerate(outs_c))
    for o_c, o_e in zip(outs_c, outs_e):
        assert_close_rel(o_c, o_e, torch.float64, "output")
    loss_e.backward()
    loss_c.backward()
    for (name, p_e), p_c in zip(model.named_parameters(), compiled_model.parameters()):
        if name.endswith(BK):
            continue
        assert_close_rel(p_c.grad, p_e.grad, torch.float64, f"∂{name}")
    for a_c, a_e, name in zip(args_c, args_e, ("ctx", "tok")):
        assert_close_rel(a_c.grad, a_e.grad, torch.float64, f"∂{name}")


@pytest.mark.parametrize("early_read", [True, "in place"])
def test_a_region_value_read_before_the_region_ends_moves_after_the_op(early_read):
    """y.mean() read before the MoE runs (a near-miss until session 49): the reader moves after
    the op, onto y rebuilt from it; output and every gradient eager's. "in place": the reader also
    writes a buffer's running statistic in place, a near-miss until session 68 ("would reorder that
    write"), though nothing in the region, nor before its end, reads the buffer: the write moves
    with its reader (an expert-load counter, a review's, is the same case), and the buffer is
    eager's. A write into a value the region reads is still refused (test_block_edges.py, a head
    writing inv)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Residual(32, 2, 64, 4, 2, early_read=early_read).double()
    ctx, tok = torch.randn(4, 3, 32, dtype=torch.float64), torch.randn(4, 5, 32, dtype=torch.float64)
    report = mha_compile.explain(copy.deepcopy(model), ctx, tok)
    assert len(report.matches) == 1 and not report.near_misses and report.matches[0]["kept"], str(report)
    torch._dynamo.reset()
    compiled_model = copy.deepcopy(model)
    out_c, out_e = torch.compile(compiled_model, backend="mha")(ctx, tok), model(ctx, tok)
    assert_close_rel(out_c, out_e, torch.float64, "output")
    assert_close_rel(compiled_model.seen, model.seen, torch.float64, "the buffer")
    cotangent = torch.randn(out_e.shape, dtype=torch.float64)
    out_c.backward(cotangent)
    out_e.backward(cotangent)
    for (name, p_e), p_c in zip(model.named_parameters(), compiled_model.parameters()):
        if not name.endswith(BK):
            assert_close_rel(p_c.grad, p_e.grad, torch.float64, f"∂{name}")


@needs_interpreter
def test_autocast_hand_off_chooses_the_fused_kernels(monkeypatch):
    """Under torch.autocast the op gets bf16 activations and fp32 parameters: the fused set takes
    that mix (it used to fall back to the reference path), and the report says how. (On the CPU
    the interpreter's bf16 dots send bf16 to the reference path: set aside here, as on a GPU.)"""
    from mha_compile.kernels import triton_region
    monkeypatch.setattr(triton_region, "BF16_UNDER_INTERPRETER", True)
    torch.manual_seed(0)
    model = models.Forecaster(16, 5, 3)
    with torch.autocast("cpu", torch.bfloat16):
        report = mha_compile.explain(model, torch.randn(4, 16, 5), options={"kernels": "fused"})
    (match,) = report.matches
    assert match["kernels"] == "fused", match["kernels_reason"]
    assert "as autocast does" in match["kernels_reason"]


def test_the_cache_digest_follows_what_sizes_the_fakes(monkeypatch):
    """ops.cache_digest changes with MHA_COMPILE_KEEP_HIDDEN (triton_moe.KEEP_HIDDEN sizes the
    fake's `reuse`: on the H200 an entry compiled without it was served to a process with it, and
    its graph refused the op's longer reuse) and with the package's source, and is stable otherwise."""
    from mha_compile.kernels import triton_moe
    monkeypatch.setattr(triton_moe, "KEEP_HIDDEN", False)
    off = backend.ops.cache_digest()
    assert backend.ops.cache_digest() == off
    monkeypatch.setattr(triton_moe, "KEEP_HIDDEN", True)
    assert backend.ops.cache_digest() != off
    monkeypatch.setattr(triton_moe, "KEEP_HIDDEN", False)
    monkeypatch.setattr(backend.ops, "_source_digest", lambda: "another build")
    assert backend.ops.cache_digest() != off


def test_compile_caches_are_keyed_by_the_ops_schemas(tmp_path, monkeypatch):
    """torch's AOTAutograd cache keys a custom op by its name only: an entry compiled when the ops'
    schemas were other (an earlier build) must not be served. The backend puts ops.cache_digest()
    in the caches' key (behind the user's own tag): the same digest hits the entry, another misses."""
    from torch._dynamo.utils import counters
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = models.Forecaster(window=12, variates=5, horizons=3)
    x = torch.randn(4, 12, 5)
    tags = []
    real = backend.cache_key_tagged

    def recorded():
        patch = real()
        tags.append(patch.changes["cache_key_tag"])
        return patch

    def compile_and_step(digest):
        monkeypatch.setattr(backend.ops, "cache_digest", lambda: digest)
        torch._dynamo.reset()
        counters.clear()
        torch.compile(model, backend="mha", options={"rest": "inductor"})(x).sum().backward()
        return counters["aot_autograd"]["autograd_cache_hit"], counters["aot_autograd"]["autograd_cache_miss"]

    monkeypatch.setattr(backend, "cache_key_tagged", recorded)
    with torch._functorch.config.patch(enable_autograd_cache=True), torch._inductor.config.patch(fx_graph_cache=True), \
            torch.compiler.config.patch(cache_key_tag="user-tag"):
        first = compile_and_step("0123456789abcdef")
        again = compile_and_step("0123456789abcdef")
        other = compile_and_step("fedcba9876543210")
    assert first[0] == 0 and first[1] >= 1, first
    assert again[0] >= 1 and again[1] == 0, again
    assert other[0] == 0 and other[1] >= 1, other
    assert tags[0] == "user-tag|mha-0123456789abcdef" and tags[-1] == "user-tag|mha-fedcba9876543210", tags



class _GradInside(torch.nn.Module):
    """A block whose forward turns grad on itself (as a model that trains a part of itself at
    eval might)."""

    def __init__(self):
        super().__init__()
        self.block = models.MHABlock.from_preset("tiny")

    def forward(self, ctx, tok):
        with torch.enable_grad():
            return self.block(ctx, tok)


def test_enable_grad_inside_the_callers_inference_mode_runs_as_eager():
    """Under the caller's inference_mode the model's enable_grad records nothing in eager; the
    compiled model must run too (its region's Function raised: inference tensors saved for a
    backward), with eager's output."""
    torch._dynamo.reset()
    torch.manual_seed(2)
    model = _GradInside()
    ctx, tok = torch.randn(4, 3, 32), torch.randn(4, 5, 32)
    with torch.inference_mode(), compiled_reports() as reports:
        want = model(ctx, tok)
        got = torch.compile(model, backend="mha")(ctx, tok)
    torch._dynamo.reset()
    assert [len(r.matches) for r in reports] == [1]
    assert not got.requires_grad
    assert relative_error(got, want) <= 1e-6
