"""bench/flag_ab.py on the CPU: it takes only a bool attribute a module reads at launch time, and
says which and why before it touches a GPU."""
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import flag_ab  # noqa: E402


@pytest.mark.parametrize("flag,why", [
    ("mha_compile.kernels.gluon_moe:STREAM_EXPERTS",
     "mha_compile.kernels.gluon_moe.STREAM_EXPERTS is not a bool attribute"),
    ("mha_compile.kernels.gluon_moe:NO_SUCH_FLAG", "mha_compile.kernels.gluon_moe has no attribute NO_SUCH_FLAG")])
def test_a_flag_that_is_not_a_bool_is_refused(monkeypatch, flag, why):
    monkeypatch.setattr(sys, "argv", ["flag_ab.py", "--flag", flag])
    with pytest.raises(SystemExit, match=f"--flag {flag}: {why}"):
        flag_ab.main()


def test_the_stream_schedule_is_a_flag_it_takes():
    from mha_compile.kernels import gluon_moe
    assert isinstance(gluon_moe.WGRAD_STREAM, bool)  # what its docstring's command flips


def test_the_summary_gives_each_order_and_says_when_they_disagree():
    """Rounds alternate which graph is timed first; session 26's had one graph slower whenever it
    ran second. The line gives both orders' medians and, when they disagree, the smaller."""
    off = [5.83, 6.25, 5.88, 6.12, 5.90, 6.02, 5.95, 5.93]
    on = [5.81, 5.82, 5.83, 5.83, 5.80, 5.92, 5.83, 5.93]
    line = flag_ab.summary(off, on)
    assert "on − off -100.0 us (off timed first -75.0, on first -195.0)" in line
    assert line.endswith("the orders disagree: read -75.0 us")
    steady = flag_ab.summary([1.0, 1.0, 1.0, 1.0], [0.99, 0.99, 0.99, 0.99])
    assert "-10.0 us (off timed first -10.0, on first -10.0)" in steady and "disagree" not in steady


def test_a_number_takes_two_values_in_its_type():
    """SLOT_CHUNK_BYTES (an int) against a smaller run size; a bool keeps False, True, and so does a
    switch left to choose by itself (None: triton_pool.SINGLE_PASS's default)."""
    flag = "mha_compile.kernels.triton_moe:SLOT_CHUNK_BYTES"
    assert flag_ab.flag_values(flag, 512 << 20, "536870912,67108864") == (536870912, 67108864)
    assert flag_ab.flag_values("m:FLAG", True, None) == (False, True)
    assert flag_ab.flag_values("m:FLAG", None, None) == (False, True)
    with pytest.raises(SystemExit, match="is not a bool attribute \\(a number takes --values A,B\\)"):
        flag_ab.flag_values(flag, 512 << 20, None)
    for bad in ("536870912", "1,2,3", "64MiB,32MiB"):
        with pytest.raises(SystemExit, match=f"--values {bad}: expected two int values A,B for "
                                             "mha_compile.kernels.triton_moe.SLOT_CHUNK_BYTES"):
            flag_ab.flag_values(flag, 512 << 20, bad)
    with pytest.raises(SystemExit, match="--values 1,2: m.FLAG is bool, not an int or float attribute"):
        flag_ab.flag_values("m:FLAG", True, "1,2")
