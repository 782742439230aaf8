"""bench/tma_probe.py on the CPU (TRITON_INTERPRET=1, tiny preset): every variant runs, and the
TMA kernel computes GEMM1 (against the shipped kernel) and g = gs W2ᵀ (against torch)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import tma_probe  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the probe's kernels on the CPU need TRITON_INTERPRET=1")


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_every_variant_runs_and_matches():
    rows = tma_probe.probe("tiny", "gelu")
    assert not [r for r in rows if "error" in r]
    checked = [r for r in rows if r["diff"] is not None]
    assert {r["variant"].split()[0] for r in checked} == {"up", "g"}
    assert all(r["diff"] <= 1e-4 for r in checked), checked
