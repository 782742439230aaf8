"""bench/flag_ab.py on the CPU: it takes only a bool attribute a module reads at launch time, and
says which and why before it touches a GPU."""
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import flag_ab  # noqa: E402


@pytest.mark.parametrize("flag", ["mha_compile.kernels.gluon_moe:STREAM_EXPERTS",
                                  "mha_compile.kernels.gluon_moe:NO_SUCH_FLAG"])
def test_a_flag_that_is_not_a_bool_is_refused(monkeypatch, flag):
    monkeypatch.setattr(sys, "argv", ["flag_ab.py", "--flag", flag])
    with pytest.raises(SystemExit, match=f"--flag {flag}: mha_compile.kernels.gluon_moe.{flag.split(':')[1]} "
                                         "is not a bool attribute"):
        flag_ab.main()


def test_the_stream_schedule_is_a_flag_it_takes():
    from mha_compile.kernels import gluon_moe
    assert isinstance(gluon_moe.WGRAD_STREAM, bool)  # what its docstring's command flips
