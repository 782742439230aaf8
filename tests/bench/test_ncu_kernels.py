"""bench/ncu_kernels.py on the CPU (TRITON_INTERPRET=1): the step it hands to Nsight Compute runs
(tiny preset) and gives every gradient the block has."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import ncu_kernels  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the fused kernels on the CPU need TRITON_INTERPRET=1")


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_the_profiled_step_runs(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ncu_kernels.py"])
    grads = ncu_kernels.main()
    args, _, _ = ncu_kernels.step_inputs("tiny", "cpu", ncu_kernels.torch.float32)
    # a gradient for ctx, tok and every parameter the block has (None only where it has none)
    assert [g is None for g in grads[:len(args) - 1]] == [a is None for a in args[:-1]]
