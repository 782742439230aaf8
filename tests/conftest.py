import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so tests can import numerics.py


@pytest.fixture
def bf16_dots(monkeypatch):
    """bf16 kernels under TRITON_INTERPRET=1: the interpreter's tl.dot takes bf16 operands by their
    values, and triton_region lets bf16 run the kernels on the CPU. Triton 3.6's interpreter keeps
    bf16 as its raw uint16 bits, converts them right in loads, stores and casts, but its create_dot
    multiplies the bits (triton-lang/triton#11584; the fix, #11585, was declined upstream): here
    bf16 operands are converted to fp32 first, as its cast path converts them (_convert_float).
    That is the one bf16 fault the fused path meets there (session 61: the tiny block's output and
    every gradient within 1.1e-2 of float64 with it, ~1e10 without)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from mha_compile.kernels import triton_region

    def values(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data.reshape(handle.data.shape), tl.float32)

    create_dot = interpreter.InterpreterBuilder.create_dot
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                        lambda self, a, b, *rest: create_dot(self, values(a), values(b), *rest))
    monkeypatch.setattr(triton_region, "BF16_UNDER_INTERPRETER", True)
