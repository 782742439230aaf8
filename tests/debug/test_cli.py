"""`python -m mha_compile explain script.py:factory`: the report, the dump, clear errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mha_compile.__main__ import main

SCRIPT = Path(__file__).with_name("factory_script.py")


def test_explain_prints_the_report_and_writes_the_dump(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mha_compile", "explain", f"{SCRIPT}:make_block",
                             "--dump", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 graph(s), 1 match(es), 0 near-miss(es)" in result.stdout
    assert "kernels: reference" in result.stdout
    (run,) = tmp_path.glob("run-*")
    assert str(run / "index.html") in result.stderr
    assert (run / "graph_000" / "report.json").exists() and (run / "graph_000" / "captured.py").exists()


@pytest.mark.parametrize("spec, message", [
    ("no/such/script.py:make_block", "no/such/script.py: no such file"),
    (f"{SCRIPT}", "expected path/to/script.py:function"),
    (f"{SCRIPT}:make_nothing", "has no function 'make_nothing'; functions defined there: make_block, "
                               "make_model_only, make_printing, make_single_input"),
    (f"{SCRIPT}:make_model_only", "must return (model, example_inputs); it returned a mha_compile.models.MHABlock"),
    (f"{SCRIPT}:make_single_input", "must return example_inputs as a tuple"),
])
def test_bad_spec_is_a_clear_error(spec, message, capsys):
    assert main(["explain", spec]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_json_is_the_report_alone_where_the_model_prints(capsys):
    """A model's print went into the JSON's stream, which no JSON reader could then read (a review's)."""
    assert main(["explain", f"{SCRIPT}:make_printing", "--json"]) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["graphs"]) >= 1 and "the model prints this" in captured.err


def test_options_and_dynamic_reach_explain(monkeypatch, capsys):
    """--option KEY=VALUE and --dynamic: before session 69 the command took --kernels and --rest only,
    and no way to explain a dynamic=True compile."""
    seen = {}

    def explain(model, *inputs, mha_options=None, mha_dynamic=None):
        seen.update(options=mha_options, dynamic=mha_dynamic)
        return "the report"

    monkeypatch.setattr("mha_compile.debug.explain.explain", explain)
    assert main(["explain", f"{SCRIPT}:make_block", "--option", "keep_hidden=true", "--option", "mode=reduce-overhead",
                 "--option", "step_graphs=False", "--dynamic"]) == 0
    assert seen == dict(options={"kernels": "auto", "rest": "eager", "keep_hidden": True, "mode": "reduce-overhead",
                                 "step_graphs": False}, dynamic=True)
    assert main(["explain", f"{SCRIPT}:make_block"]) == 0
    assert seen == dict(options={"kernels": "auto", "rest": "eager"}, dynamic=None)


@pytest.mark.parametrize("option, message", [
    ("verify", "--option 'verify': expected KEY=VALUE"),
    ("bogus=1", "unknown key(s) ['bogus']; allowed keys are ['kernels', 'rest', 'dump', 'verify'"),
    ("graphs=sometimes", "graphs='sometimes' is not allowed; expected one of ('auto', 'on', 'off')"),
])
def test_a_bad_option_is_a_clear_error(option, message, capsys):
    assert main(["explain", f"{SCRIPT}:make_block", "--option", option]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
