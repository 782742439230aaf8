"""bench/gluon_up_probe.py without a GPU: the Gluon kernel compiles for the H200 as a warp-
specialised kernel under every config it probes, and its fp32 yardstick is GEMM1's contract."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import gluon_up_probe  # noqa: E402
import gemm_probe  # noqa: E402

from mha_compile.kernels import triton_moe  # noqa: E402


def test_compiles_warp_specialised_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.abspath(ROOT)
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gluon_up_probe.py"), "--offline"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["config"] for r in rows] == gluon_up_probe.CONFIGS
    for r in rows:
        assert r["wgmma"] > 0 and r["setmaxnreg"] > 0, r  # tensor-core dots, and partitions with their registers
        assert r["smem"] <= 232448, r  # what one block may use on the H200


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="experts_up on the CPU needs TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_reference_is_experts_up():
    """The probe's yardstick (fp32, expert by expert) against the shipped GEMM1 (interpreter, fp32):
    the bias, the gelu and zero rows on padding slots."""
    c = gemm_probe.slot_case("tiny", "gelu")
    want = gluon_up_probe.reference(c)
    got = triton_moe.experts_up(c.xs, c.groups, c.w1, c.b1, None, "gelu")
    assert (c.groups.slot_pair >= c.groups.pairs).any()  # padding slots are in the case
    assert float((got - want).norm() / want.norm()) < 1e-5
