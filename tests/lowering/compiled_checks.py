"""What a compiled block is checked by: eager's output and every gradient, and what matched."""
import copy

import torch

from numerics import TOLERANCE, compiled_reports, relative_error

ZERO_GRAD = ("key.bias",)  # SPEC §1: ∂bk is exactly zero; eager leaves roundoff there
_NOISE = {torch.bfloat16: 1e-2}  # that roundoff's bound: 2.5e-3 measured in bf16 (eps 7.8e-3), ~1e-17 in float64


def compile_and_compare(model, args, dtype, dynamic_where=False, tol=None, token_axis=1, options=None):
    """Compile a copy with backend="mha" (options strict, and `options`); compare output and every
    parameter and input gradient with eager, to tol (TOLERANCE[dtype] unless given). Returns the
    reports of the compiled graphs. token_axis: the tokens' axis of args[1] (0 where they come
    sequence-first, [N,B,D])."""
    compiled_model = copy.deepcopy(model)
    args_e = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    args_c = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    with compiled_reports() as reports:
        torch._dynamo.reset()
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=dynamic_where):
            out_c = torch.compile(compiled_model, backend="mha", options={"strict": True, **(options or {})})(*args_c)
    out_e = model(*args_e)
    tol = TOLERANCE[dtype] if tol is None else tol
    assert relative_error(out_c, out_e) <= tol, f"output: {relative_error(out_c, out_e):.3g}"
    cotangent = torch.randn_like(out_e)
    out_e.backward(cotangent)
    out_c.backward(cotangent)
    # With top_k=1 and renorm the weight is exactly 1, so ∂router is zero in exact math: eager
    # leaves rounding noise there and the region exact zeros (like the key bias, SPEC §1). With
    # one expert the softmax is exactly 1 whatever the logits: the same, renormalised or not.
    router_zero = getattr(model, "k", None) == 1 and (getattr(model, "renorm", False) or getattr(model, "E", None) == 1)
    # With one token the pool's softmax is exactly 1 whatever the scores, so the query's and the
    # keys' gradients are zero in exact math: the same case again (eager's noise there depends on
    # the CPU's kernels: ~1e-17 on an AVX2 host, where an earlier host gave zeros).
    scores_zero = args[1].shape[token_axis] == 1
    for (name, p_e), p_c in zip(model.named_parameters(), compiled_model.parameters()):
        if p_e.grad is None:  # a parameter the model leaves unused (a second block's own pool)
            assert p_c.grad is None, f"{name} received a gradient through the compiled path, and none in eager"
            continue
        assert p_c.grad is not None, f"{name} received no gradient through the compiled path"
        if (name.endswith(ZERO_GRAD) or router_zero and "router" in name
                or scores_zero and name in ("query", "key.weight")):
            assert torch.count_nonzero(p_c.grad) == 0 and p_e.grad.abs().max() <= _NOISE.get(dtype, 1e-6)
            continue
        assert relative_error(p_c.grad, p_e.grad) <= tol, f"∂{name}: {relative_error(p_c.grad, p_e.grad):.3g}"
    for i, (a_e, a_c) in enumerate(zip(args_e, args_c)):
        if a_e.grad is not None:
            assert relative_error(a_c.grad, a_e.grad) <= tol, f"∂input{i}: {relative_error(a_c.grad, a_e.grad):.3g}"
    return reports


def assert_one_match(reports):
    """The one match of the compiled graphs' reports (and no near-miss)."""
    matches = [m for r in reports for m in r.matches]
    assert len(matches) == 1 and not [m for r in reports for m in r.near_misses], [str(r) for r in reports]
    return matches[0]


def as_eager_in_every_gradient(model, args, dtype):
    """Compile a copy: no match, a near-miss, and eager's output and every gradient (NaNs where
    eager's are). Returns the near-misses' reasons."""
    compiled = copy.deepcopy(model)
    args_e, args_c = ([a.clone().requires_grad_(a.is_floating_point()) for a in args] for _ in range(2))
    with compiled_reports() as reports:
        torch._dynamo.reset()
        got = torch.compile(compiled, backend="mha")(*args_c)
    reasons = [m["reason"] for r in reports for m in r.near_misses]
    assert not any(r.matches for r in reports) and reasons, [str(r) for r in reports]
    want = model(*args_e)
    torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=0, equal_nan=True)
    cotangent = torch.randn_like(want)
    got.backward(cotangent)
    want.backward(cotangent)
    for (name, p_e), p_c in zip(model.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(p_c.grad, p_e.grad, rtol=TOLERANCE[dtype], atol=0, equal_nan=True, msg=name)
    return reasons
