"""Helpers for the training tests: count what the backend replaced, compare models."""
import contextlib

from numerics import observing


@contextlib.contextmanager
def region_matches():
    """Yields a list that receives, per graph the backend compiles, how many regions it replaced.

    A training test whose graph was not rewritten compares eager with eager and proves nothing,
    so every test that claims "through the compiled path" checks this list.
    """
    counts = []
    with observing(lambda report, gm, lowered: counts.append(len(report.matches))):
        yield counts
