"""The kernel sets on the GPU (run with `pytest -m cuda` on the H200): every preset of SPEC §5,
bf16 and fp32, forward and all gradients against the float64 reference (computed on the GPU),
edge cases at sizes above one block, reproducibility, and the CUDA merge against its twin."""
import subprocess
import sys
import textwrap

import pytest
import torch

from kernel_cases import (check_activation, check_nan_rows, check_non_finite_experts, check_pool_products, check_region,
                          check_route_split_ctx, check_router_weight_grad_split, fmt, launched, make_case,
                          one_expert_router, only_config, pool_backward_way, preset_case, rel_err)
from mha_compile.kernels import fused, reference, staged, triton_moe

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SETS = [pytest.param(fused, id="fused"), pytest.param(staged, id="staged")]
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]


@pytest.mark.parametrize("module", SETS + [pytest.param(reference, id="reference")])
def test_a_non_finite_expert_reaches_only_its_rows(module):
    """kernel_cases.check_non_finite_experts on the GPU (the reference's index_add there too)."""
    check_non_finite_experts(module, "cuda")


@pytest.mark.parametrize("module", SETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["tok", "ctx", "wg"])
def test_a_nan_reaches_only_its_rows_and_chooses_real_experts(module, dtype, where):
    """kernel_cases.check_nan_rows on the GPU, whose max ignores NaN (the interpreter's need not):
    the case an argmax over NaN could turn into an expert past E."""
    check_nan_rows(module, where, "cuda", dtype=dtype)


@pytest.mark.parametrize("module", SETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset", ["tiny", "small", "medium", "large"])
def test_presets(module, dtype, preset):
    ctx, tok, params = preset_case(preset, dtype=dtype, device="cuda", seed=11)
    assert module.why_unsupported(ctx, tok, params[10], 2, "gelu", None) is None
    errors = check_region(module, ctx, tok, params, top_k=2, renorm=True, act="gelu")
    print(f"{module.__name__} {preset} {dtype}: {fmt(errors)}")


@pytest.mark.parametrize("act", ["gelu", "silu"])
@pytest.mark.parametrize("preset", ["small", "medium", "large"])
def test_presets_with_the_kept_hidden(monkeypatch, act, preset):
    """triton_moe.KEEP_HIDDEN (staged) on the GPU in bf16: u kept from the forward's GEMM1 in bf16
    and read by the backward's hidden kernel (the Triton ones both), against float64; large takes
    the runs of tiles."""
    monkeypatch.setattr(triton_moe, "KEEP_HIDDEN", True)
    ctx, tok, params = preset_case(preset, act=act, dtype=torch.bfloat16, device="cuda", seed=11)
    errors = check_region(fused, ctx, tok, params, top_k=2, renorm=True, act=act)
    print(f"kept hidden {preset} {act}: {fmt(errors)}")


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_activations_against_float64_on_gpu(act):
    """act_fwd and act_bwd as the GPU builds them (rcp.approx and ex2.approx by inline PTX)."""
    check_activation(act, "cuda")


@pytest.mark.parametrize("module", SETS)
@pytest.mark.parametrize("act", reference.ACTIVATIONS)
def test_activations_bf16(module, act):
    ctx, tok, params = preset_case("small", act=act, dtype=torch.bfloat16, device="cuda", seed=3)
    errors = check_region(module, ctx, tok, params, top_k=2, renorm=act != "silu", act=act)
    print(f"{module.__name__} {act}: {fmt(errors)}")


EDGES = [
    dict(B=33, H=7, N=47, D=100, P=4, F=97, E=5, k=2),   # odd everything, masked tails
    dict(B=3, H=1, N=1, D=64, P=2, F=64, E=8, k=1),      # rows fewer than a block
    dict(B=64, H=4, N=9, D=128, P=4, F=96, E=64, k=4),   # E = 64, many empty experts
    dict(B=16, H=3, N=5, D=32, P=2, F=32, E=3, k=3),     # k = E
]


@pytest.mark.parametrize("module", SETS)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), *DTYPES])
@pytest.mark.parametrize("shape", EDGES, ids=lambda s: "B{B}H{H}N{N}D{D}P{P}F{F}E{E}k{k}".format(**s))
def test_edge_shapes(module, dtype, shape):
    s = dict(shape)
    k = s.pop("k")
    ctx, tok, params = make_case(*s.values(), k, act="swiglu", dtype=dtype, device="cuda", seed=5)
    # k = 1 with renorm gives w ≡ 1 and no router gradient (∂Wg ≡ 0): compare it without renorm.
    errors = check_region(module, ctx, tok, params, top_k=k, renorm=k > 1, act="swiglu")
    print(f"{module.__name__} {shape} {dtype}: {fmt(errors)}")


@pytest.mark.parametrize("module", SETS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_all_rows_to_one_expert(module, top_k):
    ctx, tok, params = make_case(64, 8, 16, 128, 4, 256, 8, top_k, dtype=torch.float32, device="cuda", seed=9)
    ctx, params[7] = one_expert_router(ctx, params[7])
    index = module.region_forward(ctx, tok, *params, None, top_k, True, "gelu")[4]
    assert (index[:, 0] == 0).all()
    check_region(module, ctx, tok, params, top_k=top_k, renorm=top_k > 1, act="gelu")


@pytest.mark.parametrize("module", SETS)
def test_key_padding_mask(module):
    ctx, tok, params = make_case(32, 4, 24, 64, 2, 128, 4, 2, dtype=torch.float32, device="cuda", seed=4)
    mask = torch.rand(32, 24, device="cuda") < 0.3
    mask[:, 0] = False
    mask[5] = True  # a row with every key masked attends to nothing (reference.pool_forward)
    check_region(module, ctx, tok, params, top_k=2, renorm=True, act="gelu", mask=mask)


@pytest.mark.parametrize("P,Dh", [(8, 64), (8, 32), (3, 37)])
def test_direction_grads_bf16(P, Dh):
    """triton_pool.direction_grads on the GPU with a bf16 q and Wk (large's and medium's heads, and
    odd ones): ∂q against float64 to bf16's rounding, ∂Wk bitwise the fp32 product rounded once."""
    from mha_compile.kernels import triton_pool

    D = P * Dh
    q = torch.randn(P, Dh, device="cuda").bfloat16()
    wk = (torch.randn(D, D, device="cuda") * D ** -0.5).bfloat16()
    grad_u = torch.randn(P, D, device="cuda")
    grad_q, grad_wk = triton_pool.direction_grads(q, wk, grad_u)
    want_q = torch.einsum("pjd,pd->pj", wk.double().view(P, Dh, D), grad_u.double())
    assert rel_err(grad_q, want_q) < 2 ** -8 and grad_q.dtype == grad_wk.dtype == torch.bfloat16
    assert torch.equal(grad_wk, (q.float()[:, :, None] * grad_u[:, None, :]).reshape(D, D).bfloat16())


@pytest.mark.parametrize("dtype,D,P,single", [
    (torch.bfloat16, 1024, 16, False), (torch.bfloat16, 768, 12, False), (torch.float32, 1024, 8, False),
    (torch.float32, 1024, 32, False), (torch.bfloat16, 1024, 8, True), (torch.float32, 512, 8, True)])
def test_pool_backward_single_pass_where_it_fits(monkeypatch, dtype, D, P, single):
    """The single pass asked for (SINGLE_PASS True) runs where a config of it fits the GPU's shared
    memory, and the two passes run where none does (sm_90, offline: bf16 D 1024 with 16 heads or
    768 with 12, 241 KB at the least against 227; fp32 D 1024 with 8, 267), where its launch would
    raise OutOfResources: every gradient against float64 autograd of the reference pool on the same
    inputs, to SPEC §4's bound for the dtype (bf16 2e-2, fp32 1e-5: ieee dots). fp32 D 1024 with
    32 heads: the forward's and pass 1's first configs do not fit either (259 KB), and under
    MHA_COMPILE_NO_AUTOTUNE (the GPU suite's) their launches take the first that does; the one
    kernel of both passes (tok fits in L2 here) fits under none (257 KB), so two kernels run."""
    from mha_compile.kernels import triton_pool
    from numerics import record_calls

    monkeypatch.setattr(triton_pool, "SINGLE_PASS", True)
    two = record_calls(monkeypatch, triton_pool, "two_passes")
    B, N = 4, 37
    tok = torch.randn(B, N, D, device="cuda").to(dtype)
    q = torch.randn(P, D // P, device="cuda")
    bo, bv = torch.randn(D, device="cuda") * 0.1, torch.randn(D, device="cuda")
    wk, wv, wo = (torch.randn(D, D, device="cuda") * D ** -0.5 for _ in range(3))
    grad_inv = torch.randn(B, D, device="cuda")
    pooled = torch.empty(B, D, device="cuda")
    _, attn = triton_pool.pool_forward(tok, q, wk, wv, bv, wo, bo, pooled=pooled)
    got = triton_pool.pool_backward(grad_inv, tok, q, wk, wv, bv, wo, attn, pooled=pooled)
    leaves = [t.double().requires_grad_() for t in (tok, q, wk, wv, bv, wo, bo)]
    reference.pool_forward(*leaves, None)[0].backward(grad_inv.double())
    names = ("tok", "q", "wk", "wv", "bv", "wo", "bo")
    errors = {name: rel_err(g, leaf.grad) for name, g, leaf in zip(names, got, leaves)}
    assert all(err < (2e-2 if dtype == torch.bfloat16 else 1e-5) for err in errors.values()), errors
    assert len(two) == (0 if single else 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pool_products_where_the_kernels_do_not_fit(monkeypatch, dtype):
    """Where none of the pool forward's or pass 1's configs fits the GPU, attend_by_products and
    scores_grad_by_products run: on the GPU in each dtype (bf16 through triton_matmul's split dots
    with a stride-0 batch of directions, fp32 and fp16 through cuBLAS's fp32, fp16 copied a chunk of
    rows at a time): kernel_cases.check_pool_products, inv and attn and every gradient against
    float64 within the products' bounds of the CPU test (test_the_products_run_where_the_pool_
    forward_and_pass_1_do_not_fit; at these sizes on the CPU, inv, attn and the weights' gradients
    10x under them and more, ∂tok 2.3x under its rounding's)."""
    errors = check_pool_products(monkeypatch, 5, 37, 1024, 16, dtype, "cuda", 2 * 37 * 1024 * 4,  # chunks of two rows
                                 1e-4 if dtype == torch.bfloat16 else 1e-5)
    print(f"products {dtype}: {fmt(errors)}")


@pytest.mark.parametrize("preset", ["medium", "large"])
def test_pool_backward_with_column_sums(monkeypatch, preset):
    """triton_pool.COLUMN_SUMS (the default since session 32): the pool backward's sums over the
    batch rows by triton_pool.column_sums; the whole region against float64 in bf16, and the same
    bits twice; into bf16, the bits of torch's rounding of the fp32 sum."""
    from mha_compile.kernels import triton_pool

    monkeypatch.setattr(triton_pool, "COLUMN_SUMS", True)
    ctx, tok, params = preset_case(preset, dtype=torch.bfloat16, device="cuda", seed=13)
    errors = check_region(fused, ctx, tok, params, top_k=2, renorm=True, act="gelu")
    print(f"column sums {preset}: {fmt(errors)}")
    x = torch.randn(4096, 4096, device="cuda")
    assert torch.equal(triton_pool.column_sums(x, 0.5), triton_pool.column_sums(x, 0.5))
    assert float((triton_pool.column_sums(x, 0.5).double() - x.double().sum(0) * 0.5).norm()
                 / (x.double().sum(0) * 0.5).norm()) < 1e-6
    # into bf16: the fp32 sum rounded once, as torch rounds it (one launch and two alike)
    for rows, programs in ((4096, triton_pool.COLUMN_PROGRAMS), (200, 16)):  # two launches; one (one part)
        want = triton_pool.column_sums(x[:rows], 0.5, programs=programs).bfloat16()
        assert torch.equal(triton_pool.column_sums(x[:rows], 0.5, dtype=torch.bfloat16, programs=programs), want)


@pytest.mark.parametrize("module", SETS)
@pytest.mark.parametrize("preset", ["medium", "large"])
def test_bitwise_reproducible(module, preset):
    ctx, tok, params = preset_case(preset, dtype=torch.bfloat16, device="cuda", seed=2)
    first = module.region_forward(ctx, tok, *params, None, 2, True, "gelu")
    second = module.region_forward(ctx, tok, *params, None, 2, True, "gelu")
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    grad = torch.randn_like(first[0])
    g1 = module.region_backward(grad, ctx, tok, *params, None, *first[1:], 2, True, "gelu")
    g2 = module.region_backward(grad, ctx, tok, *params, None, *first[1:], 2, True, "gelu")
    for a, b in zip(g1, g2):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("module", SETS)
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("autotune", [False, True])
def test_runs_of_tiles(monkeypatch, module, act, autotune):
    """Forward and backward over runs of tiles (what the large preset's slot buffers take), at
    the small preset with the budget cut so that it takes several runs; bf16. With autotuning
    on, the weight-gradient kernel's trial runs must not add into the sums (restore_value)."""
    from mha_compile.kernels import triton_moe, triton_util

    monkeypatch.setattr(triton_util, "NO_AUTOTUNE", not autotune)
    monkeypatch.setattr(triton_moe, "SLOT_CHUNK_BYTES", 4 << 20)
    ctx, tok, params = preset_case("small", act=act, dtype=torch.bfloat16, device="cuda", seed=5)
    groups = triton_moe.group(torch.zeros(ctx.shape[0] * ctx.shape[1], 2, dtype=torch.int32, device="cuda"), 8)
    assert len(triton_moe.tile_runs(groups, 2 * 128 * 2 + 3 * 512 * 2)) > 2
    errors = check_region(module, ctx, tok, params, top_k=2, renorm=True, act=act)
    print(f"{module.__name__} runs of tiles {act}: {fmt(errors)}")


@pytest.mark.parametrize("module", SETS)
@pytest.mark.parametrize("act,autotune", [("gelu", True), ("swiglu", False)])
def test_hidden_layer_in_column_passes(monkeypatch, module, act, autotune):
    """The backward's hidden layer in passes of 256 columns (MHA_COMPILE_HIDDEN_COLUMNS=256) at the
    medium preset, bf16, against float64: four passes, each on the Gluon hidden kernel (its gw
    columns a view of the whole buffer's). With autotuning on, ∂x's accumulating GEMM's trial runs
    must not add into the rows (restore_value)."""
    from mha_compile.kernels import gluon_moe, triton_util

    monkeypatch.setattr(triton_util, "NO_AUTOTUNE", not autotune)
    monkeypatch.setattr(triton_moe, "HIDDEN_COLUMNS", 256)
    hidden = []
    real = gluon_moe.backward_hidden
    monkeypatch.setattr(gluon_moe, "backward_hidden", lambda *a, **k: hidden.append(a[3].shape) or real(*a, **k))
    ctx, tok, params = preset_case("medium", act=act, dtype=torch.bfloat16, device="cuda", seed=7)
    errors = check_region(module, ctx, tok, params, top_k=2, renorm=True, act=act)
    E, D, F = params[8].shape  # W1
    assert F == 1024 and hidden == [(E, D, 256)] * 4
    print(f"{module.__name__} column passes {act}: {fmt(errors)}")


def test_cuda_merge_matches_twin():
    from mha_compile.kernels import merge_cuda

    assert merge_cuda.cuda_merge_available(torch.device("cuda")), "the CUDA merge did not build"
    ctx = torch.randn(37, 11, 200, device="cuda", dtype=torch.bfloat16)
    inv = torch.randn(37, 200, device="cuda")
    y = merge_cuda._extension().merge_forward(ctx, inv)
    assert torch.equal(y, ctx.float() + inv[:, None])
    dy = torch.randn(37, 11, 200, device="cuda")
    dctx, dinv = merge_cuda._extension().merge_backward(dy, torch.empty(0, dtype=torch.bfloat16))
    twin_dctx = torch.empty_like(dctx)
    twin_dinv = torch.empty_like(dinv)
    merge_cuda._merge_bwd_kernel[(37, 1)](dy, twin_dctx, twin_dinv, 11, 200, BLOCK_D=256)
    assert torch.equal(dctx, dy.bfloat16()) and torch.equal(dctx, twin_dctx)
    # ∂inv = Σ_h ∂y in fp32, in whatever order the kernel adds: within the bound of any order's
    # rounding, γ_(H−1)·Σ_h |∂y| with γ_n = n·u / (1 − n·u), u = 2⁻²⁴ (a fixed 1e-6 failed on a
    # fresh draw, session 17).
    nu = (dy.shape[1] - 1) * 2**-24
    exact = dy.double().sum(1)
    bound = nu / (1 - nu) * dy.double().abs().sum(1)
    assert ((dinv.double() - exact).abs() <= bound).all() and torch.equal(dinv, twin_dinv)


@pytest.mark.parametrize("module", SETS)
@pytest.mark.parametrize("preset", ["small", "medium"])
def test_autocast_mix(module, preset):
    """bf16 activations with fp32 tok and parameters (torch.autocast's hand-off): the kernels
    run in bf16 on the cast inputs; gradients come back fp32 for the fp32 inputs."""
    ctx, tok, params = preset_case(preset, dtype=torch.float32, device="cuda", seed=13)
    ctx = ctx.bfloat16()
    assert module.why_unsupported(ctx, tok, params[10], 2, "gelu", None) is None
    errors = check_region(module, ctx, tok, params, top_k=2, renorm=True, act="gelu")
    print(f"{module.__name__} {preset} autocast mix: {fmt(errors)}")


def _tuned_configs():
    from mha_compile.kernels import triton_moe, triton_pool, triton_router

    tuned = [(triton_moe, name) for name in ("_up", "_hidden", "_slots_gemm", "_wgrad", "_sum_tiles", "_tile_sums")]
    tuned += [(triton_pool, name)
              for name in ("_attend", "_attend_bwd_single", "_attend_bwd_scores", "_attend_bwd", "_attend_bwd_one")]
    tuned += [(triton_router, name) for name in ("_route", "_dlogits", "_combine_dy")]
    return [pytest.param(module, name, i, id=f"{name}{i}") for module, name in tuned
            for i in range(len(getattr(module, name).configs))]


@pytest.mark.parametrize("module,name,i", _tuned_configs())
def test_every_tuned_config_bf16(monkeypatch, module, name, i):
    """Every config the autotuner may pick, on the GPU in bf16 (the interpreter checks them in
    fp32 only): tiles of 128 slots (4200 pairs over 4 experts), odd D, F and N."""
    from mha_compile.kernels import gluon_moe

    launcher = getattr(module, name)
    config = launcher.configs[i]
    metas = only_config(monkeypatch, launcher, config)
    pool_backward_way(monkeypatch, name)  # the pool backward's launchers
    monkeypatch.setattr(gluon_moe, "ENABLED", False)  # the Triton kernels these configs are for, not Gluon's
    ctx, tok, params = make_case(300, 7, 37, 100, 4, 200, 4, 2, act="gelu", dtype=torch.bfloat16, device="cuda",
                                 seed=13)
    errors = check_region(fused, ctx, tok, params, top_k=2, renorm=True, act="gelu")
    launched(metas, config)
    print(f"{name}[{i}]: {fmt(errors)}")


def _up_configs():
    from mha_compile.kernels import triton_moe

    return range(len(triton_moe._up.configs))


@pytest.mark.parametrize("keep", [False, True], ids=["", "kept"])
@pytest.mark.parametrize("i", _up_configs())
def test_up_configs_on_tma_bf16(monkeypatch, i, keep):
    """GEMM1's configs on its TMA path, which the test above (D = 100: rows not 16-byte aligned)
    does not take: D = 104, F = 200. The SMs are cut to 2, so that each of the 2 persistent
    programs (4 with SM_PROGRAMS=2) walks many jobs, as at the large preset. Kept: with
    KEEP_HIDDEN, GEMM1 also stores u into `reuse`, and stays on TMA (at c8a1fae u's start there
    was not 16-byte aligned at these sizes, and it left)."""
    from mha_compile.kernels import triton_moe

    monkeypatch.setattr(triton_moe, "KEEP_HIDDEN", keep)
    launcher = triton_moe._up
    config = launcher.configs[i]
    metas = only_config(monkeypatch, launcher, config)
    monkeypatch.setattr(triton_moe, "num_sms", lambda device: 2)
    taken = []
    real = triton_moe.tma_ok
    monkeypatch.setattr(triton_moe, "tma_ok", lambda *t: taken.append(real(*t)) or taken[-1])
    ctx, tok, params = make_case(300, 7, 37, 104, 4, 200, 4, 2, act="gelu", dtype=torch.bfloat16, device="cuda",
                                 seed=14)
    errors = check_region(fused, ctx, tok, params, top_k=2, renorm=True, act="gelu")
    assert taken and all(taken), f"GEMM1 left its TMA path: {taken}"
    launched(metas, config)
    print(f"_up[{i}] on TMA: {fmt(errors)}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_split_ctx_at_fp32_accuracy(dtype):
    """SPLIT_CTX at the large preset's sizes: the forward's logits as ctx Wgᵀ in one 16-bit dot plus
    inv[b] Wgᵀ once a batch row, against float64: π and the weights within 1e-5, at most 1e-3 of
    the rows choosing other experts (near-ties, left out)."""
    check_route_split_ctx(4096, 16, 512, 16, 2, dtype, "cuda", max_flips=1e-3)


@pytest.mark.parametrize("D", [1024, 8192])
def test_router_split_ctx_keeps_its_accuracy_over_long_d(D):
    """SPLIT_CTX at D = 1024, the longest chain of dots (64 16-wide k-steps), and at 8192, where
    each D block's dots are summed apart: π and the weights within 1e-6 of float64, as the merged
    form keeps them (3.4e-7 at 8192 on the H200). Chained over all of 8192 they were 6.4e-6 off
    (session 27)."""
    check_route_split_ctx(256, 16, D, 16, 2, torch.bfloat16, "cuda", max_flips=1e-3, bound=1e-6)


def test_router_weight_grad_split_at_fp32_accuracy():
    """SPLIT_WGRAD's ∂Wg in bf16 at the large preset's D and E and 1024 x 16 rows:
    kernel_cases.check_router_weight_grad_split, at 1e-6 against float64."""
    check_router_weight_grad_split(1024, 16, 512, 16, torch.bfloat16, "cuda")


def test_router_weight_grad_takes_the_first_stages_that_fit(monkeypatch):
    """The router's ∂Wg (an untimed Launcher, tune=False) takes the first of its configs whose build
    fits the GPU: 6 stages first, past any GPU's shared memory at fp32 (3 take 168 KB, offline),
    then 3, which fit sm_90's 227 KB (on an A100 3 do not, and 2 run). The result against float64
    at the medium preset's D and E, 16384 rows merged with inv."""
    from mha_compile.kernels import triton_router

    monkeypatch.setattr(triton_router._router_wgrad, "configs", [dict(num_stages=6), dict(num_stages=3)])
    monkeypatch.setattr(triton_router._router_wgrad, "_chosen", {})
    metas = []
    real = triton_router._router_wgrad._launch
    monkeypatch.setattr(triton_router._router_wgrad, "_launch", lambda grid, args, kwargs, meta, call=None:
                        metas.append(dict(meta)) or real(grid, args, kwargs, meta, call))
    R, H, D, E = 16384, 16, 256, 8
    dlogits = torch.randn(R, E, device="cuda")
    x, inv = torch.randn(R, D, device="cuda"), torch.randn(R // H, D, device="cuda")
    got = triton_router.router_weight_grad(dlogits, x, inv, H)
    want = dlogits.double().T @ (x.double() + inv.double().repeat_interleave(H, 0))
    assert metas == [dict(num_stages=3)]
    assert rel_err(got, want) <= 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_router_at_fp32_accuracy(dtype):
    """The router kernels alone against float64 at the medium preset's sizes. bf16 inputs run
    their dots as tf32x3 (triton_router.router_precision), fp32 ones as ieee: both must keep
    the fp32 bound, 1e-5, on the weights, ∂y and ∂Wg, with at most 1e-3 of the rows choosing
    other experts (near-ties), which are left out of the comparison."""
    from mha_compile.kernels import triton_moe, triton_router

    B, H, D, E, k = 1024, 16, 256, 8, 2
    R = B * H
    gen = torch.Generator(device="cuda").manual_seed(17)
    ctx = torch.randn(R, D, device="cuda", generator=gen).to(dtype)
    inv = torch.randn(B, D, device="cuda", generator=gen)
    wg = (torch.randn(E, D, device="cuda", generator=gen) * D**-0.5).to(dtype)
    weight, index, probs = triton_router.route(ctx, inv, wg, k, True, H)
    x64 = ctx.double() + inv.double().repeat_interleave(H, 0)
    ref_probs, ref_weight, ref_index = reference.route(x64, wg.double(), k, True)
    same = (index.long() == ref_index).all(1)
    assert same.float().mean() >= 1 - 1e-3, f"{int((~same).sum())} of {R} rows chose other experts"
    assert rel_err(weight[same], ref_weight[same]) <= 1e-5
    assert rel_err(probs, ref_probs) <= 1e-5

    groups = triton_moe.group(index, E)
    gw_part = torch.randn(groups.slots, 3, device="cuda", generator=gen)
    dx_slot = torch.randn(groups.slots, D, device="cuda", generator=gen).to(dtype)
    dy, dinv, dlogits = triton_router.router_combine_backward(
        probs, wg, weight, index, groups.pair_slot, dx_slot, gw_part, H, True, torch.float32,
        triton_router.router_precision(dtype), True)
    slots = groups.pair_slot.long().view(R, k)
    grad_weight = gw_part.double().sum(1)[slots]
    ref_dx, ref_dwg = reference.route_backward(grad_weight[same], x64[same], wg.double(), ref_probs[same],
                                               ref_weight[same], ref_index[same], True)
    ref_dy = ref_dx + dx_slot.double()[slots[same]].sum(1)
    assert rel_err(dy[same], ref_dy) <= 1e-5
    assert rel_err(dlogits[same].double().T @ x64[same], ref_dwg) <= 1e-5
    assert rel_err(dinv, dy.view(B, H, D).double().sum(1)) <= 1e-6


# A fresh process: cuBLAS keeps its workspaces for the process, so one made by an earlier test
# would hide one made here.
_STEPS_LEAVE = textwrap.dedent("""
    import torch
    from mha_compile import models, ops  # noqa: F401  (ops registers torch.ops.mha)
    p = models.PRESETS["small"]
    torch.manual_seed(0)
    block = models.MHABlock.from_preset("small", spelling="dense").to("cuda", torch.bfloat16)
    params, moe = list(models.block_parameters(block)), block.moe
    ctx = torch.randn(p["B"], p["H"], p["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tok = torch.randn(p["B"], p["N"], p["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(ctx)
    leaves = [ctx, tok] + [t for t in params if t is not None]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(2):
        out = torch.ops.mha.region(ctx, tok, *params, None, moe.top_k, moe.renorm, moe.act, "fused")[0]
        out.backward(grad)
        del out
        for t in leaves:
            t.grad = None
    torch.cuda.synchronize()
    print((torch.cuda.memory_allocated() - before) / 2**20)
""")


def test_a_training_step_leaves_no_cublas_workspace():
    """bf16 at small, in a fresh process: two training steps of the fused op (graphs off), their
    outputs and gradients dropped, leave less than 16 MiB allocated. A thread's first cuBLAS call
    on a stream allocates a workspace that stays (32 MiB on the H200): the pool's u and ∂q, on
    torch.bmm until session 28, left two, 64 MiB of the small preset's training peak where its
    model and inputs take 5 (bench/results/mem_diag.txt)."""
    run = subprocess.run([sys.executable, "-c", _STEPS_LEAVE], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    left = float(run.stdout.split()[-1])
    print(f"left allocated after two steps: {left:.2f} MiB")
    assert left < 16, left
