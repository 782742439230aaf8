"""bench/host_timers.py without a GPU: every function it times exists where it patches it (a
rename in the package fails here, not on the H200), and a timed function still returns its
result, re-raises, and counts each call."""
import os
import sys
import types

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import host_timers  # noqa: E402


@pytest.mark.parametrize("owner, name", host_timers.TIMED,
                         ids=[f"{getattr(o, '__name__', o)}.{n}" for o, n in host_timers.TIMED])
def test_every_timed_function_exists(owner, name):
    assert callable(getattr(owner, name))


def test_a_timed_function_keeps_its_behaviour():
    class Owner:
        @staticmethod
        def twice(x):
            if x is None:
                raise ValueError("none")
            return 2 * x

    module = types.SimpleNamespace(__name__="mod", add=lambda a, b: a + b)
    timers = host_timers.Timers()
    timers.wrap(Owner, "twice")
    timers.wrap(module, "add")
    assert Owner.twice(3) == 6 and Owner().twice(4) == 8 and module.add(1, 2) == 3
    with pytest.raises(ValueError):
        Owner.twice(None)
    assert timers.calls["Owner.twice"] == 3 and timers.calls["mod.add"] == 1
    assert timers.total["Owner.twice"] >= 0
