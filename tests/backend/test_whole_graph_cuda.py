"""mode="reduce-overhead" on the GPU, through torch's CUDA-graph trees (whole_graph.capture,
options step_graphs=False) and through mha_compile's own step graphs (the default): training under
the whole-graph CUDA graphs must follow the plain compiled step, with the trees' parameters copied
before each replay (Dynamo's backend as it is) or read in place (STATIC_PARAMS), through SGD's
in-place updates and through a parameter whose storage is replaced between steps (the graphs must
then read it where it now is)."""
import pytest
import torch

from cuda_training import block, train
from mha_compile import whole_graph

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _train(options):
    """cuda_training.train for 5 steps with `options`, W1's storage replaced by a scaled copy
    before step 3; parameters in fp32."""
    def move_w1(step, model):
        if step == 3:
            with torch.no_grad():
                model.moe.w1.data = model.moe.w1.data * 0.5  # new storage, same Parameter

    torch._dynamo.reset()
    losses, params = train(block(), options=options, steps=5, before_step=move_w1)
    return losses, [p.float() for p in params]


@pytest.mark.parametrize("static_params, step_graphs", [(False, False), (True, False), (True, "auto")],
                         ids=["trees", "trees_static_params", "step_graphs"])
def test_reduce_overhead_trains_as_the_plain_step(monkeypatch, static_params, step_graphs):
    monkeypatch.setattr(whole_graph, "STATIC_PARAMS", static_params)
    plain_losses, plain_params = _train(None)
    graphed_losses, graphed_params = _train({"mode": "reduce-overhead", "step_graphs": step_graphs})
    # the same kernels in the same order; a stale parameter (the moved W1, or one read before its
    # update) would change the losses by far more than this
    torch.testing.assert_close(torch.tensor(graphed_losses), torch.tensor(plain_losses), rtol=1e-4, atol=0)
    for got, want in zip(graphed_params, plain_params):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("rest", ["eager", "inductor"])
def test_mode_in_the_options_replays_cuda_graphs_and_trains_as_the_plain_step(monkeypatch, rest):
    """options={"mode": "reduce-overhead", "rest": ...} (torch.compile refuses mode= beside options=):
    the step must be captured as CUDA graphs (none in the plain step, the region's own graphs
    off), and train as the plain step does."""
    captures = []
    begin = torch.cuda.CUDAGraph.capture_begin
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin",
                        lambda self, *args, **kwargs: captures.append(1) or begin(self, *args, **kwargs))
    torch._dynamo.reset()
    plain_losses, plain_params = train(block(), options={"rest": rest, "graphs": "off"}, steps=4)
    assert not captures
    torch._dynamo.reset()
    graphed_losses, graphed_params = train(block(), options={"rest": rest, "mode": "reduce-overhead"}, steps=4)
    assert captures, "options['mode'] = 'reduce-overhead' captured no CUDA graph"
    torch.testing.assert_close(torch.tensor(graphed_losses), torch.tensor(plain_losses), rtol=1e-4, atol=0)
    for got, want in zip(graphed_params, plain_params):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-3, atol=1e-5)



def _grads_per_step(monkeypatch, outside, options, steps=3):
    """Each step's parameter gradients (no optimizer: the same parameters, fresh inputs a step)
    of the block compiled with mode="reduce-overhead" and `options`, whole_graph.POOL_OUTSIDE = outside."""
    monkeypatch.setattr(whole_graph, "POOL_OUTSIDE", outside)
    monkeypatch.setattr(whole_graph, "POOL_OUTSIDE_MIN_BYTES", 0)  # this tok is 384 KiB
    torch._dynamo.reset()
    model = block()
    compiled = torch.compile(model, backend="mha", options={**options, "mode": "reduce-overhead"})
    grads = []
    for step in range(steps):
        torch.compiler.cudagraph_mark_step_begin()
        gen = torch.Generator("cuda").manual_seed(200 + step)
        ctx = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        tok = torch.randn(64, 24, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        compiled(ctx, tok).float().square().mean().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("options", [{}, {"step_graphs": False}, {"rest": "inductor"}],
                         ids=["step_graphs", "trees", "inductor"])
def test_the_pool_outside_the_graphs_gives_the_gradients_inside(monkeypatch, options):
    """whole_graph.POOL_OUTSIDE (the default): each step runs mha::pool eagerly, once, on that
    step's own tok (read where it is, never copied into the graphs), and every parameter's
    gradient is the one the graphs give with the pool inside them (mha::region, the same kernels:
    to within bf16's last bit), none zero but the key bias's, exactly zero by the math. (SGD steps
    do not show a lost gradient here: in bf16 the query's updates at lr 0.1 round away, inside the
    graphs or out; test_reduce_overhead_trains_as_the_plain_step trains with the split.) The
    graphs are mha_compile's step graphs, torch's trees, or Inductor's (session 42)."""
    from mha_compile import pool_moe_ops

    pools = []
    real_pool = pool_moe_ops._pool  # the pool's forward, under the op and PoolFunction alike
    monkeypatch.setattr(pool_moe_ops, "_pool", lambda *args: pools.append(args[0].shape) or real_pool(*args))
    inside = _grads_per_step(monkeypatch, False, options)
    assert pools == []
    outside = _grads_per_step(monkeypatch, True, options)
    assert pools == [torch.Size([64, 24, 128])] * 3
    for step, (got, want) in enumerate(zip(outside, inside)):
        for name in want:
            torch.testing.assert_close(got[name].float(), want[name].float(), rtol=1e-3, atol=1e-6,
                                       msg=lambda m: f"step {step} ∂{name}: {m}")
            assert (got[name].abs().max() == 0) == (name == "pool.key.bias"), f"step {step} ∂{name}"
