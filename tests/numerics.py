"""Comparison helpers shared by the backend and lowering tests (SPEC §4), a call recorder, the
reports of the graphs the backend compiles, and the mark of tests that need Triton's interpreter."""
import contextlib
import os

import pytest
import torch

from mha_compile import backend

# kernels="fused" or "staged" on the CPU run Triton's kernels under its interpreter
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="kernels='fused' on CPU needs TRITON_INTERPRET=1")

# ‖got − ref‖ / ‖ref‖ bounds per dtype for whole-graph comparisons against eager.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def relative_error(got, ref):
    got, ref = got.detach().double(), ref.detach().double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def assert_close_rel(got, ref, dtype, what=""):
    error = relative_error(got, ref)
    assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.3g} > {TOLERANCE[dtype]:g}"


def graph_has_region(gm):
    return any(n.target is torch.ops.mha.region.default for n in gm.graph.nodes)


def record_calls(monkeypatch, module, name):
    """module.name wrapped for this test: each call's positional arguments appended to the returned
    list, then the real function called (with its keyword arguments too)."""
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args, **kwargs: calls.append(args) or real(*args, **kwargs))
    return calls


@contextlib.contextmanager
def observing(observe):
    """observe(report, captured gm, lowered gm) called for every graph the backend compiles inside
    the block (backend.observers)."""
    backend.observers.append(observe)
    try:
        yield
    finally:
        backend.observers.remove(observe)


@contextlib.contextmanager
def compiled_reports():
    """The GraphReport of every graph the backend compiles inside the block, in order."""
    reports = []
    with observing(lambda report, gm, lowered: reports.append(report)):
        yield reports
