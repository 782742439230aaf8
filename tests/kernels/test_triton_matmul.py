"""triton_matmul.matmul_f32 (the pool's projections on split tensor-core dots) against float64:
odd extents, strided operands and outputs, and K cut into runs whose partials are summed."""
import pytest
import torch
import triton
import triton.language as tl

from kernel_cases import launched, only_config
from mha_compile.kernels import triton_matmul, triton_util

# ieee fp32; split bf16 halves ~2⁻¹⁶ a product (1.5e-5 on the GPU, 2.7e-5 under the interpreter, whose
# fp32 → bf16 casts differ from the GPU's in the last bit; 1e-4 is within SPEC §4's 5e-4 for fp32
# dots that are not ieee); split fp16 ~2⁻²²
BOUND = {0: 1e-5, 1: 1e-4, 2: 1e-5}


def _case(device, Bt=3, M=37, K=97, N=45, seed=0):
    """a [Bt,M,K] and b [Bt,K,N] fp32, each a strided view (a transposed, b sliced)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(Bt, K, M, generator=g).to(device).transpose(1, 2)
    b = torch.randn(Bt, K, 2 * N, generator=g).to(device)[:, :, ::2]
    return a, b


def _check(a, b, out, split_dot, bias=None):
    ref = a.double() @ b.double()
    if bias is not None:
        ref = ref + (bias.double() if bias.dim() == 1 else bias.double()[:, None])
    got = triton_matmul.matmul_f32(a, b, out, split_dot, bias)
    assert got.data_ptr() == out.data_ptr()
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err <= BOUND[split_dot], (split_dot, err)
    return err


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))


@pytest.mark.skipif(not triton_util.interpreting(), reason="the interpreter's bf16 dot (TRITON_INTERPRET=1)")
def test_bf16_interpreter_takes_bf16_dot_operands_by_their_values(bf16_interpreter):
    """conftest.bf16_interpreter: a bf16 tl.dot of small integers comes back exact (fp32 sums of exact
    products), where Triton 3.6's interpreter multiplies the raw bits (~1e10, triton#11584)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(-3, 4, shape, generator=g).bfloat16() for shape in ((16, 32), (32, 16)))
    c = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, c, M=16, N=16, K=32)
    assert torch.equal(c, a.float() @ b.float())


@triton.jit
def _to_bf16_kernel(x_ptr, y_ptr, N: tl.constexpr):
    rn = tl.arange(0, N)
    tl.store(y_ptr + rn, tl.load(x_ptr + rn).to(tl.bfloat16))


@pytest.mark.skipif(not triton_util.interpreting(), reason="the interpreter's fp32 -> bf16 cast (TRITON_INTERPRET=1)")
def test_bf16_interpreter_rounds_fp32_to_bf16_to_nearest_even(bf16_interpreter):
    """conftest.bf16_interpreter: an fp32 -> bf16 cast in a kernel gives torch's bits, rounded to
    nearest even as the GPU's cvt.rn.bf16.f32 rounds, where Triton 3.6's interpreter drops the low 16
    bits: on random values of many scales, both signs, ties to an even and to an odd neighbour (half
    an ulp above each), values that round up into the next binade (1 - 2⁻²⁴), zeros, one near bf16's
    largest and one below fp32's normals."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(244, generator=g) * 10.0 ** torch.randint(-6, 7, (244,), generator=g)
    # fp32 bits of bf16 values with 0x8000 below them: each exactly between two bf16 neighbours
    even_odd = torch.tensor([1.0, 1.0078125, -3.0, -3.015625, 96.0, 96.5]).bfloat16().view(torch.int16)
    ties = ((even_odd.int() & 0xFFFF) << 16 | 0x8000).view(torch.float32)
    x = torch.cat([x, ties, torch.tensor([1 - 2 ** -24, -(1 - 2 ** -24), 0.0, -0.0, 3e38, -1e-39])])
    y = torch.empty(256, dtype=torch.bfloat16)
    _to_bf16_kernel[(1,)](x, y, N=256)
    assert torch.equal(y.view(torch.int16), x.bfloat16().view(torch.int16))
    # by hand: each tie to its even neighbour; 1 - 2⁻²⁴ up into the next binade
    assert y[244:252].float().tolist() == [1.0, 1.015625, -3.0, -3.03125, 96.0, 97.0, 1.0, -1.0]


@pytest.mark.parametrize("split_dot", [0, 1, 2])
@pytest.mark.parametrize("runs", [False, True])
@pytest.mark.parametrize("bias", [None, "shared", "per batch"])
def test_matmul_f32(monkeypatch, request, split_dot, runs, bias):
    """With a bias ([N] for every batch, or [Bt,N] strided), added once however many runs K takes.
    split_dot 1 (bf16 halves) with the interpreter's bf16 mended (conftest.bf16_interpreter)."""
    if split_dot == 1:
        request.getfixturevalue("bf16_interpreter")
    if runs:  # runs of K: with 4 SMs off the GPU, K = 97 becomes two runs of 64
        monkeypatch.setattr(triton_matmul, "MIN_RUN", 16)
    a, b = _case("cpu")
    assert triton_matmul.k_runs(3, 37, 45, 97, a.device)[0] == (2 if runs else 1)
    out = torch.empty(45, 3, 37).transpose(0, 2).transpose(0, 1)  # [3,37,45], no unit stride on N
    g = torch.Generator().manual_seed(1)
    bias = {None: None, "shared": torch.randn(45, generator=g) * 30,
            "per batch": torch.randn(2 * 45, 3, generator=g).T[:, ::2] * 30}[bias]
    _check(a, b, out, split_dot, bias)


@pytest.mark.parametrize("half_operand", ["a", "b"])
def test_matmul_f32_takes_an_operand_in_the_split_dtype(half_operand):
    """An operand in split_dot's 16-bit dtype (fp16 here: the interpreter's bf16
    halves are not exact, numpy has no bf16) is taken
    as it is: within the split's bound of float64 on the rounded operands, and the same result as
    its fp32 copy gives (its low half is zero, the dot dropped is a sum of zeros)."""
    a, b = _case("cpu")
    if half_operand == "a":
        a = a.half()
    else:
        b = b.half()
    got = torch.empty(3, 37, 45)
    _check(a, b, got, 2)  # writes got
    want = triton_matmul.matmul_f32(a.float(), b.float(), torch.empty(3, 37, 45), 2)
    assert torch.equal(got, want), (half_operand, float((got - want).abs().max()))


@pytest.mark.parametrize("runs", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_matmul_f32_into_a_16_bit_out(monkeypatch, runs, strided):
    """out and the bias in split_dot's 16-bit dtype (the pool's weight gradients of a 16-bit model;
    fp16 here, see above): the fp32 sums rounded once, as they are stored, bitwise the fp32 out's
    result cast, over one run of K and over two (added by triton_util.sum_runs), into a contiguous
    out and a strided one; within fp16's rounding of float64."""
    if runs:
        monkeypatch.setattr(triton_matmul, "MIN_RUN", 16)
    a, b = _case("cpu")
    assert triton_matmul.k_runs(3, 37, 45, 97, a.device)[0] == (2 if runs else 1)
    bias = (torch.randn(45, generator=torch.Generator().manual_seed(3)) * 30).half()
    want = triton_matmul.matmul_f32(a, b, torch.empty(3, 37, 45), 2, bias)
    out = torch.empty(45, 3, 37, dtype=torch.float16).permute(1, 2, 0) if strided else torch.empty(
        3, 37, 45, dtype=torch.float16)
    got = triton_matmul.matmul_f32(a, b, out, 2, bias)
    assert got.dtype == torch.float16 and got.data_ptr() == out.data_ptr()
    assert torch.equal(got, want.half())
    ref = a.double() @ b.double() + bias.double()
    assert float((got.double() - ref).norm() / ref.norm()) <= 2.0 ** -11 + BOUND[2]


def test_sum_runs_rounds_once_and_checks_its_shapes():
    """triton_util.sum_runs (matmul_f32's runs of K): fp32 sums in run order against float64, and
    into a 16-bit out the same sums rounded once; parts that do not stack into out are refused."""
    parts = torch.randn(5, 7, 33, generator=torch.Generator().manual_seed(4))
    want = triton_util.sum_runs(parts, torch.empty(7, 33))
    assert float((want.double() - parts.double().sum(0)).abs().max()) <= 1e-5
    got = triton_util.sum_runs(parts, torch.empty(7, 33, dtype=torch.float16))
    assert torch.equal(got, want.half())
    with pytest.raises(RuntimeError, match=r"sum_runs: parts \(5, 7, 33\) into out \(7, 32\), both contiguous"):
        triton_util.sum_runs(parts, torch.empty(7, 32))


def test_matmul_f32_checks_its_inputs():
    a, b = _case("cpu")
    with pytest.raises(RuntimeError, match="matmul_f32"):
        triton_matmul.matmul_f32(a, b.transpose(1, 2), torch.empty(3, 37, 45), 0)
    with pytest.raises(RuntimeError, match="fp32"):
        triton_matmul.matmul_f32(a.half(), b.half(), torch.empty(3, 37, 45), 0)
    with pytest.raises(RuntimeError, match=r"fp32 \(or torch.float16 with split_dot=2\), got a torch.bfloat16"):
        triton_matmul.matmul_f32(a.bfloat16(), b, torch.empty(3, 37, 45), 2)
    with pytest.raises(RuntimeError, match=r"out torch.bfloat16"):
        triton_matmul.matmul_f32(a, b, torch.empty(3, 37, 45, dtype=torch.bfloat16), 2)
    with pytest.raises(RuntimeError, match=r"bias \(3, 44\) for out \(3, 37, 45\): wants \[45\] or \[3, 45\]"):
        triton_matmul.matmul_f32(a, b, torch.empty(3, 37, 45), 0, torch.zeros(3, 44))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(1, 4096, 512, 512), (8, 4096, 512, 64), (1, 512, 4096, 512), (3, 37, 97, 45)])
def test_matmul_f32_bf16_halves(shape):
    """bf16 halves on the H200 at the large preset's projection shapes ((Bt, M, K, N): Wo,
    per-head Wv, ∂Wo with K = B cut into runs) and an odd one, with a bias a batch (bv's heads)."""
    Bt, M, K, N = shape
    a, b = _case("cuda", Bt, M, K, N, seed=1)
    bias = torch.randn(Bt, N, device="cuda") * 10
    err = _check(a, b, torch.empty(Bt, M, N, device="cuda"), 1, bias)
    print(f"{shape}: {err:.1e}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(1, 4096, 512, 512), (8, 4096, 512, 64), (3, 37, 97, 45)])
def test_matmul_f32_bf16_operand_gives_the_fp32_copys_sums(monkeypatch, shape):
    """A bf16 b (the pool's Wv and Wo of a bf16 model) on the H200 at the large preset's projection
    shapes and an odd one: bitwise the result of its fp32 copy at each config (two tensor-core
    dots in place of three: the third's products are all zero), and within bf16 halves' bound."""
    Bt, M, K, N = shape
    a, b = _case("cuda", Bt, M, K, N, seed=2)
    b = b.bfloat16()
    for config in triton_matmul._matmul.configs:
        with pytest.MonkeyPatch.context() as patch:
            metas = only_config(patch, triton_matmul._matmul, config)
            got = torch.empty(Bt, M, N, device="cuda")
            _check(a, b, got, 1)  # writes got
            want = triton_matmul.matmul_f32(a, b.float(), torch.empty(Bt, M, N, device="cuda"), 1)
            launched(metas, config)
        assert torch.equal(got, want), (config, float((got - want).abs().max()))
