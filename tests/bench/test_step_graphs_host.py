"""bench/step_graphs_host.py: it times the step through step_graphs (every step replayed) beside
the bare autograd.Function, and refuses to report a run in which the step did not replay."""
import pytest
import torch

from bench import step_graphs_host
from mha_compile import step_graphs


def test_it_times_replayed_steps(capsys):
    torch._dynamo.reset()
    step_graphs_host.main(["--steps", "3", "--rounds", "2"])
    out = capsys.readouterr().out
    assert "step_graphs' own machinery:" in out and "bare Function" in out


def test_a_run_that_did_not_replay_is_refused(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(step_graphs.StepGraphs, "__call__", lambda self, *args: self.run(*args))
    with pytest.raises(SystemExit, match="did not replay through step_graphs"):
        step_graphs_host.main(["--steps", "3", "--rounds", "1"])
