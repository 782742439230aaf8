"""What a benchmark row must prove before its time stands under its mode's name: the kernels it
ran, the compile it checked, the batches it computed on, the rounds it got, the error bound."""
import json
import math

import pytest
import torch

import mha_compile
from bench import __main__ as bench_main
from bench import cases, measure, modes, plot, report
from mha_compile import backend


def _row(job):
    row = measure.run_row(job, {}, quick=True)
    return {**dict.fromkeys(report.ROW_FIELDS), **row, "device": "cpu", "torch": "", "triton": "", "commit": ""}


def _job(mode, pass_="fwd"):
    return dict(preset="tiny", dtype="fp32", mode=mode, spelling="loop", device_type="cpu", **{"pass": pass_})


def _summary(mode, regions, kernels, **extra):
    """A finished row of `mode` at medium with the lowering check's fields as given."""
    return dict(preset="medium", dtype="bf16", spelling="loop", device="cuda", status="ok", time_ms=1.0, mode=mode,
                regions_replaced=regions, kernels_chosen=kernels, **{"pass": "fwd+bwd"}, **extra)


def test_a_row_that_ran_other_kernels_than_its_mode_names_is_not_lowered_as_named(monkeypatch):
    """On the CPU without TRITON_INTERPRET=1 the fused and staged sets fall back to the reference
    kernels (lowering/select.py): a mha-fused row there timed the reference path. It gets no
    speedup, a note naming the kernels that ran, no bar in the plot, and the reference's FLOPs; a
    mha-reference row that ran the reference kernels is as named."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # `make test` sets it, and the fused set then runs
    # fwd+bwd: the reference's backward computes more than the Triton sets' (cost.py), its forward as much
    eager, fused, reference = (_row(_job(m, "fwd+bwd")) for m in ("eager", "mha-fused", "mha-reference"))
    assert fused["status"] == "ok" and fused["kernels_chosen"] == ["reference"], fused
    rows = report.add_speedups([eager, fused, reference])
    assert fused["speedup"] is None and reference["speedup"] > 0 and eager["speedup"] > 0
    notes = {r[4]: r[-1] for r in report.table_rows(rows)}
    assert notes["mha-fused"] == "NOT LOWERED AS NAMED: ran the reference kernels, not fused"
    assert notes["mha-reference"] == ""
    assert fused["flops_mode"] == reference["flops_mode"]  # the family of what ran
    assert fused["flops_mode"] != measure.cost_fields(_job("mha-fused", "fwd+bwd"))["flops_mode"]


@pytest.mark.parametrize("mode, kernels, as_named", [
    ("mha-fused", ["fused"], True), ("mha-fused", ["staged"], False), ("mha-staged", ["staged"], True),
    ("mha-staged", ["reference"], False), ("mha-fused-nographs", ["fused", "reference"], False),
    ("mha-fused-cudagraphs", ["fused"], True), ("mha-fused-keep", ["reference"], False),
    ("mha-reference", ["reference"], True), ("mha-reference", ["fused"], False), ("mha-fused", [], False)])
def test_each_mha_mode_is_as_named_only_on_the_kernels_it_names(mode, kernels, as_named):
    """Every match's kernels must be the set the name says (a JSON row from before the check, with
    its speedup, is left out of the plot all the same)."""
    peer = _summary("inductor", None, None)
    row = _summary(mode, 1, kernels)
    report.add_speedups([peer, row])
    assert (row["speedup"] is not None) == as_named
    plotted = plot.plotted_rows([peer, dict(row, speedup=2.0)])
    assert [r["mode"] for r in plotted] == ["inductor"] + [mode] * as_named
    assert (report.not_lowered(row) is None) == as_named


def test_the_lowering_check_compiles_each_mha_mode_as_its_timed_row(monkeypatch):
    """The check (explain) takes the backend's options alone; the timed compile of
    mha-fused-cudagraphs passes mode="reduce-overhead" to torch.compile: the check's options must
    say the same, else it checks another compile (a review found it compiled without the mode)."""
    calls = []
    monkeypatch.setattr(modes.torch, "compile", lambda model, **kwargs: calls.append(kwargs))
    for mode in modes.MHA_MODES:
        modes.build(mode, None)
        kwargs = calls.pop()
        timed = dict(kwargs.get("options") or {}, **({"mode": kwargs["mode"]} if kwargs.get("mode") else {}))
        assert mha_compile.Options.parse(timed) == mha_compile.Options.parse(modes.mha_options(mode)), mode


def test_the_cudagraphs_rows_check_reaches_the_backend_with_its_mode(monkeypatch):
    """End to end: the mode the backend honours in the timed compile and in the check's."""
    seen, real = [], backend._mode
    monkeypatch.setattr(backend, "_mode", lambda given, in_options: seen.append(real(given, in_options)) or seen[-1])
    model = cases.make_model("tiny", "loop", "fp32", "cpu")
    ctx, tok, _ = cases.make_inputs("tiny", "fp32", "cpu")
    torch._dynamo.reset()
    with torch.no_grad():
        modes.build("mha-fused-cudagraphs", model)(ctx, tok)
    timed = list(seen)
    summary = measure.lowering_summary("mha-fused-cudagraphs", model, ctx, tok)
    assert timed == ["reduce-overhead"] and seen[len(timed):] == timed and summary["regions_replaced"] == 1


def test_a_row_whose_lowering_was_not_confirmed_gets_no_speedup(monkeypatch):
    """An explain that fails leaves regions_replaced None: that is no confirmed region, so the row
    is not lowered (it read as lowered: the note fired on 0 alone), and says why; 0 regions too."""
    def broken(*args, **kwargs):
        raise RuntimeError("explain blew up")

    monkeypatch.setattr(mha_compile, "explain", broken)
    eager, ours = _row(_job("eager")), _row(_job("mha-reference"))
    assert ours["status"] == "ok" and ours["regions_replaced"] is None
    report.add_speedups([eager, ours])
    assert ours["speedup"] is None
    note = report.table_rows([ours])[0][-1]
    assert note.startswith("NOT LOWERED: not confirmed (explain failed: RuntimeError: explain blew up")
    uncaptured = _summary("mha-fused", 0, [])
    report.add_speedups([_summary("inductor", None, None), uncaptured])
    assert uncaptured["speedup"] is None and report.table_rows([uncaptured])[0][-1].startswith("NOT LOWERED: no region")
    old_json = [dict(ours, speedup=3.0), dict(uncaptured, speedup=3.0), dict(eager, speedup=1.0)]
    assert plot.plotted_rows(old_json) == [old_json[2]]


@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
def test_a_step_that_computes_on_a_stale_batch_fails_the_check(monkeypatch, pass_):
    """The timed steps alternate two batches; a step that computes on the first whatever it is
    given passed when the second was a copy of it, and the check ran on the first alone. The
    second has values of its own and is checked against its own reference: the stale step is off
    (every row, and in training the gradients), the honest one within fp32's bound."""
    real_build = modes.build

    def build(mode, model):
        fn, first = real_build(mode, model), []

        def stale(ctx, tok):
            first.extend([] if first else [ctx, tok])
            return fn(*first)
        return stale

    honest = _row(_job("eager", pass_))
    assert honest["rel_err"] < 1e-5 and (honest["grad_rel_err"] or 0) < 1e-5 and honest["rows_off"] == 0
    monkeypatch.setattr(modes, "build", build)
    stale = _row(_job("eager", pass_))
    assert stale["status"] == "ok" and stale["rel_err"] > 0.1 and stale["rows_off"] > 0
    assert any(report._over_bound(stale))
    if pass_ == "fwd+bwd":
        assert stale["grad_rel_err"] > 0.1


def test_the_two_batches_differ_and_share_one_upstream_gradient():
    """The second batch is drawn from its own seed; the reference gives each batch its output and
    gradients under the one upstream gradient, zero in the tie rows of both."""
    first, second = cases.make_inputs("tiny", "fp32", "cpu"), cases.make_inputs("tiny", "fp32", "cpu", cases.OTHER_SEED)
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[1], second[1])
    (out_a, grads_a, ties_a), (out_b, grads_b, ties_b) = cases.reference(
        "tiny", "fp32", "cpu", (cases.INPUT_SEED, cases.OTHER_SEED))
    block = cases.make_model("tiny", "loop", "fp32", "cpu")
    assert torch.allclose(out_b, block(*second[:2]).detach(), atol=1e-6)
    grad_out = cases.zero_tie_rows_(first[2].clone(), ties_a | ties_b)
    ctx, tok = (t.clone().requires_grad_(True) for t in second[:2])
    want = torch.autograd.grad(block(ctx, tok), [ctx, tok, *block.parameters()], grad_out)
    assert cases.gradient_error(grads_b, want) < 1e-5


def test_a_nan_error_is_the_worst_and_flagged():
    """max() passes over a NaN that does not come first: a NaN gradient read as 0 error, and a
    NaN rel err was under every bound (NaN > bound is False)."""
    ref = [torch.ones(3), torch.ones(2)]
    assert math.isnan(cases.gradient_error([torch.ones(3), torch.full((2,), math.nan)], ref))
    checks = [dict(rel_err=1e-6, grad_rel_err=1e-6, tie_rows=1, tie_rows_flipped=0, rows_off=0),
              dict(rel_err=math.nan, grad_rel_err=2e-6, tie_rows=2, tie_rows_flipped=1, rows_off=3)]
    merged = cases.merge_errors(checks)
    assert math.isnan(merged["rel_err"]) and merged["grad_rel_err"] == 2e-6
    assert (merged["tie_rows"], merged["tie_rows_flipped"], merged["rows_off"]) == (3, 1, 3)
    assert report._over_bound(dict(dtype="bf16", rel_err=math.nan, grad_rel_err=math.nan)) == (True, True)


def test_fp32_rows_are_flagged_at_spec_bound():
    """SPEC §4: fp32 kernels within 1e-5 (ieee dots; 5e-4 only where TF32 is declared): the table
    flagged fp32 only past 1e-4, and its legend called that the dtype's bound."""
    assert report._over_bound(dict(dtype="fp32", rel_err=2e-5, grad_rel_err=9e-5)) == (True, True)
    assert report._over_bound(dict(dtype="fp32", rel_err=9e-6, grad_rel_err=1e-6)) == (False, False)
    assert report._over_bound(dict(dtype="bf16", rel_err=1e-2, grad_rel_err=1e-2)) == (False, False)
    assert "fp32 1e-5" in report.LEGEND


def test_resume_reruns_a_group_whose_rows_the_budget_cut_to_fewer_rounds(tmp_path):
    """--rounds 3 cut by the budget: a row with one round of three is no row of the table --resume
    completes; its group (preset, dtype, pass) runs again, a group every row of which got its
    rounds (or failed) is kept."""
    env = dict(device="cpu (x)", torch="2", triton="3", commit="c")
    jobs = [dict(preset="tiny", dtype="fp32", mode=m, spelling="dense", device_type="cpu", **{"pass": p})
            for p in ("fwd+bwd", "fwd") for m in ("eager", "mha-reference")]

    def row(job, status="ok", rounds=3):
        return dict(job, status=status, time_ms=1.0 if status == "ok" else None,
                    round_ms=[1.0] * rounds if status == "ok" else None)

    earlier = [row(jobs[0]), row(jobs[1], "error"), row(jobs[2]), row(jobs[3], rounds=1)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(dict(meta=dict(env, rounds=3, isolated=False, quick=False, settings={}),
                                    rows=earlier)))
    kept, _ = bench_main.resumed_rows(str(path), jobs, env, rounds=3)
    assert kept == earlier[:2]
    path.write_text(json.dumps(dict(meta=dict(env, rounds=1, isolated=False, quick=False, settings={}),
                                    rows=[dict(r, round_ms=None) for r in earlier])))
    kept, _ = bench_main.resumed_rows(str(path), jobs, env, rounds=1)  # one round: no round_ms, all ran
    assert len(kept) == 4
