"""triton_matmul.matmul_f32 (the pool's projections on split tensor-core dots) against float64:
odd extents, strided operands and outputs, and K cut into runs whose partials are summed."""
import pytest
import torch

from mha_compile.kernels import triton_matmul

BOUND = {0: 1e-5, 1: 1e-4, 2: 1e-5}  # ieee fp32; split bf16 halves ~2⁻¹⁶; split fp16 ~2⁻²²


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


@pytest.mark.parametrize("split_dot", [0, 2])
@pytest.mark.parametrize("runs", [False, True])
@pytest.mark.parametrize("bias", [None, "shared", "per batch"])
def test_matmul_f32(monkeypatch, split_dot, runs, bias):
    """With a bias ([N] for every batch, or [Bt,N] strided), added once however many runs K takes."""
    if runs:  # runs of K: with 4 SMs off the GPU, K = 97 becomes two runs of 64
        monkeypatch.setattr(triton_matmul, "MIN_RUN", 16)
    a, b = _case("cpu")
    assert triton_matmul.k_runs(3, 37, 45, 97, a.device)[0] == (2 if runs else 1)
    out = torch.empty(45, 3, 37).transpose(0, 2).transpose(0, 1)  # [3,37,45], no unit stride on N
    g = torch.Generator().manual_seed(1)
    bias = {None: None, "shared": torch.randn(45, generator=g) * 30,
            "per batch": torch.randn(2 * 45, 3, generator=g).T[:, ::2] * 30}[bias]
    _check(a, b, out, split_dot, bias)


def test_matmul_f32_checks_its_inputs():
    a, b = _case("cpu")
    with pytest.raises(RuntimeError, match="matmul_f32"):
        triton_matmul.matmul_f32(a, b.transpose(1, 2), torch.empty(3, 37, 45), 0)
    with pytest.raises(RuntimeError, match="fp32"):
        triton_matmul.matmul_f32(a.half(), b.half(), torch.empty(3, 37, 45), 0)
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


@pytest.mark.parametrize("runs", [False, True])
def test_col_sums(monkeypatch, runs):
    """Column sums of odd extents (N past one column block, R not a multiple of a run or of its
    row block), scaled, against float64; in runs of rows whose partials are summed, or one run."""
    if runs:  # with 4 SMs off the GPU and 2 column blocks: runs of 16 rows
        monkeypatch.setattr(triton_matmul, "COL_MIN_RUN", 16)
    x = torch.randn(97, 300, generator=torch.Generator().manual_seed(2)) + 3
    runs_taken = triton_matmul.split_runs(97, 2, triton_matmul.COL_MIN_RUN, triton_matmul.COL_BLOCK_R, x.device)[0]
    assert (runs_taken > 1) == runs
    got = triton_matmul.col_sums(x, 0.125)
    want = x.double().sum(0) * 0.125
    assert got.shape == (300,) and got.dtype == torch.float32
    assert float((got.double() - want).norm() / want.norm()) < 1e-6
    assert torch.equal(got, triton_matmul.col_sums(x, 0.125))  # the same bits again


def test_col_sums_checks_its_input():
    with pytest.raises(RuntimeError, match=r"col_sums takes a contiguous \[R, N\] fp32 tensor, got \(40, 30\)"):
        triton_matmul.col_sums(torch.randn(30, 40).T)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 512), (1000, 77)])
def test_col_sums_on_the_gpu(shape):
    """∂u's partials and ∂bo at the large preset, and an odd shape, against float64."""
    x = torch.randn(*shape, device="cuda") + 1
    want = x.double().sum(0) * 0.5
    got = triton_matmul.col_sums(x, 0.5)
    assert float((got.double() - want).norm() / want.norm()) < 1e-6
