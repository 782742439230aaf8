"""Where the pool backward runs gluon_pool's kernel (tok read once), decided without a GPU: each
condition that keeps it on the Triton kernels, with the reason it gives (the kernel is compiled for
sm_90a in tests/bench/test_offline_sass.py and run against float64 in test_gluon_pool_cuda.py)."""
import pytest
import torch

from mha_compile.kernels import gluon_pool, triton_pool

HOPPER = (9, 0)


def tok(B=4, N=128, D=512, dtype=torch.bfloat16):
    return torch.randn(B, N, D).to(dtype)


@pytest.fixture
def enabled(monkeypatch):
    monkeypatch.setattr(gluon_pool, "ENABLED", True)


@pytest.mark.parametrize("N, D, P", [(128, 512, 8), (64, 256, 8), (64, 128, 4), (64, 192, 3), (64, 320, 5), (256, 256, 8)])
def test_takes_bf16_tokens_on_hopper(enabled, N, D, P):
    """The large and medium presets' shapes, and others within its limits."""
    assert gluon_pool.unsupported(tok(N=N, D=D), P, capability=HOPPER) is None


@pytest.mark.parametrize("change, words", [
    (dict(capability=(8, 0)), "sm_80"),
    (dict(capability=(10, 0)), "sm_100"),
    (dict(dtype=torch.float16), "torch.float16"),
    (dict(dtype=torch.float32), "torch.float32"),
    (dict(N=37), "N=37"),
    (dict(N=320), "N=320"),
    (dict(N=192), "N=192"),
    (dict(D=100), "D=100"),
    (dict(P=9), "P=9"),
    (dict(N=256, D=512), "bytes of shared memory"),
])
def test_declines_with_the_reason(enabled, change, words):
    change = dict(change)
    capability, P = change.pop("capability", HOPPER), change.pop("P", 8)
    why = gluon_pool.unsupported(tok(**change), P, capability=capability)
    assert why is not None and words in why, why


def test_declines_when_not_asked_for_off_the_gpu_and_strided(monkeypatch):
    assert "MHA_COMPILE_POOL_GLUON" in gluon_pool.unsupported(tok(), 8, capability=HOPPER)
    monkeypatch.setattr(gluon_pool, "ENABLED", True)
    assert "not on a CUDA GPU" in gluon_pool.unsupported(tok(), 8)
    wide = tok(D=1024)[:, :, :512]
    assert "contiguous" in gluon_pool.unsupported(wide, 8, capability=HOPPER)


def test_the_grid_fills_each_sm_by_shared_memory():
    """One program an SM at large (205 KB of 227), three at medium (70 KB), never more than B."""
    assert gluon_pool.programs(4096, 128, 512, 132) == 132
    assert gluon_pool.programs(1024, 64, 256, 132) == 396
    assert gluon_pool.programs(100, 64, 256, 132) == 100


def test_the_cpu_path_keeps_the_triton_kernels(enabled, monkeypatch):
    """Asked for, off the GPU: pool_backward runs the Triton kernels and launches no Gluon one."""
    launched = []
    monkeypatch.setattr(gluon_pool, "attend_bwd", lambda *a: launched.append(a))
    B, N, D, P = 2, 5, 32, 2
    t = torch.randn(B, N, D)
    q, wk, wv, wo = torch.randn(P, D // P), *(torch.randn(D, D) * D ** -0.5 for _ in range(3))
    bv, bo = torch.randn(D), torch.randn(D)
    _, attn = triton_pool.pool_forward(t, q, wk, wv, bv, wo, bo)
    grads = triton_pool.pool_backward(torch.randn(B, D), t, q, wk, wv, bv, wo, attn)
    assert launched == [] and all(torch.isfinite(g).all() for g in grads)
