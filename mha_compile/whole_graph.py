"""mode="reduce-overhead" with rest="eager": the compiled graph replayed as CUDA graphs.

Dynamo's `cudagraphs` backend (torch._dynamo.backends.cudagraphs) takes a forward's static inputs
(read where they are, not copied into the graph's memory before each replay) to be the inputs
AOTAutograd lifted. Since Dynamo inlines nn.Modules (inline_inbuilt_nn_modules, the default) it
lifts none: every parameter is then copied before every replay, beside ctx and tok (14 inputs,
none static, for the tiny block on torch 2.13; tests/backend/test_whole_graph.py). Inductor's own
reduce-overhead takes them from the TracingContext's fw_metadata.static_input_indices
(torch._inductor.compile_fx.get_static_input_idxs), the parameters and buffers; with
STATIC_PARAMS, `capture` hands Dynamo's backend the same indices for the forward. A static
input whose address changes makes the CUDA-graph trees record again (as under Inductor); one the
graph mutates still makes Dynamo's backend skip CUDA graphs (its check is unchanged).

On by default since session 27; MHA_COMPILE_CUDAGRAPH_STATIC_PARAMS=0 turns it off. On the H200
(torch 2.11, bench/step_profile.py, mha-fused-cudagraphs on the loop spelling, off then on, each
its own process; bench/results/static_params_{medium,large}.txt): the replays' input copies
(aten::_foreach_copy_) took 16 us less GPU a medium step and 50 us less a large one, a medium
step's GPU time 0.673 → 0.657 ms and its host issue 0.829 → 0.650 ms, a large step's GPU time
6.049 → 5.980 ms. It needs the graph to carry Dynamo's metadata (backend._copy keeps it): without
it AOTAutograd marks no input static and this keeps nothing static (session 27's first run).
"""
import contextlib
import functools
import os
from unittest import mock

import torch

STATIC_PARAMS = os.environ.get("MHA_COMPILE_CUDAGRAPH_STATIC_PARAMS", "1") != "0"


def capture(gm, example_inputs):
    """Dynamo's cudagraphs backend on gm; with STATIC_PARAMS, the forward's parameters and buffers
    kept static. Dynamo's backend builds its forward while this runs; cudagraphify_impl is
    replaced for that time only, in both modules that may hold it (torch 2.13 imports it inside
    the backend, an older one may at module level)."""
    from torch._dynamo.backends import cudagraphs as dynamo_cudagraphs
    from torch._inductor import cudagraph_trees
    if not STATIC_PARAMS:
        return dynamo_cudagraphs.cudagraphs(gm, example_inputs)
    wrapped = functools.partial(_forward_static_params, cudagraph_trees.cudagraphify_impl)
    with contextlib.ExitStack() as stack:
        for module in (cudagraph_trees, dynamo_cudagraphs):
            if hasattr(module, "cudagraphify_impl"):
                stack.enter_context(mock.patch.object(module, "cudagraphify_impl", wrapped))
        return dynamo_cudagraphs.cudagraphs(gm, example_inputs)


def _forward_static_params(cudagraphify_impl, model, inputs, static_input_idxs, *args, **kwargs):
    """cudagraphify_impl with a forward's static inputs taken from the TracingContext, as
    Inductor's reduce-overhead takes them; a backward's (its saved tensors) are left as given."""
    context = torch._guards.TracingContext.try_get()
    if not kwargs.get("is_backward") and context is not None and context.fw_metadata is not None:
        static_input_idxs = list(context.fw_metadata.static_input_indices)
    return cudagraphify_impl(model, inputs, static_input_idxs, *args, **kwargs)
