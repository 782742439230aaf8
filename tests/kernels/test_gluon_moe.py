"""Where the MoE backward runs gluon_moe's kernels (the hidden kernel, the weight-gradient GEMM),
decided without a GPU: each condition that sends it to the Triton kernel, with the reason it gives
(the kernels are compiled in tests/bench/test_gluon_probe.py and test_gluon_wgrad_probe.py and run
against float64 in test_gluon_moe_cuda.py)."""
import pytest
import torch

from mha_compile.kernels import gluon_moe
from mha_compile.kernels import triton_moe as moe

HOPPER = (9, 0)


def operands(D=256, F=512, E=4, S=256, dtype=torch.bfloat16):
    rand = lambda *shape: torch.randn(*shape).to(dtype)  # noqa: E731
    return rand(S, D), rand(S, D), rand(E, D, F), rand(E, F, D)


def test_takes_hopper_bf16_and_fp16_with_each_activation():
    for dtype in (torch.bfloat16, torch.float16):
        for act in ("gelu", "gelu_tanh", "silu"):
            assert gluon_moe.unsupported(*operands(dtype=dtype), None, act, 128, capability=HOPPER) is None
        xs, gs, w1, w2 = operands(dtype=dtype)
        assert gluon_moe.unsupported(xs, gs, w1, w2, w1.clone(), "swiglu", 128, capability=HOPPER) is None
    assert gluon_moe.unsupported(*operands(), None, "gelu", 64, capability=HOPPER) is None  # small's tile


@pytest.mark.parametrize("change, words", [
    (dict(capability=(8, 0)), "sm_80"),
    (dict(capability=(10, 0)), "sm_100"),
    (dict(act="swiglu"), "'swiglu'"),
    (dict(dtype=torch.float32), "torch.float32"),
    (dict(D=200), "D=200"),
    (dict(F=320), "F=320"),
    (dict(tile=32), "TILE=32"),
])
def test_declines_with_the_reason(change, words):
    change = dict(change)
    capability, act, tile = change.pop("capability", HOPPER), change.pop("act", "gelu"), change.pop("tile", 128)
    why = gluon_moe.unsupported(*operands(**change), None, act, tile, capability=capability)
    assert why is not None and words in why, why


def test_declines_mixed_dtypes_swiglu_weights_and_strided_rows():
    xs, gs, w1, w2 = operands()
    assert "dtypes" in gluon_moe.unsupported(xs, gs.half(), w1, w2, None, "gelu", 128, capability=HOPPER)
    assert "act" in gluon_moe.unsupported(xs, gs, w1, w2, w1, "gelu", 128, capability=HOPPER)  # a W3
    assert "dtypes" in gluon_moe.unsupported(xs, gs, w1, w2, w1.float(), "swiglu", 128, capability=HOPPER)
    assert "contiguous" in gluon_moe.unsupported(xs, gs, w1, w2, w1.transpose(1, 2).contiguous().transpose(1, 2),
                                                 "swiglu", 128, capability=HOPPER)
    wide = torch.randn(256, 512).to(torch.bfloat16)[:, :256]
    assert "contiguous" in gluon_moe.unsupported(wide, gs, w1, w2, None, "gelu", 128, capability=HOPPER)


def test_off_the_gpu_and_when_switched_off(monkeypatch):
    assert gluon_moe.unsupported(*operands(), None, "gelu", 128) == "not on a CUDA GPU"
    assert moe.hidden_kernel(*operands(), None, None, "gelu", 128) == "triton"
    monkeypatch.setattr(gluon_moe, "ENABLED", False)
    assert gluon_moe.unsupported(*operands(), None, "gelu", 128, capability=HOPPER) == "MHA_COMPILE_GLUON=0"


def test_a_failed_first_launch_falls_back_to_triton_and_says_so(monkeypatch, caplog):
    """A Gluon kernel that does not build (another Triton's Gluon, say) must not fail the user's
    backward: its first launch's error is logged, that compile key takes the Triton kernel from
    then on, and errors of later launches are not swallowed."""
    monkeypatch.setattr(moe, "_GLUON_FAILED", {})
    monkeypatch.setattr(moe, "_GLUON_LAUNCHED", set())
    monkeypatch.setattr(gluon_moe, "unsupported", lambda *args, **kwargs: None)  # as on an H200
    xs, gs, w1, w2 = operands()
    key = moe.hidden_key(xs, "gelu", 128, None)
    assert moe.hidden_kernel(xs, gs, w1, w2, None, None, "gelu", 128) == "gluon"

    def broken():
        raise RuntimeError("PTX .version 9.9 does not support .target sm_90a")

    with caplog.at_level("WARNING", logger="mha_compile"):
        assert moe._gluon_launch("hidden kernel", key, broken) is False
    assert "PTX .version 9.9" in caplog.text and "Triton kernel runs instead" in caplog.text
    assert moe.hidden_kernel(xs, gs, w1, w2, None, None, "gelu", 128) == "triton"
    assert moe.hidden_kernel(xs, gs, w1, w2, None, w1[0, 0], "gelu", 128) == "gluon"  # another key: with b1

    ran = []
    other = moe.hidden_key(xs, "silu", 128, None)
    assert moe._gluon_launch("hidden kernel", other, lambda: ran.append(1)) is True and ran == [1]
    with pytest.raises(RuntimeError, match="illegal"):  # built once: a later failure is not a build's
        moe._gluon_launch("hidden kernel", other, lambda: (_ for _ in ()).throw(RuntimeError("illegal address")))


def test_descriptors_take_the_layout_the_tile_needs():
    """The layouts kept per (block, dtype) are the ones Gluon works out for that tile."""
    from triton.experimental.gluon import language as gl

    t = torch.empty(256, 192, dtype=torch.bfloat16)
    for block in ([128, 64], [64, 128], [64, 64]):
        desc = gluon_moe._descriptor(t, block, gl.bfloat16)
        assert desc.block_shape == block
        assert desc.layout == gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def test_weight_gradients_take_hopper_16_bit_rows_of_whole_blocks():
    rows = lambda I, J, dtype=torch.bfloat16: (torch.randn(256, I).to(dtype), torch.randn(256, J).to(dtype))  # noqa: E731
    assert gluon_moe.wgrad_unsupported(*rows(512, 2048), 128, capability=HOPPER) is None
    assert gluon_moe.wgrad_unsupported(*rows(256, 384, torch.float16), 64, capability=HOPPER) is None
    assert "I=200" in gluon_moe.wgrad_unsupported(*rows(200, 256), 128, capability=HOPPER)
    assert "J=320" in gluon_moe.wgrad_unsupported(*rows(256, 320), 128, capability=HOPPER)
    assert "TILE=32" in gluon_moe.wgrad_unsupported(*rows(256, 256), 32, capability=HOPPER)
    assert "torch.float32" in gluon_moe.wgrad_unsupported(*rows(256, 256, torch.float32), 128, capability=HOPPER)
    assert "sm_80" in gluon_moe.wgrad_unsupported(*rows(256, 256), 128, capability=(8, 0))
    assert gluon_moe.wgrad_unsupported(*rows(256, 256), 128) == "not on a CUDA GPU"
    assert moe.wgrad_kernel(*rows(256, 256), 128, False) == "triton"
