"""bench/offline_sass.py: the fused path's launches recorded from shapes alone and compiled for
the H200 without a GPU (a subprocess: the tool compiles, so it runs without TRITON_INTERPRET)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def offline_sass(tmp_path, *args, env=None, printed=False):
    """The rows bench/offline_sass.py writes for these arguments, run outside the interpreter (with
    `env` added to the environment); with printed, (rows, what it printed)."""
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **(env or {})}
    env["PYTHONPATH"] = os.path.abspath(ROOT)
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "offline_sass.py"), *args, "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())
    return (rows, run.stdout) if printed else rows


def test_records_every_launch_and_compiles_for_sm90(tmp_path):
    rows = offline_sass(tmp_path, "--presets", "medium", "--kernels", "_moe_up_kernel,_moe_wgrad_kernel",
                        "--all-configs")
    failed = [r for r in rows if "error" in r]
    assert not failed, failed
    from mha_compile.kernels import triton_moe
    # every config of both autotuned kernels, once each: ∂W1's and ∂W2's launches differ only in
    # I and J, both multiples of 16, so Triton compiles them as one kernel (and so does this tool)
    for name, launcher in (("_moe_up_kernel", triton_moe._up), ("_moe_wgrad_kernel", triton_moe._wgrad)):
        probed = [r for r in rows if r["kernel"] == name]
        assert len(probed) == len(launcher.configs)
        for config in launcher.configs:
            meta = {k: v for k, v in config.items() if k not in ("num_warps", "num_stages")}
            assert any(all(r["constexprs"].get(k) == v for k, v in meta.items())
                       and (r["num_warps"], r["num_stages"]) == (config["num_warps"], config["num_stages"])
                       for r in probed), (name, config)
    # GEMM1 as the H200 runs it: TMA descriptors, their block shapes following each config
    assert all(r["constexprs"]["TMA"] for r in rows if r["kernel"] == "_moe_up_kernel")
    for r in rows:
        assert 0 < r["regs"] <= 255 and r["sass"] > 0 and r["fits"]
        assert r["wgmma"] > 0, r  # bf16 tiles of 128 slots: Hopper's wgmma (HGMMA) on the H200
        assert r["constexprs"]["TILE"] == 128  # the medium preset's layout, as on the GPU


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])  # fp32 builds too (checked once), but take 3 min
def test_every_config_builds_at_an_odd_shape(tmp_path, dtype):
    """Every config the autotuner may pick, of every Triton kernel the fused path launches, builds
    for sm_90a at the odd shape the GPU tests try them at (D = 100, N = 37, P = 4: partial blocks,
    strides not multiples of 16). Triton's autotuner raises when a config fails to build, so such
    a config fails a user's compile at that shape; the pool forward's BLOCK_N 64 configs did
    (session 11), which this catches without a GPU. The pool backward's two kernels, which tok
    this small skips for their one kernel (triton_pool.bwd_one_kernel), are built in a second run
    with that turned off."""
    shape = ("--presets", "300x7x37x100x4x200x4x2", "--dtype", dtype, "--all-configs")
    rows = offline_sass(tmp_path, *shape)
    two = offline_sass(tmp_path, *shape, "--kernels", "_pool_bwd_scores_kernel,_pool_bwd_kernel",
                       env={"MHA_COMPILE_POOL_BWD_ONE_KERNEL": "0"})
    assert not [r for r in rows + two if "error" in r]
    from mha_compile.kernels import triton_pool
    for name, launcher, built in (("_pool_fwd_kernel", triton_pool._attend, rows),
                                  ("_pool_bwd_one_kernel", triton_pool._attend_bwd_one, rows),
                                  ("_pool_bwd_scores_kernel", triton_pool._attend_bwd_scores, two),
                                  ("_pool_bwd_kernel", triton_pool._attend_bwd, two)):
        assert len([r for r in built if r["kernel"] == name]) == len(launcher.configs), name
    assert not [r for r in rows if r["kernel"] in ("_pool_bwd_scores_kernel", "_pool_bwd_kernel")]
    assert {r["constexprs"]["D"] for r in rows if r["kernel"] == "_pool_fwd_kernel"} == {100}


def test_router_backward_builds(tmp_path):
    """The router's backward: every config of its two kernels builds for sm_90a, at large
    and at the odd shape of the test above (D = 100, H = 7, E = 4), without spills. (Pass 1 spilled
    at E = 4 while it computed the logits again, as the forward's kernel, which does, still spills
    there; it spilled 1440 bytes at large when it read the ∂w partials as one wide tile.)"""
    kernels = "_router_dlogits_kernel,_router_dy_kernel"
    rows = offline_sass(tmp_path, "--presets", "large,300x7x37x100x4x200x4x2", "--kernels", kernels, "--all-configs")
    assert not [r for r in rows if "error" in r]
    from mha_compile.kernels import triton_router
    for name, launcher in (("_router_dlogits_kernel", triton_router._dlogits),
                           ("_router_dy_kernel", triton_router._combine_dy)):
        assert len([r for r in rows if r["kernel"] == name]) == 2 * len(launcher.configs), name
    for r in rows:
        assert r["fits"] and r["spill_bytes"] == 0, r


def test_a_register_cap_reaches_the_build(tmp_path):
    """--maxnreg caps every build, as a config's maxnreg does on the GPU: the pool forward at large
    under the config the H200's autotuner takes ([32] at 4 warps, 2 stages) needs more than 128
    registers uncapped, and every config builds within 128 capped."""
    args = ("--presets", "large", "--kernels", "_pool_fwd_kernel", "--all-configs")
    shipped = lambda r: (r["constexprs"]["BLOCK_N"], r["num_warps"], r["num_stages"]) == (32, 4, 2)  # noqa: E731
    [plain] = [r for r in offline_sass(tmp_path, *args) if shipped(r)]
    capped = offline_sass(tmp_path, *args, "--maxnreg", "128")
    assert plain["maxnreg"] is None and plain["regs"] > 128, plain
    from mha_compile.kernels import triton_pool
    assert len(capped) == len(triton_pool._attend.configs) and any(shipped(r) for r in capped)
    for r in capped:
        assert r["maxnreg"] == 128 and r["regs"] <= 128 and r["fits"], r


def test_a_launch_no_config_fits_is_named_for_the_gpu_built_for(tmp_path):
    """--arch builds for another GPU and holds each build to its shared memory: the pool forward at
    D 1024 with 16 heads (bf16) fits the H200's 227 KB under some config, and none of its configs
    fits sm_86's 99 KB (its [D, 2P] operands, 112 KB at the least), which the report names; sm_86
    has no wgmma, its dots are mma."""
    args = ("--presets", "4x3x5x1024x16x64x4x2", "--kernels", "_pool_fwd_kernel", "--all-configs")
    h200, said_h200 = offline_sass(tmp_path, *args, printed=True)
    sm86, said_sm86 = offline_sass(tmp_path, *args, "--arch", "sm_86", printed=True)
    from mha_compile.kernels import triton_pool
    assert len(h200) == len(sm86) == len(triton_pool._attend.configs)
    assert any(r["fits"] for r in h200) and {r["arch"] for r in h200} == {"sm_90a"}
    assert "every launch builds to fit sm_90a's shared memory" in said_h200
    assert not any(r["fits"] for r in sm86) and min(r["smem"] for r in sm86) > 101376
    assert all(r["arch"] == "sm_86" and r["wgmma"] == 0 and r["mma"] > 0 for r in sm86)
    unfit = f"4x3x5x1024x16x64x4x2 _pool_fwd_kernel: {len(triton_pool._attend.configs)} configs, the least"
    assert unfit in said_sm86.split("launches under none")[1]


def test_gluon_kernels_build_with_inline_ptx(tmp_path):
    """--gluon records the backward's and GEMM2's Gluon kernels, as the H200 takes them at medium,
    and compiles them for sm_90a: warp-specialised (setmaxnreg), on wgmma, within shared memory.
    Without it the same run records none (their device checks say no off the GPU)."""
    kernels = "_hidden_kernel,_hidden_coop_kernel,_wgrad_kernel,_slots_kernel"
    rows = offline_sass(tmp_path, "--presets", "medium", "--gluon", "--kernels", kernels)
    assert not [r for r in rows if "error" in r]
    assert {r["kernel"] for r in rows} == {"_hidden_kernel", "_wgrad_kernel", "_slots_kernel"}  # coop: D ≥ 512
    for r in rows:
        assert r["setmaxnreg"] > 0 and r["wgmma"] > 0 and r["fits"], r
    assert offline_sass(tmp_path, "--presets", "medium", "--kernels", kernels) == []


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_gluon_gemm1_builds(tmp_path, act):
    """The forward's GEMM1 runs on gluon_moe's kernel by default (MHA_COMPILE_GLUON_UP=0: the
    Triton GEMM1): it builds for sm_90a, warp-specialised, on wgmma,
    within shared memory, and its [128, 128] jobs, in two column halves, do not spill (with one
    accumulator gelu's erf spilled 266 bytes)."""
    rows = offline_sass(tmp_path, "--presets", "medium", "--act", act, "--gluon", "--kernels",
                        "_up_kernel,_moe_up_kernel")
    assert [r["kernel"] for r in rows] == ["_up_kernel"] and not [r for r in rows if "error" in r]
    row = rows[0]
    assert row["setmaxnreg"] > 0 and row["wgmma"] > 0 and row["fits"] and row["spill_bytes"] == 0, row
    off = offline_sass(tmp_path, "--presets", "medium", "--act", act, "--gluon", "--kernels",
                       "_up_kernel,_moe_up_kernel", env={"MHA_COMPILE_GLUON_UP": "0"})
    assert [r["kernel"] for r in off] == ["_moe_up_kernel"]

@pytest.mark.parametrize("stream, spread", [("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")])
def test_weight_gradients_of_the_runs_build_either_way(tmp_path, stream, spread):
    """The large backward's runs of tiles add their weight gradients into totals: by jobs, or with
    MHA_COMPILE_WGRAD_STREAM=1 by the STREAM schedule (its flags' inline PTX, the K-step loops);
    ∂W1's Σb in one row an expert, or with MHA_COMPILE_WGRAD_SUM_SPREAD=1 in one a row block (4);
    each builds for sm_90a with no spills and no serialised wgmma (ptxas's C7515)."""
    rows = offline_sass(tmp_path, "--presets", "large", "--gluon", "--kernels", "_wgrad_kernel",
                        env={"MHA_COMPILE_WGRAD_STREAM": stream, "MHA_COMPILE_WGRAD_SUM_SPREAD": spread})
    assert len(rows) == 2 and not [r for r in rows if "error" in r]  # ∂W2's and ∂W1's shapes
    assert [(r["constexprs"]["has_sums"], r["constexprs"]["sum_rows"]) for r in rows] == [
        (0, 1), (1, 4 if spread == "1" else 1)]
    for r in rows:
        assert r["constexprs"]["STREAM"] == (stream == "1"), r
        assert r["spill_bytes"] == 0 and not r["wgmma_serialized"] and r["wgmma"] > 0 and r["fits"], r


def test_triton_weight_gradients_of_the_runs_build(tmp_path):
    """Where the Gluon weight-gradient GEMM does not run (swiglu's ∂W1 and ∂W3 together, a GPU
    without Gluon), the runs of tiles take the Triton kernel with FINISH (an expert's first run
    writes its totals, its last stores them final) and close_totals: both build for sm_90a under
    every config. The interpreter runs code that Triton's compiler refuses (session 31: a
    comprehension's name reused for a pointer of another dtype), so the CPU tests alone miss it."""
    rows = offline_sass(tmp_path, "--presets", "large", "--act", "swiglu", "--all-configs", "--kernels",
                        "_moe_wgrad_kernel,_close_totals_kernel")
    assert {r["kernel"] for r in rows} == {"_moe_wgrad_kernel", "_close_totals_kernel"}
    assert all(r["constexprs"]["FINISH"] for r in rows if r["kernel"] == "_moe_wgrad_kernel")
    assert not [r for r in rows if "error" in r]
