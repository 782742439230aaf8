"""GEMM1 (h = gelu(xs W1[e] + b1[e]) per slot tile) as a warp-specialised ping-pong kernel in Gluon,
against the shipped Triton kernel: a probe of the lever PERF_NOTES v12 names for the grouped GEMMs.

    PYTHONPATH=. python bench/gluon_up_probe.py [--presets medium,large]    # on the H200
    PYTHONPATH=. python bench/gluon_up_probe.py --offline                   # no GPU: compile for sm_90a

Why: Nsight Compute (bench/results/ncu_large.txt) shows every MoE GEMM latency-bound at one
program an SM: the shipped GEMM1 issues its dots and its gelu epilogue in turn, so the tensor
cores idle through every epilogue (547 us a large call without the gelu, ~850-980 with it).
Triton 3.6's `tl` cannot split one program's warps into roles on Hopper; Gluon can
(`gl.warp_specialize`), and the accumulators of Hopper's wgmma live in the registers of the
warpgroup that issues it, so the overlap takes the CUTLASS "ping-pong" shape:
  - a producer warp issues the TMA loads of xs and W1 tiles into a ring of NBUF stages;
  - two consumer warpgroups take the (tile, F block) jobs of this program in turn: while one
    runs its epilogue (bias, gelu, padding rows to zero, bf16, TMA store), the other runs its
    dots. Job i's K steps are ring positions i·KSTEPS ...; the consumers pass a turn between
    them (two more barriers) so that their K loops run one at a time, in job order: a ring wait
    is by the parity of a stage's use, and a consumer a whole job ahead would take an older
    use of the stage for its own (CUTLASS orders its ping-pong consumers the same way).
One program per SM walks the jobs in _tile_of_job's order (a tile's F blocks adjacent).
Limits of this probe: gelu (erf) only, D a multiple of BLOCK_K (W1 is read as [E·D, F]), bf16.

Status (session 9): written and compiled for sm_90a without a GPU (`--offline`: wgmma, the
partitions' setmaxnreg, 197 KB of shared memory at NBUF 4, ~280 B of spills in the consumers at
BLOCK_N 128, none at 64); NOT YET RUN on a GPU. Its first run checks each config against the fp32
reference (`rel err`) before its time means anything.
"""
import argparse
import json

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _job(job, F, BLOCK_N: gl.constexpr):
    """(tile, F block) of a job, a tile's blocks adjacent (triton_moe._tile_of_job's order)."""
    blocks = gl.cdiv(F, BLOCK_N)
    t = job // blocks
    return t, job - t * blocks


# Every partition takes (descs, bufs, bars, ptrs, sizes): worker partitions share one signature
# (and take no Python constants: a tuple with one fails to flatten). descs = (xs, W1 as [E·D, F],
# h) TMA descriptors; bufs = (xs ring, W1 ring, two h staging tiles); bars = (ready, empty) per
# ring stage and the consumers' turn (one each); ptrs = (b1, slot_pair, tile_expert); sizes =
# (PAIRS, D, F, NUM_JOBS, has_b1).


@gluon.jit
def _producer(descs, bufs, bars, ptrs, sizes):
    xs_desc, w_desc, h_desc = descs
    a_bufs, b_bufs, c_bufs = bufs
    ready, empty, turn = bars
    b1_ptr, slot_pair_ptr, tile_expert_ptr = ptrs
    PAIRS, D, F, NUM_JOBS, has_b1 = sizes
    TILE: gl.constexpr = xs_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = xs_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    NBUF: gl.constexpr = a_bufs.type.shape[0]
    ksteps = gl.cdiv(D, BLOCK_K)
    pos = 0
    for job in range(gl.program_id(0), NUM_JOBS, gl.num_programs(0)):
        t, n = _job(job, F, BLOCK_N)
        e = gl.load(tile_expert_ptr + t)
        for k in range(ksteps):
            stage = pos % NBUF
            # Barriers start with phase 1 complete: the first NBUF waits on "empty" pass.
            mbarrier.wait(empty.index(stage), ((pos // NBUF) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, xs_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(xs_desc, [t * TILE, k * BLOCK_K], bar, a_bufs.index(stage))
            tma.async_copy_global_to_shared(w_desc, [e * D + k * BLOCK_K, n * BLOCK_N], bar, b_bufs.index(stage))
            pos += 1


@gluon.jit
def _consumer_odd(descs, bufs, bars, ptrs, sizes):
    _consumer(descs, bufs, bars, ptrs, sizes, 1)


@gluon.jit
def _consumer(descs, bufs, bars, ptrs, sizes, which: gl.constexpr):
    """Jobs i of this program with i % 2 == which: dots over the ring, then the epilogue."""
    xs_desc, w_desc, h_desc = descs
    a_bufs, b_bufs, c_bufs = bufs
    ready, empty, turn = bars
    b1_ptr, slot_pair_ptr, tile_expert_ptr = ptrs
    PAIRS, D, F, NUM_JOBS, has_b1 = sizes
    TILE: gl.constexpr = xs_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = xs_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    NBUF: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    c_buf = c_bufs.index(which)
    ksteps = gl.cdiv(D, BLOCK_K)
    i = 0  # this program's jobs
    own = 0  # this consumer's
    for job in range(gl.program_id(0), NUM_JOBS, gl.num_programs(0)):
        if i % 2 == which:
            t, n = _job(job, F, BLOCK_N)
            e = gl.load(tile_expert_ptr + t)
            offs_n = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_layout)
            acc = gl.zeros([TILE, BLOCK_N], gl.float32, acc_layout)
            if has_b1 != 0:
                bias = gl.load(b1_ptr + e * F + offs_n, mask=offs_n < F, other=0.0)
                acc = acc + bias.to(gl.float32)[None, :]
            # Consumer 0 goes first: a fresh barrier passes a wait on parity 1.
            mbarrier.wait(turn.index(which), (own & 1) ^ (1 - which))
            pos = i * ksteps
            prev = 0
            for k in range(ksteps):
                stage = pos % NBUF
                mbarrier.wait(ready.index(stage), (pos // NBUF) & 1)
                acc = warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage), acc, is_async=True)
                # One wgmma in flight: the one before has read its stage, which goes back.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                if k > 0:
                    mbarrier.arrive(empty.index(prev), count=1)
                prev = stage
                pos += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index(prev), count=1)
            mbarrier.arrive(turn.index(1 - which), count=1)  # the other consumer's K loop may start
            own += 1
            offs_s = t * TILE + gl.arange(0, TILE, layout=rows_layout)
            valid = gl.load(slot_pair_ptr + offs_s) < PAIRS
            out = 0.5 * acc * (1.0 + gl.erf(acc * 0.7071067811865476))
            out = gl.where(valid[:, None], out, 0.0)
            tma.store_wait(0)  # this consumer's last store has left c_buf
            c_buf.store(out.to(h_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(h_desc, [t * TILE, n * BLOCK_N], c_buf)
        i += 1
    tma.store_wait(0)


@gluon.jit
def _up_pingpong_kernel(xs_desc, w_desc, h_desc, b1_ptr, slot_pair_ptr, tile_expert_ptr, PAIRS, D, F, NUM_JOBS,
                        has_b1, NBUF: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    dtype: gl.constexpr = xs_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [NBUF] + xs_desc.block_type.shape, xs_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NBUF] + w_desc.block_type.shape, w_desc.layout)
    c_bufs = gl.allocate_shared_memory(dtype, [2] + h_desc.block_type.shape, h_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NBUF):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for c in gl.static_range(2):
        mbarrier.init(turn.index(c), count=1)
    args = ((xs_desc, w_desc, h_desc), (a_bufs, b_bufs, c_bufs), (ready, empty, turn),
            (b1_ptr, slot_pair_ptr, tile_expert_ptr), (PAIRS, D, F, NUM_JOBS, has_b1))
    # The default partition (this kernel's 4 warps) is consumer 0; workers: consumer 1 (a
    # warpgroup) and the producer (one warp, the fewest registers a warp can have).
    gl.warp_specialize([
        (_consumer, args + (0, )),
        (_consumer_odd, args),
        (_producer, args),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def descriptor(t, block):
    """A Gluon TMA descriptor of the 2-D tensor t in `block` tiles, the default swizzle."""
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def descriptors(xs, w1, h, tile, block_n, block_k):
    """xs [S,D] in [tile, block_k] blocks, W1 as [E·D, F] in [block_k, block_n], h [S,F] in
    [tile, block_n]."""
    E, D, F = w1.shape
    return (descriptor(xs, [tile, block_k]), descriptor(w1.view(E * D, F), [block_k, block_n]),
            descriptor(h, [tile, block_n]))


def up_pingpong(xs, groups, w1, b1, block_n=128, block_k=64, nbuf=4, consumer_regs=232, producer_regs=24,
                num_sms=132):
    """h [S,F] bf16 = gelu(xs W1[e] + b1[e]) per tile, 0 on padding slots (triton_moe.experts_up's
    contract for act="gelu")."""
    E, D, F = w1.shape
    if D % block_k:
        raise ValueError(f"D={D}: this probe reads W1 as [E·D, F] and needs D a multiple of BLOCK_K={block_k}")
    h = torch.empty(xs.shape[0], F, device=xs.device, dtype=xs.dtype)
    jobs = groups.num_tiles * triton.cdiv(F, block_n)
    xs_desc, w_desc, h_desc = descriptors(xs, w1, h, groups.tile, block_n, block_k)
    _up_pingpong_kernel[(min(num_sms, jobs),)](
        xs_desc, w_desc, h_desc, w1 if b1 is None else b1, groups.slot_pair, groups.tile_expert,
        groups.pairs, D, F, jobs, int(b1 is not None), NBUF=nbuf, CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=producer_regs, num_warps=4)
    return h


def compile_offline(kernel, args, constexprs, num_warps=4):
    """Compile a Gluon kernel for the H200 (sm_90a) without a GPU: registers, spills, shared memory
    and SASS counts (bench/offline_sass.py's ptxas and nvdisasm). args: every other parameter's
    value (CPU tensors, descriptors on CPU tensors, ints; an int 1 would be a constant on the GPU,
    so pass another)."""
    import re
    import subprocess
    import tempfile

    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    import offline_sass

    signature = {name: "constexpr" if name in constexprs else mangle_type(args[name]) for name in kernel.arg_names}
    values = {(i,): constexprs[name] for i, name in enumerate(kernel.arg_names) if name in constexprs}
    compiled = triton.compile(GluonASTSource(kernel, signature, values), target=offline_sass.H200,
                              options=dict(num_warps=num_warps))
    with tempfile.TemporaryDirectory() as folder:
        ptx, cubin = f"{folder}/k.ptx", f"{folder}/k.cubin"
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([offline_sass.PTXAS, "-v", "--gpu-name", "sm_90a", ptx, "-o", cubin],
                             capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([offline_sass.NVDISASM, "-c", cubin], capture_output=True, text=True, check=True).stdout
    lines = [line for line in sass.splitlines() if line.strip().startswith("/*") and ";" in line]
    return dict(regs=int(re.search(r"Used (\d+) registers", log).group(1)),
                spill_bytes=int(re.search(r"(\d+) bytes spill stores", log).group(1)),
                smem=compiled.metadata.shared, wgmma=sum("HGMMA" in line for line in lines), sass=len(lines),
                setmaxnreg=sum("SETMAXREG" in line or "USETMAXREG" in line for line in lines))


def offline(tile=128, block_n=128, block_k=64, nbuf=4, consumer_regs=232, producer_regs=24):
    """compile_offline of this probe's kernel under one config."""
    E, D, F, S = 2, 2 * block_k, 2 * block_n, 2 * tile
    xs, h = torch.empty(S, D, dtype=torch.bfloat16), torch.empty(S, F, dtype=torch.bfloat16)
    w1, b1 = torch.empty(E, D, F, dtype=torch.bfloat16), torch.empty(E, F, dtype=torch.bfloat16)
    index = torch.empty(S, dtype=torch.int32)
    args = dict(zip(("xs_desc", "w_desc", "h_desc"), descriptors(xs, w1, h, tile, block_n, block_k)))
    args.update(b1_ptr=b1, slot_pair_ptr=index, tile_expert_ptr=index, PAIRS=1000, D=D, F=F, NUM_JOBS=1000, has_b1=3)
    return compile_offline(_up_pingpong_kernel, args,
                           dict(NBUF=nbuf, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs))


def reference(c):
    """gelu(xs W1[e] + b1[e]) in fp32, expert by expert over the slot layout; 0 on padding slots."""
    groups, E = c.groups, c.E
    bounds = groups.expert_slots.tolist()
    h = torch.zeros(c.S, c.F, device=c.dev, dtype=torch.float32)
    for e in range(E):
        lo, hi = bounds[e], bounds[E + e]
        if hi > lo:
            h[lo:hi] = torch.nn.functional.gelu(c.xs[lo:hi].float() @ c.w1[e].float() + c.b1[e].float())
    return h * (groups.slot_pair < groups.pairs)[:, None]


CONFIGS = [dict(block_n=128, block_k=64, nbuf=4), dict(block_n=128, block_k=64, nbuf=3),
           dict(block_n=64, block_k=64, nbuf=4)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="medium,large")
    parser.add_argument("--offline", action="store_true", help="compile for sm_90a only (no GPU needed)")
    args = parser.parse_args()
    if args.offline or not torch.cuda.is_available():
        for cfg in CONFIGS:
            print(json.dumps(dict(config=cfg, **offline(**cfg))), flush=True)
        return
    from gemm_probe import slot_case
    from mha_compile.kernels import triton_moe as moe

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for preset in args.presets.split(","):
        c = slot_case(preset, "gelu")
        gemm = 2 * c.S * c.D * c.F
        want = reference(c)
        err = lambda h: float((h.float() - want).norm() / want.norm())
        shipped = lambda: moe.experts_up(c.xs, c.groups, c.w1, c.b1, None, "gelu")
        ms = triton.testing.do_bench_cudagraph(shipped, rep=60, return_mode="median")
        print(f"shipped      {ms * 1e3:8.1f} us {gemm / ms / 1e9:5.0f} TF/s  rel err {err(shipped()):.1e}", flush=True)
        for cfg in CONFIGS:
            try:
                run = lambda: up_pingpong(c.xs, c.groups, c.w1, c.b1, **cfg)
                h = run()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench_cudagraph(run, rep=60, return_mode="median")
                print(f"ping-pong    {ms * 1e3:8.1f} us {gemm / ms / 1e9:5.0f} TF/s  rel err {err(h):.1e}  {cfg}",
                      flush=True)
            except Exception as error:  # a config that does not fit or fails: say so, keep going
                reason = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                print(f"ping-pong    FAILED {reason}  {cfg}", flush=True)


if __name__ == "__main__":
    main()
