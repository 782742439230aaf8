"""Registers, spills, shared memory and instruction counts of every Triton kernel the fused
path launches at a preset, compiled for the H200 (sm_90a) on a machine without a GPU.

    PYTHONPATH=. python bench/offline_sass.py [--presets medium,large] [--act gelu] [--dtype bf16] [--all-configs] [--gluon]
                                              [--kernels _moe_bwd_hidden_kernel,...] [--maxnreg 128] [--out rows.json]

A preset is a name (SPEC §5) or sizes B×H×N×D×P×F×E×k written with x (300x7x37x100x4x200x4x2).
A build that fails is listed as FAILED with its error's first line; OFFLINE_SASS_TRACE=1 prints
the whole error (the source line Triton's front end stopped at) above it.

How: the fused region's forward and backward run on meta tensors (shapes and dtypes, no data,
no GPU) taken for GPU ones (triton_util.on_gpu), and every Triton launch is recorded instead of
run, with its arguments and meta-parameters, as the GPU would get them. Each distinct launch is then compiled with triton.compile
for GPUTarget("cuda", 90, 32), the way Triton specialises it on the GPU (integer arguments
equal to 1 become constants, multiples of 16 are marked divisible by 16; pointers are taken as
16-byte aligned), and assembled with the ptxas that Triton bundles (`ptxas -v`). With
--all-configs an autotuned kernel (a triton_util.Launcher) is compiled under every config of
its list, not only the first. The registers and spills match what the H200 reports for the
same config (bench/results/gemm_probe.txt); what this cannot tell is time.
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

H200 = GPUTarget("cuda", 90, 32)
H200_SMS = 132
H200_L2 = 62914560  # bytes of L2 (torch.cuda.get_device_properties, session 28)
H200_SMEM = 232448  # bytes of shared memory one block may use (a config past it fails to launch)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
NVDISASM = os.path.join(os.path.dirname(PTXAS), "nvdisasm")
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
         torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}
# Integer arguments that choose a kernel's code (Triton builds the value 1 as a constant), shown
# beside the constexprs.
CHOOSERS = ("accumulate", "has_sums", "sum_rows", "finish")
LAUNCHERS = [v for module in (triton_matmul, triton_moe, triton_pool, triton_router) for v in vars(module).values()
             if isinstance(v, triton_util.Launcher)]


@contextlib.contextmanager
def as_h200(calls=None, gluon=False):
    """Meta tensors taken for an H200's: every Triton launch is skipped, or appended to `calls`
    as (kernel, {argument name: value}, num_warps, num_stages), which keeps its tensors alive (a
    Launcher's builds, to see whether a config fits the GPU, are taken to fit: each config's
    shared memory is in offline_sass's report);
    each kernel takes its first config (through JITFunction.run: no fast launches), split grids
    are sized for 132 SMs, and GEMM1 takes TMA descriptors as on the H200. gluon: the MoE's GEMMs
    take their Gluon kernels where those take the operands' shapes and dtypes, as on the H200
    (their device checks skipped)."""
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
            mock.patch.object(triton_util, "tma_device", lambda device: True), \
            mock.patch.object(triton_util, "num_sms", lambda device: H200_SMS), \
            mock.patch.object(triton_pool, "l2_bytes", lambda device: H200_L2), \
            mock.patch.object(triton_moe, "num_sms", lambda device: H200_SMS), \
            mock.patch.object(gluon_moe, "num_sms", lambda device: H200_SMS), \
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


def record_launches(preset, act, dtype=torch.bfloat16, gluon=False):
    """[(kernel, {argument name: value}, num_warps, num_stages)] of one fused forward and backward."""
    calls = []
    with as_h200(calls, gluon):
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


def compile_stats(kernel, named, warps, stages, maxnreg=None):
    """Registers, spill bytes, shared memory, wgmma and SASS instruction counts of one launch
    (maxnreg: a config's cap on a thread's registers)."""
    signature, constexprs, attrs = _signature(kernel, named)
    source = GluonASTSource if kernel.is_gluon() else ASTSource
    options = dict(num_warps=warps, num_stages=stages, **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    compiled = triton.compile(source(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=H200, options=options)
    return sass_stats(compiled)


def sass_stats(compiled):
    """What ptxas and nvdisasm say of a kernel compiled for the H200: registers, spill bytes, shared
    memory, wgmma, mma, SASS instruction and setmaxnreg (warp-specialised partitions) counts."""
    with tempfile.TemporaryDirectory() as folder:
        ptx, cubin = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", ptx, "-o", cubin],
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
                        help="the MoE's Gluon kernels where they take the operands, as on the H200")
    parser.add_argument("--maxnreg", type=int, default=None,
                        help="cap every build at this many registers a thread (a config's maxnreg): what it spills")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    wanted = None if args.kernels is None else set(args.kernels.split(","))
    rows = []
    print(f"sm_90a (H200) offline, triton {triton.__version__}, torch {torch.__version__}")
    presets = args.presets.split(",")
    dtype = DTYPES[args.dtype]
    width = max(7, *(len(p) + 1 for p in presets))
    for preset in presets:
        seen = set()
        for kernel, named, warps, stages in record_launches(preset, args.act, dtype, args.gluon):
            if wanted is not None and kernel.__name__ not in wanted:
                continue
            launcher = _launcher_of(kernel)
            configs = launcher.configs if (launcher is not None and args.all_configs) else [None]
            for config in configs:
                meta = dict(named)
                maxnreg = meta.pop("maxnreg", None)  # a recorded launch's, where its config has one
                if config is not None:
                    meta.update({key: value for key, value in config.items() if key not in triton_util.LAUNCH_OPTIONS})
                    warps, stages, maxnreg = config.get("num_warps", 4), config.get("num_stages", 3), config.get("maxnreg")
                    if launcher.blocks is not None:  # descriptors' block shapes follow the config
                        meta.update({name: dataclasses.replace(meta[name], block_shape=list(shape))
                                     for name, shape in launcher.blocks(meta).items()
                                     if isinstance(meta[name], TensorDescriptor)})
                maxnreg = args.maxnreg or maxnreg
                signature, constexprs, _ = _signature(kernel, meta)
                key = (kernel.__name__, warps, stages, maxnreg, repr(sorted(signature.items())),
                       repr(sorted(constexprs.items())))
                if key in seen:
                    continue
                seen.add(key)
                shown = {name: value for name, value in meta.items()
                         if (name.isupper() or name in CHOOSERS) and not isinstance(value, torch.Tensor)
                         and name not in ("PAIRS",)}
                row = dict(preset=preset, kernel=kernel.__name__, num_warps=warps, num_stages=stages, maxnreg=maxnreg,
                           constexprs=shown)
                try:
                    row.update(compile_stats(kernel, meta, warps, stages, maxnreg))
                    row["fits"] = row["smem"] <= H200_SMEM
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
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
