"""bench/offline_memory.py: live bytes counted from allocations and frees, and the fused training
step's peak at the large preset read from shapes alone (a subprocess: the tool records GPU
launches, so it runs without TRITON_INTERPRET)."""
import json

import torch
from offline_rows import run_offline

from bench.offline_memory import LiveBytes
from mha_compile import models


def test_live_bytes_counts_new_memory_until_freed():
    with LiveBytes() as mem:
        a = torch.empty(1000, device="meta")             # 4000 B
        b = torch.empty(250, 2, device="meta")           # 2000 B
        view = a.view(10, 100)                            # a view: no new memory
        a.add_(1)                                         # in place: none
        del a                                             # the view keeps a's memory
        assert mem.now == 6000
        c = view * 2                                      # 4000 B more: the peak, 10000
        del view, c
        assert mem.now == 2000
        d = torch.empty(500, device="meta", dtype=torch.float64)  # 4000 B: 6000, below the peak
    assert mem.peak == 10000
    assert sorted(n for n, _ in mem.at_peak) == [2000, 4000, 4000]
    del b, d


def _large_peak(tmp_path, monkeypatch, single_pass):
    """offline_memory.py's --out at the large preset with MHA_COMPILE_POOL_BWD_SINGLE_PASS=single_pass."""
    monkeypatch.setenv("MHA_COMPILE_POOL_BWD_SINGLE_PASS", single_pass)
    out = tmp_path / f"peaks_{single_pass}.json"
    run_offline("bench/offline_memory.py", "--presets", "large", "--out", str(out))
    found = json.loads(out.read_text())["large"]
    assert found["peak_bytes"] == sum(n for n, _ in found["at_peak"])
    return found


def test_large_training_peak_holds_two_pool_buffers(tmp_path, monkeypatch):
    """With the pool backward's two passes the large step peaks there: tok and ∂tok (bf16) both
    alive, ∂t̄ sharing its memory with the ∂u partials and t̄ the other [B,P,D] buffer. With the
    single pass (the default at large, where tok exceeds the H200's L2: no ∂s buffer) the step
    peaks no higher, and in the MoE backward instead."""
    p = models.PRESETS["large"]
    tok_bytes = p["B"] * p["N"] * p["D"] * 2
    bpd_bytes = p["B"] * p["P"] * p["D"] * 4
    two = _large_peak(tmp_path, monkeypatch, "0")
    sizes = [n for n, _ in two["at_peak"]]
    assert sizes.count(tok_bytes) == 2 and "(two_passes)" in two["peak_site"], two["peak_site"]
    pool = [n for n, site in two["at_peak"] if n == bpd_bytes and "triton_pool" in site]
    assert len(pool) <= 2, two["at_peak"]
    one = _large_peak(tmp_path, monkeypatch, "auto")
    assert one["peak_bytes"] <= two["peak_bytes"], (one["peak_bytes"], two["peak_bytes"])
    assert "triton_moe" in one["peak_site"], one["peak_site"]


def _medium_peaks(tmp_path, option, values):
    """offline_memory.py's --out at the medium preset for each of `option`'s comma list `values`."""
    out = tmp_path / "peaks.json"
    run_offline("bench/offline_memory.py", "--presets", "medium", option, values, "--top", "3", "--out", str(out))
    return json.loads(out.read_text())


def test_smaller_runs_lower_medium_peak(tmp_path):
    """--slot-chunk-mb 512,64 at medium: one run, then runs of 64 MiB; with the runs no slot
    buffer of the backward's tiles outgrows its share of a run (∂u and hw [run slots, F] of
    (2D + 2F) bf16 bytes a slot), and the step's peak comes down."""
    found = _medium_peaks(tmp_path, "--slot-chunk-mb", "512,64")
    one, runs = found["medium/512"], found["medium/64"]
    p = models.PRESETS["medium"]
    share = (64 << 20) * p["F"] / (2 * p["D"] + 2 * p["F"])
    tiles = [n for n, site in runs["at_peak"] if "_hidden_layer" in site]
    assert tiles and max(tiles) <= share
    assert max(n for n, site in one["at_peak"] if "_hidden_layer" in site) > share
    assert runs["peak_bytes"] < one["peak_bytes"]


def test_hidden_columns_lower_medium_peak(tmp_path):
    """--hidden-columns 0,256 at medium: the backward's hw and ∂u [slots, F] in one pass, then
    [slots, 256] a pass (a quarter of F's bytes), with ∂x's slot rows in fp32 [slots, D]; the
    step's peak comes down by more than those rows cost."""
    found = _medium_peaks(tmp_path, "--hidden-columns", "0,256")
    one, passes = found["medium/columns0"], found["medium/columns256"]
    p = models.PRESETS["medium"]
    hidden = lambda found: sorted(n for n, site in found["at_peak"] if "_hidden_layer" in site)  # noqa: E731
    whole, pass_ = hidden(one), hidden(passes)
    assert len(whole) == len(pass_) == 2 and all(4 * b == a for a, b in zip(whole, pass_))
    slots = whole[0] // (p["F"] * 2)
    made = sorted(n for n, site in passes["at_peak"] if "_backward_columns" in site)
    assert made[-1] == slots * p["D"] * 4 and sum(made[:-1]) < made[-1] // 8  # fp32 ∂x rows; the weights' columns
    assert passes["peak_bytes"] < one["peak_bytes"] - whole[0]
