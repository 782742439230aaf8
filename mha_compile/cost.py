"""Cost model of the region: FLOPs and bytes as sympy expressions of B, H, N, D, P, E, k, F.

Counting rule: FLOPs are 2 × the multiply-adds of the matrix products (GEMMs, batched GEMMs,
the attention contractions), which is what `torch.utils.flop_counter` counts too (the tests
hold the model to it). Elementwise work (softmax, activations, bias adds, the merge, top-k,
the gate-weighted sum) is not counted: at the SPEC presets it is about 1% of the products.

Every matrix product of the region has both operands needing a gradient in training (inputs
and parameters alike), so its backward costs two products of its size: forward+backward is
3× forward, term by term, except ∂Wk of the reassociated pool, an outer product. The pool's
terms are listed one by one below, because SPEC §5 asks for the backward to be worked out
rather than assumed.

Minimum work (SPEC §5): the pool reassociated, only the k chosen experts per row, nothing
recomputed. Bytes: every input and output of the region crosses memory once; for the
forward+backward pass that is inputs, ∂out, out and one gradient per input.

What each mode does (`region_flops`): eager and Inductor (default or max-autotune) on the
dense and loop spellings compute the pool un-reassociated (K and V projections, 4·B·N·D²)
and every expert on every row (4·R·E·D·F); the grouped-GEMM spelling computes the pool the
same way but only the chosen experts; the mha backend reassociates the pool and, like
`kernels/reference.py`, recomputes the pool's pooled value and the experts' forward in the
backward (the router's softmax π is kept from the forward); with options keep_hidden=True the
Triton sets keep u = x W1 + b1 from the forward instead (not for swiglu, where it does not
apply). The reference pads expert tiles (see `reference_pairs`); `region_flops` leaves padding
out (≈3% at medium) unless given its pairs (the bench gives them for mha-reference rows).
"""
import sympy

B, H, N, D, P, E, k, F = sympy.symbols("B H N D P E k F", positive=True, integer=True)
SYMBOLS = (B, H, N, D, P, E, k, F)
R = B * H  # rows through the MoE
PASSES = ("fwd", "fwd+bwd")

# Measured on the H200 (SPEC §5): bf16 dense GEMM rate and device-to-device copy bandwidth.
# Only bf16 has a measured peak; other dtypes get no floor rather than a made-up one.
H200_BF16_FLOPS = 790e12
H200_COPY_BYTES_PER_S = 4.3e12
PEAK_FLOPS = {"bf16": H200_BF16_FLOPS}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}

# Mode families: which algorithm a benchmark mode runs (see the module docstring).
ALL_EXPERTS = "all_experts"        # eager / Inductor on the dense and loop spellings
GROUPED = "grouped"                # the grouped-GEMM spelling: chosen experts, plain pool
REGION_KERNELS = "region_kernels"  # backend="mha", kernels="reference"
REGION_TRITON = "region_triton"    # backend="mha", the Triton kernel sets (staged, fused)
REGION_TRITON_KEPT = "region_triton_kept"  # the same with options keep_hidden=True
MINIMUM = "minimum"
FAMILIES = (MINIMUM, ALL_EXPERTS, GROUPED, REGION_KERNELS, REGION_TRITON, REGION_TRITON_KEPT)


def _check_pass(pass_):
    if pass_ not in PASSES:
        raise ValueError(f"pass_={pass_!r}: expected one of {PASSES}")


def _pool_terms(reassociated):
    """Forward and backward products of the pool, as two lists of FLOP expressions."""
    if reassociated:
        forward = [
            2 * D * D,          # u_p = Wk_pᵀ q_p (parameters only): P·Dh·D MACs
            2 * B * N * D * P,  # scores = tok · u       [B,N,D]x[D,P]
            2 * B * N * D * P,  # t̄ = Σ_n a tok          [B,P,N]x[B,N,D]
            2 * B * D * D,      # pooled_p = Wv_p t̄_p     B·P·Dh·D MACs
            2 * B * D * D,      # inv = pooled Woᵀ
        ]
        backward = [
            2 * B * D * D,      # ∂Wo = ∂invᵀ pooled
            2 * B * D * D,      # ∂pooled = ∂inv Wo
            2 * B * D * D,      # ∂Wv_p = Σ_b ∂pooled_p ⊗ t̄_p
            2 * B * D * D,      # ∂t̄_p = ∂pooled_p Wv_p
            2 * B * N * D * P,  # ∂a = ⟨∂t̄, tok⟩
            2 * B * N * D * P,  # ∂tok (through t̄) = Σ_p a ∂t̄
            2 * B * N * D * P,  # ∂tok (through scores) = ∂s u
            2 * B * N * D * P,  # ∂u = Σ_{b,n} ∂s ⊗ tok
            2 * D * D,          # ∂q_p = Wk_p ∂u_p
            # ∂Wk_p = q_p ⊗ ∂u_p is an outer product (D² multiplies, no sum): not counted
        ]
        return forward, backward
    forward = [
        2 * B * N * D * D,  # K = tok Wkᵀ
        2 * B * N * D * D,  # V = tok Wvᵀ
        2 * B * N * D,      # scores: ⟨q_p, K[b,n,p]⟩, B·N·P·Dh MACs
        2 * B * N * D,      # pooled = Σ_n a V
        2 * B * D * D,      # inv = pooled Woᵀ
    ]
    return forward, [2 * t for t in forward]  # each product: ∂ of both operands


def pool_flops(reassociated, pass_):
    """FLOPs of the inverted attention pool."""
    _check_pass(pass_)
    forward, backward = _pool_terms(reassociated)
    return sympy.expand(sum(forward) + (sum(backward) if pass_ == "fwd+bwd" else 0))


def router_flops(pass_):
    """logits = x Wgᵀ on all R rows; backward: ∂x and ∂Wg."""
    _check_pass(pass_)
    return sympy.expand(2 * R * D * E * (3 if pass_ == "fwd+bwd" else 1))


def expert_flops(pairs, act, pass_):
    """Experts on `pairs` (row, expert) pairs: x W1 and h W2 (and x W3 for swiglu)."""
    _check_pass(pass_)
    forward = (6 if act == "swiglu" else 4) * pairs * D * F
    return sympy.expand(forward * (3 if pass_ == "fwd+bwd" else 1))


def combine_flops(pass_):
    """The dense spelling's einsum('re,red->rd', gates, f): a product over E."""
    _check_pass(pass_)
    return sympy.expand(2 * R * E * D * (3 if pass_ == "fwd+bwd" else 1))


def region_flops(family, act="gelu", pass_="fwd", spelling="dense", pairs=None):
    """FLOPs of the region as a mode family (one of FAMILIES) computes it.

    pairs: (row, expert) pairs the chosen-expert families compute; R·k unless given
    (e.g. `reference_pairs(...)` to count the reference's padded tiles).
    """
    pairs = R * k if pairs is None else pairs
    if family == MINIMUM:
        return pool_flops(True, pass_) + router_flops(pass_) + expert_flops(pairs, act, pass_)
    if family == ALL_EXPERTS:
        combine = combine_flops(pass_) if spelling == "dense" else 0
        return pool_flops(False, pass_) + router_flops(pass_) + expert_flops(R * E, act, pass_) + combine
    if family == GROUPED:
        return pool_flops(False, pass_) + router_flops(pass_) + expert_flops(pairs, act, pass_)
    if family in (REGION_KERNELS, REGION_TRITON, REGION_TRITON_KEPT):
        total = region_flops(MINIMUM, act, pass_, pairs=pairs)
        if pass_ == "fwd+bwd" and not (family == REGION_TRITON_KEPT and act != "swiglu"):
            total += (4 if act == "swiglu" else 2) * pairs * D * F  # every set recomputes u = x W1 (and u3)
            if family == REGION_KERNELS:  # the reference also recomputes u_p, t̄ and pooled
                total += 2 * D * D + 2 * B * N * D * P + 2 * B * D * D
        return sympy.expand(total)
    raise ValueError(f"family={family!r}: expected one of {FAMILIES}")


def mode_family(mode, spelling):
    """The algorithm family of a benchmark (mode, spelling)."""
    if mode == "mha-reference":
        return REGION_KERNELS
    if mode.startswith("mha-fused-keep"):  # keep_hidden=True (bench/modes.py)
        return REGION_TRITON_KEPT
    if mode.startswith("mha"):
        return REGION_TRITON
    return GROUPED if spelling == "grouped_mm" else ALL_EXPERTS


def region_bytes(act="gelu", pass_="fwd", bias=True, dtype_bytes=2):
    """Minimum bytes: every input and output of the region read or written once."""
    _check_pass(pass_)
    params = D + 3 * D * D + 3 * D  # q, Wk Wv Wo, bk bv bo
    params += E * D + (3 if act == "swiglu" else 2) * E * D * F  # Wg, W1 W2 (W3)
    if bias:
        params += E * F + E * D  # b1, b2
    inputs = B * H * D + B * N * D + params  # ctx, tok, parameters
    out = B * H * D
    elements = inputs + out if pass_ == "fwd" else 2 * inputs + 2 * out  # + ∂out, + ∂inputs
    return sympy.expand(elements * dtype_bytes)


def evaluate(expr, dims):
    """A float from an expression, with dims a dict of B, H, N, D, P, F, E, k (e.g. a PRESET)."""
    values = {symbol: dims[symbol.name] for symbol in SYMBOLS}
    return float(sympy.sympify(expr).subs(values))


def floor_seconds(flops, bytes_, peak_flops=H200_BF16_FLOPS, peak_bytes=H200_COPY_BYTES_PER_S):
    """The roofline floor: the larger of compute time and memory time."""
    return max(flops / peak_flops, bytes_ / peak_bytes)


def preset_floor(dims, dtype="bf16", act="gelu", pass_="fwd", bias=True):
    """Floor time in seconds for a preset (None where the dtype has no measured peak)."""
    if dtype not in PEAK_FLOPS:
        return None
    flops = evaluate(region_flops(MINIMUM, act, pass_), dims)
    bytes_ = evaluate(region_bytes(act, pass_, bias, DTYPE_BYTES[dtype]), dims)
    return floor_seconds(flops, bytes_, PEAK_FLOPS[dtype])


def achieved_tflops(flops, seconds):
    return flops / seconds / 1e12


def percent_of_floor(floor_s, seconds):
    """100 means running at the floor; None where there is no floor."""
    return None if floor_s is None else 100.0 * floor_s / seconds


def reference_pairs(pairs, experts, tile):
    """(row, expert) slots kernels/reference.py computes: whole tiles, padding included."""
    return -(-(pairs + experts * (tile - 1)) // tile) * tile
