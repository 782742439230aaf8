"""bench/kernel_times.py on the CPU: the profile's table of torch's own kernels keeps the aten ops
with GPU time of their own, grouped by input shapes, the most first, and nothing else."""
import os
import sys
from types import SimpleNamespace

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)
from bench import kernel_times  # noqa: E402


class FakeProfile:
    def __init__(self, events):
        self.events, self.grouped = events, None

    def key_averages(self, group_by_input_shape=False):
        self.grouped = group_by_input_shape
        return self.events


def test_aten_by_shape_keeps_aten_ops_with_gpu_time_grouped_by_shape():
    event = lambda key, us: SimpleNamespace(key=key, self_device_time_total=us)  # noqa: E731
    fill, cast = event("aten::fill_", 15.6), event("aten::copy_", 23.0)
    prof = FakeProfile([fill, event("aten::view", 0.0), event("_wgrad_kernel", 160.0),
                        event("GeneratedBackwardFor_mha_region_defaultBackward", 40.0), cast])
    kept = kernel_times.aten_by_shape(prof)
    assert prof.grouped is True
    assert kept == [cast, fill]  # the most GPU time first
