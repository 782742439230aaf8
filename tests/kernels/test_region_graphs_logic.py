"""region_graphs.call's bookkeeping on the CPU, with CUDA's graph API replaced by a stand-in.

The stand-in graph records, while "capturing", each call of the test kernel with the tensors it
read and wrote; its replay runs them again, reading those same tensor objects and writing into
the same outputs, which is what a CUDA graph does with addresses. So these tests check what
call() adds around a graph: the first call eager, copies into the static inputs, arguments read
in place and captured again when they move, fresh outputs, the signature key, the bound on
graphs kept, and the eager fallback when a capture fails. The real capture and replay are
tested on the GPU (test_region_graphs_cuda.py).
"""
import contextlib

import pytest
import torch

from mha_compile.kernels import region_graphs


class _Capture:
    active = None


class FakeGraph:
    def __init__(self):
        self.work = []

    def replay(self):
        for kernel, inputs, outputs in self.work:
            for out, new in zip(outputs, kernel.compute(*inputs)):
                out.copy_(new)


@contextlib.contextmanager
def _fake_capture(graph, **_):
    _Capture.active = graph
    try:
        yield
    finally:
        _Capture.active = None


class _Stream:
    current = None  # what torch.cuda.current_stream() returns

    def __init__(self):
        self.waited_for = []

    def wait_stream(self, other):
        self.waited_for.append(other)


class Kernel:
    """out = (x · scale + Σ w, Σ_j x[:, j]); counts eager runs, records captured ones."""

    def __init__(self, fail_capture=False):
        self.eager_runs = 0
        self.fail_capture = fail_capture

    @staticmethod
    def compute(x, w, scale):
        return x * scale + w.sum(), x.sum(1)

    def __call__(self, x, w, scale):
        out = self.compute(x, w, scale)
        if _Capture.active is None:
            self.eager_runs += 1
            return out
        if self.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing")
        _Capture.active.work.append((self, (x, w, scale), out))
        return out


@pytest.fixture(autouse=True)
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream())
    _Stream.current = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream.current)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    region_graphs.clear()
    yield
    region_graphs.clear()


def _args(seed, w=None):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen) if w is None else w]


def _expected(args, scale=2.0):
    return Kernel.compute(*args, scale)


def _assert_equal(got, want):
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_first_call_eager_second_captured_then_replayed_on_fresh_inputs():
    kernel, w = Kernel(), torch.randn(4)
    results = [region_graphs.call(kernel, _args(seed, w), (2.0,)) for seed in range(5)]
    for seed, got in enumerate(results):
        _assert_equal(got, _expected(_args(seed, w)))
    # eager: the first call and the capture's warm-up; the rest were replays
    assert kernel.eager_runs == 2 and region_graphs.graphs_held() == 1


def test_outputs_are_fresh_memory_every_call():
    kernel, w = Kernel(), torch.randn(4)
    first = [region_graphs.call(kernel, _args(seed, w), (2.0,)) for seed in range(3)]
    later = region_graphs.call(kernel, _args(3, w), (2.0,))
    pointers = {t.data_ptr() for out in first[1:] + [later] for t in out}
    assert len(pointers) == 2 * 3, "a replay returned memory another call also returned"
    first[2][0].fill_(7.0)  # a caller writing into its output must not reach the next call
    _assert_equal(region_graphs.call(kernel, _args(4, w), (2.0,)), _expected(_args(4, w)))


def test_an_argument_read_in_place_is_read_where_it_now_is():
    kernel, w = Kernel(), torch.randn(4)
    for seed in range(3):  # w had the same address twice: read in place
        region_graphs.call(kernel, _args(seed, w), (2.0,))
    with torch.no_grad():
        w.mul_(3.0)  # new values at the same address: seen by the replay
    _assert_equal(region_graphs.call(kernel, _args(3, w), (2.0,)), _expected(_args(3, w)))
    moved = w.clone() + 1.0  # another address: captured again, with w copied from then on
    runs = kernel.eager_runs
    _assert_equal(region_graphs.call(kernel, _args(4, moved), (2.0,)), _expected(_args(4, moved)))
    assert kernel.eager_runs == runs + 1, "the moved argument should have caused one new capture"
    other = moved.clone() - 2.0  # copied now: no further capture
    _assert_equal(region_graphs.call(kernel, _args(5, other), (2.0,)), _expected(_args(5, other)))
    assert kernel.eager_runs == runs + 1


def test_signatures_and_statics_are_graphs_of_their_own_and_bounded(monkeypatch):
    monkeypatch.setattr(region_graphs, "MAX_GRAPHS", 2)
    kernel, w = Kernel(), torch.randn(4)
    for scale in (1.0, 2.0, 3.0):
        for seed in range(3):
            got = region_graphs.call(kernel, _args(seed, w), (scale,))
            _assert_equal(got, _expected(_args(seed, w), scale))
    assert region_graphs.graphs_held() == 2


def test_inference_mode_is_part_of_the_signature():
    kernel, w = Kernel(), torch.randn(4)
    with torch.inference_mode():
        for seed in range(3):
            region_graphs.call(kernel, _args(seed, w), (2.0,))
    for seed in range(3):  # static inputs made in inference mode could not be copied into here
        _assert_equal(region_graphs.call(kernel, _args(seed, w), (2.0,)), _expected(_args(seed, w)))
    assert region_graphs.graphs_held() == 2


def test_a_failed_capture_runs_eagerly_with_a_warning(caplog):
    kernel, w = Kernel(fail_capture=True), torch.randn(4)
    with caplog.at_level("WARNING", logger="mha_compile"):
        results = [region_graphs.call(kernel, _args(seed, w), (2.0,)) for seed in range(4)]
    for seed, got in enumerate(results):
        _assert_equal(got, _expected(_args(seed, w)))
    assert "capturing the region as a CUDA graph failed" in caplog.text
    assert region_graphs.graphs_held() == 0


def test_a_replay_on_another_stream_waits_for_the_devices_last_replay():
    """The graphs share one pool: the forward's replay and the backward's must not overlap,
    whichever graph ran last."""
    forward, backward, w = Kernel(), Kernel(), torch.randn(4)
    for seed in range(3):
        region_graphs.call(forward, _args(seed, w), (2.0,))
        region_graphs.call(backward, _args(seed, w), (1.0,))
    first = _Stream.current
    _Stream.current = other = _Stream()
    region_graphs.call(backward, _args(3, w), (1.0,))  # last replayed on `first`, by either graph
    assert first in other.waited_for
    waits = len(first.waited_for)
    _Stream.current = first
    region_graphs.call(forward, _args(4, w), (2.0,))
    assert other in first.waited_for[waits:]


@pytest.mark.parametrize("alone_bytes", [1 << 20, 40])
def test_copies_of_mixed_dtypes_and_layouts_land_each_in_its_own(monkeypatch, alone_bytes):
    """The copies in and out are grouped by dtype and layout (one _foreach_copy_ a group), those of
    COPY_ALONE_BYTES or more copied alone (at 40 bytes here, some of each): each destination still
    gets its own source, whatever the mix."""
    monkeypatch.setattr(region_graphs, "COPY_ALONE_BYTES", alone_bytes)
    gen = torch.Generator().manual_seed(7)
    srcs = [torch.randn(4, 3, generator=gen), torch.randint(0, 9, (5,), generator=gen, dtype=torch.int32),
            torch.randn(3, 4, generator=gen).to(torch.bfloat16), torch.randn(2, 6, generator=gen),
            torch.randn(6, 2, generator=gen).t(), torch.randint(0, 9, (2, 2), generator=gen, dtype=torch.int32)]
    dsts = [torch.full_like(s, 0, memory_format=torch.contiguous_format) for s in srcs]
    region_graphs.copy_pairs(list(zip(dsts, srcs)))
    assert all(d.dtype == s.dtype and torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_replays_copy_mixed_dtype_arguments_and_outputs():
    """A kernel whose arguments and outputs mix fp32, int32 and bf16: replays on fresh inputs give
    the eager results, each output in its own dtype."""
    def kernel(x, idx, h):
        out = (x * 2 + idx.float().sum(), idx + 1, h * 3)
        if _Capture.active is not None:
            _Capture.active.work.append((_Mixed, (x, idx, h), out))
        return out

    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        args = [torch.randn(5, 3, generator=gen), torch.randint(0, 9, (4,), generator=gen, dtype=torch.int32),
                torch.randn(2, 2, generator=gen).to(torch.bfloat16)]
        got = region_graphs.call(kernel, args, ())
        want = _Mixed.compute(*args)
        assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))
    assert region_graphs.graphs_held() == 1


class _Mixed:
    @staticmethod
    def compute(x, idx, h):
        return x * 2 + idx.float().sum(), idx + 1, h * 3
