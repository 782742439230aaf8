"""bench/siamese_step.py on the CPU: with the step graphs' recorder a stub (bench/step_graphs_host.py)
and CUDA's calls stubbed, it times its three ways at the tiny preset and counts each one's
replays; a way that replays otherwise than it says is refused; without a GPU it says so."""
import time

import pytest
import torch
import triton.testing

from bench import cases, siamese_step, step_graphs_host
from mha_compile import backend, step_graphs, whole_graph


def _bench(fn, warmup, rep, return_mode):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


@pytest.fixture()
def on_cpu(monkeypatch):
    make_model, make_inputs = cases.make_model, cases.make_inputs
    monkeypatch.setattr(cases, "make_model",
                        lambda preset, spelling, dtype, device: make_model(preset, spelling, "fp32", "cpu"))
    monkeypatch.setattr(cases, "make_inputs", lambda preset, dtype, device: make_inputs(preset, "fp32", "cpu"))
    monkeypatch.setattr(step_graphs, "CudaGraphs", step_graphs_host.StubGraphs)
    monkeypatch.setattr(backend, "_whole_graph_captured", lambda opts, mode, inputs: mode == "reduce-overhead")
    monkeypatch.setattr(whole_graph, "capture", lambda gm, inputs: gm.forward)  # the trees: not on the CPU
    monkeypatch.setattr(triton.testing, "do_bench", _bench)
    monkeypatch.setattr(siamese_step, "needs_gpu", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(siamese_step.timing, "peak_memory_call", lambda step, device: (step(), 0.0, 0.0, 0.0))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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
