"""Registers, spills, shared memory and instruction counts of every Triton kernel the fused
path launches at a preset, compiled for the H200 (sm_90a) on a machine without a GPU, or for
another GPU (--arch: sm_80, the A100; sm_86 and sm_89, 99 KB of shared memory a block).

    PYTHONPATH=. python bench/offline_sass.py [--presets medium,large] [--act gelu] [--dtype bf16] [--all-configs] [--gluon]
                                              [--kernels _moe_bwd_hidden_kernel,...] [--maxnreg 128] [--out rows.json]
                                              [--arch sm_90a]

A preset is a name (SPEC §5) or sizes B×H×N×D×P×F×E×k written with x (300x7x37x100x4x200x4x2).
A build that fails is listed as FAILED with its error's first line; OFFLINE_SASS_TRACE=1 prints
the whole error (the source line Triton's front end stopped at) above it.

How: the fused region's forward and backward run on meta tensors (shapes and dtypes, no data,
no GPU) taken for GPU ones (triton_util.on_gpu), and every Triton launch is recorded instead of
run, with its arguments and meta-parameters, as the GPU would get them. Each distinct launch is then compiled with triton.compile
for the GPU's target (GPUTarget("cuda", 90, 32) for the H200), the way Triton specialises it on the
GPU (integer arguments equal to 1 become constants, multiples of 16 are marked divisible by 16;
pointers are taken as 16-byte aligned), and assembled with the ptxas that Triton bundles (`ptxas
-v`). With --all-configs an autotuned kernel (a triton_util.Launcher) is compiled under every
config of its list, not only the first, and the report ends with the launches under none of
whose configs the build fits the GPU's shared memory: there a launch raises OutOfResources
(where the fused path has no other way; the pool backward's single pass and its one kernel of
both passes fall back, triton_pool.attend_bwd_single and attend_bwd_one, but this tool takes
every launch as fitting, so run it again with MHA_COMPILE_POOL_BWD_SINGLE_PASS=0 and
MHA_COMPILE_POOL_BWD_ONE_KERNEL=0 to see what they fall back to). The registers and spills match
what the H200 reports for the same config (bench/results/gemm_probe.txt); what this cannot tell
is time.

Off sm_90 (--arch sm_80, sm_86, sm_89) launches take no TMA descriptors and no Gluon kernels, as
on those GPUs, and the split grids and L2 choices follow the named GPU's SMs and L2.
"""
import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import tempfile
import types
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.runtime.jit import JITFunction, mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from mha_compile import models
from mha_compile.kernels import (gluon_moe, triton_matmul, triton_moe, triton_pool, triton_region, triton_router,
                                  triton_util)



@dataclasses.dataclass(frozen=True)
class Gpu:
    """What the fused path's choices and the builds read of a GPU."""
    name: str
    arch: str  # ptxas's --gpu-name
    capability: int  # GPUTarget's: major · 10 + minor
    sms: int
    l2: int  # bytes of L2
    smem: int  # bytes of shared memory one block may use (a config past it fails to launch)

    @property
    def target(self):
        return GPUTarget("cuda", self.capability, 32)


# By --arch. The H200's SMs and L2 as torch.cuda.get_device_properties gives them (session 28); the
# others' from NVIDIA's specifications, one card for each architecture (the shared memory a block
# may opt into: 227 KB on sm_90, 163 on sm_80, 99 on sm_86 and sm_89).
GPUS = {"sm_90a": Gpu("H200", "sm_90a", 90, 132, 62914560, 232448),
        "sm_80": Gpu("A100", "sm_80", 80, 108, 41943040, 166912),
        "sm_86": Gpu("A10", "sm_86", 86, 72, 6291456, 101376),
        "sm_89": Gpu("L40S", "sm_89", 89, 142, 100663296, 101376)}
H200 = GPUS["sm_90a"]
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
NVDISASM = os.path.join(os.path.dirname(PTXAS), "nvdisasm")
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
         torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}
# Integer arguments that choose a kernel's code (Triton builds the value 1 as a constant), shown
# beside the constexprs.
CHOOSERS = ("accumulate", "has_sums", "sum_rows", "finish")
LAUNCHERS = [v for module in (triton_matmul, triton_moe, triton_pool, triton_router) for v in vars(module).values()
             if isinstance(v, triton_util.Launcher)]


def as_h200(calls=None, gluon=False):
    """as_gpu for the H200."""
    return as_gpu(H200, calls, gluon)


@contextlib.contextmanager
def as_gpu(gpu, calls=None, gluon=False):
    """Meta tensors taken for `gpu`'s (one of GPUS): every Triton launch is skipped, or appended to `calls`
    as (kernel, {argument name: value}, num_warps, num_stages), which keeps its tensors alive (a
    Launcher's builds, to see whether a config fits the GPU, are taken to fit: each config's
    shared memory is in offline_sass's report);
    each kernel takes its first config (through JITFunction.run: no fast launches), split grids
    are sized for the GPU's SMs (132 on the H200), and GEMM1 takes TMA descriptors where the GPU
    has TMA (sm_90). gluon: the MoE's GEMMs take their Gluon kernels where those take the
    operands' shapes and dtypes, as on the H200 (their device checks skipped; sm_90 only)."""
    if gluon and gpu.capability != 90:
        raise ValueError(f"gluon: the Gluon kernels need sm_90 (wgmma, setmaxnreg), not {gpu.arch}")

    def run(self, *args, grid, warmup, **kwargs):
        if warmup:  # a Launcher's build of a config (its fits, its first that fits): taken to load,
            return types.SimpleNamespace(_init_handles=lambda: None)  # not a launch (smem: the report's)
        if calls is None:
            return
        named = dict(zip(self.arg_names, args), **kwargs)
        warps, stages = named.pop("num_warps", 4), named.pop("num_stages", 3)
        calls.append((self, named, warps, stages))

    with mock.patch.object(JITFunction, "run", run), \
            mock.patch.object(triton_util, "on_gpu", lambda t: True), \
            mock.patch.object(triton_util, "NO_AUTOTUNE", True), \
            mock.patch.object(triton_util, "FAST_LAUNCH", False), \
            mock.patch.object(triton_util, "tma_device", lambda device: gpu.capability >= 90), \
            mock.patch.object(triton_util, "num_sms", lambda device: gpu.sms), \
            mock.patch.object(triton_pool, "l2_bytes", lambda device: gpu.l2), \
            mock.patch.object(triton_moe, "num_sms", lambda device: gpu.sms), \
            mock.patch.object(gluon_moe, "num_sms", lambda device: gpu.sms), \
            mock.patch.object(gluon_moe, "_device_reason",
                              (lambda *a: None) if gluon else (lambda *a: "offline without --gluon")):
        yield


DIMS = ("B", "H", "N", "D", "P", "F", "E", "k")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def preset_dims(preset):
    """(B, H, N, D, P, F, E, k) of a preset's name, or of sizes written B×H×N×D×P×F×E×k with x
    ("300x7x37x100x4x200x4x2": the odd shape the GPU tests try every config at)."""
    if preset in models.PRESETS:
        return tuple(models.PRESETS[preset][key] for key in DIMS)
    sizes = preset.split("x")
    if len(sizes) != len(DIMS) or not all(size.isdigit() and int(size) > 0 for size in sizes):
        raise SystemExit(f"preset {preset!r}: expected one of {list(models.PRESETS)} or eight positive sizes "
                         f"{'x'.join(DIMS)}, e.g. 300x7x37x100x4x200x4x2")
    return tuple(map(int, sizes))


def meta_case(preset, act, dtype=torch.bfloat16):
    """(ctx, tok, params in region-op order, k, renorm) of the preset, as meta tensors."""
    B, H, N, D, P, F, E, k = preset_dims(preset)
    block = models.MHABlock(D, P, F, E, k, act=act)
    params = [None if t is None else torch.empty(t.shape, device="meta", dtype=dtype)
              for t in models.block_parameters(block)]
    ctx = torch.empty(B, H, D, device="meta", dtype=dtype)
    tok = torch.empty(B, N, D, device="meta", dtype=dtype)
    return ctx, tok, params, k, block.moe.renorm


def record_launches(preset, act, dtype=torch.bfloat16, gluon=False, gpu=H200):
    """[(kernel, {argument name: value}, num_warps, num_stages)] of one fused forward and backward on `gpu`."""
    calls = []
    with as_gpu(gpu, calls, gluon):
        ctx, tok, params, k, renorm = meta_case(preset, act, dtype)
        out, *saved = triton_region.region_forward("on_load", ctx, tok, *params, None, k, renorm, act)
        triton_region.region_backward("on_load", torch.empty_like(out), ctx, tok, *params, None, *saved,
                                      k, renorm, act)
    return calls


def _signature(kernel, named):
    """(signature, constexprs, attrs) for ASTSource, specialised as Triton does on the GPU."""
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = named[param.name] if param.name in named or not param.has_default else param.default
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, GluonDescriptor):  # its type names its shared-memory layout too
            signature[param.name] = mangle_type(value)
        elif isinstance(value, TensorDescriptor):  # as Triton names a host descriptor's type
            signature[param.name] = f"tensordesc<{TYPES[value.base.dtype]}[{', '.join(map(str, value.block_shape))}]>"
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            if value == 1:  # Triton makes an integer argument equal to 1 a constant
                signature[param.name] = "constexpr"
                constexprs[(i,)] = 1
                continue
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {param.name}={value!r} of a type this tool does not map")
    return signature, constexprs, attrs


def compile_stats(kernel, named, warps, stages, maxnreg=None, gpu=H200):
    """Registers, spill bytes, shared memory, wgmma and SASS instruction counts of one launch
    built for `gpu` (maxnreg: a config's cap on a thread's registers)."""
    signature, constexprs, attrs = _signature(kernel, named)
    source = GluonASTSource if kernel.is_gluon() else ASTSource
    options = dict(num_warps=warps, num_stages=stages, **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    compiled = triton.compile(source(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=gpu.target, options=options)
    return sass_stats(compiled, gpu)


def sass_stats(compiled, gpu=H200):
    """What ptxas and nvdisasm say of a kernel compiled for `gpu`: registers, spill bytes, shared
    memory, wgmma, mma, SASS instruction and setmaxnreg (warp-specialised partitions) counts."""
    with tempfile.TemporaryDirectory() as folder:
        ptx, cubin = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([PTXAS, "-v", "--gpu-name", gpu.arch, ptx, "-o", cubin],
                             capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([NVDISASM, "-c", cubin], capture_output=True, text=True, check=True).stdout
    instructions = [line for line in sass.splitlines() if line.strip().startswith("/*") and ";" in line]
    return dict(regs=int(re.search(r"Used (\d+) registers", log).group(1)),
                spill_bytes=int(re.search(r"(\d+) bytes spill stores", log).group(1)),
                smem=compiled.metadata.shared,
                wgmma=sum("HGMMA" in line for line in instructions),
                mma=sum(" HMMA" in line for line in instructions),
                sass=len(instructions),
                setmaxnreg=sum("SETMAXREG" in line for line in instructions),
                # ptxas's C7515: it runs the kernel's wgmmas one after another (no overlap of the
                # tensor cores' work) where other instructions write an accumulator mid-pipeline
                wgmma_serialized="C7515" in log)


def _launcher_of(kernel):
    return next((launcher for launcher in LAUNCHERS if launcher.kernel is kernel), None)


def main():
    if triton_util.interpreting():
        raise SystemExit("bench/offline_sass.py compiles the kernels: run it without TRITON_INTERPRET=1")
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="medium,large", help="names, or sizes BxHxNxDxPxFxExk")
    parser.add_argument("--act", default="gelu")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES),
                        help="the model's dtype (ctx, tok and parameters)")
    parser.add_argument("--all-configs", action="store_true", help="every config of each autotuned kernel")
    parser.add_argument("--kernels", default=None, help="comma list of kernel names (default: all)")
    parser.add_argument("--gluon", action="store_true",
                        help="the MoE's Gluon kernels where they take the operands, as on the H200 (sm_90a only)")
    parser.add_argument("--maxnreg", type=int, default=None,
                        help="cap every build at this many registers a thread (a config's maxnreg): what it spills")
    parser.add_argument("--arch", default="sm_90a", choices=list(GPUS),
                        help="the GPU to build for: " + ", ".join(f"{a} ({g.name})" for a, g in GPUS.items()))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gpu = GPUS[args.arch]
    if args.gluon and gpu.capability != 90:
        parser.error(f"--gluon: the Gluon kernels need sm_90a, not --arch {args.arch}")
    wanted = None if args.kernels is None else set(args.kernels.split(","))
    print(f"{gpu.arch} ({gpu.name}, {gpu.smem} bytes of shared memory a block) offline, "
          f"triton {triton.__version__}, torch {torch.__version__}")
    presets = args.presets.split(",")
    rows, unfit = [], []
    width = max(7, *(len(p) + 1 for p in presets))
    for preset in presets:
        built = {}  # a build's key -> its row: a launch whose build was made before shares its row
        for kernel, named, warps, stages in record_launches(preset, args.act, DTYPES[args.dtype], args.gluon, gpu):
            if wanted is not None and kernel.__name__ not in wanted:
                continue
            launcher = _launcher_of(kernel)
            configs = launcher.configs if (launcher is not None and args.all_configs) else [None]
            launch_rows = [_config_row(preset, kernel, named, warps, stages, launcher, config, args.maxnreg, gpu,
                                       built, rows, width)
                           for config in configs]
            if not any(row.get("fits") for row in launch_rows):
                unfit.append((preset, kernel.__name__, launch_rows))
    if args.all_configs:
        _say_unfit(unfit, gpu)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def _config_row(preset, kernel, named, warps, stages, launcher, config, maxnreg, gpu, built, rows, width):
    """The row of one launch's build for `gpu` under `config` (None: as recorded; maxnreg: the
    command line's cap), built, printed and appended to rows unless `built` has it already."""
    meta = dict(named)
    cap = meta.pop("maxnreg", None)  # a recorded launch's, where its config has one
    if config is not None:
        meta.update({key: value for key, value in config.items() if key not in triton_util.LAUNCH_OPTIONS})
        warps, stages, cap = config.get("num_warps", 4), config.get("num_stages", 3), config.get("maxnreg")
        if launcher.blocks is not None:  # descriptors' block shapes follow the config
            meta.update({name: dataclasses.replace(meta[name], block_shape=list(shape))
                         for name, shape in launcher.blocks(meta).items()
                         if isinstance(meta[name], TensorDescriptor)})
    maxnreg = maxnreg or cap  # the command line's cap first
    signature, constexprs, _ = _signature(kernel, meta)
    key = (kernel.__name__, warps, stages, maxnreg, repr(sorted(signature.items())), repr(sorted(constexprs.items())))
    if key in built:
        return built[key]
    shown = {name: value for name, value in meta.items()
             if (name.isupper() or name in CHOOSERS) and not isinstance(value, torch.Tensor) and name not in ("PAIRS",)}
    row = built[key] = dict(preset=preset, kernel=kernel.__name__, num_warps=warps, num_stages=stages,
                            maxnreg=maxnreg, constexprs=shown, arch=gpu.arch)
    try:
        row.update(compile_stats(kernel, meta, warps, stages, maxnreg, gpu))
        row["fits"] = row["smem"] <= gpu.smem
        print(f"{preset:<{width}}{kernel.__name__:<28} regs {row['regs']:>3} spill {row['spill_bytes']:>5} B "
              f"smem {row['smem']:>6} wgmma {row['wgmma']:>3} mma {row['mma']:>3} sass {row['sass']:>5}  "
              f"w{warps} s{stages}{'' if maxnreg is None else f' maxnreg {maxnreg}'} {shown}"
              f"{'' if row['fits'] else '  SHARED MEMORY OVER THE LIMIT'}"
              f"{'  WGMMA SERIALIZED' if row['wgmma_serialized'] else ''}", flush=True)
    except Exception as error:  # a config that does not compile: say so, go on
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        if os.environ.get("OFFLINE_SASS_TRACE"):
            print(error)
        print(f"{preset:<{width}}{kernel.__name__:<28} FAILED {row['error']}", flush=True)
    rows.append(row)
    return row


def _say_unfit(unfit, gpu):
    """The launches (preset, kernel name, their config rows) that no config builds to fit `gpu`."""
    if not unfit:
        print(f"every launch builds to fit {gpu.arch}'s shared memory under some config of its list")
        return
    print(f"launches under none of whose configs the build fits {gpu.arch}'s {gpu.smem} bytes of shared memory "
          "(the launch raises OutOfResources there):")
    for preset, name, launch_rows in unfit:
        smem = [row["smem"] for row in launch_rows if "smem" in row]
        print(f"  {preset} {name}: {len(launch_rows)} configs, the least {min(smem) if smem else '-'} bytes")


if __name__ == "__main__":
    main()
