"""Helpers for the training tests: count what the backend replaced, compare models."""
import contextlib

from mha_compile import backend


@contextlib.contextmanager
def region_matches():
    """Yields a list that receives, per graph the backend compiles, how many regions it replaced.

    A training test whose graph was not rewritten compares eager with eager and proves nothing,
    so every test that claims "through the compiled path" checks this list.
    """
    counts = []
    observe = lambda report, gm, lowered: counts.append(len(report.matches))
    backend.observers.append(observe)
    try:
        yield counts
    finally:
        backend.observers.remove(observe)
