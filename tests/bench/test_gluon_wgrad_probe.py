"""bench/gluon_wgrad_probe.py without a GPU: its kernel compiles
for the H200 as a warp-specialised kernel under every config it probes, and its fp32 yardstick is
triton_moe.weight_grads' contract (run in the interpreter)."""
import os
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import gluon_wgrad_probe  # noqa: E402
from offline_rows import offline_rows  # noqa: E402

from mha_compile.kernels import triton_moe as moe  # noqa: E402


def test_compiles_warp_specialised_for_sm90():
    rows = offline_rows(gluon_wgrad_probe.__file__)
    first = gluon_wgrad_probe.CONFIGS[0]
    assert [r["config"] for r in rows] == gluon_wgrad_probe.CONFIGS + [dict(first, out="fp32"),
                                                                       dict(first, out="fp32", stream=True)]
    for r in rows:
        assert r["wgmma"] > 0 and r["setmaxnreg"] > 0, r
        assert r["smem"] <= 232448, r
        # ptxas did not serialise the wgmmas (C7515: a non-wgmma write to an accumulator in flight)
        assert not r["wgmma_serialized"], r


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="triton_moe on the CPU needs TRITON_INTERPRET=1")
def test_reference_is_weight_grads():
    torch.manual_seed(0)
    index = torch.randint(0, 3, (200, 2), dtype=torch.int32)
    index[:, 1] = (index[:, 0] + 1) % 3
    groups = moe.group(index, 4)  # expert 3 has no slots
    a = torch.randn(groups.slots, 48) * (groups.slot_pair < groups.pairs)[:, None]
    b = torch.randn(groups.slots, 40) * (groups.slot_pair < groups.pairs)[:, None]
    want = gluon_wgrad_probe.reference(a, b, groups)
    got = moe.weight_grads(a, b, None, groups)[0]
    assert float(want[3].abs().max()) == 0.0
    assert float((got - want).norm() / want.norm()) < 1e-5
