"""A backward asked for its graph (create_graph=True: a gradient penalty, a Hessian-vector product).

Autograd differentiates a backward's result only through the ops it recorded there. The kernel
sets' gradients come out of Triton launches and the CUDA graphs' out of a replay: no ops are
recorded, so a second derivative would take them for constants and come out wrong without a
word. torch's `once_differentiable` does not close this: its error node hangs off detached
aliases, so `torch.autograd.grad(penalty, params, allow_unused=True)` never reaches it and
returns None where eager gives a gradient (torch 2.13, the region before this module).

So where a backward must give a graph, `gradients_with_graph` computes the gradients again in
plain differentiable ops (kernels/reference.py's forward, at the forward's top-k choice) and lets
autograd differentiate that: the same first derivative within the dtype's bound (SPEC §4), and a
second one that is the math's. What cannot do that (the step graphs) refuses, naming the option.

A batch of cotangents (is_grads_batched=True) is refused by every backward of the region, with
refuse_batched's error.
"""
import warnings

import torch

SLOW = ("mha_compile: a backward with create_graph=True computes the region's gradients again in plain "
        "PyTorch ops (kernels/reference.py), so that they can be differentiated: slower than the kernels")


def refuse_batched(*grads):
    """A clear error where torch.autograd.grad(..., is_grads_batched=True) hands this backward a
    batch of cotangents (torch's legacy vmap over the backward): the kernels, the CUDA graphs' copies
    and the reference's einsums (which that vmap has no rule for) take one cotangent at a time."""
    if any(isinstance(g, torch.Tensor) and torch._C._functorch.is_legacy_batchedtensor(g) for g in grads):
        raise NotImplementedError(
            "mha_compile: torch.autograd.grad(..., is_grads_batched=True) reached the MHA region's backward, "
            "which takes one cotangent at a time: call torch.autograd.grad once per cotangent (retain_graph=True), "
            "or run the model without backend='mha'")


def differentiating(*tensors):
    """Whether this backward's result must carry a graph: grad mode is on inside a backward only
    under create_graph=True, and some tensor it reads requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def gradients_with_graph(forward, inputs, cotangents):
    """Gradients of forward(*inputs) (a tuple of outputs) against `cotangents` (None where an output
    takes none), with their graph, one for each input: None for one that takes no gradient, zeros
    for one the forward does not read (the key bias).

    Each input is read through a view of its own, so that one tensor passed twice (tied weights)
    gets each position's part, as the kernels' backward gives it, not the whole gradient twice."""
    warnings.warn(SLOW, stacklevel=2)
    inputs = [t.view_as(t) if isinstance(t, torch.Tensor) and t.requires_grad else t for t in inputs]
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    with torch.enable_grad():
        outputs = forward(*inputs)
        pairs = [(o, c) for o, c in zip(outputs, cotangents) if c is not None]
        found = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wanted], [c for _, c in pairs],
                                    create_graph=True, allow_unused=True)
    grads = [None] * len(inputs)
    for i, g in zip(wanted, found):
        grads[i] = torch.zeros_like(inputs[i]) if g is None else g
    return grads
