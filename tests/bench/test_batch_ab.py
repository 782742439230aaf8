"""bench/batch_ab.py on the CPU with the step graphs' recorder a stub (tests/bench/conftest.py): the
one-batch way reads ctx and tok in place, the two-batch way copies them in every step, and the
script prints both ways' times and the gap."""
from bench import batch_ab
from mha_compile.models import PRESETS


def test_the_two_ways_differ_by_the_inputs_copied_in(step_graphs_on_cpu):
    times, copied = batch_ab.measure("tiny", "mha-fused-cudagraphs", "cpu", rounds=1)
    p = PRESETS["tiny"]
    ctx_and_tok = 4 * (p["B"] * p["H"] * p["D"] + p["B"] * p["N"] * p["D"])  # fp32
    grad_out = 4 * p["B"] * p["H"] * p["D"]  # ∂out, copied in by both ways' backward
    assert copied == {"one batch": grad_out, "two batches": grad_out + ctx_and_tok}
    assert all(len(rounds) == 1 and rounds[0][0] > 0 for rounds in times.values())


def test_it_prints_each_way_and_the_gap(step_graphs_on_cpu, capsys):
    batch_ab.main(["--presets", "tiny", "--modes", "mha-fused-cudagraphs", "--rounds", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2:4] for line in lines[1:3]] == [["one", "batch"], ["two", "batches"]]
    assert lines[3].startswith("tiny     mha-fused-cudagraphs   two − one, median: ") and "(rounds " in lines[3]


def test_cuda_times_are_do_benchs_median_and_mean(step_graphs_on_cpu, monkeypatch):
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", lambda *a, **k: [1.0, 2.0, 6.0])
    assert batch_ab._times_ms(lambda: None, "cuda", []) == (2.0, 3.0)
