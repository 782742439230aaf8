"""The region replayed as per-signature CUDA graphs (kernels/region_graphs.py), on the GPU.

A replayed call must give the eager call's results bit for bit (same kernels, same order), on
fresh inputs every call; outputs the backward saved must survive later replays; a parameter
that moves must be read where it now is; and the graphs must really be used (counted), so that
a silent fallback to the eager path cannot pass for the graphed one.
"""
import pytest
import torch

from cuda_training import block, train
from kernel_cases import make_case
from mha_compile import ops
from mha_compile.kernels import region_graphs, triton_moe

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SHAPE = (33, 7, 47, 128, 4, 96, 5, 2)  # B H N D P F E k: odd sizes


@pytest.fixture(autouse=True)
def _fresh_graphs():
    region_graphs.clear()
    yield
    region_graphs.clear()


def _params(kernels_dtype, act, seed):
    _, _, params = make_case(*SHAPE, act=act, dtype=kernels_dtype, device="cuda", seed=seed)
    return [None if p is None else p.requires_grad_() for p in params]


def _activations(dtype, seed):
    ctx, tok, _ = make_case(*SHAPE, dtype=dtype, device="cuda", seed=seed)
    return ctx.requires_grad_(), tok.requires_grad_()


def _step(ctx, tok, params, act, kernels, graphs, grad_seed):
    """(out, gradients of ctx, tok and every parameter) of one forward and backward."""
    out = ops.region_call(ctx, tok, *params, None, SHAPE[-1], True, act, kernels, False, graphs=graphs)[0]
    g = torch.randn(out.shape, generator=torch.Generator("cuda").manual_seed(grad_seed), device="cuda",
                    dtype=out.dtype)
    leaves = [t for t in (ctx, tok, *params) if t is not None]
    return [out.detach(), *torch.autograd.grad(out, leaves, g)]


@pytest.mark.parametrize("kernels", ["fused", "staged"])
@pytest.mark.parametrize("dtype,act", [(torch.bfloat16, "gelu"), (torch.float32, "swiglu")])
def test_replays_equal_eager_bitwise(kernels, dtype, act):
    params = _params(dtype, act, seed=1)
    for call in range(4):  # eager, capture, replay, replay; fresh activations each time
        ctx, tok = _activations(dtype, seed=10 + call)
        graphed = _step(ctx, tok, params, act, kernels, "on", grad_seed=call)
        eager = _step(ctx, tok, params, act, kernels, "off", grad_seed=call)
        for i, (a, b) in enumerate(zip(graphed, eager)):
            assert torch.equal(a, b), f"call {call}, result {i}"
    assert region_graphs.graphs_held() == 2, "the forward and the backward should each be one graph"


def test_graphs_auto_replays_runs_of_tiles_as_eager(monkeypatch):
    """MHA_COMPILE_SLOT_CHUNK_MB set low (here a run a tile): graphs="auto" still graphs the call
    (its sizes are fixed, region_graphs.AUTO_SLOT_BYTES), its graphs capture the runs, and the
    replays give the eager runs' results bit for bit."""
    monkeypatch.setattr(triton_moe, "SLOT_CHUNK_BYTES", 1)
    params = _params(torch.bfloat16, "gelu", seed=2)
    for call in range(4):
        ctx, tok = _activations(torch.bfloat16, seed=20 + call)
        graphed = _step(ctx, tok, params, "gelu", "fused", "auto", grad_seed=call)
        eager = _step(ctx, tok, params, "gelu", "fused", "off", grad_seed=call)
        for i, (a, b) in enumerate(zip(graphed, eager)):
            assert torch.equal(a, b), f"call {call}, result {i}"
    assert region_graphs.graphs_held() == 2, "graphs='auto' should have graphed the forward and the backward"


def test_saved_tensors_survive_later_replays():
    """Gradient accumulation: two forwards, then their backwards in reverse order."""
    params = _params(torch.bfloat16, "gelu", seed=2)
    batches = [_activations(torch.bfloat16, seed=20 + i) for i in range(4)]
    expected = [_step(*b, params, "gelu", "fused", "off", grad_seed=i) for i, b in enumerate(batches)]
    outs = [ops.region_call(*b, *params, None, SHAPE[-1], True, "gelu", "fused", False, graphs="on")[0]
            for b in batches]
    assert region_graphs.graphs_held() >= 1
    for i in reversed(range(4)):
        g = torch.randn(outs[i].shape, generator=torch.Generator("cuda").manual_seed(i), device="cuda",
                        dtype=outs[i].dtype)
        leaves = [t for t in (*batches[i], *params) if t is not None]
        got = [outs[i].detach(), *torch.autograd.grad(outs[i], leaves, g)]
        for j, (a, b) in enumerate(zip(got, expected[i])):
            assert torch.equal(a, b), f"batch {i}, result {j}"


def test_a_moved_parameter_is_read_where_it_now_is():
    params = _params(torch.bfloat16, "gelu", seed=3)
    ctx, tok = _activations(torch.bfloat16, seed=30)
    for _ in range(3):  # captured with the parameters read in place
        _step(ctx, tok, params, "gelu", "fused", "on", grad_seed=0)
    moved = [None if p is None else p.detach().clone().requires_grad_() for p in params]
    with torch.no_grad():
        moved[10].mul_(1.5)  # W2 at a new address, with new values
    got = _step(ctx, tok, moved, "gelu", "fused", "on", grad_seed=0)
    expected = _step(ctx, tok, moved, "gelu", "fused", "off", grad_seed=0)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"result {i}"


def test_replay_on_another_stream():
    params = _params(torch.bfloat16, "gelu", seed=4)
    ctx, tok = _activations(torch.bfloat16, seed=40)
    for _ in range(2):
        _step(ctx, tok, params, "gelu", "fused", "on", grad_seed=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = _step(ctx, tok, params, "gelu", "fused", "on", grad_seed=0)
    torch.cuda.current_stream().wait_stream(side)
    expected = _step(ctx, tok, params, "gelu", "fused", "off", grad_seed=0)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"result {i}"


@pytest.mark.parametrize("rest", ["eager", "inductor"])
def test_backend_trains_with_graphs_as_without(rest):
    torch._dynamo.reset()
    losses_off, params_off = train(block(), {"graphs": "off", "rest": rest})
    assert region_graphs.graphs_held() == 0
    torch._dynamo.reset()
    losses_on, params_on = train(block(), {"graphs": "auto", "rest": rest})
    assert region_graphs.graphs_held() == 2, "graphs='auto' at this size should replay both directions"
    assert losses_on == losses_off
    for a, b in zip(params_on, params_off):
        assert torch.equal(a, b)


def test_no_region_graphs_inside_reduce_overhead():
    """The whole graph is one CUDA graph there (torch.compile takes mode or options, not both:
    the options are the defaults, graphs="auto", which would graph this size)."""
    torch._dynamo.reset()
    train(block(), None, mode="reduce-overhead")
    assert region_graphs.graphs_held() == 0


def test_captures_do_not_grow_memory_once_cleared():
    """Capturing more signatures and dropping them leaves nothing behind: a side stream per
    capture would leave a cuBLAS workspace each, which is what this guards against. torch may
    allocate small things lazily on a first use (seen once on the H200, in a pytest-xdist worker
    after other tests: 0.83 MB after the third signature, then none), so the bound is one
    cuBLAS workspace over five new signatures, not zero; a fresh process measured 0 bytes over
    ten (bench/graph_memory_probe.py)."""
    params = _params(torch.bfloat16, "gelu", seed=6)

    def capture_and_clear(batch):
        ctx, tok, _ = make_case(batch, *SHAPE[1:], dtype=torch.bfloat16, device="cuda", seed=batch)
        for _ in range(3):
            _step(ctx.requires_grad_(), tok.requires_grad_(), params, "gelu", "fused", "on", grad_seed=0)
        assert region_graphs.graphs_held() == 2
        del ctx, tok
        region_graphs.clear()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    first = capture_and_clear(33)
    later = [capture_and_clear(batch) for batch in (34, 35, 36, 37, 38)]
    workspace = getattr(torch._C, "_cuda_getCublasWorkspaceSize", lambda: 1 << 20)()
    assert max(later) - first < min(workspace, 1 << 20), (
        f"allocated after the first signature {first}, after later ones {later}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("kernels", ["fused", "staged"])
@pytest.mark.parametrize("graphs", ["off", "on"])
def test_a_block_off_the_current_device(kernels, graphs):
    """Tensors on cuda:1 while cuda:0 is current: Triton launches on the current device, so the op
    must make theirs current. The results equal the same calls made with cuda:1 current."""
    ctx, tok, params = make_case(*SHAPE, dtype=torch.bfloat16, device="cuda:1", seed=5)
    params = [None if p is None else p.requires_grad_() for p in params]
    results = []
    for current in (1, 0, 0):  # cuda:1 current, then cuda:0 (twice: eager, then captured)
        with torch.cuda.device(current):
            c, t = ctx.clone().requires_grad_(), tok.clone().requires_grad_()
            out = ops.region_call(c, t, *params, None, SHAPE[-1], True, "gelu", kernels, False, graphs=graphs)[0]
            g = torch.randn(out.shape, generator=torch.Generator("cuda:1").manual_seed(3), device="cuda:1",
                            dtype=out.dtype)
            leaves = [x for x in (c, t, *params) if x is not None]
            results.append([out.detach(), *torch.autograd.grad(out, leaves, g)])
            assert torch.cuda.current_device() == current  # the call left the caller's device current
    for got in results[1:]:
        for i, (a, b) in enumerate(zip(got, results[0])):
            assert a.device == torch.device("cuda:1") and torch.equal(a, b), f"result {i}"
