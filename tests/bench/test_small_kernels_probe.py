"""bench/small_kernels_probe.py without a GPU (TRITON_INTERPRET=1, tiny preset, fp32): its cases are
real inputs, gather_rows' launch overrides reach the kernel and give the shipped rows, the pool
backward's sweeps launch its passes as pool_backward does, and every config the probe sweeps
runs and agrees with the shipped one."""
import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import small_kernels_probe as probe  # noqa: E402
from gemm_probe import variant  # noqa: E402

from mha_compile.kernels import triton_matmul, triton_moe, triton_pool, triton_router, triton_util  # noqa: E402

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the probe's kernels on the CPU need TRITON_INTERPRET=1"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")]


@pytest.fixture(scope="module")
def case():
    return probe.case("tiny", torch.float32, "cpu")


def test_the_cases_are_real_inputs(case):
    g = case.groups
    valid = g.slot_pair < g.pairs
    assert valid.sum() == g.pairs and (~valid).any()  # tiny pads its tiles
    assert (case.du[valid] != 0).all() and (case.du[~valid] == 0).all()
    for t in (case.x, case.inv, case.G, case.b2, case.weight, case.tok, case.q, case.wk, case.wv, case.wo,
              case.grad_inv):
        assert (t != 0).any()
    bmm, no_autotune = triton_pool._bmm, triton_util.NO_AUTOTUNE
    sites = probe.matmul_sites(case)
    assert (triton_pool._bmm, triton_util.NO_AUTOTUNE) == (bmm, no_autotune)
    # the pool's 7 projections and ∂bv = ∂bo Wo, the forward's t̄ heads again in the backward
    assert sum(len(s.calls) for s in sites) == 8 and len(sites) == 7
    assert [len(s.calls) for s in sites if "_heads" in s.calls[0]] == [2]
    assert all((s.a != 0).any() and (s.b != 0).any() and s.split == 0 for s in sites)
    # the recorded operands give the products the pool wrote (fp32: torch.bmm, + bv's heads or bo
    # where the product adds a bias), but for ∂t̄, over which the pool's backward kernel writes its
    # ∂u partials
    assert sorted(tuple(s.bias.shape) for s in sites if s.bias is not None) == sorted([(case.D,), (case.P, case.D // case.P)])
    bias = lambda s: 0 if s.bias is None else s.bias if s.bias.dim() == 1 else s.bias[:, None]  # noqa: E731
    kept = [torch.allclose(s.out, torch.bmm(s.a, s.b) + bias(s), rtol=1e-6, atol=1e-6) for s in sites]
    assert kept.count(False) == 1 and "out=grad_tbar" in sites[kept.index(False)].line


class _Launches:
    """Stands in for _gather_rows_kernel: records each launch's grid and meta-parameters, then runs
    the kernel (in the interpreter, which takes no warps)."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.seen.append((grid, meta))
            return self.kernel[grid](*args, **{k: v for k, v in meta.items() if k not in ("num_warps", "num_stages")})
        return launch


@pytest.mark.parametrize("b2", [False, True])
def test_gather_overrides_reach_the_kernel_and_give_the_shipped_rows(case, monkeypatch, b2):
    g, D = case.groups, case.D
    gb2_col = 2
    # every launch option reaches the kernel; here, where the interpreter takes no warps too
    monkeypatch.setattr(triton_moe, "gpu_options", lambda t, **options: options)
    launches = _Launches(triton_moe._gather_rows_kernel)
    monkeypatch.setattr(triton_moe, "_gather_rows_kernel", launches)

    def gather(**overrides):
        n_d = triton_moe.gather_blocks_d(D)[1] if "block_d" not in overrides else -(-D // overrides["block_d"])
        gw = torch.full((g.slots, gb2_col + n_d), float("nan"))
        xs, gs, db2 = triton_moe.gather_rows(case.x, case.inv, g, case.H, case.dt, case.G, case.weight,
                                             case.b2 if b2 else None, gw, gb2_col, **overrides)
        return (xs, gs) + ((db2, gw[:, gb2_col:]) if b2 else ())

    want = gather()
    grid, meta = launches.seen[-1]  # the shipped launch: 16 slots by all of D = 32, Triton's default
    # warps (GATHER_B2_WARPS with b2)
    assert grid == (g.slots // 16, 1) and (meta["BLOCK_S"], meta["BLOCK_D"]) == (16, 32)
    assert meta.get("num_warps") == (triton_moe.GATHER_B2_WARPS if b2 else None)
    assert (want[0] != 0).any() and (want[1] != 0).any()
    # D = 32: block_d 16 takes two D blocks (two ⟨G, b2⟩ columns), 64 one; 96 slots take block_s 32
    overrides = [dict(block_d=16), dict(block_d=64, num_warps=2), dict(num_warps=1)]
    overrides += [] if b2 else [dict(block_s=32), dict(block_s=32, block_d=16, num_warps=8)]
    for override in overrides:
        got = gather(**override)
        grid, meta = launches.seen[-1]
        block_s, block_d = override.get("block_s", 16), override.get("block_d", 32)
        assert grid == (g.slots // block_s, -(-D // block_d)), override
        assert (meta["BLOCK_S"], meta["BLOCK_D"], meta.get("num_warps")) == (
            block_s, block_d, override.get("num_warps", triton_moe.GATHER_B2_WARPS if b2 else None)), override
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), override
        if b2:
            torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-6)
            assert got[3].isfinite().all(), override  # every ⟨G, b2⟩ column written
            torch.testing.assert_close(got[3].sum(1), want[3].sum(1), rtol=1e-6, atol=1e-6)


def test_gather_overrides_that_cannot_be_right_are_refused(case):
    g, D = case.groups, case.D
    gw = torch.empty(g.slots, 2 + 1)
    with pytest.raises(ValueError, match="with b2"):  # ∂b2's partials are sums of 16 slots
        triton_moe.gather_rows(case.x, case.inv, g, case.H, case.dt, case.G, case.weight, case.b2, gw, 2, block_s=32)
    with pytest.raises(ValueError, match="columns"):  # two D blocks need two ⟨G, b2⟩ columns
        triton_moe.gather_rows(case.x, case.inv, g, case.H, case.dt, case.G, case.weight, case.b2, gw, 2, block_d=16)
    with pytest.raises(ValueError, match="96 slots"):
        triton_moe.gather_rows(case.x, case.inv, g, case.H, case.dt, block_s=64)
    assert D == 32 and g.slots == 96  # what the cases above assume


def test_column_sums_overrides_reach_the_kernel(monkeypatch):
    """triton_pool.column_sums' launch options (the column_sums sweep's): blocks, the first pass's
    parts from its programs, and warps reach both launches; the sums stay the float64 ones."""
    monkeypatch.setattr(triton_pool, "gpu_options", lambda t, **options: options)
    launches = _Launches(triton_pool._column_sums_kernel)
    monkeypatch.setattr(triton_pool, "_column_sums_kernel", launches)
    R, C = 300, 700
    x = torch.randn(R, C)
    want = x.double().sum(0) * 0.5
    shipped = dict(block_r=triton_pool.COLUMN_BLOCK_R, block_c=triton_pool.COLUMN_BLOCK_C,
                   programs=triton_pool.COLUMN_PROGRAMS, num_warps=4)
    for cfg in ({}, dict(block_r=8, block_c=128, programs=264, num_warps=1),
                dict(block_r=32, block_c=512, programs=1056, num_warps=8)):
        got = triton_pool.column_sums(x, 0.5, **cfg)
        o = {**shipped, **cfg}
        blocks = -(-C // o["block_c"])
        rows = min(256, triton_util.pow2(R * blocks // o["programs"], lo=o["block_r"]))
        (first, meta1), (second, meta2) = launches.seen[-2:]
        assert first == (blocks, -(-R // rows)) and second == (blocks, 1), cfg
        assert meta1 == meta2 == dict(BLOCK_R=o["block_r"], BLOCK_C=o["block_c"], num_warps=o["num_warps"]), cfg
        assert float((got.double() - want).norm() / want.norm()) < 1e-6, cfg


def test_every_swept_config_runs_and_agrees_with_the_shipped_one(capsys):
    launchers = (triton_moe._tile_sums, triton_matmul._matmul, triton_pool._attend, triton_pool._attend_bwd_scores,
                 triton_pool._attend_bwd, triton_pool._attend_bwd_one, triton_moe._sum_tiles,
                 triton_pool._attend_bwd_single)
    plain = lambda: [triton_moe._gather_rows_kernel, triton_router._router_wgrad_kernel,  # noqa: E731
                     triton_router._inv_logits_kernel, triton_pool._column_sums_kernel]
    before = [(l.kernel, l.configs, l.tuned) for l in launchers] + plain()
    probe.probe("tiny", probe.KERNELS, torch.float32, "cpu")
    out = capsys.readouterr().out
    assert [(l.kernel, l.configs, l.tuned) for l in launchers] + plain() == before
    assert "FAILED" not in out and "MISMATCH" not in out, out
    rows = [line for line in out.splitlines() if line[:2] in ("* ", "+ ", "  ") and " us " in line]
    shipped = [line.split()[1:3] for line in rows if line.startswith("* ")]
    # one sweep each: tile_sums, the gather's three calls, the pool's 7 distinct matmuls, its
    # forward, its backward's two passes and both in one kernel, ∂b2's sums, ∂Wg and the forward
    # split's inv Wgᵀ, the pool backward's column sums of ∂u's partials and of ∂inv
    assert [name for name, _ in shipped] == (["tile_sums", "gather", "gather", "gather"] + ["matmul"] * 7
                                             + ["pool"] * 4 + ["bias_sums", "router_wgrad", "inv_logits"]
                                             + ["column_sums"] * 2)
    for launcher, name in zip(launchers, ("tile_sums", "matmul #0", "pool fwd", "pool bwd 1", "pool bwd 2",
                                          "pool bwd one", "bias_sums")):
        listed = [line for line in rows if line[2:].startswith(name)]
        assert all(any(probe.describe(cfg) in line for line in listed) for cfg in launcher.configs), name
    # the pool backward's sweeps: their lists at tiny (N = 5, D = 32), each config once
    for name, configs in (("pool bwd 1", probe.bwd1_configs(5)), ("pool bwd 2", probe.bwd2_configs(5, 32)),
                          ("pool bwd one", probe.bwd_one_configs(5, 32))):
        listed = [line for line in rows if line[2:].startswith(name)]
        assert len(listed) == len(configs) and all(
            sum(f" {probe.describe(cfg)} " in line for line in listed) == 1 for cfg in configs), name
    # the single pass under each config of its list, once, against the two passes
    single = [line for line in rows if line[2:].lstrip().startswith("pool single")]
    assert len(single) == len(triton_pool._attend_bwd_single.configs) and all(
        sum(f" {probe.describe(cfg)} " in line for line in single) == 1 for cfg in triton_pool._attend_bwd_single.configs)
    # the configs are run, not the shipped one again: other BLOCK_K sum the products in another order
    assert any("max diff 0.0e+00" not in line for line in rows if "matmul" in line)


def test_bias_sums_on_one_run_of_tiles_as_the_large_backward(case, monkeypatch, capsys):
    """Where the backward takes runs of tiles (the large preset's path, here forced at tiny), the
    bias_sums sweep sums the first run's partials into fp32 totals, each config as the shipped
    one; and those totals are the expert sums of that run's rows."""
    per_tile = case.groups.tile * triton_moe.backward_slot_bytes(case.D, case.F, False, 4)
    monkeypatch.setattr(triton_moe, "SLOT_CHUNK_BYTES", 3 * per_tile)  # runs of 3 tiles: 2 at tiny
    probe.bias_sums(case)
    out = capsys.readouterr().out
    assert "of run 1 of 2" in out and "FAILED" not in out and "MISMATCH" not in out, out
    g = case.groups.tiles(0, 3)
    part = torch.randn(3 * case.groups.tile // triton_moe.GATHER_BLOCK_S, case.D)
    total = torch.randn(case.E, case.D)
    want = total.double().clone()
    triton_moe.bias_grads(None, part, g, torch.float32, into=(None, total))
    bounds = (g.expert_slots.long() // triton_moe.GATHER_BLOCK_S).tolist()
    for e in range(case.E):  # experts outside the run (an empty range) keep their totals
        want[e] += part[bounds[e]:bounds[case.E + e]].double().sum(0)
    assert sum(b > a for a, b in zip(bounds[:case.E], bounds[case.E:])) >= 2
    assert torch.allclose(total.double(), want, atol=1e-5)


class _Recorded:
    """Stands in for one of triton_pool's Launchers: launches it, keeping clones of its arguments
    (by name) from before and after the launch."""

    def __init__(self, launcher):
        self.launcher, self.calls = launcher, []

    def __call__(self, grid, *args, **kwargs):
        def clones():
            return {n: a.clone() if isinstance(a, torch.Tensor) else a for n, a in zip(self.launcher.arg_names, args)}
        before = clones()
        self.launcher(grid, *args, **kwargs)
        self.calls.append((before, clones()))

    def launch_where_fits(self, grid, *args, **kwargs):
        """Launcher.launch_where_fits (pass 1 asks it): launched and kept where the launcher fits."""
        if not self.launcher.fits(*args, **kwargs):
            return False
        self(grid, *args, **kwargs)
        return True


def test_the_pool_backward_sweeps_launch_what_pool_backward_does(monkeypatch):
    """Each config of the three pool backward sweeps (pass 1, pass 2, both in one kernel), at an
    odd shape, on the inputs pool_backward gave its two kernels: its blocks reach the kernel, and
    it writes into NaN-filled outputs what pool_backward's launches wrote (∂s; ∂tok, t̄ and the ∂u
    partials, for pass 2 and the one kernel) to fp32 rounding."""
    B, N, D, P = 2, 37, 300, 4  # pow2(N) = 64, pow2(D) = 512: every BLOCK_N and BLOCK_D of the lists
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    tok, q, grad_inv = rand(B, N, D), rand(P, D // P), rand(B, D)
    wk, wv, wo = (rand(D, D) * D ** -0.5 for _ in range(3))
    bv, bo = rand(D) * 0.1, rand(D) * 0.1
    _, attn = triton_pool.pool_forward(tok, q, wk, wv, bv, wo, bo)
    with monkeypatch.context() as patch:
        patch.setattr(triton_pool, "BWD_ONE_KERNEL", False)  # the two kernels, whose inputs the sweeps take
        scores, pass2 = _Recorded(triton_pool._attend_bwd_scores), _Recorded(triton_pool._attend_bwd)
        patch.setattr(triton_pool, "_attend_bwd_scores", scores)
        patch.setattr(triton_pool, "_attend_bwd", pass2)
        triton_pool.pool_backward(grad_inv, tok, q, wk, wv, bv, wo, attn)
    [(in1, out1)], [(in2, out2)] = scores.calls, pass2.calls
    x = SimpleNamespace(tok=in1["tok_ptr"], attn=in1["attn_ptr"], dtbar=in1["dtbar_ptr"], u=in2["u_ptr"],
                        ds=in2["ds_ptr"])
    # pass 2 read pass 1's ∂s and the same ∂t̄, and wrote its ∂u partials over ∂t̄ (which the
    # probe's bwd writes to a buffer of their own)
    assert torch.equal(x.tok, tok) and torch.equal(x.attn, attn) and torch.equal(in2["dtbar_ptr"], x.dtbar)
    assert torch.equal(x.ds, out1["ds_ptr"]) and torch.equal(out2["du_ptr"], out2["dtbar_ptr"])
    want = {triton_pool._attend_bwd_scores: (out1["ds_ptr"],),
            triton_pool._attend_bwd: (out2["dtok_ptr"], out2["tbar_ptr"], out2["du_ptr"])}
    want[triton_pool._attend_bwd_one] = want[triton_pool._attend_bwd]
    assert all(t.isfinite().all() and (t != 0).any() for ts in want.values() for t in ts)
    nans = lambda ts: tuple(torch.full_like(t, float("nan")) for t in ts)  # noqa: E731
    runs = {triton_pool._attend_bwd_scores: lambda ts: (probe.bwd_scores(x, ds=nans(ts)[0]),),
            triton_pool._attend_bwd: lambda ts: probe.bwd(x, out=nans(ts)),
            triton_pool._attend_bwd_one: lambda ts: probe.bwd_one(
                SimpleNamespace(**{**vars(x), "ds": torch.full_like(x.ds, float("nan"))}), out=nans(ts))}
    sweeps = ((triton_pool._attend_bwd_scores, probe.bwd1_configs(N)), (triton_pool._attend_bwd,
                                                                       probe.bwd2_configs(N, D)),
              (triton_pool._attend_bwd_one, probe.bwd_one_configs(N, D)))
    assert {cfg["BLOCK_N"] for cfg in sweeps[0][1]} == {16, 32, 64} and len(sweeps[0][1]) == 24
    assert {cfg["BLOCK_D"] for cfg in sweeps[1][1]} == {32, 64, 128, 256, 512} and len(sweeps[1][1]) == 25
    assert [cfg for cfg in sweeps[1][1] if "maxnreg" in cfg] == [probe.BWD2_MORE[-1]]  # the capped shipped config
    assert {cfg["BLOCK_D2"] for cfg in sweeps[2][1]} == {32, 64, 128, 256} and len(sweeps[2][1]) == 15
    for launcher, configs in sweeps:
        launches = _Launches(launcher.kernel)
        monkeypatch.setattr(launcher, "kernel", launches)
        for cfg in configs:
            got = []
            variant(launcher, cfg, lambda: got.append(runs[launcher](want[launcher])))
            grid, meta = launches.seen[-1]
            assert all(meta[k] == v for k, v in cfg.items() if k.startswith("BLOCK_")), cfg
            assert grid == ((B, -(-D // cfg["BLOCK_D"])) if "BLOCK_D" in cfg else (B,)), cfg
            for a, b in zip(got[-1], want[launcher]):
                assert a.isfinite().all(), cfg  # every element written
                assert float((a - b).abs().max()) <= probe.TOLERANCE * float(b.abs().max()), cfg
        monkeypatch.undo()


def test_the_byte_counts_are_the_tensors_the_passes_move():
    B, N, D, P = 3, 37, 40, 4
    tok, grad_tok = (torch.empty(B, N, D, dtype=torch.bfloat16) for _ in range(2))
    attn, ds = (torch.empty(B, N, P) for _ in range(2))
    dtbar, tbar, du = (torch.empty(B, P, D) for _ in range(3))
    u = torch.empty(P, D)
    size = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    # pass 1: ∂s written as ∂a, read back, written again
    assert probe.bwd1_bytes(B, N, D, P, 2) == size(tok, attn, dtbar) + 3 * size(ds)
    assert probe.bwd2_bytes(B, N, D, P, 2) == size(tok, attn, ds, dtbar, u, grad_tok, tbar, du)
    # large: ~0.7 and ~1.3 GB, as the probe's comment says
    assert round(probe.bwd1_bytes(4096, 128, 512, 8, 2) / 1e9, 1) == 0.7
    assert round(probe.bwd2_bytes(4096, 128, 512, 8, 2) / 1e9, 1) == 1.3
