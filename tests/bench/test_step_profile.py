"""bench/step_profile.py on the CPU: its runs are checked before anything is built, and it says
it needs a GPU rather than profiling nothing."""
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)
from bench import step_profile  # noqa: E402


def test_runs_are_parsed_and_every_default_is_a_mode_it_takes():
    runs = step_profile.parse_runs(step_profile.RUNS)
    assert ("mha-fused-cudagraphs", "loop") in runs and ("inductor-reduce-overhead", "loop") in runs
    assert step_profile.parse_runs("eager:dense") == [("eager", "dense")]
    assert step_profile.parse_runs("mha-inductor-reduce-overhead:loop") == [("mha-inductor-reduce-overhead", "loop")]
    assert step_profile.parse_runs("mha-options-reduce-overhead:dense") == [("mha-options-reduce-overhead", "dense")]
    assert step_profile.parse_runs("mha-fused-keep-pool-inside:dense") == [("mha-fused-keep-pool-inside", "dense")]
    assert step_profile.parse_runs("mha-inductor-reduce-overhead-pool-inside:loop") == [
        ("mha-inductor-reduce-overhead-pool-inside", "loop")]


@pytest.mark.parametrize("text,message", [("mha-fast:loop", "mode 'mha-fast' is not one of"),
                                          ("eager:grouped_mm", "spelling 'grouped_mm' is not 'dense' or 'loop'"),
                                          ("eager", "spelling '' is not")])
def test_a_bad_run_is_refused_by_name(text, message):
    with pytest.raises(ValueError, match=f"--runs {text!r}: {message}"):
        step_profile.parse_runs(text)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message without a GPU")
def test_without_a_gpu_it_says_so(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["step_profile.py", "--runs", "eager:loop"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        step_profile.main()
