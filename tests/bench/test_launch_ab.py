"""bench/launch_ab.py on the CPU: it says it needs a GPU rather than timing nothing, and the
switches it flips are ones triton_util.launch reads."""
import os
import sys

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)
import launch_ab  # noqa: E402


def test_the_switches_are_the_launches_flags():
    assert all(isinstance(getattr(launch_ab.triton_util, flag), bool) for flag in launch_ab.FLAGS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_without_a_gpu_it_says_so(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["launch_ab.py", "--preset", "tiny"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        launch_ab.main()
