"""The step graphs on the CPU for the bench's scripts that time them: the recorder a stub whose
replays do nothing (bench/step_graphs_host.py), CUDA's calls stubbed, do_bench a host clock."""
import time

import pytest
import torch
import triton.testing

from bench import cases, step_graphs_host
from mha_compile import backend, step_graphs, whole_graph


def _bench(fn, warmup, rep, return_mode="mean", grad_to_none=None):
    start = time.perf_counter()
    fn()
    elapsed = (time.perf_counter() - start) * 1e3
    return [elapsed] if return_mode == "all" else elapsed


@pytest.fixture()
def step_graphs_on_cpu(monkeypatch):
    make_model, make_inputs = cases.make_model, cases.make_inputs
    monkeypatch.setattr(cases, "make_model",
                        lambda preset, spelling, dtype, device: make_model(preset, spelling, "fp32", "cpu"))
    monkeypatch.setattr(cases, "make_inputs", lambda preset, dtype, device: make_inputs(preset, "fp32", "cpu"))
    monkeypatch.setattr(step_graphs, "CudaGraphs", step_graphs_host.StubGraphs)
    monkeypatch.setattr(backend, "_whole_graph_captured", lambda opts, mode, inputs: mode == "reduce-overhead")
    monkeypatch.setattr(whole_graph, "capture", lambda gm, inputs: gm.forward)  # the trees: not on the CPU
    monkeypatch.setattr(triton.testing, "do_bench", _bench)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
