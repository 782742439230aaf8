"""bench/gluon_slots_probe.py without a GPU (its kernel is staged, not yet run on one): it compiles
for the H200 as a warp-specialised kernel under every config, for GEMM2's B and ∂x's transposed
one, and its fp32 yardstick is triton_moe.slots_gemm's contract (run in the interpreter)."""
import os
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import gluon_slots_probe  # noqa: E402
from offline_rows import offline_rows  # noqa: E402

from mha_compile.kernels import triton_moe as moe  # noqa: E402


def test_compiles_warp_specialised_for_sm90():
    rows = offline_rows(gluon_slots_probe.__file__)
    assert [(r["b_t"], r["config"]) for r in rows] == [(b_t, cfg) for b_t in (False, True)
                                                       for cfg in gluon_slots_probe.CONFIGS]
    for r in rows:
        assert r["wgmma"] > 0 and r["setmaxnreg"] > 0, r
        assert r["smem"] <= 232448, r


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="triton_moe on the CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("b_t", [False, True], ids=["GEMM2", "dx"])
def test_reference_is_slots_gemm(b_t):
    torch.manual_seed(1)
    E, K, N = 3, 40, 24
    index = torch.randint(0, E, (90, 2), dtype=torch.int32)
    index[:, 1] = (index[:, 0] + 1) % E
    groups = moe.group(index, E)
    a = torch.randn(groups.slots, K)
    b = torch.randn(E, N, K) if b_t else torch.randn(E, K, N)
    bias, scale = (None, None) if b_t else (torch.randn(E, N), torch.rand(180))
    strides = (N * K, 1, K) if b_t else (K * N, N, 1)
    want = gluon_slots_probe.reference(a, b, groups, b_t, bias, scale)
    got = moe.slots_gemm(a, b, strides, N, groups, bias=bias, scale=scale)
    assert (groups.slot_pair >= groups.pairs).any()
    assert float((got - want).norm() / want.norm()) < 1e-5
