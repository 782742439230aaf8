"""bench/step_ab.py on the CPU: each tree's step runs in a process of its own that imports that
tree's mha_compile, and a tree whose step fails says so with its error."""
import os
import shutil
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import step_ab  # noqa: E402


def _copy_tree(dest):
    for name in ("mha_compile", "bench"):
        shutil.copytree(os.path.join(ROOT, name), dest / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
    return str(dest)


def test_each_tree_is_timed_from_its_own_package(tmp_path):
    other = _copy_tree(tmp_path / "other")
    times = step_ab.compare([ROOT, other], "tiny", 1, {"graphs": "off"}, "cpu")
    assert list(times) == [ROOT, other]
    assert all(len(t) == 1 and t[0] > 0 for t in times.values())


def test_a_failing_tree_raises_with_its_error(tmp_path):
    broken = _copy_tree(tmp_path / "broken")
    with open(os.path.join(broken, "mha_compile", "__init__.py"), "a") as f:
        f.write("\nraise ImportError('this tree is broken on purpose')\n")
    with pytest.raises(RuntimeError, match="broken on purpose"):
        step_ab.run_step(broken, "tiny", {}, "cpu")


def test_options_are_key_value_pairs():
    assert step_ab.parse_options(["graphs=off", "kernels=fused"]) == {"graphs": "off", "kernels": "fused"}
    with pytest.raises(SystemExit, match="key=value"):
        step_ab.parse_options(["graphs"])
