"""region_graphs on the CPU: when a call is graphed (the policy), and the option's checks.
Capture and replay themselves need a GPU: test_region_graphs_cuda.py."""
import types

import pytest
import torch

import mha_compile
from mha_compile import models
from mha_compile.kernels import region_graphs, triton_moe


def _meta_case(preset, dtype=torch.bfloat16, act="gelu"):
    p = models.PRESETS[preset]
    ctx = torch.empty(p["B"], p["H"], p["D"], device="meta", dtype=dtype)
    w1 = torch.empty(p["E"], p["D"], p["F"], device="meta", dtype=dtype)
    return ctx, w1, p["k"], act


@pytest.mark.parametrize("preset,expected", [("tiny", True), ("small", True), ("medium", True), ("large", False)])
def test_auto_graphs_the_host_bound_sizes_only(preset, expected):
    """Medium's backward slot buffers (~170 MiB bf16) take one run of SLOT_CHUNK_BYTES; large's
    (~1.3 GB) do not, and there the pool would hold about a gigabyte for little host time."""
    assert region_graphs.auto_wanted(*_meta_case(preset)) is expected


@pytest.mark.parametrize("chunk_mb", ["64", "4096"])
def test_auto_keeps_its_sizes_whatever_the_run_size(monkeypatch, chunk_mb):
    """MHA_COMPILE_SLOT_CHUNK_MB moves the MoE's runs, not graphs="auto"'s sizes: medium's plain
    step keeps its graphs with runs of 64 MiB (set for memory), large gets none with one run."""
    monkeypatch.setattr(triton_moe, "SLOT_CHUNK_BYTES", triton_moe.slot_chunk_bytes(chunk_mb))
    ctx, w1, k, act = _meta_case("medium")
    per_slot = triton_moe.backward_slot_bytes(ctx.shape[2], w1.shape[2], False, 2)
    pairs, E = ctx.shape[0] * ctx.shape[1] * k, w1.shape[0]
    tile = triton_moe.tile_rows(pairs, E)
    layout = types.SimpleNamespace(tile=tile, num_tiles=triton_moe.tile_count(pairs, E, tile))
    assert len(triton_moe.tile_runs(layout, per_slot)) == (3 if chunk_mb == "64" else 1)
    assert [region_graphs.auto_wanted(*_meta_case(p)) for p in ("medium", "large")] == [True, False]


def test_auto_counts_swiglus_third_buffer():
    """A size just inside the bound for gelu is outside it for swiglu (∂u3 is a third [S,F])."""
    ctx, w1, k, _ = _meta_case("medium")
    B, H, D = ctx.shape
    E, _, F = w1.shape
    slots = triton_moe.slot_count(B * H * k, E)
    gelu, swiglu = (slots * triton_moe.backward_slot_bytes(D, F, s, 2) for s in (False, True))
    # Scale the batch so that gelu fits and swiglu does not.
    scale = (region_graphs.AUTO_SLOT_BYTES / gelu + region_graphs.AUTO_SLOT_BYTES / swiglu) / 2
    big = torch.empty(int(B * scale) - 1, H, D, device="meta", dtype=ctx.dtype)
    assert region_graphs.auto_wanted(big, w1, k, "gelu")
    assert not region_graphs.auto_wanted(big, w1, k, "swiglu")


def test_auto_graphs_exactly_the_sizes_the_backward_runs_in_one_run():
    """auto_wanted's rule is tile_runs': around the bound (large's widths, batch 1530-1600, where
    a run's tiles round down to a multiple of 8) every batch that graphs takes one run and every
    other takes more (at B = 1570 the bytes fit 512 MiB but the tiles made two runs)."""
    ctx, w1, k, act = _meta_case("large")
    (_, H, D), (E, _, F) = ctx.shape, w1.shape
    per_slot = triton_moe.backward_slot_bytes(D, F, False, 2)
    seen = set()
    for B in range(1530, 1600):
        pairs = B * H * k
        tile = triton_moe.tile_rows(pairs, E)
        layout = types.SimpleNamespace(tile=tile, num_tiles=triton_moe.tile_count(pairs, E, tile))
        one_run = len(triton_moe.tile_runs(layout, per_slot)) == 1
        big = torch.empty(B, H, D, device="meta", dtype=ctx.dtype)
        assert region_graphs.auto_wanted(big, w1, k, act) is one_run, B
        seen.add(one_run)
    assert seen == {True, False}


def test_slot_count_is_the_layouts():
    index = torch.randint(0, 5, (37, 2), dtype=torch.int32)
    assert triton_moe.group(index, 5).slots == triton_moe.slot_count(index.numel(), 5)


@pytest.mark.parametrize("graphs", ["auto", "on", "off"])
def test_never_on_the_cpu_or_with_the_reference(graphs):
    ctx, tok, w1 = torch.randn(2, 3, 8), torch.randn(2, 4, 8), torch.randn(3, 8, 6)
    for kernels in ("fused", "staged", "reference"):
        assert not region_graphs.wanted(graphs, kernels, ctx, tok, w1, 2, "gelu", None)


def test_a_bad_setting_names_itself():
    ctx, tok, w1 = torch.randn(2, 3, 8), torch.randn(2, 4, 8), torch.randn(3, 8, 6)
    with pytest.raises(ValueError, match="graphs='always'"):
        region_graphs.wanted("always", "fused", ctx, tok, w1, 2, "gelu", None)


def test_option_default_and_values():
    assert mha_compile.Options().graphs == "auto"
    for value in ("auto", "on", "off"):
        assert mha_compile.Options.parse({"graphs": value}).graphs == value
    with pytest.raises(ValueError, match="graphs='yes'.*'auto', 'on', 'off'"):
        mha_compile.Options.parse({"graphs": "yes"})


def _fake_match(preset, kernels="fused", act="gelu", device="cuda", keep_hidden=False):
    """A match as describe_graphs reads it: example values of ctx and W1 (fake CUDA tensors)."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    p = models.PRESETS[preset]
    with FakeTensorMode():
        ctx = torch.empty(p["B"], p["H"], p["D"], device=device, dtype=torch.bfloat16)
        w1 = torch.empty(p["E"], p["D"], p["F"], device=device, dtype=torch.bfloat16)
    node = lambda value: SimpleNamespace(meta={"example_value": value})
    return SimpleNamespace(ctx=node(ctx), params={"w1": SimpleNamespace(node=node(w1))}, kernels=kernels,
                           config={"top_k": p["k"], "act": act}, keep_hidden=keep_hidden)


def _slot_mib(preset, columns=None):
    """The backward's slot buffers at a preset in MiB, from the sizes: xs, gs [S, D] and hw, ∂u
    [S, F] (or `columns` of F) in bf16, for S = the R·k (row, expert) pairs plus a padding tile of
    128 slots an expert at most (medium 33792 slots, 5120 bytes each: 165 MiB)."""
    p = models.PRESETS[preset]
    slots = p["B"] * p["H"] * p["k"] + p["E"] * 128
    mib = slots * 2 * (2 * p["D"] + 2 * (p["F"] if columns is None else columns)) / 2**20
    assert mib == int(mib)
    return int(mib)


@pytest.mark.parametrize("preset,graphs,kernels,device,whole,expected", [
    ("medium", "auto", "fused", "cuda", False,
     f"yes (graphs='auto'): the backward's slot buffers, {_slot_mib('medium')} MiB, fit"),
    ("large", "auto", "fused", "cuda", False,
     f"no (graphs='auto'): the backward's slot buffers, {_slot_mib('large')} MiB, do not"),
    ("large", "on", "staged", "cuda", False, "yes (graphs='on')"),
    ("medium", "off", "fused", "cuda", False, "no: graphs='off'"),
    ("medium", "auto", "reference", "cuda", False, "no: the reference path"),
    ("medium", "auto", "fused", "cpu", False, "no: inputs are on cpu"),
    ("medium", "auto", "fused", "cuda", True, "no: the whole graph is captured"),
])
def test_the_report_says_whether_and_why(preset, graphs, kernels, device, whole, expected):
    from mha_compile.lowering.select import describe_graphs

    assert describe_graphs(_fake_match(preset, kernels, device=device), graphs, whole).startswith(expected)


def test_explain_reports_the_graphs_decision():
    block = models.MHABlock.from_preset("tiny")
    report = mha_compile.explain(block, torch.randn(4, 3, 32), torch.randn(4, 5, 32), options={"kernels": "fused"})
    assert report.matches[0]["graphs"] == "no: inputs are on cpu"
    assert "CUDA graphs: no: inputs are on cpu" in str(report)


@pytest.mark.parametrize("nbytes, text", [(1300 * 2**20, "1300 MiB"), (2**20, "1 MiB"), (2560, "2 KiB"),
                                          (1023, "1023 bytes")])
def test_report_sizes_say_kib_below_a_mib(nbytes, text):
    from mha_compile.lowering.select import size_text
    assert size_text(nbytes) == text


@pytest.mark.parametrize("preset,chunk_mb,expected", [
    ("medium", None, f"1 run of whole tiles: the backward's slot buffers, {_slot_mib('medium')} MiB, within "
                     "512 MiB a run (MHA_COMPILE_SLOT_CHUNK_MB)"),
    ("medium", "64", f"3 runs of whole tiles: the backward's slot buffers, {_slot_mib('medium')} MiB, within "
                     "64 MiB a run"),
    ("large", None, f"3 runs of whole tiles: the backward's slot buffers, {_slot_mib('large')} MiB, within "
                    "512 MiB a run"),
])
def test_the_report_says_how_the_moe_walks_its_slots(monkeypatch, preset, chunk_mb, expected):
    """explain's "MoE slot runs" line: how many runs set the MoE's training peak, and the bound
    MHA_COMPILE_SLOT_CHUNK_MB gave them (medium: one run by default, three of 64 MiB)."""
    from mha_compile.lowering.select import describe_slot_runs

    if chunk_mb is not None:
        monkeypatch.setattr(triton_moe, "SLOT_CHUNK_BYTES", triton_moe.slot_chunk_bytes(chunk_mb))
    assert describe_slot_runs(_fake_match(preset)).startswith(expected)
    assert describe_slot_runs(_fake_match(preset, "reference")) == "none: the reference path has no slot rows"


@pytest.mark.parametrize("keep", [False, True])
def test_the_report_says_when_the_hidden_layer_takes_passes(monkeypatch, keep):
    """With MHA_COMPILE_HIDDEN_COLUMNS the line gives the passes and their buffers instead of the
    backward's runs (medium, 256: four passes, a pass's xs, gs, hw, ∂u 66 MiB of the whole 165);
    a region that keeps u (keep_hidden) says the passes are not taken."""
    from types import SimpleNamespace

    from mha_compile.lowering.select import describe_slot_runs

    monkeypatch.setattr(triton_moe, "HIDDEN_COLUMNS", 256)
    text = describe_slot_runs(_fake_match("medium", keep_hidden=keep))
    if keep:
        assert text.startswith(f"1 run of whole tiles: the backward's slot buffers, {_slot_mib('medium')} MiB")
        assert text.endswith("; MHA_COMPILE_HIDDEN_COLUMNS=256 is not taken: the region keeps u [slots, F] for its "
                             "backward (keep_hidden)")
    else:
        assert text == ("the backward over all slots at once, its hidden layer in 4 passes of at most 256 of F = 1024 "
                        f"columns (MHA_COMPILE_HIDDEN_COLUMNS=256): its slot buffers {_slot_mib('medium', 256)} MiB "
                        "a pass, ∂x's slot rows in "
                        "fp32; the forward in runs within 512 MiB a run (MHA_COMPILE_SLOT_CHUNK_MB)")
    monkeypatch.setattr(triton_moe, "HIDDEN_COLUMNS", 1024)  # F in one pass: the runs' line
    assert describe_slot_runs(_fake_match("medium")).startswith("1 run of whole tiles")
    monkeypatch.setattr(triton_moe, "HIDDEN_COLUMNS", 256)  # a symbolic batch: the passes named
    match = _fake_match("medium")
    ctx = match.ctx.meta["example_value"]
    symbolic = SimpleNamespace(shape=("s0", *ctx.shape[1:]), dtype=ctx.dtype, device=ctx.device)
    match.ctx = SimpleNamespace(meta={"example_value": symbolic})
    assert describe_slot_runs(match) == ("decided per call (symbolic shapes): runs of whole tiles within 512 MiB a "
                                         "run (MHA_COMPILE_SLOT_CHUNK_MB); the backward's hidden layer in 4 passes "
                                         "(MHA_COMPILE_HIDDEN_COLUMNS=256)")


def test_explain_reports_the_slot_runs():
    # Dynamo remembers the sizes MHABlock's forward was compiled at before (tests/backend's), and
    # would compile these as symbolic ("decided per call"): the concrete count needs a fresh start
    torch._dynamo.reset()
    block = models.MHABlock.from_preset("tiny")
    report = mha_compile.explain(block, torch.randn(4, 3, 32), torch.randn(4, 5, 32), options={"kernels": "fused"})
    assert report.matches[0]["slot_runs"].startswith("1 run of whole tiles")
    assert "MoE slot runs: 1 run of whole tiles" in str(report)


def test_symbolic_sizes_are_decided_per_call():
    """A batch that is a symbol (dynamic shapes; a stand-in object here) gives no count: the
    reports say the decision is made per call, and by what rule."""
    from types import SimpleNamespace

    from mha_compile.lowering.select import describe_graphs, describe_slot_runs

    match = _fake_match("medium")
    ctx = match.ctx.meta["example_value"]
    symbolic = SimpleNamespace(shape=("s0", *ctx.shape[1:]), dtype=ctx.dtype, device=ctx.device)
    match.ctx = SimpleNamespace(meta={"example_value": symbolic})
    assert describe_graphs(match, "auto", False) == ("decided per call (symbolic shapes): yes where the slot "
                                                     "buffers fit one run of 512 MiB")
    assert describe_slot_runs(match) == ("decided per call (symbolic shapes): runs of whole tiles within 512 MiB "
                                         "a run (MHA_COMPILE_SLOT_CHUNK_MB)")
