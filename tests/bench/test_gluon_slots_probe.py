"""bench/gluon_slots_probe.py without a GPU: the forward's GEMM2 (gluon_moe.slots_gemm, the live
kernel: each build it ships, without spills, and the probe's other configs) and the probe's own
kernel (∂x's transposed B, GEMM1's gelu epilogue) compile for the H200 as warp-specialised kernels,
and the probe's fp32 yardstick is triton_moe's contract (slots_gemm and experts_up, run in the
interpreter)."""
import os
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import gluon_slots_probe  # noqa: E402
from offline_rows import offline_rows  # noqa: E402

from mha_compile.kernels import gluon_moe  # noqa: E402
from mha_compile.kernels import triton_moe as moe  # noqa: E402


def test_compiles_warp_specialised_for_sm90():
    rows = offline_rows(gluon_slots_probe.__file__)
    shipped = gluon_slots_probe.GEMM2_SHIPPED
    assert [(r["mode"], r["config"]) for r in rows] == (
        [(0, cfg) for cfg in gluon_slots_probe.gemm2_configs()]
        + [(mode, cfg) for mode in (1, 2) for cfg in gluon_slots_probe.CONFIGS])
    # what the forward runs: each TILE it takes, at both column blocks, in its config
    assert sorted((cfg["tile"], cfg["block_n"]) for cfg in shipped) == [(64, 64), (64, 128), (128, 128), (128, 256)]
    assert gluon_moe.SLOTS_TILES == (64, 128)
    assert all(cfg["block_k"] == gluon_moe.SLOTS_BK and cfg["nbuf"] == gluon_moe.SLOTS_NBUF for cfg in shipped)
    for r in rows:
        assert r["wgmma"] > 0 and r["setmaxnreg"] > 0, r
        assert r["smem"] <= 232448, r
        # ptxas did not serialise the wgmmas (C7515: a non-wgmma write to an accumulator in flight)
        assert not r["wgmma_serialized"], r
        if r["mode"] == 0 and r["config"] in shipped:
            assert r["spill_bytes"] == 0, r  # the accumulator and epilogue fit the consumers' registers


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


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="triton_moe on the CPU needs TRITON_INTERPRET=1")
def test_reference_with_gelu_is_experts_up():
    torch.manual_seed(2)
    E, K, N = 3, 32, 48
    index = torch.randint(0, E, (90, 2), dtype=torch.int32)
    index[:, 1] = (index[:, 0] + 2) % E
    groups = moe.group(index, E)
    xs = torch.randn(groups.slots, K) * (groups.slot_pair < groups.pairs)[:, None]
    w1, b1 = torch.randn(E, K, N) * K ** -0.5, torch.randn(E, N)
    want = gluon_slots_probe.reference(xs, w1, groups, bias=b1, gelu=True)
    got = moe.experts_up(xs, groups, w1, b1, None, "gelu")
    valid = groups.slot_pair < groups.pairs
    assert (want[~valid] == 0).all()  # the reference's padding rows; GEMM1's hold act(b1), not read
    assert float((got[valid] - want[valid]).norm() / want.norm()) < 1e-5
