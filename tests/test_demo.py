"""`make demo` checks what it shows (a review's: with the training compile's rewrite switched off,
it printed the same story, a loss gap of 0, and exited 0): a region replaced in what it trains
and in each block it times, and the compiled losses within LOSS_GAP of eager's."""
import time

import pytest
import torch

from mha_compile import backend, demo


def test_the_demo_trains_and_times_the_replaced_region(capsys, monkeypatch):
    """The table times one thread's CPU time (wall time on a shared machine read 0.46x and 43x for one
    row in two runs, a review's) and gives the caller's thread count back."""
    threads, clocks = torch.get_num_threads(), set()
    timed = demo.median_ms
    monkeypatch.setattr(demo, "median_ms", lambda fn, repeats, clock=None: (
        clocks.add((clock, torch.get_num_threads())), timed(fn, repeats, clock))[1])
    demo.train(3)
    demo.speed_table("tiny", repeats=1)
    out = capsys.readouterr().out
    assert "largest relative gap to eager" in out and "speedup" in out and "CPU time of one thread" in out
    assert clocks == {(time.process_time, 1)} and torch.get_num_threads() == threads


@pytest.mark.parametrize("part", ["train", "speed"])
def test_the_demo_fails_where_the_compile_replaced_nothing(monkeypatch, part):
    monkeypatch.setattr(backend, "lower", lambda gm, *args: gm)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="replaced no region"):
        demo.train(2) if part == "train" else demo.speed_table("tiny", repeats=1)


def test_the_demo_fails_where_the_losses_part(monkeypatch):
    monkeypatch.setattr(demo, "LOSS_GAP", -1.0)  # every gap, 0 included, is past it
    torch._dynamo.reset()
    with pytest.raises(SystemExit, match="left eager's"):
        demo.train(3)
