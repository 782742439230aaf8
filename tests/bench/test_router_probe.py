"""bench/router_probe.py without a GPU: its case is what the backward passes the kernels, and the
configs it sweeps change the blocking only, not the result (run in the interpreter)."""
import os
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import router_probe  # noqa: E402

from mha_compile.kernels import triton_router  # noqa: E402


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels on the CPU need TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_backward_rows_run_every_config_to_the_same_result(capsys):
    """The probe's case is what the backward passes the kernels (∂x_slot and the ∂w partials not
    all zero), and its rows: one a config of either pass, none failed, each within fp32 rounding
    of the first configs' outputs (bf16's ∂y may differ by one rounding on the GPU; the
    interpreter's case is fp32)."""
    c, inputs, traffic = router_probe.case("tiny", torch.float32, "cpu")
    probs, wg, weight, index, pair_slot, dx_slot, gw_part, H, renorm, dt, precision, sum_h = inputs
    assert traffic > c.x.numel() * 4 and (gw_part != 0).any() and (dx_slot != 0).any()
    assert probs.shape == (c.x.shape[0], wg.shape[0]) and sum_h
    router_probe.backward(inputs, traffic)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("backward")]
    assert len(rows) == len(triton_router._dlogits.configs) + len(triton_router._combine_dy.configs)
    assert not [line for line in rows if "FAILED" in line]
    assert all(float(line.rsplit("max diff ", 1)[1]) <= 1e-6 for line in rows), rows
