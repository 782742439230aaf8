"""bench/pool_op_host.py: both ways of calling the pool timed, every round, with positive times."""
from bench import pool_op_host


def test_both_ways_are_timed_every_round(capsys):
    result = pool_op_host.timings(rounds=2, calls=2, repeats=2)
    assert set(result) == {"op", "function"} and all(len(v) == 2 and min(v) > 0 for v in result.values())
    assert pool_op_host.main(["--rounds", "1", "--calls", "2"]) == 0
    assert "us a forward+backward" in capsys.readouterr().out
