"""The latency- and bandwidth-bound small kernels alone, under each launch config: which are mistuned,
as the router's were (bench/router_probe.py: its backward went 256 -> 167 us at large at one
warp a program).

    PYTHONPATH=. python bench/small_kernels_probe.py [--presets medium,large]
                                                     [--kernels tile_sums,gather,matmul,pool,pool_bwd1,pool_bwd2,
                                                                pool_bwd_one,bias_sums,router_wgrad,inv_logits,
                                                                column_sums,pool_single]

On the H200 (bf16; ~1-2 min for both presets without pool_bwd1 and pool_bwd2, which add some 3-5
min, not yet measured: ~90 configs to compile and time; bench/results/small_kernels_probe.txt), at each
preset on the router's grouping of random tokens (bench/router_probe.py's `routing`), the whole
slot layout:
  tile_sums  triton_moe._tile_sums_kernel on ∂u [S,F] (∂b1's per-tile sums in the backward):
             BLOCK × BLOCK_R × warps
  gather     triton_moe._gather_rows_kernel as the step calls it (at large in runs of tiles, 2 in
             the forward and 3 in the backward): the forward's x (+ inv), the backward's x and G
             with b2 (∂w's ⟨G, b2⟩ columns and ∂b2's partials) and without: gather_rows'
             block_s × block_d × num_warps (block_s stays 16 with b2)
  matmul     triton_matmul._matmul_f32_kernel at each distinct call of the pool's projections
             in one forward and backward (recorded there, 7 calls a step): BLOCK_M/N/K, warps,
             stages; the fastest config is named for each call
  pool       triton_pool._pool_fwd_kernel: BLOCK_N × warps × stages
  pool_bwd1  triton_pool._pool_bwd_scores_kernel, the backward's pass 1 (∂s): BLOCK_N × warps × stages
  pool_bwd2  triton_pool._pool_bwd_kernel, pass 2 (∂tok, t̄, the ∂u partials): BLOCK_N × BLOCK_D ×
             warps × stages; both on the forward's attn of the preset's tokens and a random ∂t̄
  pool_bwd_one triton_pool._pool_bwd_one_kernel, both passes in one kernel (BWD_ONE_KERNEL): BLOCK_N ×
             BLOCK_N2 × BLOCK_D2 × warps × stages, after the two kernels' time as shipped
  bias_sums  triton_moe._sum_tiles_kernel, ∂b2's per-expert sums of the gather's partials, as the
             backward calls it (at large on one run of tiles, added into totals): BLOCK × BLOCK_R × warps
  router_wgrad triton_router._router_wgrad_kernel, ∂Wg, with the partials' sum: block_d × BLOCK_R ×
             warps × runs of rows
  inv_logits triton_router._inv_logits_kernel, the forward split's inv Wgᵀ: BLOCK_R × warps
  column_sums triton_pool.column_sums, the pool backward's sums over the batch rows (its two
             launches of _column_sums_kernel) of the ∂u partials [B, P·D] and of ∂inv [B, D], fp32:
             block_r × block_c × warps with VALUES or 2·VALUES loaded values a thread × programs
             of its first pass (40 us a large step for ~72 MB on the H200, session 32)
  pool_single triton_pool._pool_bwd_single_kernel, the backward in one pass over tok (single_pass):
             BLOCK_N × warps × stages of its list, after the two passes as shipped (one kernel where
             tok fits in L2; session 58 on an H100: 574.7 against 677.7 us at large,
             bench/results/h100_s58_pool_single.txt)
The tile_sums and gather sweeps take the [rows, columns] tiles holding VALUES values a thread
(loaded or accumulated) for each warp count, beside the shipped configs.
Each row: the config, the median CUDA-graph time (gemm_probe.variant), the rate of the bytes the
call must read and write once (bwd1_bytes, bwd2_bytes for the pool's backward), registers,
spills, and how far its outputs are from the shipped config's: copies (the gathered rows) bit for
bit, fp32 sums to within TOLERANCE of their largest value (rounding in another order), 16-bit
ones (the pool's ∂tok) to one rounding of it, flagged MISMATCH otherwise. `*` marks the shipped config
(printed first: the autotuner's pick where the kernel is tuned), `+` the rest of its list.
A config that fails to build prints FAILED and the probe goes on.

Without a GPU (TRITON_INTERPRET=1, fp32, `--presets tiny`) each config runs once in the
interpreter and is compared, nothing is timed: what tests/bench/test_small_kernels_probe.py runs.
"""
import argparse
import linecache
import sys
from types import SimpleNamespace

import torch
import triton

from router_probe import routing, row
from mha_compile.kernels import reference, triton_matmul, triton_moe, triton_pool, triton_router, triton_util
from mha_compile.kernels.triton_util import pow2

WARPS = (1, 2, 4, 8)
VALUES = 32  # values a thread in the swept tiles: BLOCK·BLOCK_R (tile_sums), block_s·block_d (gather)
TOLERANCE = 1e-5  # sums in another order: the largest difference, relative to the largest value
TILE_SUMS_ROWS, TILE_SUMS_COLUMNS = (16, 32, 64, 128), (32, 64, 128, 256)  # BLOCK_R (≤ TILE), BLOCK
GATHER_ROWS, GATHER_COLUMNS = (16, 32, 64), (64, 128, 256)  # block_s (GATHER_BLOCK_S with b2), block_d
# column_sums' block_r, block_c, and its first pass's programs (2, 4 and 8 an SM of the H200's 132)
COLUMN_ROWS, COLUMN_COLUMNS, COLUMN_PROGRAM_COUNTS = (8, 16, 32), (128, 256, 512), (264, 528, 1056)
# Beside _matmul's list, fewer warps (latency-bound, as the router's kernels were).
MATMUL_MORE = [dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=2, num_stages=3),
               dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=2, num_stages=4)]
# Beside _attend's list, BLOCK_N 64 (out of it: it fails to build at many D on Triton 3.6) and
# 32 with other stages.
# And the shipped [32] at 4 warps and 2 stages capped at 128 registers: uncapped it takes 155 and
# 3 programs an SM (ncu, session 24: 18% occupancy, L1/TEX at 77%); at 128 a fourth fits (its
# 50 KB of shared memory too), for 72 bytes spilled (offline, sm_90a, large).
POOL_MORE = [dict(BLOCK_N=64, num_warps=4, num_stages=3), dict(BLOCK_N=64, num_warps=8, num_stages=3),
             dict(BLOCK_N=32, num_warps=4, num_stages=2), dict(BLOCK_N=32, num_warps=8, num_stages=4),
             dict(BLOCK_N=32, num_warps=4, num_stages=2, maxnreg=128)]
# The backward's two passes move ~0.7 and ~1.3 GB at large: beside their lists, wider tiles. Every
# config of the grids below builds for large (bf16, sm_90a, bench/offline_sass.compile_stats); the
# ones left out spill, overflow shared memory, or are cut to hold a sweep to 24 configs.
# Pass 1 (one program a batch row, all of D): BLOCK_N 16/32/64 × warps 4/8/16 × stages 2/3/4, 42-80
# registers and no spills, but BLOCK_N 64 with 4 stages: 274 KiB of shared memory (tok's tiles,
# [64, 512] bf16 a stage), past the H200's 227.
BWD1_MORE = [dict(BLOCK_N=n, num_warps=w, num_stages=s)
             for n in (16, 32, 64) for w in (4, 8, 16) for s in (2, 3, 4) if (n, s) != (64, 4)]
# Pass 2 (a program a batch row and BLOCK_D columns): (BLOCK_N, BLOCK_D, warps, stages tried). Of
# the grid BLOCK_D 64/128/256/512 × BLOCK_N 16/32/64 × warps 4/8 × stages 2/3/4 all build at
# large; left out for spills or ptxas' cap of 255 registers: at BLOCK_D 512, 4 warps (255, up to
# 1080 B spilled), BLOCK_N 64 (3.9-5.2 KB spilled; with 4 stages 256 KiB of shared memory) and
# BLOCK_N 32 with 4 stages (255); at 256, BLOCK_N 64 with 4 warps (548-1064 B spilled) or 3-4
# stages (255, 44 B spilled with 4), and BLOCK_N 32 with 4 warps (244-255). The rest spill
# nothing (56-248 registers): kept are the widest blocks with 2-4 stages and, of the 36 at
# BLOCK_D ≤ 128, a few beside the shipped ones, 24 configs in all with the shipped list; and
# one capped at 128 registers (below).
BWD2_MORE = [dict(BLOCK_N=n, BLOCK_D=d, num_warps=w, num_stages=s) for n, d, w, stages in (
    (16, 512, 8, (2, 3, 4)), (32, 512, 8, (2, 3)),  # one program a batch row at large: a and ∂s read once
    (16, 256, 4, (2, 3, 4)), (16, 256, 8, (2, 3, 4)), (32, 256, 8, (2, 4)), (64, 256, 8, (2,)),
    (16, 128, 4, (3,)), (32, 128, 8, (3,)), (64, 128, 8, (2,)),
    (32, 64, 4, (3,)), (64, 64, 8, (3,))) for s in stages] + [
    # the shipped [16, 256] at 4 warps and 4 stages (168 registers, 3 programs an SM) capped at 128
    # for a fourth program: 60 bytes spilled (offline, sm_90a, large); pass 2 lives on its
    # occupancy (PERF_NOTES v26)
    dict(BLOCK_N=16, BLOCK_D=256, num_warps=4, num_stages=4, maxnreg=128)]

# Both passes in one kernel: beside _attend_bwd_one's list, configs of pass 2's blocks with more
# registers or fewer warps (all build at large without spills, offline sm_90a: 96-200 registers);
# none was within 5 us of the list's best at medium, nor within 40 of the two kernels at large
# (session 28, bench/results/pool_bwd_one_probe.txt).
BWD_ONE_MORE = [dict(BLOCK_N=n, BLOCK_N2=n2, BLOCK_D2=d2, num_warps=w, num_stages=s) for n, n2, d2, w, s in (
    (16, 16, 64, 4, 3), (32, 16, 64, 8, 3), (16, 32, 64, 8, 2), (16, 32, 128, 8, 2), (32, 32, 128, 8, 2),
    (16, 16, 256, 8, 2), (32, 16, 256, 8, 3), (16, 32, 128, 4, 2), (16, 32, 256, 8, 2), (16, 16, 256, 4, 3),
    (16, 32, 128, 4, 3))]


def tiles(rows, columns, values=VALUES):
    """(rows, columns, warps) for each warp count: every [rows, columns] tile with `values`
    values a thread."""
    return [(r, c, w) for w in WARPS for r in rows for c in columns if r * c == values * 32 * w]


def shipped(launcher, run):
    """The config `launcher` runs for run()'s call: its autotuner's pick on the GPU (tuned now
    unless this process has tuned its key), else its first config (the interpreter, or
    MHA_COMPILE_NO_AUTOTUNE)."""
    saved, launcher.best = launcher.best, {}
    try:
        run()
        picks = list(launcher.best.values())
    finally:
        launcher.best = {**saved, **launcher.best}
    first = launcher.configs[0]
    return {k: picks[-1][k] for k in first} if picks else dict(first)


def ordered(*configs):
    """The configs in order, each once."""
    out = []
    for cfg in configs:
        if cfg not in out:
            out.append(cfg)
    return out


def describe(cfg):
    return " ".join(f"{k.replace('num_', '')}={v}" for k, v in cfg.items() if v is not None)


def agreement(got, want, copies=0):
    """compare's phrase for a row: the first `copies` outputs must be the shipped config's bit for
    bit, the others within TOLERANCE of their largest value, or one rounding of it for 16-bit
    outputs (their fp32 sums ran in another order before the rounding); MISMATCH where not."""
    exact = all(torch.equal(a, b) for a, b in zip(got[:copies], want[:copies]))
    diffs = [(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)),
              max(TOLERANCE, torch.finfo(b.dtype).eps)) for a, b in zip(got[copies:], want[copies:])]
    diff = max((d for d, _ in diffs), default=0.0)
    phrase = (f"copies {'exact' if exact else 'DIFFER'}, " if copies else "") + f"max diff {diff:.1e}"
    return phrase if exact and all(d <= tol for d, tol in diffs) else phrase + "  MISMATCH"


def sweep(name, launcher, configs, run, traffic, listed=(), copies=0, compared=tuple):
    """A row for each config (configs[0] the shipped one, marked `*`; those in `listed` `+`): run(cfg)
    returns the kernel's outputs, with cfg's overrides or under launcher's config cfg, and
    compared(outputs) what of them agreement compares (outside the timed calls); then the fastest
    config."""
    want = [t.clone() for t in compared(run(configs[0]))]
    times = []
    for i, cfg in enumerate(configs):
        mark = "*" if i == 0 else "+" if cfg in listed else " "
        times.append(row(f"{mark} {name:<13} {describe(cfg):<52}", launcher, cfg, lambda: run(cfg), traffic,
                         lambda got: agreement(compared(got), want, copies)))
    timed = [(ms, cfg) for ms, cfg in zip(times, configs) if ms == ms]
    if timed:
        ms, cfg = min(timed, key=lambda t: t[0])
        print(f"  {name} fastest: {describe(cfg)}, {ms * 1e3:.1f} us against the shipped {times[0] * 1e3:.1f}",
              flush=True)


class _Plain:
    """A kernel launched plainly (module.name[grid](...)), standing in for a Launcher in
    gemm_probe.variant: the recorder variant puts in for `kernel` goes into the module meanwhile;
    the config given is not used (the call carries its overrides)."""

    def __init__(self, module, name):
        self.module, self.name, self.configs, self.tuned = module, name, [], None

    @property
    def kernel(self):
        return getattr(self.module, self.name)

    @kernel.setter
    def kernel(self, kernel):
        setattr(self.module, self.name, kernel)


def case(preset, dt, dev):
    """The inputs at a preset: the router's grouping of random tokens (routing) with ∂u [S,F] (zero
    on padding slots, as the hidden kernel writes it), G [R,D], b2; the pool's tok [B,N,D],
    weights (fp32), ∂inv and ∂t̄ [B,P,D] (fp32). Printed as a header."""
    r = routing(preset, dt, dev)
    p, rand, groups = r.p, r.rand, r.groups
    B, H, N, D, P, F, E = (p[n] for n in ("B", "H", "N", "D", "P", "F", "E"))
    valid = (groups.slot_pair < groups.pairs)[:, None]
    c = SimpleNamespace(
        dt=dt, B=B, H=H, N=N, D=D, P=P, F=F, E=E, x=r.x, inv=r.inv, wg=r.wg, weight=r.weight, groups=groups,
        du=(rand(groups.slots, F) * valid).to(dt), G=rand(B * H, D).to(dt), b2=(rand(E, D) * 0.1).to(dt),
        tok=rand(B, N, D).to(dt), q=rand(P, D // P), wk=rand(D, D) * D ** -0.5, wv=rand(D, D) * D ** -0.5,
        wo=rand(D, D) * D ** -0.5, bv=rand(D) * 0.1, bo=rand(D) * 0.1, grad_inv=rand(B, D),
        grad_tbar=rand(B, P, D))
    print(f"\n{preset}: R={B * H}, D={D}, F={F}, E={E}, S={groups.slots} slots in {groups.num_tiles} tiles of "
          f"{groups.tile}; pool B={B}, N={N}, P={P}; {dt}", flush=True)
    return c


def tile_sums(c):
    """∂b1's per-tile sums of ∂u: BLOCK × BLOCK_R ≤ TILE × warps with VALUES accumulators a thread."""
    launcher = triton_moe._tile_sums
    configs = [dict(BLOCK=b, BLOCK_R=r, num_warps=w, num_stages=3)
               for r, b, w in tiles([r for r in TILE_SUMS_ROWS if r <= c.groups.tile], TILE_SUMS_COLUMNS)]
    run = lambda cfg: (triton_moe.tile_sums(c.du, c.groups),)  # noqa: E731
    first = shipped(launcher, lambda: run(None))
    traffic = c.du.numel() * c.du.element_size() + 4 * c.groups.num_tiles * c.F
    print(f"tile_sums: ∂u [{c.groups.slots}, {c.F}], {traffic / 1e6:.0f} MB", flush=True)
    sweep("tile_sums", launcher, ordered(first, *launcher.configs, *configs), run, traffic, launcher.configs)


def gather(c):
    """The slot-row gather as the forward and the backward (with b2, and without) call it: the
    shipped launch, then block_s × block_d × warps with VALUES loads a thread."""
    g, D, es = c.groups, c.D, c.x.element_size()
    gb2_col = triton.cdiv(c.F, triton_util.GW_BLOCK)
    rows = g.slots * D * es  # one [S,D] of slot rows, xs or gs
    fwd = c.x.numel() * es + 4 * (c.inv.numel() + g.slots) + rows  # x, inv, slot_pair; xs
    bwd = fwd + c.G.numel() * es + rows  # G; gs
    bwd_b2 = bwd + c.b2.numel() * es + 4 * (c.weight.numel() + g.num_tiles + g.slots * triton_moe.gather_blocks_d(D)[1]
                                            + g.slots // triton_moe.GATHER_BLOCK_S * D)  # ⟨G, b2⟩ columns, db2

    def backward(cfg):
        """(xs, gs, db2, the ⟨G, b2⟩ columns): gw holds the hidden kernel's columns (not written
        here) and one a D block."""
        n_d = triton_moe.gather_blocks_d(D)[1] if cfg.get("block_d") is None else triton.cdiv(D, cfg["block_d"])
        gw = torch.empty(g.slots, gb2_col + n_d, device=c.x.device, dtype=torch.float32)
        xs, gs, db2 = triton_moe.gather_rows(c.x, c.inv, g, c.H, c.dt, c.G, c.weight, c.b2, gw, gb2_col, **cfg)
        return xs, gs, db2, gw[:, gb2_col:]

    # the ⟨G, b2⟩ columns as each slot's total: their number follows block_d
    summed = lambda got: (*got[:3], got[3].sum(1))  # noqa: E731
    # (name, run, traffic, outputs copied, what is compared, block_s swept: 16 only with b2)
    calls = (("fwd", lambda cfg: triton_moe.gather_rows(c.x, c.inv, g, c.H, c.dt, **cfg)[:1], fwd, 1, tuple,
              GATHER_ROWS),
             ("bwd b2", backward, bwd_b2, 2, summed, (triton_moe.GATHER_BLOCK_S,)),
             ("bwd", lambda cfg: triton_moe.gather_rows(c.x, c.inv, g, c.H, c.dt, c.G, **cfg)[:2], bwd, 2, tuple,
              GATHER_ROWS))
    first = dict(block_s=triton_moe.GATHER_BLOCK_S, block_d=triton_moe.gather_blocks_d(D)[0], num_warps=None)
    for name, run, traffic, copies, compared, block_s in calls:
        swept = [dict(block_s=s, block_d=d, num_warps=w) for s, d, w in tiles(block_s, GATHER_COLUMNS)
                 if g.slots % s == 0]
        warps = triton_moe.GATHER_B2_WARPS if name == "bwd b2" else "Triton's default, 4"
        print(f"gather {name}: {traffic / 1e6:.0f} MB (shipped warps: {warps})", flush=True)
        sweep(f"gather {name}", _Plain(triton_moe, "_gather_rows_kernel"), ordered(first, *swept), run, traffic,
              copies=copies, compared=compared)


def bias_sums(c):
    """∂b2's sums per expert (bias_grads' _sum_tiles_kernel) from the gather's partials [S/16, D]
    fp32 as the backward calls it: on the whole layout where the backward takes one run of tiles
    (small, medium), else on the first of its runs (large: three, each added into fp32 totals,
    made here zero each call): BLOCK × BLOCK_R × warps with VALUES accumulators a thread, beside
    _sum_tiles' one config (not autotuned since session 24)."""
    launcher = triton_moe._sum_tiles
    runs = triton_moe.tile_runs(c.groups, triton_moe.backward_slot_bytes(c.D, c.F, False, c.x.element_size()))
    t0, t1 = runs[0]
    g = c.groups if len(runs) == 1 else c.groups.tiles(t0, t1)
    rows = (t1 - t0) * c.groups.tile // triton_moe.GATHER_BLOCK_S
    part = torch.randn(rows, c.D, device=c.x.device, generator=torch.Generator(c.x.device).manual_seed(3))
    total = (lambda: None) if len(runs) == 1 else (lambda: (None, torch.zeros(c.E, c.D, device=c.x.device)))
    run = lambda cfg: (triton_moe.bias_grads(None, part, g, torch.float32, into=total())[1],)  # noqa: E731
    first = shipped(launcher, lambda: run(None))
    configs = [dict(BLOCK=b, BLOCK_R=r, num_warps=w, num_stages=3)
               for r, b, w in tiles(TILE_SUMS_ROWS + (256,), (16,) + TILE_SUMS_COLUMNS)]
    traffic = part.numel() * 4 + 4 * c.E * c.D * (2 if len(runs) > 1 else 1)
    which = "the whole layout" if len(runs) == 1 else f"run 1 of {len(runs)}"
    print(f"bias_sums: ∂b2's partials [{rows}, {c.D}] of {which}, {traffic / 1e6:.1f} MB", flush=True)
    sweep("bias_sums", launcher, ordered(first, *launcher.configs, *configs), run, traffic, launcher.configs)


def router_wgrad(c):
    """∂Wg = ∂logitsᵀ x (triton_router.router_weight_grad) as the backward calls it, on x [R,D] and
    inv (merged on load, or taken apart where triton_router.split_wgrad takes them: then the
    launch's overrides are the ctx call's) and ∂logits [R,E] fp32: block_d × BLOCK_R × warps × runs
    (router_runs' and 2, and 4 times as many), the partials' torch sum included."""
    R, D = c.x.shape
    dlogits = torch.randn(R, c.E, device=c.x.device, generator=torch.Generator(c.x.device).manual_seed(4))
    base, _ = triton_router.router_runs(R, D, c.x.device)
    split = triton_router.split_wgrad(c.x, c.inv, c.wg)
    run = lambda cfg: (triton_router.router_weight_grad(dlogits, c.x, c.inv, c.H, split=split, **cfg),)  # noqa: E731
    first = dict(block_d=None, block_r=triton_router.WGRAD_BLOCK_R, runs=None, num_warps=4)
    configs = [dict(block_d=d, block_r=r, runs=base * k, num_warps=w) for d in (32, 64, 128) for r in (32, 64, 128)
               for k in (1, 2, 4) for w in (2, 4) if d <= pow2(D)]
    traffic = c.x.numel() * c.x.element_size() + 4 * (c.inv.numel() + dlogits.numel() + c.E * D)
    print(f"router_wgrad: R={R}, D={D}, E={c.E}, router_runs' runs {base}, {'split' if split else 'merged'}, "
          f"{traffic / 1e6:.0f} MB", flush=True)
    sweep("router_wgrad", _Plain(triton_router, "_router_wgrad_kernel"), ordered(first, *configs), run, traffic)


def inv_logits(c):
    """inv Wgᵀ (triton_router.inv_logits, the forward split's term a batch row) on inv [B,D] fp32 and
    Wg: BLOCK_R × warps."""
    run = lambda cfg: (triton_router.inv_logits(c.inv, c.wg, **cfg),)  # noqa: E731
    first = dict(block_r=triton_router.INV_LOGITS_BLOCK_R, num_warps=4)
    configs = [dict(block_r=r, num_warps=w) for r in (16, 32, 64) for w in (1, 2, 4)]
    traffic = 4 * (c.inv.numel() + c.inv.shape[0] * c.E) + c.wg.numel() * c.wg.element_size()
    print(f"inv_logits: B={c.inv.shape[0]}, D={c.D}, E={c.E}, {traffic / 1e6:.1f} MB", flush=True)
    sweep("inv_logits", _Plain(triton_router, "_inv_logits_kernel"), ordered(first, *configs), run, traffic)


def matmul_sites(c):
    """Each distinct matmul_f32 call of one pool forward and backward (the projections, through
    triton_pool._bmm): [SimpleNamespace(calls, line, a, b, out, split)], calls = where each came
    from ("pool_forward:<line> > _heads:<line>"), line = the call's source. The pool's kernels
    run meanwhile with their first configs (no autotuning of what is not timed)."""
    sites = {}
    real, no_autotune = triton_pool._bmm, triton_util.NO_AUTOTUNE

    def record(a, b, split, out=None, bias=None, dtype=torch.float32):
        out = real(a, b, split, out, bias, dtype)
        frames, frame = [], sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name != "_mm":
                frames.append(frame)
            if frame.f_code.co_name in ("pool_forward", "pool_backward"):
                break
            frame = frame.f_back
        key = tuple((tuple(t.shape), t.stride(), t.dtype) for t in (a, b, out)) + (split,)
        line = linecache.getline(frames[0].f_code.co_filename, frames[0].f_lineno).strip()
        key += (None if bias is None else (tuple(bias.shape), bias.stride()),)
        site = sites.setdefault(key, SimpleNamespace(calls=[], line=line, a=a, b=b, out=out, split=split, bias=bias))
        site.calls.append(" > ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(frames)))
        return out

    triton_pool._bmm, triton_util.NO_AUTOTUNE = record, True
    try:
        weights = (c.q, c.wk, c.wv, c.bv, c.wo)
        _, attn = triton_pool.pool_forward(c.tok, *weights, c.bo)
        triton_pool.pool_backward(c.grad_inv, c.tok, *weights, attn)
    finally:
        triton_pool._bmm, triton_util.NO_AUTOTUNE = real, no_autotune
    return list(sites.values())


def matmul(c):
    """The pool's projections on split tensor-core dots, each distinct call under _matmul's list
    and MATMUL_MORE. fp32 tokens (the interpreter's case) take cuBLAS in the model; here they run
    matmul_f32's ieee dots (split 0)."""
    launcher = triton_matmul._matmul
    sites = matmul_sites(c)
    print(f"matmul_f32: {sum(len(s.calls) for s in sites)} calls a step, {len(sites)} distinct", flush=True)
    for i, s in enumerate(sites):
        (Bt, M, K), N = s.a.shape, s.b.shape[2]
        split, run_k = triton_matmul.k_runs(Bt, M, N, K, s.a.device)
        traffic = sum(t.numel() * t.element_size() for t in (s.a, s.b, s.out))
        print(f"matmul #{i}: Bt={Bt} M={M} K={K} N={N}, strides a {s.a.stride()} b {s.b.stride()} out "
              f"{s.out.stride()}, K in {split} run(s) of {run_k}, split dots {s.split}; {traffic / 1e6:.2f} MB; "
              f"{len(s.calls)} call(s) a step: {', '.join(s.calls)} `{s.line}`", flush=True)
        run = lambda cfg, s=s: (triton_matmul.matmul_f32(s.a, s.b, s.out, s.split, s.bias),)  # noqa: E731
        first = shipped(launcher, lambda: run(None))
        sweep(f"matmul #{i}", launcher, ordered(first, *launcher.configs, *MATMUL_MORE), run, traffic,
              launcher.configs)


def pool(c):
    """The pool's forward kernel (attn and t̄ from tok), under _attend's list and POOL_MORE."""
    launcher = triton_pool._attend
    u = reference.pool_directions(c.q, c.wk).float().contiguous()
    run = lambda cfg: triton_pool.pool_attend(c.tok, u)  # noqa: E731
    first = shipped(launcher, lambda: run(None))
    traffic = c.tok.numel() * c.tok.element_size() + 4 * (u.numel() + c.B * c.N * c.P + c.B * c.P * c.D)
    print(f"pool forward: tok [{c.B}, {c.N}, {c.D}], {traffic / 1e6:.0f} MB", flush=True)
    sweep("pool fwd", launcher, ordered(first, *launcher.configs, *POOL_MORE), run, traffic, launcher.configs)


def bwd1_bytes(B, N, D, P, tok_bytes):
    """The bytes pass 1 moves: tok [B,N,D] (tok_bytes a value), a [B,N,P] and ∂t̄ [B,P,D] (fp32)
    read once; ∂s [B,N,P] (fp32) written twice and read once between, as the kernel does (∂a
    parked there until c is final). Its second loop's read of a again is not counted, as the
    forward's count leaves out its second pass over attn."""
    return B * N * D * tok_bytes + 4 * (B * N * P + B * P * D + 3 * B * N * P)


def bwd2_bytes(B, N, D, P, tok_bytes):
    """The bytes pass 2 must move: tok [B,N,D] read and ∂tok [B,N,D] written (tok_bytes a value);
    a and ∂s [B,N,P], ∂t̄ [B,P,D] and u [P,D] read, t̄ and the ∂u partials [B,P,D] written (fp32).
    Each once: the re-reads of a, ∂s and u by every block of D columns are the config's cost."""
    return 2 * B * N * D * tok_bytes + 4 * (2 * B * N * P + 3 * B * P * D + P * D)


def bwd1_configs(N):
    """Pass 1's candidates at N tokens: its shipped list, then BWD1_MORE's with BLOCK_N ≤ pow2(N)
    (a longer block only loads masked rows)."""
    return ordered(*triton_pool._attend_bwd_scores.configs,
                   *(cfg for cfg in BWD1_MORE if cfg["BLOCK_N"] <= pow2(N)))


def bwd2_configs(N, D):
    """Pass 2's candidates at N tokens of D: its shipped list, then BWD2_MORE's with BLOCK_N ≤
    pow2(N) and BLOCK_D ≤ pow2(D)."""
    return ordered(*triton_pool._attend_bwd.configs,
                   *(cfg for cfg in BWD2_MORE if cfg["BLOCK_N"] <= pow2(N) and cfg["BLOCK_D"] <= pow2(D)))


def backward_inputs(c):
    """What the pool's backward kernels read at c: tok, u [P,D] (fp32), the forward kernel's attn
    [B,N,P] of them (normalised weights, not random ones) and ∂t̄ (c.grad_tbar)."""
    u = reference.pool_directions(c.q, c.wk).float().contiguous()
    attn, _ = triton_pool.pool_attend(c.tok, u)
    return SimpleNamespace(tok=c.tok.contiguous(), u=u, attn=attn, dtbar=c.grad_tbar)


def bwd_scores(x, ds=None):
    """Pass 1 as pool_backward launches it (triton_pool.attend_bwd_scores): ∂s [B,N,P] (fp32;
    into ds if given) from x.tok, x.attn and x.dtbar."""
    return triton_pool.attend_bwd_scores(x.tok, x.attn, x.dtbar, torch.empty_like(x.attn) if ds is None else ds)


def bwd_outputs(x):
    """Empty (∂tok in tok's dtype, t̄, ∂u partials [B,P,D] fp32) for x."""
    B, N, D = x.tok.shape
    P = x.attn.shape[2]
    return (torch.empty_like(x.tok),) + tuple(
        torch.empty(B, P, D, device=x.tok.device, dtype=torch.float32) for _ in range(2))


def bwd(x, out=None):
    """Pass 2 as pool_backward launches it (triton_pool.attend_bwd), but for the ∂u partials,
    written to a buffer of their own where pool_backward writes them over ∂t̄: the same bytes move,
    and x.dtbar stays as it was through the timing's replays, so that the last call's ∂tok can be
    compared. (∂tok in tok's dtype, t̄, ∂u partials [B,P,D] fp32), into out if given, from x.tok,
    x.u, x.attn, x.ds (pass 1's) and x.dtbar."""
    grad_tok, tbar, du = out = bwd_outputs(x) if out is None else out
    triton_pool.attend_bwd(x.tok, x.u, x.attn, x.ds, x.dtbar, tbar, du, grad_tok)
    return out


def bwd_one(x, out=None):
    """Both passes in one kernel (triton_pool.attend_bwd_one), with bwd's outputs (the ∂u partials
    likewise in a buffer of their own), into out if given; x.ds is its scratch for ∂s."""
    grad_tok, tbar, du = out = bwd_outputs(x) if out is None else out
    triton_pool.attend_bwd_one(x.tok, x.u, x.attn, x.ds, x.dtbar, tbar, du, grad_tok)
    return out


def bwd_one_configs(N, D):
    """The one kernel's candidates at N tokens of D: its shipped list, then BWD_ONE_MORE's with
    BLOCK_N ≤ pow2(N) and BLOCK_D2 ≤ pow2(D)."""
    return ordered(*triton_pool._attend_bwd_one.configs,
                   *(cfg for cfg in BWD_ONE_MORE if cfg["BLOCK_N"] <= pow2(N) and cfg["BLOCK_D2"] <= pow2(D)))


def pool_bwd1(c):
    """The pool backward's pass 1 (∂s) under _POOL_CONFIGS and BWD1_MORE."""
    launcher, x = triton_pool._attend_bwd_scores, backward_inputs(c)
    run = lambda cfg: (bwd_scores(x),)  # noqa: E731
    first = shipped(launcher, lambda: run(None))
    traffic = bwd1_bytes(c.B, c.N, c.D, c.P, c.tok.element_size())
    print(f"pool backward pass 1: tok [{c.B}, {c.N}, {c.D}], P={c.P}, {traffic / 1e6:.0f} MB", flush=True)
    sweep("pool bwd 1", launcher, ordered(first, *bwd1_configs(c.N)), run, traffic, launcher.configs)


def pool_bwd2(c):
    """The pool backward's pass 2 (∂tok, t̄, the ∂u partials) on pass 1's ∂s, under _attend_bwd's
    list and BWD2_MORE."""
    launcher, x = triton_pool._attend_bwd, backward_inputs(c)
    x.ds = bwd_scores(x)
    run = lambda cfg: bwd(x)  # noqa: E731
    first = shipped(launcher, lambda: run(None))
    traffic = bwd2_bytes(c.B, c.N, c.D, c.P, c.tok.element_size())
    print(f"pool backward pass 2: tok [{c.B}, {c.N}, {c.D}], P={c.P}, {traffic / 1e6:.0f} MB", flush=True)
    sweep("pool bwd 2", launcher, ordered(first, *bwd2_configs(c.N, c.D)), run, traffic, launcher.configs)


def pool_bwd_one(c):
    """Both passes of the pool backward as one kernel (triton_pool.attend_bwd_one: a program a batch
    row, pass 2 reading tok[b] again right after pass 1) under _attend_bwd_one's list and
    BWD_ONE_MORE, after a row for the two kernels as pool_backward launches them (each its
    autotuner's pick), timed the same way. The rate is over bwd2_bytes, the bytes of one read of
    tok (the two kernels read it twice)."""
    launcher, x = triton_pool._attend_bwd_one, backward_inputs(c)
    x.ds = bwd_scores(x)
    traffic = bwd2_bytes(c.B, c.N, c.D, c.P, c.tok.element_size())
    print(f"pool backward in one kernel: tok [{c.B}, {c.N}, {c.D}], P={c.P}, {traffic / 1e6:.0f} MB", flush=True)
    two = lambda: (bwd_scores(x, x.ds), bwd(x))[1]  # noqa: E731
    want = [t.clone() for t in two()]
    if torch.cuda.is_available():
        ms = triton.testing.do_bench_cudagraph(two, rep=60, return_mode="median")
        print(f"  {'two kernels, as shipped':<66}  {ms * 1e3:7.1f} us {traffic / ms / 1e9:5.2f} TB/s", flush=True)
    run = lambda cfg: bwd_one(x)  # noqa: E731
    first = shipped(launcher, lambda: run(None))
    configs = ordered(first, *bwd_one_configs(c.N, c.D))
    for i, cfg in enumerate(configs):
        mark = "*" if i == 0 else "+" if cfg in launcher.configs else " "
        row(f"{mark} {'pool bwd one':<13} {describe(cfg):<52}", launcher, cfg, lambda: run(cfg), traffic,
            lambda got: agreement(got, want))


def pool_single(c):
    """The pool backward in one pass over tok (triton_pool.attend_bwd_single) under each config of
    its list, after the two passes as shipped (one kernel where tok fits in L2), whose ∂tok, t̄ and
    ∂u partials each is compared against. The heads and ∂t̄ are consistent (pooled = Wv t̄ + bv,
    ∂t̄_p = Wv_pᵀ ∂pooled_p), as the single pass's c needs."""
    x = backward_inputs(c)
    B, N, D, P = c.B, c.N, c.D, c.P
    _, tbar = triton_pool.pool_attend(x.tok, x.u)
    x.pooled = triton_pool._heads(tbar, c.wv, c.bv, triton_pool.split_dot(c.tok.dtype)).contiguous()
    x.gpooled = (c.grad_inv @ c.wo).contiguous()
    x.dtbar = torch.einsum("bpj,pjd->bpd", x.gpooled.view(B, P, D // P), c.wv.view(P, D // P, D)).contiguous()
    x.ds = torch.empty_like(x.attn)
    traffic = bwd2_bytes(B, N, D, P, c.tok.element_size())
    print(f"pool backward in one pass: tok [{B}, {N}, {D}], P={P}, {traffic / 1e6:.0f} MB", flush=True)
    one = triton_pool.bwd_one_kernel(x.tok)
    two = lambda: bwd_one(x) if one else (bwd_scores(x, x.ds), bwd(x))[1]  # noqa: E731
    want = [t.clone() for t in two()]
    if torch.cuda.is_available():
        ms = triton.testing.do_bench_cudagraph(two, rep=60, return_mode="median")
        print(f"  {'two passes, as shipped' + (' (one kernel)' if one else ''):<66}  {ms * 1e3:7.1f} us "
              f"{traffic / ms / 1e9:5.2f} TB/s", flush=True)
    out = bwd_outputs(x)

    def run():
        grad_tok, tbar, du = out
        triton_pool.attend_bwd_single(x.tok, x.u, x.attn, x.pooled, c.bv, x.gpooled, x.dtbar, tbar, du, grad_tok)
        return out
    launcher = triton_pool._attend_bwd_single
    for cfg in launcher.configs:
        row(f"  {'pool single':<13} {describe(cfg):<51}", launcher, cfg, run, traffic, lambda got: agreement(got, want))


def column_sums(c):
    """The pool backward's column sums of the ∂u partials [B, P·D] and ∂inv [B, D] (fp32), each
    as shipped, then block_r × block_c × warps (VALUES or 2·VALUES values a thread) × the
    programs its first pass aims at."""
    shipped_cfg = dict(block_r=triton_pool.COLUMN_BLOCK_R, block_c=triton_pool.COLUMN_BLOCK_C,
                       programs=triton_pool.COLUMN_PROGRAMS, num_warps=4)
    swept = [dict(block_r=r, block_c=col, programs=n, num_warps=w)
             for values in (VALUES, 2 * VALUES) for r, col, w in tiles(COLUMN_ROWS, COLUMN_COLUMNS, values)
             for n in COLUMN_PROGRAM_COUNTS]
    for name, x in (("du", c.grad_tbar.reshape(c.B, c.P * c.D)), ("dinv", c.grad_inv)):
        R, C = x.shape
        traffic = 4 * (R * C + C)  # x once and the sums; the parts between the passes are extra
        print(f"column_sums {name}: [{R}, {C}] fp32, {traffic / 1e6:.0f} MB", flush=True)
        sweep(f"column_sums {name}", _Plain(triton_pool, "_column_sums_kernel"), ordered(shipped_cfg, *swept),
              lambda cfg: (triton_pool.column_sums(x, 0.5, **cfg),), traffic)


PROBES = dict(tile_sums=tile_sums, gather=gather, matmul=matmul, pool=pool, pool_bwd1=pool_bwd1, pool_bwd2=pool_bwd2,
              pool_bwd_one=pool_bwd_one, bias_sums=bias_sums, router_wgrad=router_wgrad, inv_logits=inv_logits,
              column_sums=column_sums, pool_single=pool_single)
KERNELS = tuple(PROBES)


def probe(preset, kernels, dt, dev):
    c = case(preset, dt, dev)
    for name in kernels:
        PROBES[name](c)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="medium,large")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma list of {', '.join(KERNELS)}")
    args = parser.parse_args()
    kernels = args.kernels.split(",")
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        parser.error(f"unknown kernels {sorted(unknown)}: expected some of {', '.join(KERNELS)}")
    gpu = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if gpu else "cpu (TRITON_INTERPRET=1, fp32, no times)"
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}")
    for preset in args.presets.split(","):
        probe(preset, kernels, torch.bfloat16 if gpu else torch.float32, "cuda" if gpu else "cpu")


if __name__ == "__main__":
    main()
