"""The MoE weight-gradient GEMM in Gluon (gluon_moe.weight_grads, warp-specialised) against the
Triton one (triton_moe._moe_wgrad_kernel), on the whole layout and added into fp32 totals (the
backward's runs of tiles), under each config. Each row is checked against an fp32 reference first.

    PYTHONPATH=. python bench/gluon_wgrad_probe.py [--presets medium,large]   # H200
    PYTHONPATH=. python bench/gluon_wgrad_probe.py --offline                  # compile for sm_90a

First H200 run (session 10, bench/results/gluon_wgrad_probe.txt, large, whole layout, bf16, the
kernel then in this file): ∂W1 435 against the Triton kernel's 575 us (641 against 485 TFLOP/s),
∂W2 440 against 604, rel err 1.7e-3 for both (the fp32 reference's bf16 rounding).
"""
import torch

from gluon_probe import _time, compile_offline, probe_cli
from mha_compile.kernels import gluon_moe

CONFIGS = [dict(block_k=64, block_n=256, nbuf=3), dict(block_k=64, block_n=256, nbuf=4),
           dict(block_k=64, block_n=128, nbuf=4), dict(block_k=32, block_n=256, nbuf=6)]


def offline(block_k=64, block_n=256, nbuf=3, out_dtype=torch.bfloat16, stream=False):
    """compile_offline of gluon_moe's weight-gradient kernel under one config (fp32 out: the runs'
    totals; stream: their STREAM schedule)."""
    S, E, I, J = 256, 2, 128, 2 * block_n
    a, b = torch.empty(S, I, dtype=torch.bfloat16), torch.empty(S, J, dtype=torch.bfloat16)
    out, slots = torch.empty(E, I, J, dtype=out_dtype), torch.empty(2 * E, dtype=torch.int32)
    kernel = gluon_moe._wgrad_kernel
    final = torch.empty(E, I, J, dtype=torch.bfloat16)
    args = dict(a_ptr=a, b_ptr=b, out_ptr=out, expert_slots_ptr=slots, sums_ptr=out, flags_ptr=slots, final_ptr=final,
                span_ptr=slots, pending_ptr=slots, S=1000, S0=1000, I=I, J=J, E=E, JOBS=1000, accumulate=3, SPLIT=3,
                TILE=128, has_sums=3, sum_rows=3, finish=3)
    return compile_offline(kernel, args, dict(BK=block_k, BN=block_n, NBUF=nbuf, STREAM=stream,
                                              CONSUMER_REGS=gluon_moe.CONSUMER_REGS,
                                              PRODUCER_REGS=gluon_moe.PRODUCER_REGS))


def reference(a, b, groups):
    """fp32, expert by expert: Σ_{s∈e} A[s]ᵀ B[s]."""
    bounds = groups.expert_slots.tolist()
    E = groups.experts
    out = torch.zeros(E, a.shape[1], b.shape[1], device=a.device, dtype=torch.float32)
    for e in range(E):
        lo, hi = bounds[e], bounds[E + e]
        out[e] = a[lo:hi].float().t() @ b[lo:hi].float()
    return out


def triton_weight_grads(a, b, groups, into=None):
    """triton_moe.weight_grads with the Gluon kernel switched off (the Triton kernel's time)."""
    from mha_compile.kernels import triton_moe as moe

    enabled, gluon_moe.ENABLED = gluon_moe.ENABLED, False
    try:
        return moe.weight_grads(a, b, None, groups, into=into)[0]
    finally:
        gluon_moe.ENABLED = enabled


def offline_rows():
    for cfg in CONFIGS:
        yield dict(config=cfg, **offline(**cfg))
    yield dict(config=dict(CONFIGS[0], out="fp32"), **offline(**CONFIGS[0], out_dtype=torch.float32))
    yield dict(config=dict(CONFIGS[0], out="fp32", stream=True),
               **offline(**CONFIGS[0], out_dtype=torch.float32, stream=True))


def probe_preset(c):
    """∂W1's and ∂W2's shapes, whole and added into fp32 totals: the Triton kernel, then the Gluon one."""
    du = torch.randn(c.S, c.F, device=c.dev, dtype=c.dt) * (c.groups.slot_pair < c.groups.pairs)[:, None]
    for name, a, b in (("dW1", c.xs, du), ("dW2", du, c.gs)):  # ∂W1 = xsᵀ ∂u; ∂W2's shape (hw ~ ∂u)
        want = reference(a, b, c.groups)
        err = lambda got: float((got.float() - want).norm() / want.norm())  # noqa: E731
        flops = 2 * c.S * a.shape[1] * b.shape[1]
        out = torch.empty(want.shape, device=c.dev, dtype=c.dt)
        _time(f"{name} triton", lambda: triton_weight_grads(a, b, c.groups), flops, err)
        for cfg in CONFIGS:
            _time(f"{name} gluon", lambda: gluon_moe.weight_grads(a, b, c.groups, out, False, **cfg), flops, err, cfg)
        # added into fp32 totals (the runs of tiles), zeroed first so that the sum is the whole ∂W
        total = torch.zeros(want.shape, device=c.dev)
        into = lambda fn: (total.zero_(), fn())[1]  # noqa: E731
        _time(f"{name} triton+=", lambda: into(lambda: triton_weight_grads(a, b, c.groups, (total, None, None))),
              flops, err)
        for stream in (False, True):  # by jobs, by the STREAM schedule
            _time(f"{name} gluon+={' stream' if stream else ''}",
                  lambda: into(lambda: gluon_moe.weight_grads(a, b, c.groups, total, True, stream=stream)),
                  flops, err, CONFIGS[0])
        if name == "dW1":  # with ∂b1 = Σ ∂u beside it, as the backward runs it (+Σ), whole and added
            E = c.groups.experts
            sums, sums_total = torch.empty(E, c.F, device=c.dev, dtype=c.dt), torch.zeros(E, c.F, device=c.dev)
            _time(f"{name} gluon+Σ", lambda: gluon_moe.weight_grads(a, b, c.groups, out, False, sums=sums),
                  flops, err, CONFIGS[0])
            rows = a.shape[1] // 128  # Σb spread over the row blocks' jobs (MHA_COMPILE_WGRAD_SUM_SPREAD)
            spread = torch.zeros(E * rows, c.F, device=c.dev)
            for stream in (False, True):
                _time(f"{name} gluon+=Σ{' stream' if stream else ''}",
                      lambda: into(lambda: gluon_moe.weight_grads(a, b, c.groups, total, True, sums=sums_total,
                                                                  stream=stream)),
                      flops, err, CONFIGS[0])
                _time(f"{name} gluon+=Σ/{rows}{' stream' if stream else ''}",
                      lambda: into(lambda: gluon_moe.weight_grads(a, b, c.groups, total, True, sums=spread,
                                                                  stream=stream, sum_rows=rows)),
                      flops, err, CONFIGS[0])


if __name__ == "__main__":
    probe_cli(offline_rows, probe_preset)
