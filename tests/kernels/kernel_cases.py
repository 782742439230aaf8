"""Inputs, the float64 oracle and the comparison rules shared by the kernel tests (SPEC §4).

One tolerance table per dtype: ‖got − ref‖ / ‖ref‖ for the output and for every gradient.
The reference runs in float64 on the same (already rounded) inputs. Rows whose top-k choice
differs from the reference (rounding can flip a near-tie in bf16/fp16) are counted and
reported separately: the output is compared on the other rows, the count is bounded, and the
gradients are compared against the reference backward fed with this forward's saved tensors
(that is the op's contract: its backward receives whatever its forward returned).
"""
import math
import os
import subprocess
import sys

import torch
import triton
import triton.language as tl

from numerics import record_calls
from mha_compile import models
from mha_compile.kernels import reference, triton_pool, triton_router
from mha_compile.kernels.triton_util import ACT_CODE, act_bwd, act_fwd

# Relative-norm tolerance per dtype (fp32 with ieee dots; bf16/fp16 with fp32 accumulation).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
# Largest fraction of rows allowed to flip their top-k set through rounding.
FLIP_FRACTION = {torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 1e-2}
# ∂w_j = ⟨G_r, f_e(x_r)⟩ (SPEC §1) cancels when the cotangent G_r is nearly orthogonal to the
# chosen expert's output: the fp32 operands carry ~1e-7 of rounding, which a cosine of c
# amplifies to ~1e-7 / c in ∂w, and ∂w scales all of ∂Wg when one row is all there is (2 of 300
# draws failed ∂Wg's 1e-5 at B=H=1, k=1: every entry off by the same factor). Many pairs average
# it away in the relative norm; few cannot, whatever the kernel. So, as SPEC §4 has test inputs
# avoid top-k ties, a case of at most FEW_PAIRS pairs draws its cotangent again (next seed)
# while some pair's |cos(G_r, f_e(x_r))| is below CANCEL_COS.
FEW_PAIRS, CANCEL_COS = 8, 0.05
# The kernels take tok and the experts' weights in a 16-bit ctx's dtype (triton_region's
# _in_compute_dtype, as autocast casts them), where check_region's reference reads them as given:
# with fp32 tok the two routers see inputs 16-bit rounding apart. In fp16 that moved
# test_autocast_mix's logits by up to 2.6e-3 and flipped a row's top-k choice in 11 of 20000 draws,
# where its 6 rows may flip none (FLIP_FRACTION; CI failed one). So, as SPEC §4 has test inputs
# avoid top-k ties, autocast_case draws again (next seed) until every row's chosen experts lead the
# others by ROUTER_GAP in logit on both sides' inputs, in float64 (router_gap); the kernels' own
# router is within 2.4e-6 of float64 on their inputs (40 draws, both sets), so no flip is left to
# rounding, and one that happens fails the test. 56 of those 20000 draws are drawn again.
ROUTER_GAP = 1e-3
GRAD_NAMES = ("ctx", "tok", "q", "wk", "bk", "wv", "bv", "wo", "bo", "wg", "w1", "b1", "w2", "b2", "w3")


class UnfitLauncher:
    """A pool Launcher's stand-in whose kernel fits no GPU (as the forward's and pass 1's at D 1024
    with 16 or more heads on sm_86 and sm_89, offline): launch_where_fits launches nothing; a plain
    launch of it is recorded, not run."""

    def __init__(self):
        self.launches = []

    def launch_where_fits(self, *args, **kwargs):
        return False

    def __call__(self, *args, **kwargs):
        self.launches.append(args)


def only_config(monkeypatch, launcher, config):
    """`launcher` (a triton_util.Launcher) made to launch `config` alone, untuned, from a fresh
    cache of chosen configs: on the GPU a call whose arguments an earlier test met launches what
    was chosen then (Launcher._chosen), so swapping `configs` alone ran config 0 for every config
    after the first. Returns the list each launch's meta-parameters go into, for launched()."""
    monkeypatch.setattr(launcher, "configs", [config])
    monkeypatch.setattr(launcher, "tuned", None)
    monkeypatch.setattr(launcher, "_chosen", {})
    metas = []
    real = launcher._launch
    monkeypatch.setattr(launcher, "_launch", lambda grid, args, kwargs, meta, call=None:
                        metas.append(dict(meta)) or real(grid, args, kwargs, meta, call))
    return metas


# The pool backward's launchers, each with the switches that make pool_backward launch it.
POOL_BACKWARD_WAYS = {"_attend_bwd_single": (True, False), "_attend_bwd_one": (False, True),
                      "_attend_bwd_scores": (False, False), "_attend_bwd": (False, False)}


def pool_backward_way(monkeypatch, name):
    """triton_pool's SINGLE_PASS and BWD_ONE_KERNEL set so that pool_backward launches the
    launcher `name`; left as they are for any other name."""
    from mha_compile.kernels import triton_pool

    if name not in POOL_BACKWARD_WAYS:
        return
    single, one = POOL_BACKWARD_WAYS[name]
    monkeypatch.setattr(triton_pool, "SINGLE_PASS", single)
    monkeypatch.setattr(triton_pool, "BWD_ONE_KERNEL", one)


def launched(metas, config):
    """Assert that the launches recorded by only_config ran `config` (the interpreter drops the
    warps and stages, which it ignores)."""
    assert metas, "the launcher never launched"
    for meta in metas:
        assert all(config[k] == v for k, v in meta.items()), f"launched {meta}, asked for {config}"


def make_case(B, H, N, D, P, F, E, k, act="gelu", dtype=torch.float32, device="cpu", bias=True,
              pool_bias=True, seed=None):
    """Fresh random inputs: (ctx, tok, params) with params in region-op order, in `dtype`."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    block = models.MHABlock(D, P, F, E, k, act=act, bias=bias)
    params = []
    for p in models.block_parameters(block):
        if p is None:
            params.append(None)
            continue
        # Re-draw every parameter from our generator (biases too: never zeros).
        t = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        fan = p.shape[-2] if p.dim() >= 2 else 10.0
        params.append(t / math.sqrt(fan))
    if not pool_bias:
        params[2] = params[4] = params[6] = None  # bk, bv, bo
    ctx = torch.randn(B, H, D, generator=gen, dtype=torch.float64)
    tok = torch.randn(B, N, D, generator=gen, dtype=torch.float64)
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)
    return cast(ctx), cast(tok), [cast(p) for p in params]


def preset_case(name, act="gelu", dtype=torch.float32, device="cpu", seed=0):
    p = models.PRESETS[name]
    return make_case(p["B"], p["H"], p["N"], p["D"], p["P"], p["F"], p["E"], p["k"], act=act, dtype=dtype,
                     device=device, seed=seed)


def autocast_case(B, H, N, D, P, F, E, k, ctx_dtype, act="gelu", device="cpu", seed=None, tries=16):
    """make_case's fp32 inputs with ctx in ctx_dtype (16-bit), as torch.autocast hands them to the
    op, drawn again with the next seed (at most `tries` draws) while router_gap < ROUTER_GAP."""
    seed = torch.seed() % 2**31 if seed is None else seed
    gaps = []
    for attempt in range(tries):
        ctx, tok, params = make_case(B, H, N, D, P, F, E, k, act=act, device=device, seed=seed + attempt)
        ctx = ctx.to(ctx_dtype)
        gaps.append(router_gap(ctx, tok, params, k))
        if gaps[-1] >= ROUTER_GAP:
            return ctx, tok, params
    raise AssertionError(f"no case in {tries} draws (seeds {seed}…) with every row's top-{k} choice "
                         f"{ROUTER_GAP} clear of the rest in logit: smallest gaps {[f'{g:.1e}' for g in gaps]}")


def router_gap(ctx, tok, params, k, mask=None):
    """min over rows r of min_{e∈S_r} l[r,e] − max_{e∉S_r} l[r,e], S_r the top-k experts of the
    float64 router logits l = (ctx + inv) Wgᵀ on the inputs as given (check_region's reference),
    over those l and the l from tok in ctx's dtype (as the kernels take it). Negative: the two
    choose different experts for some row; inf where k = E (no choice to flip)."""
    q, wk, _, wv, bv, wo, bo, wg = (_f64(p) for p in params[:8])
    B, H, D = ctx.shape
    logits = []
    for t in (tok, tok.to(ctx.dtype)):
        inv, _ = reference.pool_forward(_f64(t), q, wk, wv, bv, wo, bo, mask)
        logits.append((_f64(ctx) + inv[:, None]).reshape(B * H, D) @ wg.T)
    if k >= wg.shape[0]:
        return math.inf
    chosen = torch.zeros_like(logits[0], dtype=torch.bool).scatter_(1, logits[0].topk(k, dim=1).indices, True)
    gaps = [torch.where(chosen, l, math.inf).amin(1) - torch.where(chosen, -math.inf, l).amax(1) for l in logits]
    return float(torch.minimum(*gaps).min())


def rel_err(got, ref):
    got, ref = got.double(), ref.double()
    denom = ref.norm()
    if denom == 0:
        return float(got.norm())
    return float((got - ref).norm() / denom)


def _f64(t):
    return None if t is None else t.double()


def pool_case(tok_dtype, bv_scale, B=3, N=37, D=40, P=2, device="cpu"):
    """Fresh (tok, q, wk, wv, bv, wo, bo) of the pool, tok in tok_dtype; bv None where bv_scale is."""
    tok = torch.randn(B, N, D, device=device).to(tok_dtype)
    q, bo = torch.randn(P, D // P, device=device), torch.randn(D, device=device) * 0.1
    bv = None if bv_scale is None else torch.randn(D, device=device) * bv_scale
    wk, wv, wo = (torch.randn(D, D, device=device) * D ** -0.5 for _ in range(3))
    return tok, q, wk, wv, bv, wo, bo


def pool_grad_errors(got, inputs, grad_inv, mask=None):
    """{name: ‖g − ref‖ / ‖ref‖} of pool_backward's gradients `got` against float64 autograd of the
    reference pool on `inputs` (tok, q, wk, wv, bv, wo, bo; an absent bv is left out)."""
    leaves = [None if t is None else t.double().requires_grad_() for t in inputs]
    reference.pool_forward(*leaves, mask)[0].backward(grad_inv.double())
    return {name: float((g.double() - leaf.grad).norm() / leaf.grad.norm())
            for name, g, leaf in zip(("tok", "q", "wk", "wv", "bv", "wo", "bo"), got, leaves) if leaf is not None}


def check_pool_products(monkeypatch, B, N, D, P, dtype, device, chunk_bytes, products_bound):
    """Where none of the pool forward's or pass 1's configs fits the GPU (UnfitLauncher), pool_forward
    and pool_backward compute the same sums by attend_by_products and scores_grad_by_products
    instead of launches that would raise: one call each, no launch; a key-padding mask with batch
    row 1 all masked (its attn 0, its inv bo); inv and attn against float64 within products_bound,
    then every gradient, ∂tok within its dtype's rounding past that (it is returned in tok's dtype).
    chunk_bytes: PRODUCTS_CHUNK_BYTES (copies of fp16 or fp32 tok a chunk of batch rows at a time).
    Returns {name: error}."""
    monkeypatch.setattr(triton_pool, "PRODUCTS_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(triton_pool, "SINGLE_PASS", False)
    monkeypatch.setattr(triton_pool, "BWD_ONE_KERNEL", False)
    for name in ("_attend", "_attend_bwd_scores"):
        monkeypatch.setattr(triton_pool, name, UnfitLauncher())
    products = record_calls(monkeypatch, triton_pool, "attend_by_products")
    scores = record_calls(monkeypatch, triton_pool, "scores_grad_by_products")
    tok, q, wk, wv, bv, wo, bo = inputs = pool_case(dtype, 1.0, B, N, D, P, device)
    mask = torch.rand(B, N, device=device) < 0.3
    mask[1] = True
    want_inv, want_attn = reference.pool_forward(*[t.double() for t in inputs], mask)
    inv, attn = triton_pool.pool_forward(tok, q, wk, wv, bv, wo, bo, mask)
    assert triton_pool._attend.launches == [] and len(products) == 1
    assert torch.equal(attn[1], torch.zeros_like(attn[1])) and torch.equal(inv[1], bo)
    errors = {"inv": rel_err(inv, want_inv), "attn": rel_err(attn, want_attn)}
    assert max(errors.values()) < products_bound, errors
    grad_inv = torch.randn(B, D, device=device)
    got = triton_pool.pool_backward(grad_inv, tok, q, wk, wv, bv, wo, attn, mask=mask)
    assert triton_pool._attend_bwd_scores.launches == [] and len(scores) == 1
    errors.update(pool_grad_errors(got, inputs, grad_inv, mask))
    # ∂tok's rounding to tok's dtype: 2⁻¹¹ (fp16) or 2⁻⁸ (bf16) of each entry at most, to nearest
    bounds = {"tok": products_bound + {torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8}.get(dtype, 0)}
    assert all(err < bounds.get(name, products_bound) for name, err in errors.items()), errors
    return errors


def check_route_split_ctx(B, H, D, E, k, dtype, device, max_flips, bound=1e-5):
    """triton_router.route with SPLIT_CTX on fresh ctx [B·H,D] in `dtype`, inv [B,D] fp32 and Wg
    [E,D] in `dtype` (a caller below SPLIT_CTX_MIN_WORK lowers it), against float64: the split
    taken, π and the weights within `bound` (the fp32 bound by default), at most max_flips of the
    rows choosing other experts (near-ties, left out)."""
    gen = torch.Generator(device=device).manual_seed(25)
    ctx = torch.randn(B * H, D, device=device, generator=gen).to(dtype)
    inv = torch.randn(B, D, device=device, generator=gen)
    wg = (torch.randn(E, D, device=device, generator=gen) * D**-0.5).to(dtype)
    assert triton_router.split_ctx(ctx, inv, wg)
    weight, index, probs = triton_router.route(ctx, inv, wg, k, True, H)
    x64 = ctx.double() + inv.double().repeat_interleave(H, 0)
    ref_probs, ref_weight, ref_index = reference.route(x64, wg.double(), k, True)
    same = (index.long() == ref_index).all(1)
    assert int((~same).sum()) <= max_flips * B * H, f"{int((~same).sum())} of {B * H} rows chose other experts"
    errors = rel_err(weight[same], ref_weight[same]), rel_err(probs, ref_probs)
    assert max(errors) <= bound, f"weights, π off float64 by {errors}, over {bound}"
    return ctx, inv, wg


def check_router_weight_grad_split(B, H, D, E, dtype, device):
    """∂Wg split (SPLIT_WGRAD) on fresh ctx [B·H,D] in `dtype`, inv [B,D] fp32 and ∂logits [B·H,E]
    fp32: Σ_r ∂logits[r]ᵀ ctx[r] on the 16-bit ctx (∂logits in hi/mid/lo parts) + Σ_b
    (Σ_h ∂logits[b·H + h])ᵀ inv[b], against float64 at 1e-6, under the default launch (runs of a
    few hundred rows) and the probe's overrides (3 runs: thousands of rows each at 1024 x 16, where
    the split chained into one accumulator was 1.29e-5 off on the H200 and the merged form 2.7e-7)."""
    gen = torch.Generator(device=device).manual_seed(26)
    ctx = torch.randn(B * H, D, device=device, generator=gen).to(dtype)
    inv = torch.randn(B, D, device=device, generator=gen)
    dlogits = torch.randn(B * H, E, device=device, generator=gen)
    want = dlogits.double().T @ (ctx.double() + inv.double().repeat_interleave(H, 0))
    for launch in (dict(), dict(block_d=16, block_r=32, runs=3, num_warps=2)):
        got = triton_router.router_weight_grad(dlogits, ctx, inv, H, split=True, **launch)
        assert rel_err(got, want) <= 1e-6, (launch, rel_err(got, want))


def check_region(module, ctx, tok, params, top_k, renorm, act, mask=None, grad_seed=1, check_grads=True):
    """Run `module`'s forward and backward and compare with the float64 reference.

    Returns a dict of errors (and the flip count); raises AssertionError with every failure.
    """
    dtype = ctx.dtype
    tol = TOLERANCE[dtype]
    out, inv, attn, weight, index, probs, reuse = module.region_forward(ctx, tok, *params, mask, top_k, renorm, act)
    ref = reference.region_forward(_f64(ctx), _f64(tok), *[_f64(p) for p in params], mask, top_k, renorm, act)
    r_out, r_inv, r_attn, r_weight, r_index, r_probs, r_reuse = ref
    B, H, D = ctx.shape
    # what the op's fake promises (its backward reads the layout and u from it; empty on the reference)
    assert reuse.dtype == torch.int32 and reuse.numel() == module.reuse_size(ctx, tok, params[0], params[8], top_k,
                                                                             act, mask)
    assert r_reuse.numel() == 0
    assert out.shape == (B, H, D) and out.dtype == dtype
    assert inv.dtype == attn.dtype == weight.dtype == probs.dtype == reference.accumulation_dtype(dtype)
    assert probs.shape == r_probs.shape
    assert index.dtype == torch.int32 and index.shape == r_index.shape
    assert torch.isfinite(out).all(), "non-finite output"
    same = (index.long().sort(1).values == r_index.sort(1).values).all(1)  # [R]
    flips = int((~same).sum())
    # π is kept for the router's backward: every row's, flipped or not (it is continuous in x)
    errors = {"flips": flips, "inv": rel_err(inv, r_inv), "attn": rel_err(attn, r_attn),
              "probs": rel_err(probs, r_probs)}
    keep = same.view(B, H)
    errors["out"] = rel_err(out[keep], r_out[keep])
    errors["weight"] = rel_err(weight[same], r_weight[same])
    failures = [f"{name} {err:.2e} > {tol:.0e}" for name, err in errors.items()
                if name != "flips" and err > tol]
    if flips > FLIP_FRACTION[dtype] * B * H:
        failures.append(f"{flips} of {B * H} rows flipped their top-k choice")
    if check_grads:
        grad_out = _cotangent(out.shape, grad_seed, ref, ctx, params, act).to(device=ctx.device, dtype=dtype)
        grads = module.region_backward(grad_out, ctx, tok, *params, mask, inv, attn, weight, index, probs,
                                       reuse, top_k, renorm, act)
        # The reference backward, fed this forward's saved tensors (in float64) but its own π: the
        # reference forms 1 − π_j, which from an fp32 π loses up to 2⁻²⁴ / (1 − π_j) relative (∂Wg
        # off by 1e-5 to 1e-2 at π_j near 1; the kernels sum the other experts' π instead).
        r_grads = reference.region_backward(
            _f64(grad_out), _f64(ctx), _f64(tok), *[_f64(p) for p in params], mask,
            _f64(inv), _f64(attn), _f64(weight), index, r_probs, r_reuse, top_k, renorm, act)
        inputs = (ctx, tok, *params)
        assert len(grads) == 15
        for name, g, r, t in zip(GRAD_NAMES, grads, r_grads, inputs):
            if t is None:
                assert g is None, f"∂{name} should be None for an absent input"
                continue
            assert g.shape == t.shape and g.dtype == t.dtype, f"∂{name}: {g.shape} {g.dtype}"
            assert torch.isfinite(g).all(), f"∂{name} is not finite"
            if name == "bk":
                assert (g == 0).all(), "∂bk must be exactly zero"
                continue
            errors["d" + name] = err = rel_err(g, r)
            if err > tol:
                failures.append(f"∂{name} {err:.2e} > {tol:.0e}")
    assert not failures, f"{module.__name__}: " + "; ".join(failures) + f" (all: {fmt(errors)})"
    return errors


def check_nan_rows(module, where, device, E=5, k=2, dtype=torch.float32):
    """A NaN or inf where training meets one (an fp16 overflow before GradScaler skips the step):
    `where` "tok" (a NaN token of batch row 1), "ctx" (an inf in one horizon row) or "wg" (a NaN
    router weight: every row). Every chosen expert is one of the E (E = 5: the router's block has
    padding lanes, which argmax over NaN could pick, and an expert past E would send every MoE
    kernel after it outside W1's memory); the rows the bad value reaches, and only those, get NaN
    weights and a non-finite output, as the reference's (torch.topk ranks NaN above every
    number); the others match the float64 reference (those whose choice no rounding flipped),
    and so do their gradients (∂ctx's rows, ∂tok's clean batch rows)."""
    ctx, tok, params = make_case(3, 4, 6, 24, 2, 40, E, k, dtype=dtype, device=device, seed=3)
    B, H, D = ctx.shape
    bad = torch.zeros(B, H, dtype=torch.bool, device=device)
    if where == "tok":
        tok[1, 2, 5] = float("nan")
        bad[1] = True
    elif where == "ctx":
        ctx[2, 1, 7] = float("inf")
        bad[2, 1] = True
    else:
        params[7][3, 4] = float("nan")
        bad[:] = True
    out, inv, attn, weight, index, probs, reuse = module.region_forward(ctx, tok, *params, None, k, True, "gelu")
    ref = reference.region_forward(_f64(ctx), _f64(tok), *[_f64(p) for p in params], None, k, True, "gelu")
    assert ((index >= 0) & (index < E)).all(), f"experts chosen outside [0, {E}): {index.tolist()}"
    assert torch.equal(weight.isnan().any(1).view(B, H), bad), "NaN weights on other rows than the bad value's"
    assert torch.equal(~out.isfinite().all(-1), ~ref[0].isfinite().all(-1)), "non-finite rows differ from the reference's"
    assert torch.equal(~out.isfinite().all(-1), bad)
    same = (index.long().sort(1).values == ref[4].sort(1).values).all(1).view(B, H)  # no bf16 flip
    if (same & ~bad).any():
        assert rel_err(out[same & ~bad], ref[0][same & ~bad]) <= TOLERANCE[dtype], "the other rows differ from the reference"
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(device=device, dtype=dtype)
    grads = module.region_backward(grad_out, ctx, tok, *params, None, inv, attn, weight, index, probs, reuse, k,
                                   True, "gelu")
    if device != "cpu":
        torch.cuda.synchronize()  # an access outside W1 would surface here
    # The rows the bad value never reached take their gradients as the reference gives them (fed
    # this forward's saved tensors, as check_region does): ∂ctx's rows, and ∂tok's batch rows
    # whose every horizon row is clean; a NaN leaking into them fails here.
    r_grads = reference.region_backward(_f64(grad_out), _f64(ctx), _f64(tok), *[_f64(p) for p in params], None,
                                        _f64(inv), _f64(attn), _f64(weight), index, ref[5], ref[6], k, True, "gelu")
    clean = same & ~bad
    clean_b = clean.all(1)
    assert clean.any() or where == "wg"
    for name, g, r, rows in (("ctx", grads[0], r_grads[0], clean), ("tok", grads[1], r_grads[1], clean_b)):
        if rows.any():
            assert g[rows].isfinite().all(), f"∂{name}: a non-finite value in rows the bad value never reached"
            assert rel_err(g[rows], r[rows]) <= TOLERANCE[dtype], f"∂{name}'s clean rows differ from the reference"


EXPERT_PARAMS = (8, 9, 10, 11)  # W1, b1, W2, b2 in region-op order (params; their gradients are 2 further on)


def check_non_finite_experts(module, device, E=8, k=2):
    """SPEC §1 computes the chosen experts only, so (a) a NaN or inf in the weights of an expert no
    row chooses, the last (whose weights the reference's trailing tiles of padding take), reaches no
    output and no gradient, its own being 0; and (b) a NaN in one row of G reaches only the gradients
    of that row's experts. Before session 69 the reference's per-expert sums of its tiles (a one-hot
    GEMM: 0·NaN) gave every expert's ∂W1, ∂W2 and ∂b1 a NaN in both cases (a review's): with (a), a
    finite loss and a NaN in every expert after the optimiser's step."""
    ctx, tok, params = make_case(2, 2, 6, 24, 2, 40, E, k, device=device, seed=5)
    index = module.region_forward(ctx, tok, *params, None, k, True, "gelu")[4]
    unchosen = sorted(set(range(E)) - set(index.flatten().tolist()))
    assert unchosen, f"every expert chosen: {index.tolist()}"
    order = list(range(E))  # one unchosen expert moved last, the rest as they were
    order.remove(unchosen[0])
    order.append(unchosen[0])
    for i in (7,) + EXPERT_PARAMS:
        params[i] = params[i][order].contiguous()
    clean = list(params)
    for i, spot in zip(EXPERT_PARAMS, [(E - 1, 0, 0), (E - 1, 3), (E - 1, 1, 2), (E - 1, 4)]):
        params[i] = params[i].clone()
        params[i][spot] = float("nan") if i != 10 else float("inf")
    saved = module.region_forward(ctx, tok, *params, None, k, True, "gelu")
    assert (saved[4] != E - 1).all(), "the moved expert is chosen"
    want = module.region_forward(ctx, tok, *clean, None, k, True, "gelu")
    assert torch.equal(saved[0], want[0]), "a non-finite unchosen expert changed the output"
    grad_out = torch.randn(saved[0].shape, generator=torch.Generator().manual_seed(6)).to(device)
    grads = module.region_backward(grad_out, ctx, tok, *params, None, *saved[1:], k, True, "gelu")
    wanted = module.region_backward(grad_out, ctx, tok, *clean, None, *want[1:], k, True, "gelu")
    for i in EXPERT_PARAMS:
        g = grads[i + 2]
        bad = sorted(set((~g.isfinite()).nonzero()[:, 0].tolist()))
        assert not bad, f"param {i}: a non-finite gradient in experts {bad}"
        assert (g[E - 1] == 0).all() and torch.equal(g, wanted[i + 2]), f"param {i}: not the clean experts' gradient"
    # (b) a NaN in G's row 0: the gradients of row 0's experts take it, no other expert's
    grad_out[0, 0, 0] = float("nan")
    grads = module.region_backward(grad_out, ctx, tok, *clean, None, *want[1:], k, True, "gelu")
    reached = set(want[4].view(2, 2, k)[0, 0].tolist())
    for i in EXPERT_PARAMS:
        nan_experts = {e for e in range(E) if grads[i + 2][e].isnan().any()}
        assert nan_experts == reached, f"param {i}: NaN in experts {sorted(nan_experts)}, row 0 chose {sorted(reached)}"


def _cotangent(shape, seed, ref, ctx, params, act):
    """A random G [B,H,D] in float64; see CANCEL_COS for the few-pair cases."""
    B, H, D = shape
    index = ref[4]
    for attempt in range(64):
        gen = torch.Generator().manual_seed(seed + 1000 * attempt)
        grad_out = torch.randn(shape, generator=gen, dtype=torch.float64)
        if index.numel() > FEW_PAIRS or min_pair_cosine(grad_out, ref, ctx, params, act) >= CANCEL_COS:
            return grad_out
    raise AssertionError(f"no cotangent in 64 draws with every pair's |cos(G, f)| >= {CANCEL_COS}")


def min_pair_cosine(grad_out, ref, ctx, params, act):
    """min over rows r and chosen experts j of |cos(G_r, f_{idx_j}(x_r))| (float64 reference)."""
    inv, index = ref[1], ref[4]
    B, H, D = ctx.shape
    x = (_f64(ctx).cpu() + inv.cpu()[:, None]).reshape(B * H, D)
    w1, b1, w2, b2, w3 = (None if p is None else _f64(p).cpu() for p in params[8:13])
    G = grad_out.reshape(B * H, D).cpu()
    index = index.cpu().long()
    worst = 1.0
    for j in range(index.shape[1]):
        one_hot = torch.zeros(index.shape, dtype=torch.float64)
        one_hot[:, j] = 1.0
        f = reference.moe_forward(x, one_hot, index, w1, b1, w2, b2, w3, act)  # f_{idx_j}(x_r)
        cos = (G * f).sum(1).abs() / (G.norm(dim=1) * f.norm(dim=1)).clamp_min(1e-300)
        worst = min(worst, float(cos.min()))
    return worst


def fmt(errors):
    return ", ".join(f"{k}={v:.1e}" if isinstance(v, float) else f"{k}={v}" for k, v in errors.items())


def one_expert_router(ctx, wg, strength=3.5):
    """Make expert 0 win every row: set ctx's component along a direction v to `strength` and point Wg[0] at v.

    Expert 0's logit is then strength² plus strength·⟨inv, v⟩ (at least 3.6 above the others' in 300 draws
    of the CPU case). A larger logit makes ∂Wg ill-conditioned in fp32: at strength 6, with ctx's own
    component along v left in (logits up to ~50), even the plain-PyTorch reference in fp32 missed 1e-5 on
    ∂Wg (1.2e-5) in one draw of 300; at 3.5 its worst of 300 is 2.8e-6.
    """
    D = ctx.shape[-1]
    gen = torch.Generator().manual_seed(7)
    v = torch.randn(D, generator=gen, dtype=torch.float64).to(ctx.device)
    v = v / v.norm()
    x = ctx.double()
    x = x - (x @ v)[..., None] * v + strength * v
    wg = (0.05 * wg.double()).clone()
    wg[0] = strength * v
    return x.to(ctx.dtype), wg.to(ctx.dtype)


@triton.jit
def _act_kernel(u_ptr, h_ptr, du_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    u = tl.load(u_ptr + offs, mask=ok)
    tl.store(h_ptr + offs, act_fwd(u, u, ACT), mask=ok)
    tl.store(du_ptr + offs, act_bwd(1.0, u, u, ACT)[0], mask=ok)


def check_activation(act, device, kernel=_act_kernel):
    """act(u) and act′(u) elementwise against float64 autograd of reference.act_forward, to fp32's
    rounding: 4e-7·max(1, |u|), over both tails (past where exp overflows in a sigmoid) and fresh
    random values; past |u| = 100, where act′ is 0 or 1 in fp32, act′ to 4e-7 itself (gelu_tanh's
    act′ had grown as u³ 2^−126 below u ≈ −10: 1.4 at −1e13, NaN past |u| = 1.8e19 where u² overflows;
    session 69). gelu's Φ by Abramowitz and Stegun 7.1.26 is within 7.5e-8 of float64's (a wrong
    coefficient fails this), and rcp.approx and ex2.approx within 2 ulp. kernel[grid](u, h, du, n,
    ACT=, BLOCK=) writes h = act(u) and du = act′(u): triton_util's act_fwd and act_bwd (∂h = 1)
    by default (the interpreter on the CPU, where rcp is 1 / x; inline PTX on the GPU)."""
    far = torch.logspace(2.05, 30, 57)
    u = torch.cat([torch.linspace(-100, 100, 201), torch.linspace(-12, 12, 24001), torch.randn(999) * 3, -far,
                   far]).float().to(device)
    h, du = torch.empty_like(u), torch.empty_like(u)
    kernel[(triton.cdiv(u.numel(), 1024),)](u, h, du, u.numel(), ACT=ACT_CODE[act], BLOCK=1024)
    leaf = u.cpu().double().requires_grad_()
    want = reference.act_forward(act, leaf)
    want.sum().backward()
    size = leaf.detach().abs()
    bound = 4e-7 * size.clamp(min=1)
    for name, got, ref, tol in (("act", h, want.detach(), bound), ("act'", du, leaf.grad,
                                                                     torch.where(size > 100, 4e-7, bound))):
        err = (got.cpu().double() - ref).abs()
        assert torch.isfinite(got).all() and (err <= tol).all(), (
            f"{act} {name}: max error {err.max().item():.3g} at u = {u[err.argmax()].item():.4g}")
    # a NaN pre-activation stays NaN in both (the GPU's min and max drop a NaN operand unless told)
    u = torch.tensor([float("nan")] * 4, device=device)
    kernel[(1,)](u, h, du, u.numel(), ACT=ACT_CODE[act], BLOCK=1024)
    assert h[:4].isnan().all() and du[:4].isnan().all(), f"{act}: NaN in gave {h[:4].tolist()}, {du[:4].tolist()}"


def phase_column_sums(b, groups, split, rows, bk):
    """B's column sums as gluon_moe.weight_grads leaves them with sum_rows=rows, in float64 on the
    CPU: [E, split, rows, J], row i of split c of expert e the sums over that split's K steps k
    (slots k … k + bk) with (k / bk) mod rows = i; splits are runs of whole tiles, as
    triton_moe._moe_wgrad_kernel cuts an expert's slots."""
    b, bounds, E = b.double().cpu(), groups.expert_slots.tolist(), groups.experts
    want = torch.zeros(E, split, rows, b.shape[1], dtype=torch.float64)
    for e in range(E):
        lo, hi = bounds[e], bounds[E + e]
        run = -(-((hi - lo) // groups.tile) // split) * groups.tile
        for c in range(split):
            for k in range(min(lo + c * run, hi), min(lo + (c + 1) * run, hi), bk):
                want[e, c, (k // bk) % rows] += b[k:k + bk].sum(0)
    return want


def read_at_import(module, attr, env, value):
    """str(module.attr) as a fresh interpreter reads it with environment variable `env` set to
    `value` (None: unset): for the switches read once, at import."""
    environ = {k: v for k, v in os.environ.items() if k != env}
    if value is not None:
        environ[env] = value
    code = f"import {module}; print({module}.{attr})"
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True,
                          check=True).stdout.strip()
