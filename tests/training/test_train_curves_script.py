"""bench/train_curves.py (the H200 script) end to end at tiny size on the CPU, and its curve check."""
import json

from bench import train_curves


def test_script_runs_end_to_end_on_cpu(tmp_path):
    rc = train_curves.main(["--device", "cpu", "--kernels", "reference", "--preset", "tiny", "--steps", "60",
                            "--skip-suite", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "train_curves.json").read_text())
    assert rc == 0 and result["curve"]["ok"], result["curve"]["worst_smoothed_gap"]
    assert len(result["curve"]["eager"]) == len(result["curve"]["mha"]) == 60
    assert (tmp_path / "train_curves.md").exists()


def test_curve_check_catches_a_systematic_gap():
    eager = [1.0 / (1 + 0.05 * i) for i in range(300)]
    assert train_curves.compare_curves(eager, [v * 1.01 for v in eager])["ok"]
    assert not train_curves.compare_curves(eager, [v * 1.2 for v in eager])["ok"]
    assert not train_curves.compare_curves(eager, [max(v, 0.1) for v in eager])["ok"]  # a plateau
