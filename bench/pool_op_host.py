"""Host time of the eager pool's layers on this machine: mha::pool (the custom op, with its
dispatch and autograd wrapper) against pool_moe_ops.PoolFunction (whole_graph's eager pool before
the CUDA graphs), a forward and backward each, with the pool's kernels stubbed out so that only the
layers around them are timed. Rounds alternate the order.

    PYTHONPATH=. python bench/pool_op_host.py [--rounds 3] [--calls 100]
"""
import argparse
import statistics
import time
from unittest import mock

import torch

from mha_compile import pool_moe_ops
from mha_compile.kernels import triton_region


def timings(rounds=3, calls=100, repeats=20):
    """{"op": [median us a forward+backward, per round], "function": [...]}."""
    B, N, D, P = 8, 16, 64, 4
    tok = torch.randn(B, N, D, requires_grad=True)
    q = torch.randn(P, D // P, requires_grad=True)
    wk, wv, wo = [torch.randn(D, D, requires_grad=True) for _ in range(3)]
    bk, bv, bo = [torch.randn(D, requires_grad=True) for _ in range(3)]
    args, grad = (tok, q, wk, bk, wv, bv, wo, bo, None), torch.randn(B, D)
    inv, attn, u = torch.randn(B, D), torch.randn(B, N, P), torch.randn(P, D)
    stubs = (mock.patch.object(triton_region, "pool_forward", lambda *a, **k: (inv.clone(), attn, (u,))),
             mock.patch.object(triton_region, "pool_backward", lambda *a, **k: [t.detach() for t in args[:8]]))
    ways = {"op": pool_moe_ops.pool, "function": pool_moe_ops.PoolFunction.apply}
    result = {name: [] for name in ways}
    with stubs[0], stubs[1]:
        for r in range(rounds):
            for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                def step():
                    torch.autograd.backward(ways[name](*args)[0], grad)
                for _ in range(calls):
                    step()
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    for _ in range(calls):
                        step()
                    times.append((time.perf_counter() - start) / calls * 1e6)
                result[name].append(statistics.median(times))
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args(argv)
    result = timings(args.rounds, args.calls)
    for name, values in result.items():
        print(f"{name:9s} " + " ".join(f"{v:.0f}" for v in values) + " us a forward+backward (per round)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
