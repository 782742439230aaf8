"""The latency- and bandwidth-bound small kernels alone, under each launch config: which are mistuned,
as the router's were (bench/router_probe.py: its backward went 256 -> 167 us at large at one
warp a program).

    PYTHONPATH=. python bench/small_kernels_probe.py [--presets medium,large] [--kernels tile_sums,gather,matmul,pool]

On the H200 (bf16; ~1-2 min for both presets; bench/results/small_kernels_probe.txt), at each
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
The tile_sums and gather sweeps take the [rows, columns] tiles holding VALUES values a thread
(loaded or accumulated) for each warp count, beside the shipped configs.
Each row: the config, the median CUDA-graph time (gemm_probe.variant), the rate of the bytes the
call must read and write once, registers, spills, and how far its outputs are from the shipped
config's: copies (the gathered rows) bit for bit, sums to within TOLERANCE of their largest
value (fp32 rounding in another order), flagged MISMATCH otherwise. `*` marks the shipped config
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
from mha_compile.kernels import reference, triton_matmul, triton_moe, triton_pool, triton_util

WARPS = (1, 2, 4, 8)
VALUES = 32  # values a thread in the swept tiles: BLOCK·BLOCK_R (tile_sums), block_s·block_d (gather)
TOLERANCE = 1e-5  # sums in another order: the largest difference, relative to the largest value
TILE_SUMS_ROWS, TILE_SUMS_COLUMNS = (16, 32, 64, 128), (32, 64, 128, 256)  # BLOCK_R (≤ TILE), BLOCK
GATHER_ROWS, GATHER_COLUMNS = (16, 32, 64), (64, 128, 256)  # block_s (GATHER_BLOCK_S with b2), block_d
# Beside _matmul's list, fewer warps (latency-bound, as the router's kernels were).
MATMUL_MORE = [dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=2, num_stages=3),
               dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=2, num_stages=4)]
# Beside _attend's list, BLOCK_N 64 (out of it: it fails to build at many D on Triton 3.6) and
# 32 with other stages.
POOL_MORE = [dict(BLOCK_N=64, num_warps=4, num_stages=3), dict(BLOCK_N=64, num_warps=8, num_stages=3),
             dict(BLOCK_N=32, num_warps=4, num_stages=2), dict(BLOCK_N=32, num_warps=8, num_stages=4)]


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
    bit, the others within TOLERANCE of their largest value; MISMATCH where not."""
    exact = all(torch.equal(a, b) for a, b in zip(got[:copies], want[:copies]))
    diff = max((float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                for a, b in zip(got[copies:], want[copies:])), default=0.0)
    phrase = (f"copies {'exact' if exact else 'DIFFER'}, " if copies else "") + f"max diff {diff:.1e}"
    return phrase if exact and diff <= TOLERANCE else phrase + "  MISMATCH"


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
    weights (fp32) and ∂inv. Printed as a header."""
    r = routing(preset, dt, dev)
    p, rand, groups = r.p, r.rand, r.groups
    B, H, N, D, P, F, E = (p[n] for n in ("B", "H", "N", "D", "P", "F", "E"))
    valid = (groups.slot_pair < groups.pairs)[:, None]
    c = SimpleNamespace(
        dt=dt, B=B, H=H, N=N, D=D, P=P, F=F, E=E, x=r.x, inv=r.inv, weight=r.weight, groups=groups,
        du=(rand(groups.slots, F) * valid).to(dt), G=rand(B * H, D).to(dt), b2=(rand(E, D) * 0.1).to(dt),
        tok=rand(B, N, D).to(dt), q=rand(P, D // P), wk=rand(D, D) * D ** -0.5, wv=rand(D, D) * D ** -0.5,
        wo=rand(D, D) * D ** -0.5, bv=rand(D) * 0.1, bo=rand(D) * 0.1, grad_inv=rand(B, D))
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


def matmul_sites(c):
    """Each distinct matmul_f32 call of one pool forward and backward (the projections, through
    triton_pool._bmm): [SimpleNamespace(calls, line, a, b, out, split)], calls = where each came
    from ("pool_forward:<line> > _heads:<line>"), line = the call's source. The pool's kernels
    run meanwhile with their first configs (no autotuning of what is not timed)."""
    sites = {}
    real, no_autotune = triton_pool._bmm, triton_util.NO_AUTOTUNE

    def record(a, b, split, out=None):
        out = real(a, b, split, out)
        frames, frame = [], sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name != "_mm":
                frames.append(frame)
            if frame.f_code.co_name in ("pool_forward", "pool_backward"):
                break
            frame = frame.f_back
        key = tuple((tuple(t.shape), t.stride()) for t in (a, b, out)) + (split,)
        line = linecache.getline(frames[0].f_code.co_filename, frames[0].f_lineno).strip()
        site = sites.setdefault(key, SimpleNamespace(calls=[], line=line, a=a, b=b, out=out, split=split))
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
        traffic = 4 * (s.a.numel() + s.b.numel() + s.out.numel())
        print(f"matmul #{i}: Bt={Bt} M={M} K={K} N={N}, strides a {s.a.stride()} b {s.b.stride()} out "
              f"{s.out.stride()}, K in {split} run(s) of {run_k}, split dots {s.split}; {traffic / 1e6:.2f} MB; "
              f"{len(s.calls)} call(s) a step: {', '.join(s.calls)} `{s.line}`", flush=True)
        run = lambda cfg, s=s: (triton_matmul.matmul_f32(s.a, s.b, s.out, s.split),)  # noqa: E731
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


PROBES = dict(tile_sums=tile_sums, gather=gather, matmul=matmul, pool=pool)
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
