"""bench/gemm_probe.py on the CPU (TRITON_INTERPRET=1, tiny preset): every kernel under every
config it probes launches through the real launchers and the probe restores them after, and
where gluon_moe's kernels would take a call (on an H200) the probe still times the Triton one."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import gemm_probe  # noqa: E402

from mha_compile.kernels import gluon_moe, triton_moe  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the probe's kernels on the CPU need TRITON_INTERPRET=1")


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_every_probe_variant_runs_and_launchers_are_restored():
    launchers = [triton_moe._up, triton_moe._slots_gemm, triton_moe._hidden, triton_moe._wgrad, triton_moe._tile_sums]
    before = [(l.kernel, l.configs, l.tuned) for l in launchers]
    rows = []
    gemm_probe.probe("tiny", "gelu", rows, ["up", "slots", "hidden", "wgrad"])
    assert [(l.kernel, l.configs, l.tuned) for l in launchers] == before
    assert {r["kernel"] for r in rows} == {"up", "slots", "hidden", "wgrad"}
    failed = [(r["kernel"], r["variant"], r["config"], r["error"]) for r in rows if "error" in r]
    assert not failed, failed
    # each kernel's whole config list is among what it probes
    for name, launcher in zip(("up", "slots", "hidden", "wgrad"), launchers):
        probed = [r["config"] for r in rows if r["kernel"] == name]
        assert all(cfg in probed for cfg in launcher.configs), name
    sums = [r["config"] for r in rows if r["variant"] == "db1 sums"]
    assert sums == triton_moe._tile_sums.configs


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_the_triton_rows_run_triton_where_gluon_would_take_them(monkeypatch):
    """As on an H200, where gluon_moe takes GEMM2 and the whole layout's weight gradients (unless
    switched off): the probe's rows of those configs must not time the Gluon kernels."""
    off = lambda *args, **kwargs: None if gluon_moe.ENABLED else "MHA_COMPILE_GLUON=0"  # noqa: E731
    monkeypatch.setattr(gluon_moe, "slots_unsupported", off)
    monkeypatch.setattr(gluon_moe, "wgrad_unsupported", off)
    monkeypatch.setattr(triton_moe, "_GLUON_LAUNCHED", set())
    monkeypatch.setattr(triton_moe, "_GLUON_FAILED", {})
    ran = []
    monkeypatch.setattr(gluon_moe, "slots_gemm", lambda *args, **kwargs: ran.append("GEMM2"))
    monkeypatch.setattr(gluon_moe, "weight_grads", lambda *args, **kwargs: ran.append("wgrad"))
    monkeypatch.setattr(triton_moe, "wgrad_splits", lambda *args: 1)  # the large preset's: no split
    assert triton_moe.gemm2_kernel(*[torch.empty(8, 8)] * 3, None, None, 64) == "gluon"  # the setting holds
    rows = []
    gemm_probe.probe("tiny", "gelu", rows, ["slots", "wgrad"])
    assert ran == [] and not [r for r in rows if "error" in r]
    assert gluon_moe.ENABLED


def test_a_variant_starts_from_no_chosen_config():
    """On the GPU a Launcher launches the config it chose before for a call it met before (its
    _chosen cache, keyed by the kernel's id among the rest), and a variant's recorder can take the
    id of the last one's: each variant runs with an empty cache, and the launcher's own comes back
    after."""
    launcher = triton_moe._hidden
    mine = {("a call",): ("a config", None)}
    seen = []
    saved = launcher._chosen
    launcher._chosen = mine
    try:
        gemm_probe.variant(launcher, launcher.configs[0], lambda: seen.append(dict(launcher._chosen)))
        assert seen == [{}]
        assert launcher._chosen is mine
    finally:
        launcher._chosen = saved
