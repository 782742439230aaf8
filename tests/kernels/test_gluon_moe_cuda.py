"""gluon_moe's kernels on the H200 (`pytest -m cuda`). The hidden kernel: hw, ∂u (∂u3 for swiglu)
and the ∂w partials against float64 on fresh random operands, for each activation, dtype and bias
setting, with empty experts, padding slots, both tile sizes and one run of tiles. The
weight-gradient GEMM: ∂W against float64, written and added into fp32 totals run by run. The
forward's GEMM2: c against float64 at both tile sizes and column blocks, with and without b2,
whole and for one run of tiles. And the backward and the forward run each where it applies (the
whole region's output and gradients through them: test_triton_kernels_cuda.py)."""
import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kernel_cases import check_activation, phase_column_sums
from mha_compile.kernels import gluon_moe, reference
from mha_compile.kernels import triton_moe as moe

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-2}  # SPEC §4, 16-bit operands, fp32 accumulation


def slot_case(R, k, D, F, E, experts_used, dtype, bias, seed):
    """Slot rows of random routing over `experts_used` (the other experts empty), k distinct a row."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    used = torch.tensor(experts_used, device="cuda")
    pick = torch.rand(R, len(experts_used), device="cuda", generator=g).argsort(1)[:, :k]
    index = used[pick].to(torch.int32)
    groups = moe.group(index, E)
    rand = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=g) * scale).to(dtype)  # noqa: E731
    x, grad = rand(R, D), rand(R, D)
    xs, gs, _ = moe.gather_rows(x, None, groups, 1, dtype, grad)
    w1, w2 = rand(E, D, F, scale=D ** -0.5), rand(E, F, D, scale=F ** -0.5)
    b1 = rand(E, F, scale=0.5) if bias else None
    weight = torch.rand(R * k, device="cuda", generator=g)
    return groups, xs, gs, w1, b1, w2, weight


def float64_hidden(groups, xs, gs, w1, b1, w2, weight, act, w3=None):
    """(hw, ∂u, gw [S, F/64]) (and ∂u3 with W3) from SPEC §1's backward, in float64, 0 on padding
    slots."""
    valid = groups.slot_pair < groups.pairs
    e = groups.tile_expert.long().repeat_interleave(groups.tile)
    w = torch.where(valid, weight.double()[groups.slot_pair.clamp(max=groups.pairs - 1).long()], 0.0)[:, None]
    u = torch.einsum("sd,sdf->sf", xs.double(), w1.double()[e])
    if b1 is not None:
        u = u + b1.double()[e]
    g = torch.einsum("sd,sfd->sf", gs.double(), w2.double()[e])
    u3 = None if w3 is None else torch.einsum("sd,sdf->sf", xs.double(), w3.double()[e])
    h = reference.act_forward(act, u, u3)
    du, du3 = reference.act_backward(act, w * g, u, u3)
    gw = (h * g).view(len(h), -1, 64).sum(-1) * valid[:, None]
    return (w * h, du * valid[:, None], gw) + (() if w3 is None else (du3 * valid[:, None],))


def check_hidden(groups, got, want, dtype):
    """The kernel's (hw, ∂u, gw (, ∂u3)) against float64_hidden's, and zeros on padding slots."""
    hw, du, gw = got[:3]
    F = hw.shape[1]
    for name, out, ref in zip(("hw", "du", "gw", "du3"), (hw, du, gw[:, :F // 64]) + tuple(got[3:]), want):
        err = float((out.double() - ref).norm() / ref.norm())
        assert err < TOL[dtype], f"{name}: rel err {err:.2e}"
    padding = groups.slot_pair >= groups.pairs
    assert (hw[padding] == 0).all() and (du[padding] == 0).all() and (gw[padding, :F // 64] == 0).all()


CASES = [  # (R, k, D, F, E, experts used): TILE 64 (small's) with three empty experts; TILE 128
    pytest.param((600, 2, 192, 384, 7, [0, 2, 3, 6]), id="tile64-empty-experts"),
    pytest.param((1600, 2, 128, 256, 3, [0, 1, 2]), id="tile128"),
]


@gluon.jit
def _act_kernel(u_ptr, h_ptr, du_ptr, n, ACT: gl.constexpr, BLOCK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    offs = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    ok = offs < n
    u = gl.load(u_ptr + offs, mask=ok, other=0.0)
    h, du = gluon_moe._act(u, ACT)
    gl.store(h_ptr + offs, h, mask=ok)
    gl.store(du_ptr + offs, du, mask=ok)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_activation_against_float64(act):
    """The hidden kernel's act and act′ (gluon_moe._act) elementwise, to fp32's rounding: the kernel
    tests below compare at 16-bit tolerances, which a wrong polynomial coefficient would pass."""
    check_activation(act, "cuda", _act_kernel)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("act", list(gluon_moe.ACTS))
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize("bias", [True, False], ids=["b1", "no-b1"])
def test_matches_float64(case, act, dtype, bias):
    R, k, D, F, E, used = case
    groups, xs, gs, w1, b1, w2, weight = slot_case(R, k, D, F, E, used, dtype, bias, seed=R + F + len(act))
    assert groups.tile == (64 if E == 7 else 128) and (groups.slot_pair >= groups.pairs).any()  # and padding
    w3 = (torch.randn_like(w1, dtype=torch.float32) * D ** -0.5).to(dtype) if act == "swiglu" else None
    assert moe.hidden_kernel(xs, gs, w1, w2, w3, b1, act, groups.tile) == "gluon"
    hw, du, du3 = torch.full((3, groups.slots, F), float("nan"), device="cuda", dtype=dtype)
    gw = torch.full((groups.slots, moe.gw_columns(D, F, True)), float("nan"), device="cuda")
    gluon_moe.backward_hidden(xs, gs, groups, w1, b1, w2, weight, act, hw, du, gw, w3, None if w3 is None else du3)
    check_hidden(groups, (hw, du, gw, du3), float64_hidden(groups, xs, gs, w1, b1, w2, weight, act, w3), dtype)


def kept_u(groups, xs, w1, b1, dtype):
    """u = xs W1[e] + b1[e] on every slot row, rounded to `dtype` (what KEEP_HIDDEN keeps)."""
    e = groups.tile_expert.long().repeat_interleave(groups.tile)
    u = torch.einsum("sd,sdf->sf", xs.double(), w1.double()[e])
    return (u if b1 is None else u + b1.double()[e]).to(dtype)


KEPT_CASES = [*CASES, pytest.param((1600, 2, 512, 256, 3, [0, 1, 2]), id="tile128-d512-coop")]


@pytest.mark.parametrize("case", KEPT_CASES)
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias", [True, False], ids=["b1", "no-b1"])
def test_kept_u_matches_float64(case, act, bias):
    """The hidden kernels' KEEP_U variants (triton_moe.KEEP_HIDDEN, staged): u read from the
    forward's [S,F] (bf16) instead of computed, the ping-pong kernel at TILE 64 and 128 and the
    cooperative one at D = 512, against float64 from the same rounded u; the stages then hold
    gs and W2 only."""
    R, k, D, F, E, used = case
    dtype = torch.bfloat16
    groups, xs, gs, w1, b1, w2, weight = slot_case(R, k, D, F, E, used, dtype, bias, seed=R + F + len(act) + 1)
    u = kept_u(groups, xs, w1, b1, dtype)
    hw, du = torch.full((2, groups.slots, F), float("nan"), device="cuda", dtype=dtype)
    gw = torch.full((groups.slots, moe.gw_columns(D, F, True)), float("nan"), device="cuda")
    xs_nan = torch.full_like(xs, float("nan"))  # xs and W1 are not read: NaN there would show
    config = gluon_moe.COOP_CONFIG if D >= gluon_moe.COOP_MIN_D else None
    gluon_moe.backward_hidden(xs_nan, gs, groups, w1, b1, w2, weight, act, hw, du, gw, config=config, hidden=u)
    # float64_hidden's math from the kept (rounded) u rather than from xs and W1
    valid = groups.slot_pair < groups.pairs
    e = groups.tile_expert.long().repeat_interleave(groups.tile)
    w = torch.where(valid, weight.double()[groups.slot_pair.clamp(max=groups.pairs - 1).long()], 0.0)[:, None]
    g = torch.einsum("sd,sfd->sf", gs.double(), w2.double()[e])
    h = reference.act_forward(act, u.double(), None)
    du_want, _ = reference.act_backward(act, w * g, u.double(), None)
    want = (w * h, du_want * valid[:, None], (h * g).view(len(h), -1, 64).sum(-1) * valid[:, None])
    check_hidden(groups, (hw, du, gw), want, dtype)


# The cooperative kernel (TILE 128: mean ≥ 1024 pairs an expert): D = 512 (where the backward
# chooses it); D = 192 (6 K steps of 32 over a ring of 5: it wraps within a job), three column
# blocks and two empty experts. (Session 13's D = 192 case had 560 pairs an expert, so TILE 64,
# and failed on its own TILE assertion.)
COOP_CASES = [
    pytest.param((1600, 2, 512, 256, 3, [0, 1, 2]), id="tile128-d512"),
    pytest.param((2700, 2, 192, 384, 5, [0, 2, 4]), id="tile128-odd-ksteps-empty-experts"),
]


@pytest.mark.parametrize("case", COOP_CASES)
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize("bias", [True, False], ids=["b1", "no-b1"])
def test_cooperative_kernel_matches_float64(case, act, dtype, bias):
    """The cooperative hidden kernel (two consumers on each job's 128 rows), its shipped config."""
    R, k, D, F, E, used = case
    groups, xs, gs, w1, b1, w2, weight = slot_case(R, k, D, F, E, used, dtype, bias, seed=R + D + len(act))
    assert groups.tile == 128 and (groups.slot_pair >= groups.pairs).any()
    hw, du = torch.full((2, groups.slots, F), float("nan"), device="cuda", dtype=dtype)
    gw = torch.full((groups.slots, moe.gw_columns(D, F, True)), float("nan"), device="cuda")
    gluon_moe.backward_hidden(xs, gs, groups, w1, b1, w2, weight, act, hw, du, gw, config=gluon_moe.COOP_CONFIG)
    check_hidden(groups, (hw, du, gw), float64_hidden(groups, xs, gs, w1, b1, w2, weight, act), dtype)


@pytest.mark.parametrize("D", [128, gluon_moe.COOP_MIN_D], ids=["pingpong", "cooperative"])
def test_one_run_of_tiles_writes_only_its_rows(monkeypatch, D):
    """A run (Groups.tiles) reads its own slot buffers and writes gw rows at its offset only, in
    the kernel the backward chooses for its D (the cooperative one from COOP_MIN_D)."""
    groups, xs, gs, w1, b1, w2, weight = slot_case(3000, 2, D, 256, 4, [0, 1, 2, 3], torch.bfloat16, True, 7)
    launched = []
    real = gluon_moe._hidden_coop_kernel
    monkeypatch.setattr(gluon_moe, "_hidden_coop_kernel",
                        type("Spy", (), {"__getitem__": lambda self, grid: launched.append(grid) or real[grid]})())
    t0, t1 = 8, 24
    part = groups.tiles(t0, t1)
    rows = slice(t0 * groups.tile, t1 * groups.tile)
    F = w1.shape[2]
    gw = torch.full((groups.slots, moe.gw_columns(D, F, True)), -7.0, device="cuda")
    hw, du = torch.empty(2, part.slots, F, device="cuda", dtype=torch.bfloat16)
    gluon_moe.backward_hidden(xs[rows].contiguous(), gs[rows].contiguous(), part, w1, b1, w2, weight, "gelu", hw, du,
                              gw[rows])
    assert len(launched) == (D >= gluon_moe.COOP_MIN_D)
    want = float64_hidden(groups, xs, gs, w1, b1, w2, weight, "gelu")
    for name, got, ref in zip(("hw", "du", "gw"), (hw, du, gw[rows, :F // 64]), want):
        assert float((got.double() - ref[rows]).norm() / ref[rows].norm()) < 2e-2, name
    outside = torch.ones(groups.slots, dtype=torch.bool, device="cuda")
    outside[rows] = False
    assert (gw[outside] == -7.0).all()


def test_backward_runs_it_where_it_applies(monkeypatch):
    calls = []
    real = gluon_moe.backward_hidden
    monkeypatch.setattr(gluon_moe, "backward_hidden", lambda *a, **kw: calls.append(a[7]) or real(*a, **kw))
    for act, w3, want in (("gelu", False, ["gelu"]), ("swiglu", True, ["swiglu"])):
        calls.clear()
        groups, xs, gs, w1, b1, w2, weight = slot_case(1500, 2, 128, 256, 3, [0, 1, 2], torch.bfloat16, True, 3)
        R, D = 1500, 128
        x = torch.randn(R, D, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(R, D, device="cuda", dtype=torch.bfloat16)
        b2 = torch.randn(3, D, device="cuda", dtype=torch.bfloat16)
        moe.moe_backward(grad, x, None, weight.view(R, 2), groups, w1, b1, w2, b2, w1.clone() if w3 else None, act, 1)
        assert calls == want


def float64_wgrad(a, b, groups):
    bounds = groups.expert_slots.tolist()
    E = groups.experts
    out = torch.zeros(E, a.shape[1], b.shape[1], device="cuda", dtype=torch.float64)
    for e in range(E):
        out[e] = a[bounds[e]:bounds[E + e]].double().t() @ b[bounds[e]:bounds[E + e]].double()
    return out


def float64_column_sums(b, groups):
    """Σ_{s∈e} b[s], [E, J] in float64: float64_wgrad with A a column of ones."""
    return float64_wgrad(torch.ones_like(b[:, :1]), b, groups)[:, 0]


# The weight-gradient kernel's rows of ∂W come in 128s, so its TILE-64 case has D = 256 (D = 192
# goes to Triton: test_gluon_moe.py checks that reason).
WGRAD_CASES = [pytest.param((600, 2, 256, 384, 7, [0, 2, 3, 6]), id="tile64-empty-experts"), CASES[1]]


@pytest.mark.parametrize("case", WGRAD_CASES)
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize("split", [1, 3], ids=["whole", "split3"])
def test_weight_grads_match_float64(case, dtype, split):
    """∂W against float64, written whole, or split 3 ways into fp32 partial sums (rows e·3 + c) that
    add up to it, each split c holding the sum over its part of e's slots as the Triton kernel cuts
    them (the last splits of a small expert empty: zeros); and B's column sums (∂b1 beside ∂W1)
    the same way."""
    R, k, D, F, E, used = case
    groups, xs, gs, w1, b1, w2, weight = slot_case(R, k, D, F, E, used, dtype, True, seed=R + D)
    assert groups.tile == (64 if E == 7 else 128)
    du = torch.randn(groups.slots, F, device="cuda").to(dtype) * (groups.slot_pair < groups.pairs)[:, None]
    empty = [e for e in range(E) if e not in used]
    for a, b in ((xs, du), (du, gs)):  # ∂W1's shape (I = D, J = F; F = 384 takes BN 128), ∂W2's
        assert moe.wgrad_kernel(a, b, groups.tile, False, split) == "gluon"
        rows = E * split
        out_dtype = dtype if split == 1 else torch.float32
        out = torch.full((rows, a.shape[1], b.shape[1]), float("nan"), device="cuda", dtype=out_dtype)
        sums = torch.full((rows, b.shape[1]), float("nan"), device="cuda", dtype=out_dtype)
        gluon_moe.weight_grads(a, b, groups, out, accumulate=False, split=split, sums=sums)
        want = float64_wgrad(a, b, groups)
        got = out.view(E, split, *out.shape[1:])
        got_sums = sums.view(E, split, -1)
        for e in range(E):
            for c, (lo, hi) in enumerate(split_bounds(groups, e, split)):
                part = a[lo:hi].double().t() @ b[lo:hi].double()
                assert float((got[e, c].double() - part).norm()) <= TOL[dtype] * max(float(part.norm()), 1e-30), (e, c)
                col = b[lo:hi].double().sum(0)
                assert float((got_sums[e, c].double() - col).norm()) <= TOL[dtype] * max(float(col.norm()), 1e-30), (e, c)
        total = got.double().sum(1)
        assert (total[empty] == 0).all()  # experts without slots: zeros
        assert float((total - want).norm() / want.norm()) < TOL[dtype]
        assert (got_sums.double().sum(1)[empty] == 0).all()


def split_bounds(groups, e, split):
    """[(lo, hi)] of expert e's slots in each of `split` runs of whole tiles (_moe_wgrad_kernel's cut)."""
    bounds = groups.expert_slots.tolist()
    lo, hi = bounds[e], bounds[groups.experts + e]
    run = -(-((hi - lo) // groups.tile) // split) * groups.tile
    return [(min(lo + c * run, hi), min(lo + (c + 1) * run, hi)) for c in range(split)]


@pytest.mark.parametrize("stream", [False, True], ids=["jobs", "stream"])
def test_weight_grads_add_run_by_run(stream):
    """The runs of tiles: each run's sums added into fp32 totals, experts absent from it untouched;
    by (e, I block, J block) jobs, or by the STREAM schedule."""
    groups, xs, gs, w1, b1, w2, weight = slot_case(3000, 2, 128, 256, 4, [0, 1, 2, 3], torch.bfloat16, True, 11)
    want = float64_wgrad(xs, gs, groups)
    want_sums = float64_column_sums(gs, groups)
    total = torch.full(want.shape, 0.25, device="cuda")  # a starting sum the kernel must keep
    sums = torch.full(want_sums.shape, -0.5, device="cuda")
    runs = [(0, 10), (10, 27), (27, groups.num_tiles)]
    for t0, t1 in runs:
        rows = slice(t0 * groups.tile, t1 * groups.tile)
        part = groups.tiles(t0, t1)
        before, sums_before = total.clone(), sums.clone()
        gluon_moe.weight_grads(xs[rows].contiguous(), gs[rows].contiguous(), part, total, accumulate=True, sums=sums,
                               stream=stream)
        bounds = part.expert_slots.tolist()
        for e in range(4):
            if bounds[e] == bounds[4 + e]:
                assert torch.equal(total[e], before[e]), f"expert {e} has no slots in run {t0}-{t1}"
                assert torch.equal(sums[e], sums_before[e]), f"expert {e} has no slots in run {t0}-{t1}"
    # exact bf16 products summed in fp32 over ≤ ~1600 slots an expert: ≤ K·2⁻²⁴ ≈ 1e-4
    assert float((total.double() - 0.25 - want).norm() / want.norm()) < 1e-4
    assert float((sums.double() + 0.5 - want_sums).norm() / want_sums.norm()) < 1e-4


@pytest.mark.parametrize("stream", [False, True], ids=["jobs", "stream"])
def test_weight_grads_finish_run_by_run(monkeypatch, stream):
    """moe_backward's sums over runs of tiles (the large preset's path): triton_moe.weight_grads
    with `final` run by run, then close_totals. Totals and finals hold NaN before (torch.empty's);
    experts over two runs, experts whole in one, empty experts. ∂W in bf16 against float64 (fp32
    sums, one rounding); an expert over several runs is left pending (its last run adds into the
    totals) and an empty one is not; Σb added into its rows (moe.sum_rows an expert) as without
    `final`, added up after the last run; the same bits on a second pass. STREAM's middle run holds more tiles than programs: whole tiles and tiles in
    pieces both."""
    monkeypatch.setattr(gluon_moe, "WGRAD_STREAM", stream)
    E, used, D, J = 7, [0, 1, 2, 4, 5, 6], 512, 2048
    groups, xs, _, _, _, _, _ = slot_case(3000, 2, D, 128, E, used, torch.bfloat16, True, seed=17)
    b = (torch.randn(groups.slots, J, device="cuda") * (groups.slot_pair < groups.pairs)[:, None]).bfloat16()
    tile, bounds = groups.tile, groups.expert_slots.tolist()
    middle = lambda e: (bounds[e] + bounds[E + e]) // 2 // tile  # noqa: E731 - a tile boundary inside e's slots
    runs = [(0, middle(0)), (middle(0), middle(5)), (middle(5), groups.num_tiles)]
    spans = [sum(max(bounds[e], t0 * tile) < min(bounds[E + e], t1 * tile) for t0, t1 in runs) for e in range(E)]
    assert spans == [2, 1, 1, 0, 1, 2, 1]  # 0 and 5 over two runs, 3 with no slots
    tiles_a_run = [sum(max(bounds[e], t0 * tile) < min(bounds[E + e], t1 * tile) for e in range(E))
                   * (D // 128) * (J // 256) for t0, t1 in runs]
    assert tiles_a_run[1] > moe.num_sms(xs.device)
    want, want_sums = float64_wgrad(xs, b, groups), float64_column_sums(b, groups)
    passes = []
    for _ in range(2):
        total = torch.full((E, D, J), float("nan"), device="cuda")
        final = torch.full((E, D, J), float("nan"), device="cuda", dtype=torch.bfloat16)
        sums = torch.zeros(E * moe.sum_rows(D), J, device="cuda")
        pending = torch.zeros(3, E, device="cuda", dtype=torch.int32)
        for t0, t1 in runs:
            rows = slice(t0 * tile, t1 * tile)
            part = groups.tiles(t0, t1)
            assert moe.wgrad_kernel(xs, b, tile, True, 1, True, stream, gluon_moe.wgrad_sum_rows(D), True) == "gluon"
            moe.weight_grads(xs[rows].contiguous(), b[rows].contiguous(), None, part, into=(total, None, sums),
                             sums=True, final=(final, None), pending=pending[0])
        moe.close_totals([(total, final)], groups, pending)
        sums = moe.sum_splits(sums, torch.empty(E, J, device="cuda"), moe.sum_rows(D))
        passes.append((final, sums, pending))
    assert float((final.double() - want).norm() / want.norm()) < 3e-3
    for e in range(E):
        if e in used:
            assert float((final[e].double() - want[e]).norm() / want[e].norm()) < 3e-3, e
        else:
            assert (final[e] == 0).all(), e
    assert float((sums.double() - want_sums).norm() / want_sums.norm()) < 1e-4
    assert all(pending[0, e] == 1 for e in range(E) if spans[e] > 1)
    assert all(pending[0, e] == 0 for e in range(E) if spans[e] == 0) and not pending[1:].any()
    assert all(torch.equal(a, b) for a, b in zip(*passes))

@pytest.mark.parametrize("R, k, D, J, E, used", [
    # I = J = 128: one tile an expert, 24 K steps each over 132 programs: each step its own program
    pytest.param(3000, 1, 128, 128, 2, [0, 1], id="one-step-a-program"),
    # BN 256, two row blocks (Σb on the first), empty experts: a tile's steps over ~11 programs
    pytest.param(6000, 2, 256, 512, 5, [0, 2, 4], id="bn256-empty-experts"),
    # 5 experts × 32 tiles: one whole wave of 132 tiles, then the last 28 tiles by K steps
    pytest.param(1200, 2, 512, 2048, 5, [0, 1, 2, 3, 4], id="whole-wave-then-steps"),
])
def test_weight_grads_stream_adds_in_step_order(R, k, D, J, E, used):
    """Added into totals (STREAM: each program an equal share of the K steps, a tile's parts added
    in the order of their steps): against float64, ∂W and Σb; the same bits on every call (parts
    added out of order would round differently)."""
    groups, xs, _, _, _, _, _ = slot_case(R, k, D, 128, E, used, torch.bfloat16, True, seed=R + J)
    b = (torch.randn(groups.slots, J, device="cuda") * (groups.slot_pair < groups.pairs)[:, None]).to(torch.bfloat16)
    assert moe.wgrad_kernel(xs, b, groups.tile, True, 1, True) == "gluon"
    want, want_sums = float64_wgrad(xs, b, groups), float64_column_sums(b, groups)
    start = torch.rand(want.shape, device="cuda"), torch.rand(want_sums.shape, device="cuda")
    calls = []
    for _ in range(3):
        total, sums = (t.clone() for t in start)
        gluon_moe.weight_grads(xs, b, groups, total, accumulate=True, sums=sums, stream=True)
        calls.append((total, sums))
    assert float((total.double() - start[0] - want).norm() / want.norm()) < 1e-4
    assert float((sums.double() - start[1] - want_sums).norm() / want_sums.norm()) < 1e-4
    for e in set(range(E)) - set(used):  # experts without slots: untouched
        assert torch.equal(total[e], start[0][e]) and torch.equal(sums[e], start[1][e])
    for total_again, sums_again in calls[:-1]:
        assert torch.equal(total_again, total) and torch.equal(sums_again, sums)


@pytest.mark.parametrize("mode", ["whole", "split3", "jobs+=", "stream+="])
def test_weight_grads_sums_spread_over_row_blocks(mode):
    """sum_rows = I/128 (the default; MHA_COMPILE_WGRAD_SUM_SPREAD=0: 1): B's column sums in that
    many fp32 rows an expert, row i over the K steps the jobs of row block i take (k/64 mod R = i), against float64,
    with empty experts; written (whole, or split 3 ways) or added into totals (jobs, STREAM), where
    experts without slots stay untouched. ∂W itself as without the spread."""
    R, k, D, F, E, used = 3000, 2, 512, 256, 5, [0, 2, 3, 4]
    groups, xs, _, _, _, _, _ = slot_case(R, k, D, F, E, used, torch.bfloat16, True, seed=21)
    du = (torch.randn(groups.slots, F, device="cuda") * (groups.slot_pair < groups.pairs)[:, None]).bfloat16()
    rows, split = D // 128, 3 if mode == "split3" else 1
    accumulate = mode.endswith("+=")
    fill = torch.zeros if accumulate else (lambda *s, **kw: torch.full(s, float("nan"), **kw))
    out = fill(E * split, D, F, device="cuda", dtype=torch.float32 if accumulate or split > 1 else torch.bfloat16)
    sums = fill(E * split * rows, F, device="cuda", dtype=torch.float32)
    gluon_moe.weight_grads(xs, du, groups, out, accumulate, split=split, sums=sums,
                           stream=(mode == "stream+=") if accumulate else None, sum_rows=rows)
    want = phase_column_sums(du, groups, split, rows, gluon_moe.WGRAD_BK)
    got = sums.view(E, split, rows, F).double().cpu()
    for e in range(E):
        for c in range(split):
            for i in range(rows):
                ref = want[e, c, i]
                # exact bf16 values summed in fp32: ≤ K·2⁻²⁴ (as the totals' test)
                assert float((got[e, c, i] - ref).norm()) <= 1e-4 * max(float(ref.norm()), 1e-30), (e, c, i)
    assert float((out.double().view(E, split, D, F).sum(1) - float64_wgrad(xs, du, groups)).norm()
                 / float64_wgrad(xs, du, groups).norm()) < 1e-2


def test_weight_grads_dispatch(monkeypatch):
    """weight_grads takes the Gluon GEMM for one B, added into totals (the runs of tiles) or in
    split sums (medium's), and the Triton one for two Bs (swiglu's ∂W1, ∂W3)."""
    calls = []
    real = gluon_moe.weight_grads
    monkeypatch.setattr(gluon_moe, "weight_grads", lambda *a, **kw: calls.append(a[4:]) or real(*a, **kw))
    groups, xs, gs, w1, b1, w2, weight = slot_case(3000, 2, 128, 256, 4, [0, 1, 2, 3], torch.bfloat16, True, 5)
    total, sums = torch.zeros(4, 128, 128, device="cuda"), torch.zeros(4, 128, device="cuda")
    assert moe.weight_grads(xs, gs, None, groups, into=(total, None, sums), sums=True)[2] is sums
    assert calls == [(True, 1)]
    assert float((total.double() - float64_wgrad(xs, gs, groups)).norm() / total.double().norm()) < 1e-4
    splits = moe.gluon_wgrad_splits(groups.slots, 4, 128, 128, xs.device)
    assert splits > 1
    split, _, split_sums = moe.weight_grads(xs, gs, None, groups, sums=True)  # split sums, added by _sum_splits_kernel
    pair = moe.weight_grads(xs, gs, gs, groups, sums=True)  # two Bs: the Triton kernel, which does not sum B
    assert calls == [(True, 1), (False, splits)]
    assert pair[2] is None and split_sums.dtype == torch.bfloat16
    for got in (split, *pair[:2]):
        assert float((got.double() - total.double()).norm() / total.double().norm()) < 2e-2
    want_sums = float64_column_sums(gs, groups)
    for got in (sums, split_sums):
        assert float((got.double() - want_sums).norm() / want_sums.norm()) < 2e-2


def float64_gemm2(groups, h, w2, b2, weight):
    """c [S, D] = w · (h W2[e] + b2[e]) from SPEC §1's forward, in float64, 0 on padding slots
    (whatever h holds there)."""
    bounds, E = groups.expert_slots.tolist(), groups.experts
    out = torch.zeros(groups.slots, w2.shape[2], device="cuda", dtype=torch.float64)
    for e in range(E):
        lo, hi = bounds[e], bounds[E + e]
        out[lo:hi] = h[lo:hi].double() @ w2[e].double() + (0.0 if b2 is None else b2[e].double())
    valid = groups.slot_pair < groups.pairs
    w = torch.where(valid, weight.double()[groups.slot_pair.clamp(max=groups.pairs - 1).long()], 0.0)
    return out * w[:, None]


def gemm2_case(case, dtype, bias, seed):
    """(groups, h [S, F] random on every slot row, padding ones too, W2, b2 or None, weight)."""
    R, k, D, F, E, used = case
    groups, _, _, _, _, w2, weight = slot_case(R, k, D, F, E, used, dtype, False, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    h = torch.randn(groups.slots, F, device="cuda", generator=g).to(dtype)
    b2 = (torch.randn(E, D, device="cuda", generator=g) * 0.5).to(dtype) if bias else None
    return groups, h, w2, b2, weight


# (R, k, D, F, E, experts used): D = N, the output columns (jobs of 256 where D allows, else 128:
# both at each TILE), F = K (steps of 64). Every case is one the kernel takes (asserted below);
# D = 192 is not (test_gemm2_declines_what_it_cannot_take).
GEMM2_CASES = [
    pytest.param((600, 2, 256, 384, 7, [0, 2, 3, 6]), id="tile64-D256-empty-experts"),
    pytest.param((600, 2, 128, 320, 5, [0, 1, 3]), id="tile64-D128"),
    pytest.param((2200, 2, 384, 256, 4, [0, 1, 3]), id="tile128-D384-empty-expert"),
    pytest.param((1600, 2, 256, 192, 3, [0, 1, 2]), id="tile128-D256"),
]
GEMM2_TILES = {600: 64, 2200: 128, 1600: 128}


@pytest.mark.parametrize("case", GEMM2_CASES)
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize("bias", [True, False], ids=["b2", "no-b2"])
def test_gemm2_matches_float64(case, dtype, bias):
    groups, h, w2, b2, weight = gemm2_case(case, dtype, bias, seed=case[0] + case[2] + int(bias))
    assert groups.tile == GEMM2_TILES[case[0]] and (groups.slot_pair >= groups.pairs).any()  # and padding
    c = torch.full((groups.slots, w2.shape[2]), float("nan"), device="cuda", dtype=dtype)
    assert moe.gemm2_kernel(h, w2, c, b2, weight, groups.tile) == "gluon"
    gluon_moe.slots_gemm(h, w2, groups, c, b2, weight)
    want = float64_gemm2(groups, h, w2, b2, weight)
    err = float((c.double() - want).norm() / want.norm())  # NaN (fails) where a row was not written
    assert err < TOL[dtype], f"rel err {err:.2e}"
    padding = groups.slot_pair >= groups.pairs
    assert (c[padding] == 0).all()


@pytest.mark.parametrize("case", [GEMM2_CASES[0], GEMM2_CASES[2]], ids=["tile64", "tile128"])
def test_gemm2_one_run_of_tiles_writes_only_its_rows(monkeypatch, case):
    """A run (Groups.tiles), as moe_forward calls it: its own h rows, and c's rows of the run
    written through triton_moe.slots_gemm's dispatch; c's other rows untouched."""
    groups, h, w2, b2, weight = gemm2_case(case, torch.bfloat16, True, seed=17)
    t0, t1 = 3, groups.num_tiles - 2
    part = groups.tiles(t0, t1)
    rows = slice(t0 * groups.tile, t1 * groups.tile)
    E, F, D = w2.shape
    c = torch.full((groups.slots, D), -7.0, device="cuda", dtype=torch.bfloat16)
    assert moe.gemm2_kernel(h[rows], w2, c[rows], b2, weight, part.tile) == "gluon"
    calls = []
    real = gluon_moe.slots_gemm
    monkeypatch.setattr(gluon_moe, "slots_gemm", lambda *a, **kw: calls.append(a[3].data_ptr()) or real(*a, **kw))
    moe.slots_gemm(h[rows].contiguous(), w2, (F * D, D, 1), D, part, bias=b2, scale=weight, out=c[rows])
    assert calls == [c[rows].data_ptr()]
    want = float64_gemm2(groups, h, w2, b2, weight)[rows]
    assert float((c[rows].double() - want).norm() / want.norm()) < TOL[torch.bfloat16]
    assert (c[rows][part.slot_pair >= part.pairs] == 0).all()
    outside = torch.ones(groups.slots, dtype=torch.bool, device="cuda")
    outside[rows] = False
    assert (c[outside] == -7.0).all()


def test_gemm2_declines_what_it_cannot_take():
    """D = 192 (jobs of 128 columns do not divide it) and fp32 go to the Triton kernel, whose c is
    right; ∂x's call (W1 read transposed) never asks for the Gluon GEMM."""
    groups, h, w2, b2, weight = gemm2_case((1600, 2, 192, 256, 3, [0, 1, 2]), torch.bfloat16, True, seed=5)
    D = w2.shape[2]
    c = torch.empty(groups.slots, D, device="cuda", dtype=torch.bfloat16)
    assert moe.gemm2_kernel(h, w2, c, b2, weight, groups.tile) == "triton"
    assert moe.gemm2_kernel(h.float(), w2.float(), c.float(), b2.float(), weight, groups.tile) == "triton"
    got = moe.slots_gemm(h, w2, (w2.shape[1] * D, D, 1), D, groups, bias=b2, scale=weight)
    want = float64_gemm2(groups, h, w2, b2, weight)
    assert float((got.double() - want).norm() / want.norm()) < TOL[torch.bfloat16]


def test_forward_runs_gemm2_in_gluon_where_it_applies(monkeypatch):
    """moe_forward's GEMM2 goes to the Gluon kernel (once a run of tiles, into c's rows of the run),
    and not with MHA_COMPILE_GLUON=0 (gluon_moe.ENABLED); ∂x in the backward stays in Triton.
    The output against the float64 reference of the experts (SPEC §1)."""
    calls = []
    real = gluon_moe.slots_gemm
    monkeypatch.setattr(gluon_moe, "slots_gemm", lambda *a, **kw: calls.append(a[3].shape[0]) or real(*a, **kw))
    g = torch.Generator(device="cuda").manual_seed(23)
    R, D, F, E, k = 1500, 128, 256, 3, 2
    index = torch.rand(R, E, device="cuda", generator=g).argsort(1)[:, :k].to(torch.int32)
    groups = moe.group(index, E)
    rand = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=g) * scale).to(torch.bfloat16)  # noqa: E731
    x, w1, b1 = rand(R, D), rand(E, D, F, scale=D ** -0.5), rand(E, F)
    w2, b2 = rand(E, F, D, scale=F ** -0.5), rand(E, D)
    weight = torch.rand(R, k, device="cuda", generator=g)
    want = reference.moe_forward(*(t.double() for t in (x, weight)), index.long(),
                                 *(t.double() for t in (w1, b1, w2, b2)), None, "gelu")
    err = lambda got: float((got.double() - want).norm() / want.norm())  # noqa: E731
    out = moe.moe_forward(x, None, weight, groups, w1, b1, w2, b2, None, "gelu", 1, torch.bfloat16)
    assert calls == [groups.slots] and err(out) < TOL[torch.bfloat16]
    # runs of tiles (the large preset's slot buffers): one call a run, c's rows of it
    monkeypatch.setattr(moe, "SLOT_CHUNK_BYTES", 256 << 10)
    runs = moe.tile_runs(groups, (D + F) * 2)
    assert len(runs) > 2
    calls.clear()
    out = moe.moe_forward(x, None, weight, groups, w1, b1, w2, b2, None, "gelu", 1, torch.bfloat16)
    assert calls == [(t1 - t0) * groups.tile for t0, t1 in runs] and err(out) < TOL[torch.bfloat16]
    monkeypatch.setattr(gluon_moe, "ENABLED", False)
    calls.clear()
    out = moe.moe_forward(x, None, weight, groups, w1, b1, w2, b2, None, "gelu", 1, torch.bfloat16)
    assert calls == [] and err(out) < TOL[torch.bfloat16]
    monkeypatch.setattr(gluon_moe, "ENABLED", True)
    moe.moe_backward(rand(R, D), x, None, weight, groups, w1, b1, w2, b2, None, "gelu", 1)
    assert calls == []  # ∂x = ∂u W1ᵀ reads W1 transposed: the Triton kernel


def test_back_to_back_launches_on_new_buffers():
    """Launches of the hidden kernel queued back to back on different buffers and sizes (no
    synchronisation between them) must each read and write their own (its descriptors are made on
    the host; the other Gluon kernels', tested likewise below, on the device)."""
    cases = [slot_case(R, 2, 128, 256, 3, [0, 1, 2], torch.bfloat16, True, seed) for R, seed in
             ((1500, 11), (700, 12), (1500, 13), (2300, 14))]
    outs = []
    for groups, xs, gs, w1, b1, w2, weight in cases:
        F = w1.shape[2]
        hw, du = torch.full((2, groups.slots, F), float("nan"), device="cuda", dtype=torch.bfloat16)
        gw = torch.full((groups.slots, moe.gw_columns(128, F, True)), float("nan"), device="cuda")
        gluon_moe.backward_hidden(xs, gs, groups, w1, b1, w2, weight, "gelu", hw, du, gw)
        outs.append((hw, du, gw[:, :F // 64]))
    for (groups, xs, gs, w1, b1, w2, weight), got in zip(cases, outs):
        want = float64_hidden(groups, xs, gs, w1, b1, w2, weight, "gelu")
        for name, g, ref in zip(("hw", "du", "gw"), got, want):
            assert float((g.double() - ref).norm() / ref.norm()) < 2e-2, name


def test_weight_grads_back_to_back_on_new_buffers():
    """As test_back_to_back_launches_on_new_buffers, for the weight-gradient kernel (whole and in
    split sums): launches queued on different slot buffers and sizes, checked after."""
    cases = [slot_case(R, 2, 128, 256, 3, [0, 1, 2], torch.bfloat16, False, seed) for R, seed in
             ((1500, 21), (900, 22), (2100, 23))]
    outs = []
    for split, (groups, xs, gs, *_) in zip((1, 3, 1), cases):
        out = torch.full((3 * split, 128, 128), float("nan"), device="cuda",
                         dtype=torch.bfloat16 if split == 1 else torch.float32)
        gluon_moe.weight_grads(xs, gs, groups, out, accumulate=False, split=split)
        outs.append(out.view(3, split, 128, 128).double().sum(1))
    for (groups, xs, gs, *_), got in zip(cases, outs):
        want = float64_wgrad(xs, gs, groups)
        assert float((got - want).norm() / want.norm()) < TOL[torch.bfloat16]


def test_gemm2_back_to_back_on_new_buffers():
    """As test_back_to_back_launches_on_new_buffers, for GEMM2 at both tile sizes: launches queued
    on different operands and sizes, checked after."""
    cases = [gemm2_case(GEMM2_CASES[i].values[0], torch.bfloat16, True, seed=40 + i) for i in (3, 0, 2, 1)]
    outs = []
    for groups, h, w2, b2, weight in cases:
        c = torch.full((groups.slots, w2.shape[2]), float("nan"), device="cuda", dtype=torch.bfloat16)
        gluon_moe.slots_gemm(h, w2, groups, c, b2, weight)
        outs.append(c)
    for (groups, h, w2, b2, weight), c in zip(cases, outs):
        want = float64_gemm2(groups, h, w2, b2, weight)
        assert float((c.double() - want).norm() / want.norm()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("tile", sorted(gluon_moe.UP_CONFIGS))
@pytest.mark.parametrize("act,dtype,bias", [("gelu", torch.bfloat16, True), ("gelu_tanh", torch.float16, False),
                                            ("silu", torch.bfloat16, False)])
def test_gluon_gemm1_against_float64(tile, act, dtype, bias):
    """gluon_moe's GEMM1 (GLUON_UP; bench/gemm_probe.py's up_gluon times it against the Triton
    one) at each TILE's config: h = act(xs W1[e] + b1[e]) on every slot row,
    padding rows included (act(b1), xs being 0 there), against float64, with an empty expert and R
    not a multiple of the tile."""
    R, k, D, F, E = 293, 2, 128, 512, 5
    groups, _, _, w1, b1, _, _ = slot_case(R, k, D, F, E, [0, 1, 3, 4], dtype, bias, seed=7)
    groups = moe.Groups(groups.index, E, tile)
    xs, _, _ = moe.gather_rows(torch.randn(R, D, device="cuda", dtype=dtype), None, groups, 1, dtype)
    h = torch.empty(groups.slots, F, device="cuda", dtype=dtype)
    assert gluon_moe.up_unsupported(xs, w1, h, act, tile) is None
    gluon_moe.experts_up(xs, groups, w1, b1, act, h)
    e = groups.tile_expert.long().repeat_interleave(tile)
    u = torch.einsum("sd,sdf->sf", xs.double(), w1.double()[e])
    if b1 is not None:
        u = u + b1.double()[e]
    want = reference.act_forward(act, u, None)
    err = float((h.double() - want).norm() / want.norm())
    assert err <= TOL[dtype], f"{act} TILE {tile}: relative error {err:.2e}"
    # KEEP_U (triton_moe.KEEP_HIDDEN, staged): u written too, through the same staging tile, and h
    # still the same
    kept, h2 = torch.full_like(h, float("nan")), torch.full_like(h, float("nan"))
    gluon_moe.experts_up(xs, groups, w1, b1, act, h2, hidden=kept)
    err_u = float((kept.double() - u).norm() / u.norm())
    assert err_u <= TOL[dtype] and torch.equal(h2, h), f"{act} TILE {tile}: u relative error {err_u:.2e}"
    # two staging tiles a consumer (bench/gemm_probe.py's stage_tiles=2 configs, staged): the same h
    config = dict(gluon_moe.UP_CONFIGS[tile], stage_tiles=2, nbuf=3 if tile == 128 else 4)
    h3 = torch.full_like(h, float("nan"))
    gluon_moe.experts_up(xs, groups, w1, b1, act, h3, config)
    assert torch.equal(h3, h), f"{act} TILE {tile}: stage_tiles=2 differs"
