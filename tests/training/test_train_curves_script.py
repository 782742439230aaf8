"""bench/train_curves.py (the H200 script) end to end at tiny size on the CPU, and its curve check."""
import json
import math
import random
import types

import pytest

from bench import curve_check, train_curves


def test_script_runs_end_to_end_on_cpu(tmp_path):
    rc = train_curves.main(["--device", "cpu", "--kernels", "reference", "--preset", "tiny", "--steps", "60",
                            "--curves", "autocast,fp32", "--skip-suite", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "train_curves.json").read_text())
    curves = result["curves"]
    assert list(curves) == ["autocast", "fp32"]
    for name, curve in curves.items():
        assert curve["gated"] and curve["ok"], (name, curve["worst_smoothed_gap"])
        assert len(curve["eager"]) == len(curve["mha"]) == 60
        assert curve["kernels"] == ["reference"]
        assert len(curve["eager_twin"]) == 60 and curve["eager_twin"] != curve["eager"]
    assert rc == 0
    assert "| autocast | ['reference'] |" in (tmp_path / "train_curves.md").read_text()


def test_a_fallback_kernel_set_is_refused():
    report = types.SimpleNamespace(matches=[{"kernels": "reference", "kernels_reason": "mixed dtypes"}])
    assert train_curves.require_kernels([report], "reference") == ["reference"]
    with pytest.raises(RuntimeError, match="kernels='fused' was requested"):
        train_curves.require_kernels([report], "fused")


def test_curve_check_catches_a_systematic_gap():
    eager = [1.0 / (1 + 0.05 * i) for i in range(300)]
    assert curve_check.compare_curves(eager, [v * 1.01 for v in eager])["ok"]
    # A twin that rounding alone moved 15% away widens the bound to 30%, and no further.
    twin = curve_check.compare_curves(eager, [v * 1.15 for v in eager])
    assert curve_check.compare_curves(eager, [v * 1.2 for v in eager], twin)["ok"]
    assert not curve_check.compare_curves(eager, [v * 1.4 for v in eager], twin)["ok"]
    assert not curve_check.compare_curves(eager, [v * 1.2 for v in eager])["ok"]
    assert not curve_check.compare_curves(eager, [max(v, 0.1) for v in eager])["ok"]  # a plateau


def test_seed_check_catches_a_slower_learner_and_passes_noise():
    gen = random.Random(0)
    eager = [[(1.0 + 0.3 * gen.random()) / (1 + 0.05 * i) for i in range(300)] for _ in range(5)]
    noisy = [[v * math.exp(gen.gauss(0, 0.02)) for v in run] for run in eager]
    assert curve_check.compare_seeds(eager, noisy)["ok"]
    slower = [[v * 1.3 for v in run] for run in eager]  # every seed 30% above eager
    result = curve_check.compare_seeds(eager, slower)
    assert not result["ok"] and abs(result["final"]["ratio"] - 1.3) < 1e-9


def test_seeds_mode_runs_end_to_end_on_cpu(tmp_path):
    rc = train_curves.main(["--device", "cpu", "--kernels", "reference", "--preset", "tiny", "--steps", "60",
                            "--curves", "fp32", "--seeds", "2", "--skip-suite", "--out", str(tmp_path)])
    curve = json.loads((tmp_path / "train_curves.json").read_text())["curves"]["fp32"]
    assert rc == 0 and curve["ok"] is curve["seeds"]["ok"] is True
    assert len(curve["runs"]["mha"]) == len(curve["seeds"]["final"]["per_seed_ratio"]) == 2
    assert "Over 2 seeds" in (tmp_path / "train_curves.md").read_text()


def test_an_interrupted_run_keeps_what_finished(tmp_path, monkeypatch):
    """timeout -s INT on the GPU machine: the finished curves are written, the run fails."""
    original = train_curves.train_curve

    def stop_at_autocast(args, precision, *rest, **kwargs):
        if precision == "autocast":
            raise KeyboardInterrupt
        return original(args, precision, *rest, **kwargs)

    monkeypatch.setattr(train_curves, "train_curve", stop_at_autocast)
    rc = train_curves.main(["--device", "cpu", "--kernels", "reference", "--preset", "tiny", "--steps", "60",
                            "--curves", "fp32,autocast", "--skip-suite", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "train_curves.json").read_text())
    assert rc == 1 and result["interrupted"] is True and list(result["curves"]) == ["fp32"]
