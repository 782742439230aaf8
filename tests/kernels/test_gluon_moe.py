"""Where the MoE runs gluon_moe's kernels (the backward's hidden kernel and weight-gradient GEMM,
the forward's GEMM2), decided without a GPU: each condition that sends it to the Triton kernel,
with the reason it gives (the kernels are compiled in tests/bench/test_gluon_probe.py,
test_gluon_wgrad_probe.py and test_gluon_slots_probe.py and run against float64 in
test_gluon_moe_cuda.py)."""
import os
import re
import types

import pytest
import torch

from kernel_cases import phase_column_sums
from mha_compile.kernels import gluon_moe
from mha_compile.kernels import triton_moe as moe
from mha_compile.kernels.triton_util import GW_BLOCK, dot_precision

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


def test_weight_gradient_splits_take_fp32_partial_sums():
    """Split sums (medium's) go to an fp32 [E·split, I, J] buffer and never add into totals: any
    other output is refused before a launch, naming what it got."""
    from types import SimpleNamespace

    a, b = torch.randn(256, 128).bfloat16(), torch.randn(256, 256).bfloat16()
    groups = SimpleNamespace(experts=4, tile=128)
    for out, accumulate in ((torch.empty(12, 128, 256), True), (torch.empty(12, 128, 256).bfloat16(), False),
                            (torch.empty(4, 128, 256), False)):
        with pytest.raises(ValueError, match=rf"split=3: .*got out \({out.shape[0]}, 128, 256\)"):
            gluon_moe.weight_grads(a, b, groups, out, accumulate, split=3)


def test_weight_gradient_sums_take_out_layout():
    """B's column sums go to [E·split·sum_rows, J] in out's dtype or fp32, contiguous, with sum_rows
    at most I's row blocks of 128: anything else is refused before a launch, naming what it got."""
    from types import SimpleNamespace

    a, b = torch.randn(256, 128).bfloat16(), torch.randn(256, 256).bfloat16()
    groups = SimpleNamespace(experts=4, tile=128)
    out = torch.empty(12, 128, 256)
    for sums in (torch.empty(4, 256), torch.empty(12, 256).bfloat16(), torch.empty(256, 12).t()):
        with pytest.raises(ValueError, match=rf"sums: wants a contiguous \[E·split·sum_rows, J\] = \[12, 256\] "
                                             rf"torch.float32 or fp32 tensor, got \({sums.shape[0]}, {sums.shape[1]}\) "
                                             rf"{sums.dtype}"):
            gluon_moe.weight_grads(a, b, groups, out, False, split=3, sums=sums)
    wide, out = torch.randn(256, 256).bfloat16(), torch.empty(4, 256, 256).bfloat16()  # I = 256: two row blocks
    with pytest.raises(ValueError, match=r"sum_rows=3: takes 1 to I / 128 = 2"):
        gluon_moe.weight_grads(wide, b, groups, out, False, sums=torch.empty(12, 256), sum_rows=3)
    with pytest.raises(ValueError, match=r"\[E·split·sum_rows, J\] = \[8, 256\] .* got \(4, 256\)"):
        gluon_moe.weight_grads(wide, b, groups, out, False, sums=torch.empty(4, 256), sum_rows=2)


def test_weight_gradient_stream_takes_totals_of_few_experts():
    """stream=True (each program a share of the K steps, parts added in step order) only adds into
    fp32 totals, of at most STREAM_EXPERTS experts (one vector of them in each partition): asked
    for anything else it is refused before a launch, naming what it got. Off by default."""
    from types import SimpleNamespace

    a, b = torch.randn(256, 128).bfloat16(), torch.randn(256, 256).bfloat16()
    many = gluon_moe.STREAM_EXPERTS.value + 1
    for experts, accumulate in ((4, False), (many, True)):
        out = torch.empty(experts, 128, 256)
        with pytest.raises(ValueError, match=rf"at most {many - 1} experts; got accumulate={accumulate}, "
                                             rf"E={experts}"):
            gluon_moe.weight_grads(a, b, SimpleNamespace(experts=experts, tile=128), out, accumulate, stream=True)
    assert gluon_moe.WGRAD_STREAM  # MHA_COMPILE_WGRAD_STREAM unset: STREAM, −99 us a large step on the H200
    n = gluon_moe._flags_a_launch(a.device)
    assert gluon_moe.stream_flags(a.device, 3).shape == (3, n) and not gluon_moe.stream_flags(a.device).any()
    for flags in (torch.zeros(n + 1, dtype=torch.int32), torch.zeros(n), gluon_moe.stream_flags(a.device, 2)):
        with pytest.raises(ValueError, match=re.escape(f"flags: wants a contiguous [{n}] int32 row of stream_flags, "
                                                       f"got {tuple(flags.shape)} {flags.dtype}")):
            gluon_moe.weight_grads(a, b, SimpleNamespace(experts=4, tile=128), torch.empty(4, 128, 256), True,
                                   stream=True, flags=flags)


def test_weight_gradient_final_takes_totals_and_pending():
    """`final` (the runs' outputs in the weights' dtype) goes with adding into fp32 totals, a final
    of the totals' shape and an [E] int32 pending: anything else is refused before a launch,
    naming what it got."""
    from types import SimpleNamespace

    a, b = torch.randn(256, 128).bfloat16(), torch.randn(256, 256).bfloat16()
    groups = SimpleNamespace(experts=4, tile=128)
    out, final = torch.empty(4, 128, 256), torch.empty(4, 128, 256).bfloat16()
    pending = torch.zeros(4, dtype=torch.int32)
    cases = [(False, final, pending, r"accumulate=False, final \(4, 128, 256\)"),
             (True, final[:3], pending, r"final \(3, 128, 256\)"),
             (True, final, None, r"pending None"),
             (True, final, pending.long(), r"pending \(\(4,\), torch.int64\)")]
    for accumulate, fin, pend, got in cases:
        with pytest.raises(ValueError, match=r"final: takes accumulate, final of out's shape \(4, 128, 256\) .*" + got):
            gluon_moe.weight_grads(a, b, groups, out, accumulate, final=fin, pending=pend)


def gemm2_operands(S=256, K=512, N=256, E=4, dtype=torch.bfloat16, bias=True):
    """GEMM2's (h [S, K], W2 [E, K, N], c [S, N], b2 [E, N] or None, routing weights [S] fp32)."""
    rand = lambda *shape: torch.randn(*shape).to(dtype)  # noqa: E731
    return rand(S, K), rand(E, K, N), torch.empty(S, N, dtype=dtype), rand(E, N) if bias else None, torch.rand(S)


def test_gemm2_takes_hopper_16_bit_rows_of_whole_blocks():
    for dtype in (torch.bfloat16, torch.float16):
        for tile in (64, 128):
            for K, N, bias in ((2048, 512, True), (192, 384, False), (64, 128, True)):
                operands = gemm2_operands(K=K, N=N, dtype=dtype, bias=bias)
                assert gluon_moe.slots_unsupported(*operands, tile, capability=HOPPER) is None, (dtype, tile, K, N)
    h, w2, c, b2, _ = gemm2_operands()
    assert gluon_moe.slots_unsupported(h, w2, c, b2, None, 128, capability=HOPPER) is None  # no scale
    assert gluon_moe.slots_unsupported(h[64:192], w2, c[64:192], b2, None, 64, capability=HOPPER) is None  # a run
    # the column blocks: jobs of 256 columns where N allows, at either TILE
    assert [gluon_moe.slots_block_n(N, tile) for N in (512, 384) for tile in (128, 64)] == [256, 128, 128, 64]


@pytest.mark.parametrize("change, words", [
    (dict(capability=(8, 0)), "sm_80"),
    (dict(capability=(10, 0)), "sm_100"),
    (dict(dtype=torch.float32), "torch.float32"),
    (dict(N=192), "N=192"),  # D = 192: not in whole 128-column jobs
    (dict(K=96), "K=96"),  # F = 96: not in whole 64-column K steps
    (dict(tile=32), "TILE=32"),
    (dict(tile=16), "TILE=16"),
])
def test_gemm2_declines_with_the_reason(change, words):
    change = dict(change)
    capability, tile = change.pop("capability", HOPPER), change.pop("tile", 128)
    why = gluon_moe.slots_unsupported(*gemm2_operands(**change), tile, capability=capability)
    assert why is not None and words in why, why


def test_gemm2_declines_mixed_dtypes_mismatched_shapes_and_strided_or_misaligned_rows():
    h, w2, c, b2, scale = gemm2_operands()
    why = lambda *args: gluon_moe.slots_unsupported(*args, 128, capability=HOPPER)  # noqa: E731
    assert "dtypes" in why(h, w2, c, b2.float(), scale)  # a bias in another dtype
    assert "dtypes" in why(h, w2, c.half(), b2, scale)
    assert "B (4, 512, 384)" in why(h, torch.randn(4, 512, 384).to(h.dtype), c, b2, scale)
    assert "out (128, 256)" in why(h, w2, c[:128], b2, scale)
    wide = torch.randn(256, 512).to(torch.bfloat16)
    assert "contiguous" in why(h, w2, wide[:, :256], b2, scale)  # c's rows inside wider ones
    flat = torch.empty(256 * 256 + 1, dtype=torch.bfloat16)
    assert "16-byte aligned" in why(h, w2, flat[1:].view(256, 256), b2, scale)
    assert "contiguous" in why(h, w2.transpose(1, 2).contiguous().transpose(1, 2), c, b2, scale)
    assert "scale" in why(h, w2, c, b2, torch.rand(512)[::2])


def test_gemm2_off_the_gpu_and_when_switched_off(monkeypatch):
    h, w2, c, b2, scale = gemm2_operands()
    assert gluon_moe.slots_unsupported(h, w2, c, b2, scale, 128) == "not on a CUDA GPU"
    assert moe.gemm2_kernel(h, w2, c, b2, scale, 128) == "triton"
    monkeypatch.setattr(gluon_moe, "ENABLED", False)  # what MHA_COMPILE_GLUON=0 sets
    assert gluon_moe.slots_unsupported(h, w2, c, b2, scale, 128, capability=HOPPER) == "MHA_COMPILE_GLUON=0"


def _top2_layout(E, rows, seed):
    """triton_moe.group of `rows` random rows' two distinct experts of E (torch's generator seeded)."""
    torch.manual_seed(seed)
    index = torch.randint(0, E, (rows, 2), dtype=torch.int32)
    index[:, 1] = (index[:, 0] + 1) % E
    return moe.group(index, E)


def _taken(monkeypatch, unsupported):
    """gluon_moe's kernels taken where gluon_moe.<unsupported> decides, as on an H200 (it finds
    nothing), with no build recorded yet."""
    monkeypatch.setattr(moe, "_GLUON_FAILED", {})
    monkeypatch.setattr(moe, "_GLUON_LAUNCHED", set())
    monkeypatch.setattr(gluon_moe, unsupported, lambda *args, **kwargs: None)


def _taken_but_broken(monkeypatch, unsupported, kernel):
    """gluon_moe.<kernel> taken (_taken) and failing to build: the list each attempt appends its
    keyword arguments to."""
    _taken(monkeypatch, unsupported)
    launches = []

    def broken(*args, **kwargs):
        launches.append(kwargs)
        raise RuntimeError("PTX .version 9.9 does not support .target sm_90a")

    monkeypatch.setattr(gluon_moe, kernel, broken)
    return launches


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="triton_moe on the CPU needs TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_gemm2_falls_back_to_triton_when_its_first_launch_fails(monkeypatch, caplog):
    """triton_moe.slots_gemm as moe_forward calls it for GEMM2, with the Gluon kernel taken (as on
    an H200) but failing to build: the Triton kernel computes c the same call, the failure is
    logged, and that compile key stays on Triton. ∂x's call (B transposed) never asks for it."""
    launches = _taken_but_broken(monkeypatch, "slots_unsupported", "slots_gemm")
    E, K, N = 3, 40, 24
    groups = _top2_layout(E, 90, seed=3)
    h, w2, b2, scale = torch.randn(groups.slots, K), torch.randn(E, K, N), torch.randn(E, N), torch.rand(180)
    moe.slots_gemm(h, w2.transpose(1, 2).contiguous(), (N * K, 1, K), N, groups)  # ∂x's strides
    assert launches == []
    # float64: c[s] = w · (h W2[e] + b2[e]), 0 on padding slots
    e = groups.tile_expert.long().repeat_interleave(groups.tile)
    valid = groups.slot_pair < groups.pairs
    w = scale.double()[groups.slot_pair.clamp(max=groups.pairs - 1).long()] * valid
    want = (torch.einsum("sk,skn->sn", h.double(), w2.double()[e]) + b2.double()[e]) * w[:, None]
    assert (~valid).any()
    for call in range(2):
        with caplog.at_level("WARNING", logger="mha_compile"):
            got = moe.slots_gemm(h, w2, (K * N, N, 1), N, groups, bias=b2, scale=scale)
        assert len(launches) == 1  # tried once; the second call goes straight to Triton
        assert float((got.double() - want).norm() / want.norm()) < 1e-5
        assert (got[~valid] == 0).all()
    assert "PTX .version 9.9" in caplog.text and "GEMM2" in caplog.text
    assert moe.gemm2_kernel(h, w2, got, b2, scale, groups.tile) == "triton"
    assert moe.gemm2_kernel(h, w2, got, None, scale, groups.tile) == "gluon"  # another key: no bias


def test_device_scratch_is_set_for_its_launches_only():
    """The kernels that make their TMA descriptors on the device need Triton's scratch allocator;
    device_scratch sets it inside its block only (triton.set_allocator would set it for the
    process), and puts the previous one back when the block raises."""
    from triton.runtime import _allocation
    before = _allocation._allocator.get()
    with gluon_moe.device_scratch():
        assert _allocation._allocator.get() is gluon_moe._torch_scratch
    assert _allocation._allocator.get() is before
    with pytest.raises(ValueError), gluon_moe.device_scratch():
        raise ValueError("a launch failed")
    assert _allocation._allocator.get() is before


@pytest.mark.parametrize("act, tile", [("swiglu", 128), ("gelu", 64)])
def test_cooperative_config_declines_swiglu_and_small_tiles(act, tile):
    """The cooperative hidden kernel takes 128-row jobs of TILE 128 without swiglu; asked for
    anything else it says what it got, before anything is launched."""
    groups = types.SimpleNamespace(tile=tile, num_tiles=2, slot_pair=None, tile_expert=None, pairs=10)
    w1 = torch.empty(2, 128, 256)
    with pytest.raises(ValueError, match=f"act={act!r}.*TILE={tile}"):
        gluon_moe.backward_hidden(None, None, groups, w1, None, None, None, act, None, None, None,
                                  config=gluon_moe.COOP_CONFIG)


@pytest.mark.parametrize("act, shape, dtype", [("gelu", (64, 96), torch.float16), ("silu", (64, 128), torch.float32),
                                               ("swiglu", (64, 128), torch.float16)], ids=["shape", "dtype", "swiglu"])
def test_kept_u_of_another_shape_dtype_or_swiglu_is_refused(act, shape, dtype):
    """KEEP_U's u for the hidden kernels and GEMM1: hw's (h's) shape and dtype, contiguous, no
    swiglu; anything else is refused with what it got, before anything is launched."""
    groups = types.SimpleNamespace(tile=128, num_tiles=1, slot_pair=None, tile_expert=None, pairs=10)
    w1, hw = torch.empty(2, 64, 128, dtype=torch.float16), torch.empty(64, 128, dtype=torch.float16)
    hidden = torch.empty(*shape, dtype=dtype)
    with pytest.raises(ValueError, match=rf"backward_hidden: hidden \({shape[0]}, {shape[1]}\) .*act='{act}'"):
        gluon_moe.backward_hidden(None, None, groups, w1, None, None, None, act, hw, None, None, hidden=hidden)
    with pytest.raises(ValueError, match=rf"experts_up: hidden \({shape[0]}, {shape[1]}\) .*shape \(64, 128\)"):
        gluon_moe.experts_up(None, groups, w1, None, act, hw, hidden=hidden)


def test_default_config_is_cooperative_at_tile_128_and_large_d_only():
    big = gluon_moe.COOP_MIN_D
    assert gluon_moe.default_config("gelu", 128, big) is gluon_moe.COOP_CONFIG
    assert gluon_moe.default_config("silu", 128, 2 * big) is gluon_moe.COOP_CONFIG
    assert gluon_moe.default_config("gelu", 128, big // 2) is gluon_moe.CONFIGS[128]  # medium's D = 256
    assert gluon_moe.default_config("gelu", 64, big) is gluon_moe.CONFIGS[64]
    assert gluon_moe.default_config("swiglu", 128, big) is gluon_moe.SWIGLU_CONFIG


@pytest.mark.parametrize("tile, D", [(128, 512), (128, 256), (64, 128)])
def test_the_kept_variant_runs_the_ping_pong_at_six_stages(tile, D):
    """KEEP_U's hidden kernel: the ping-pong with six stages of gs and W2 at every TILE and D
    (faster than the cooperative kernel at large, bench/results/gluon_probe_kept.txt)."""
    config = gluon_moe.default_config("gelu", tile, D, kept=True)
    assert config is gluon_moe.KEPT_CONFIG and not config.get("coop") and config["nbuf"] == 6
    assert gluon_moe.default_config("gelu", tile, D) is not config



@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="triton_moe on the CPU needs TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_weight_grads_fall_back_to_triton_without_sums(monkeypatch, caplog):
    """triton_moe.weight_grads asked for Σb (∂b1 beside ∂W1), with the Gluon kernel taken (as on an
    H200) but failing to build: the Triton kernel computes ∂W the same call and Σb comes back None
    (the caller then sums ∂u itself), never a buffer nobody wrote; that key (with Σb) stays on
    Triton, so a second call does not try the build again."""
    launches = _taken_but_broken(monkeypatch, "wgrad_unsupported", "weight_grads")
    E, I, J = 3, 24, 40
    groups = _top2_layout(E, 70, seed=5)
    valid = (groups.slot_pair < groups.pairs)[:, None]
    a, b = torch.randn(groups.slots, I) * valid, torch.randn(groups.slots, J) * valid  # padding rows hold zeros
    e = groups.tile_expert.long().repeat_interleave(groups.tile)
    want = torch.zeros(E, I, J, dtype=torch.float64).index_add_(0, e, a.double()[:, :, None] * b.double()[:, None, :])
    for call in range(2):
        with caplog.at_level("WARNING", logger="mha_compile"):
            dw, dw2, sums = moe.weight_grads(a, b, None, groups, sums=True)
        assert len(launches) == 1 and launches[0]["sums"] is not None  # tried once, asked for Σb
        assert sums is None and dw2 is None
        assert float((dw.double() - want).norm() / want.norm()) < 1e-5
    assert "PTX .version 9.9" in caplog.text and "weight-gradient GEMM" in caplog.text
    assert moe.wgrad_kernel(a, b, groups.tile, False, sums=True) == "triton"
    assert moe.wgrad_kernel(a, b, groups.tile, False) == "gluon"  # another key: without Σb


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="triton_moe on the CPU needs TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_weight_grads_failed_stream_build_leaves_the_jobs_on_gluon(monkeypatch):
    """A run's weight gradients (added into totals) ask for the STREAM schedule by default, and
    its build fails: the Triton kernel adds the same sums, and only the STREAM key goes to Triton;
    the jobs' key (MHA_COMPILE_WGRAD_STREAM=0, or more experts than STREAM takes) stays Gluon."""
    launches = _taken_but_broken(monkeypatch, "wgrad_unsupported", "weight_grads")
    monkeypatch.setattr(gluon_moe, "WGRAD_STREAM", True)
    E, I, J = 3, 24, 40
    groups = _top2_layout(E, 70, seed=7)
    valid = (groups.slot_pair < groups.pairs)[:, None]
    a, b = torch.randn(groups.slots, I) * valid, torch.randn(groups.slots, J) * valid
    e = groups.tile_expert.long().repeat_interleave(groups.tile)
    start = torch.randn(E, I, J)
    want = start.double().index_add_(0, e, a.double()[:, :, None] * b.double()[:, None, :])
    dw, _, _ = moe.weight_grads(a, b, None, groups, into=(start.clone(), None, None))
    assert len(launches) == 1 and launches[0]["stream"] is True
    assert float((dw.double() - want).norm() / want.norm()) < 1e-5
    assert moe.wgrad_kernel(a, b, groups.tile, True, stream=True) == "triton"
    assert moe.wgrad_kernel(a, b, groups.tile, True, stream=False) == "gluon"


def test_hidden_key_tells_the_two_gluon_hidden_kernels_apart():
    """backward_hidden builds the cooperative kernel from COOP_MIN_D on (TILE 128, not swiglu) and
    the ping-pong one below: two builds, two compile keys."""
    narrow, wide = torch.empty(8, 256), torch.empty(8, gluon_moe.COOP_MIN_D)
    assert gluon_moe.default_config("gelu", 128, 256) is not gluon_moe.default_config("gelu", 128, wide.shape[1])
    assert moe.hidden_key(narrow, "gelu", 128, None) != moe.hidden_key(wide, "gelu", 128, None)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="triton_moe on the CPU needs TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_a_cooperative_build_that_fails_after_the_ping_pong_ran_falls_back(monkeypatch, caplog):
    """moe_backward at D = 256 (the ping-pong hidden kernel: built and ran), then at D = 512 (the
    cooperative one, whose first build fails): the second falls back to the Triton kernel with a
    warning and its gradients, as any failed first build does. With one key for both kernels it
    raised out of the backward (the key counted as built)."""
    monkeypatch.setattr(moe, "_GLUON_FAILED", {})
    monkeypatch.setattr(moe, "_GLUON_LAUNCHED", set())
    monkeypatch.setattr(gluon_moe, "unsupported", lambda *args, **kwargs: None)  # as on an H200
    tried = []

    def backward_hidden(xs, gs, groups, w1, b1, w2, weight, act, hw, du, gw, w3=None, du3=None, config=None,
                        hidden=None):
        coop = bool(gluon_moe.default_config(act, groups.tile, w1.shape[1]).get("coop"))
        tried.append(coop)
        if coop:
            raise RuntimeError("simulated: the cooperative kernel does not build with this Triton")
        E, D, F = w1.shape  # the ping-pong kernel "runs": the Triton kernel on the same buffers
        moe._hidden(moe.tile_grid(groups, F, "BLOCK_F"), xs, gs, groups.slot_pair, groups.tile_expert, weight,
                    w1, w1 if b1 is None else b1, w1, w2, hw, hw, du, du, gw, groups.pairs, D, F, gw.shape[1],
                    HAS_B1=b1 is not None, KEEP_U=False, ACT=moe._act(act), PRECISION=dot_precision(w1.dtype), TILE=groups.tile,
                    GW_BLOCK=GW_BLOCK)

    def backward(D, F=128, E=2, R=8):
        gen = torch.Generator().manual_seed(D)
        rand = lambda *shape: torch.randn(*shape, generator=gen) / 4  # noqa: E731
        index = torch.arange(R, dtype=torch.int32).remainder(E).view(R, 1)
        weight = torch.rand(R, 1, generator=gen)
        groups = moe.Groups(index, E, 128)  # TILE 128, as at the medium and large presets
        return moe.moe_backward(rand(R, D), rand(R, D), None, weight, groups, rand(E, D, F), rand(E, F),
                                rand(E, F, D), rand(E, D), None, "gelu", 1)

    monkeypatch.setattr(gluon_moe, "backward_hidden", backward_hidden)
    backward(256)
    with caplog.at_level("WARNING", logger="mha_compile"):
        got = backward(512)
    assert tried == [False, True] and "simulated" in caplog.text
    monkeypatch.setattr(gluon_moe, "unsupported", lambda *args, **kwargs: "off")  # the Triton kernel alone
    for g, w in zip(got, backward(512)):
        assert (g is None and w is None) or torch.equal(g, w)


def test_gemm2_key_holds_the_scale_dtype():
    """GEMM2 loads the routing weights in their own dtype, so a bf16 scale is another build than an
    fp32 one: a failed build of one must not send the other to Triton (nor go unguarded after it)."""
    h, w2, out, b2, scale = gemm2_operands()
    keys = {moe.gemm2_key(h, out, b2, s, 128) for s in (scale, scale.bfloat16(), None)}
    assert len(keys) == 3


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="triton_moe on the CPU needs TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
@pytest.mark.parametrize("mode", ["whole", "split", "added"])
def test_weight_grads_add_up_sums_spread_over_row_blocks(monkeypatch, mode):
    """Σb spread over the row blocks (the default): the Gluon kernel (here its contract in torch, as on an H200)
    leaves Σb in I/128 rows an expert, each the sums over 1/R of the K steps; triton_moe.weight_grads
    adds them up into Σb [E, J] (written, over the splits too), or adds them into the runs' rows
    [E·R, J] as they are (the caller adds those up after its last run)."""
    assert gluon_moe.WGRAD_SUM_SPREAD  # MHA_COMPILE_WGRAD_SUM_SPREAD unset: spread, −125 us a large step on the H200
    _taken(monkeypatch, "wgrad_unsupported")
    launches = []

    def contract(a, b, groups, out, accumulate, split=1, sums=None, stream=None, sum_rows=1, final=None, pending=None,
                 flags=None):
        assert final is None and pending is None  # no runs' final outputs here
        launches.append((split, sum_rows, None if sums is None else tuple(sums.shape)))
        e = groups.tile_expert.long().repeat_interleave(groups.tile)
        dw = torch.zeros(groups.experts, a.shape[1], b.shape[1], dtype=torch.float64).index_add_(
            0, e, a.double()[:, :, None] * b.double()[:, None, :])
        phase = phase_column_sums(b, groups, split, sum_rows, gluon_moe.WGRAD_BK).view(sums.shape)
        if accumulate:
            out += dw.to(out.dtype)
            sums += phase.to(sums.dtype)
        else:
            out.copy_(dw.repeat_interleave(split, 0) / split)  # the splits' parts: any that add up
            sums.copy_(phase.to(sums.dtype))

    monkeypatch.setattr(gluon_moe, "weight_grads", contract)
    monkeypatch.setattr(moe, "gluon_wgrad_splits", lambda *args: 2 if mode == "split" else 1)
    E, I, J = 3, 512, 256
    groups = _top2_layout(E, 700, seed=9)
    valid = (groups.slot_pair < groups.pairs)[:, None]
    a, b = torch.randn(groups.slots, I) * valid, torch.randn(groups.slots, J) * valid
    want = phase_column_sums(b, groups, 1, 1, gluon_moe.WGRAD_BK)[:, 0, 0]
    if mode == "added":
        start = torch.randn(E * I // 128, J)
        totals = (torch.zeros(E, I, J), None, start.clone())
        got = moe.weight_grads(a, b, None, groups, into=totals, sums=True)[2]
        assert got is totals[2]
        phases = phase_column_sums(b, groups, 1, I // 128, gluon_moe.WGRAD_BK).view(E * I // 128, J)
        assert float((got.double() - start.double() - phases).norm() / phases.norm()) < 1e-6
        got, want = got.view(E, I // 128, J).sum(1), want + start.view(E, I // 128, J).double().sum(1)
        with pytest.raises(RuntimeError, match=r"into's Σb wants fp32 rows \[E·R, J\] = \[12, 256\], got "
                                               r"torch.float32 \(3, 256\)"):
            moe.weight_grads(a, b, None, groups, into=(totals[0], None, torch.zeros(E, J)), sums=True)
    else:
        got = moe.weight_grads(a, b, None, groups, sums=True)[2]
    split, rows, shape = launches[0]
    assert rows == I // 128 and shape == (E * split * rows, J) and split == (2 if mode == "split" else 1)
    assert float((got.double() - want).norm() / want.norm()) < 1e-6


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="triton_moe on the CPU needs TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_runs_add_sums_rows_up_once(monkeypatch, act):
    """The backward over runs of tiles with the Gluon weight-gradient kernel taken (its contract
    in torch, as on an H200, Σb in 3 rows an expert): every run adds into one [E·3, F] buffer of
    ∂b1's rows, which is added up once after the last run with the tile sums' total (swiglu's ∂W1
    and ∂W3 take the Triton kernel and the tile sums); the whole region against float64."""
    from kernel_cases import check_region, make_case
    from mha_compile.kernels import fused

    _taken(monkeypatch, "wgrad_unsupported")
    monkeypatch.setattr(moe, "SLOT_CHUNK_BYTES", 1)  # a run a tile
    monkeypatch.setattr(gluon_moe, "wgrad_sum_rows", lambda I: 3)
    launches, added_up, rows_seen = [], [], []

    def contract(a, b, groups, out, accumulate, split=1, sums=None, stream=None, sum_rows=1, final=None, pending=None,
                 flags=None):
        """Over runs (accumulate): an expert opened in this run written, else added to, and every
        expert of the run left pending for close_totals; Σb's rows added to."""
        assert accumulate and split == 1 and sum_rows == (1 if sums is None else 3)
        assert flags.shape == (gluon_moe._flags_a_launch(a.device),) and not flags.any()  # a fresh row
        launches.append(None if sums is None else sums.data_ptr())
        rows_seen.append((flags.untyped_storage().data_ptr(), flags.data_ptr()))
        E, e = groups.experts, groups.tile_expert.long().repeat_interleave(groups.tile)
        dw = torch.zeros(E, a.shape[1], b.shape[1], dtype=torch.float64).index_add_(
            0, e, a.double()[:, :, None] * b.double()[:, None, :])
        lo, hi = groups.expert_slots[:E].tolist(), groups.expert_slots[E:].tolist()
        for x in range(E):
            if hi[x] > lo[x]:
                opens = int(groups.whole_slots[x]) >= groups.first_slot
                out[x] = dw[x].to(out.dtype) if opens else out[x] + dw[x].to(out.dtype)
                if pending is not None:
                    pending[x] = 1
        if sums is not None:
            sums += phase_column_sums(b, groups, 1, 3, gluon_moe.WGRAD_BK).view(sums.shape).to(sums.dtype)

    real = moe.sum_splits
    monkeypatch.setattr(gluon_moe, "weight_grads", contract)
    monkeypatch.setattr(moe, "sum_splits", lambda parts, out, split, base=None: added_up.append(
        (parts.shape, split, base is not None)) or real(parts, out, split, base))
    ctx, tok, params = make_case(3, 4, 5, 32, 2, 48, 3, 2, act=act)
    check_region(fused, ctx, tok, params, top_k=2, renorm=True, act=act)
    assert not moe._GLUON_FAILED  # the stand-in ran every launch: no fallback to Triton
    runs = len(launches) // (2 if act == "gelu" else 1)  # gelu: ∂W2's launch and ∂W1's a run
    assert runs > 1
    if act == "gelu":  # ∂W1's launches with sums, all into one buffer
        assert len({ptr for ptr in launches if ptr is not None}) == 1 and launches.count(None) == runs
    assert added_up == [((3 * 3, 48), 3, True)]
    # STREAM's flags: each launch its own row of one buffer zeroed once for the step
    assert len({storage for storage, _ in rows_seen}) == 1 and len({row for _, row in rows_seen}) == len(rows_seen)


def test_gluon_gemm1_is_on_by_default_and_says_what_it_takes():
    """gluon_moe's GEMM1 (GLUON_UP) runs unless MHA_COMPILE_GLUON_UP=0 asks otherwise; it takes
    Hopper 16-bit operands with gelu, gelu_tanh or silu at TILE 64 or 128, and says why not
    otherwise."""
    assert gluon_moe.GLUON_UP is True
    xs, _, w1, _ = operands(D=256, F=512)
    h = torch.empty(xs.shape[0], 512, dtype=xs.dtype)
    for act in gluon_moe.UP_ACTS:
        for tile in (64, 128):
            assert gluon_moe.up_unsupported(xs, w1, h, act, tile, capability=HOPPER) is None, (act, tile)
    assert "swiglu" in gluon_moe.up_unsupported(xs, w1, h, "swiglu", 128, capability=HOPPER)
    assert "TILE=32" in gluon_moe.up_unsupported(xs, w1, h, "gelu", 32, capability=HOPPER)
    _, _, w1_odd, _ = operands(D=256, F=320)  # F not in whole 128-column jobs
    for tile in (64, 128):
        assert "F=320" in gluon_moe.up_unsupported(xs, w1_odd, h[:, :320].contiguous(), "gelu", tile, capability=HOPPER)
    assert gluon_moe.up_unsupported(xs, w1, h, "gelu", 128) == "not on a CUDA GPU"


def test_gluon_gemm1_refuses_a_config_that_does_not_tile_the_layout():
    """experts_up with a config (bench/gemm_probe.py passes them) whose row block exceeds the
    layout's TILE, or whose blocks do not divide F or D, raises before it launches, naming them:
    a [128, ·] job on TILE 64 rows once wrote h wrong (relative error 1.0 in the probe)."""
    xs, _, w1, _ = operands(D=256, F=512)
    h = torch.empty(xs.shape[0], 512, dtype=xs.dtype)
    bad = [(64, dict(tile_m=128, block_n=128, block_k=64, nbuf=4), "TILE 64"),
           (128, dict(tile_m=128, block_n=384, block_k=64, nbuf=4), "F=512"),
           (128, dict(tile_m=128, block_n=128, block_k=96, nbuf=4), "D=256")]
    for tile, config, named in bad:
        with pytest.raises(ValueError, match=named):
            gluon_moe.experts_up(xs, types.SimpleNamespace(tile=tile, num_tiles=4), w1, None, "gelu", h, config)
