"""Median times and peak memory of one step.

CUDA: triton.testing.do_bench (CUDA events, L2 flushed between runs, median). CPU: a plain
timer with warmup and the median of repeated calls, since a mean would carry the odd
scheduler hiccup into the table.
"""
import statistics
import time

import torch

# do_bench's warmup and rep are in milliseconds of GPU time, per measurement.
CUDA_WARMUP_MS, CUDA_REP_MS = 25, 100
CUDA_QUICK_WARMUP_MS, CUDA_QUICK_REP_MS = 10, 40
# CPU: warm up for at least CPU_WARMUP calls and CPU_WARMUP_SECONDS (lazy loading after a
# compile made the first calls of a tiny graph 100x slow once); then at least this many timed
# calls, and more until this much time has passed.
CPU_WARMUP, CPU_WARMUP_SECONDS = 2, 0.1
CPU_MIN_REPS, CPU_MAX_REPS, CPU_MIN_SECONDS = 5, 50, 0.5
CPU_QUICK_MIN_REPS, CPU_QUICK_MIN_SECONDS = 3, 0.1


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(step, device, quick=False, grad_to_none=None):
    """Median milliseconds of step(); grad_to_none: tensors whose .grad is cleared before each call."""
    if torch.device(device).type == "cuda":
        import triton.testing

        warmup, rep = (CUDA_QUICK_WARMUP_MS, CUDA_QUICK_REP_MS) if quick else (CUDA_WARMUP_MS, CUDA_REP_MS)
        return float(triton.testing.do_bench(step, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                                             return_mode="median"))
    min_reps, min_seconds = (CPU_QUICK_MIN_REPS, CPU_QUICK_MIN_SECONDS) if quick else (CPU_MIN_REPS, CPU_MIN_SECONDS)
    warmup_end, calls = time.perf_counter() + CPU_WARMUP_SECONDS, 0
    while calls < CPU_WARMUP or time.perf_counter() < warmup_end:
        _clear_grads(grad_to_none)
        step()
        calls += 1
    times = []
    while len(times) < min_reps or (sum(times) < min_seconds and len(times) < CPU_MAX_REPS):
        _clear_grads(grad_to_none)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _clear_grads(tensors):
    for t in tensors or ():
        t.grad = None


# host_probe_ms' loop: ~2-4 ms of pure Python on a 2020s core, no torch call in it
PROBE_RANGE, PROBE_REPS = 100_000, 5


def host_probe_ms():
    """The median milliseconds of a fixed pure-Python loop: the host's speed for one thread just
    now. Taken beside each row, it tells a slow host (every row's probe up) from a slow process
    (a host-bound row slow beside an ordinary probe: bench/PERF_NOTES.md v44)."""
    times = []
    for _ in range(PROBE_REPS):
        start = time.perf_counter()
        sum(range(PROBE_RANGE))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def timed_call(step, device):
    """(result, seconds) of one call, synchronised: the first call of a compiled mode is its compile time."""
    synchronize(device)
    start = time.perf_counter()
    result = step()
    synchronize(device)
    return result, time.perf_counter() - start


def peak_memory_call(step, device):
    """(result, peak MiB, peak above what was allocated before the call MiB, graph pools MiB);
    None on the CPU. The peak counts the memory CUDA-graph pools hold beside their live tensors
    (see graph_pool_held): a replay writes there, so it is the step's as much as any allocation."""
    if torch.device(device).type != "cuda":
        return step(), None, None, None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = step()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    held = graph_pool_held(device)
    return result, (peak + held) / 2**20, (peak - before) / 2**20, held / 2**20


def graph_pool_held(device):
    """Bytes that CUDA-graph private pools hold and max_memory_allocated does not count: a
    graph's intermediates are freed at capture's end but stay the pool's, and each replay
    writes them again. (Live tensors in a pool are counted as allocated already.)"""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    return sum(s["total_size"] - s["allocated_size"] for s in torch.cuda.memory_snapshot()
               if s["device"] == index and tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))
