"""bench/offline_calls.py: torch's calls and the launches of a fused training step, counted without
a GPU (the large preset in a subprocess: the tool records GPU launches, so it runs without
TRITON_INTERPRET)."""
import json

import torch
from offline_rows import run_offline

from bench.offline_calls import CallCount, is_view


def test_views_are_told_from_calls():
    aten = torch.ops.aten
    assert is_view(aten.view.default) and is_view(aten.unbind.int) and is_view(aten.select.int)
    assert not is_view(aten.add_.Tensor)  # in place: writes its input
    assert not is_view(aten.empty.memory_format) and not is_view(aten.mul.Tensor)


def test_call_count_records_each_op_in_order():
    a = torch.empty(6, 4, device="meta")
    with CallCount() as counted:
        (a.view(4, 6) * 2).add_(1).unbind(0)
    assert [(op, view) for op, _, view in counted.calls] == [
        ("view.default", True), ("mul.Tensor", False), ("add_.Tensor", False), ("unbind.int", True)]
    assert all(site.endswith("(step)") for _, site, _ in counted.calls)  # no mha_compile frame called them


def test_large_step_zeroes_stream_flags_once_and_sums_rows_once(tmp_path):
    """At large (three runs of tiles, the Gluon weight gradients with STREAM): one zeroed buffer of
    STREAM's flags for the step's six weight-gradient launches, and ∂b1's rows added up by one
    launch after the last run, with no torch sum of them (session 32). The same kernel adds up the
    runs of K of the pool's ∂Wo and ∂Wv (triton_util.sum_runs, session 35): three launches; ∂q's
    product, which took a fourth, is one launch with ∂Wk's since session 38 (direction_grads)."""
    out = tmp_path / "calls.json"
    run = run_offline("bench/offline_calls.py", "--presets", "large", "--out", str(out))
    assert "large backward:" in run.stdout and "launch _wgrad_kernel" in run.stdout
    backward = json.loads(out.read_text())["large"]["backward"]
    calls, launches = backward["calls"], backward["launches"]
    assert launches.count("_wgrad_kernel") == 6 and launches.count("_sum_splits_kernel") == 3
    assert launches.count("_direction_grads_kernel") == 1
    assert len([site for op, site, _ in calls if op == "zeros.default" and "stream_flags" in site]) == 1
    assert not [site for op, site, _ in calls if op.startswith("sum") and "weight_grads" in site]
