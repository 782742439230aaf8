"""bench/siamese_step.py on the CPU: with the step graphs' recorder a stub (bench/step_graphs_host.py)
and CUDA's calls stubbed, it times its three ways at the tiny preset and counts each one's
replays; a way that replays otherwise than it says is refused; without a GPU it says so."""
import pytest

from bench import siamese_step


@pytest.fixture()
def on_cpu(step_graphs_on_cpu, monkeypatch):
    monkeypatch.setattr(siamese_step, "needs_gpu", lambda: None)
    monkeypatch.setattr(siamese_step.timing, "peak_memory_call", lambda step, device: (step(), 0.0, 0.0, 0.0))


def test_it_times_the_three_ways(on_cpu, capsys):
    siamese_step.main(["--presets", "tiny", "--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(siamese_step.WAYS)
    for line, name in zip(lines, siamese_step.WAYS):
        assert line.startswith("tiny") and f" {name} " in line and " ms (rounds " in line, line


def test_a_way_that_replays_otherwise_is_refused(on_cpu, monkeypatch):
    monkeypatch.setitem(siamese_step.WAYS, "trees", ({"step_graphs": False}, 4, 1))  # says 1 a step, replays 0
    with pytest.raises(SystemExit, match="trees: 0 forward replays in .* steps, not 1 a step"):
        siamese_step.main(["--presets", "tiny", "--rounds", "1"])


def test_without_a_gpu_it_says_so():
    with pytest.raises(SystemExit, match="needs a GPU"):
        siamese_step.main([])
