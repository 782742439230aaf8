"""One benchmark row: build, compile (first call), time, check against the reference, cost.

A failure anywhere in a row becomes that row's `error` (with the full traceback kept apart),
and the sweep goes on: a missing backend or an OOM at one preset must not hide the rest.
"""
import gc
import itertools
import traceback

import torch

from bench import cases, grouped_mm_moe, modes, timing
from mha_compile import cost
from mha_compile.kernels import reference, region_graphs
from mha_compile.models import PRESETS

ACT = "gelu"  # MHABlock's default activation, which every spelling here uses


def run_row(job, cache, quick=False):
    """Measure job = dict(preset, dtype, mode, spelling, pass, device_type); returns the row.

    cache: a dict kept across rows for the fp32 references and the lowering summaries.
    """
    row = dict(job)
    row.update(cost_fields(job))
    reason = skip_reason(job)
    if reason:
        row.update(status="skipped", error=reason)
        return row
    try:
        row.update(_measure(job, cache, quick))
        row["status"] = "ok"
        ran = mode_that_ran(job["mode"], row)
        if ran != job["mode"]:  # the FLOPs of what ran (a fallback's), not of what the name asks
            row["flops_mode"] = cost_fields(dict(job, mode=ran))["flops_mode"]
    except Exception as error:  # noqa: BLE001 - every failure is a result here
        row.update(status="error", error=error_line(error), traceback=traceback.format_exc())
    finally:
        _cleanup(job["device_type"])
    if row.get("time_ms"):
        seconds = row["time_ms"] / 1e3
        row["tflops"] = cost.achieved_tflops(row["flops_min"], seconds)
        row["tflops_mode"] = cost.achieved_tflops(row["flops_mode"], seconds)
        row["pct_floor"] = cost.percent_of_floor(row["floor_s"], seconds)
    return row


def skip_reason(job):
    if job["spelling"] == "grouped_mm":
        return grouped_mm_moe.available(job["device_type"], cases.DTYPES[job["dtype"]])
    return None


def mode_that_ran(mode, row):
    """The mode whose FLOP family (cost.mode_family) is what a measured row ran: for a mha row
    that replaced no region eager's (the backend ran the graph as captured), for one whose every
    match fell back to the reference kernels (lowering/select.py) mha-reference's; else its own."""
    if mode not in modes.MHA_MODES:
        return mode
    if row.get("regions_replaced") == 0:
        return "eager"
    if row.get("kernels_chosen") and set(row["kernels_chosen"]) == {"reference"}:
        return "mha-reference"
    return mode


def family_work(family, dims):
    """region_flops's pairs for what a family computes at dims: the reference's slots, padding
    included; none otherwise (R·k)."""
    if family != cost.REGION_KERNELS:
        return {}
    pairs = dims["B"] * dims["H"] * dims["k"]
    return dict(pairs=cost.reference_pairs(pairs, dims["E"], reference.tile_rows(pairs, dims["E"])))


def cost_fields(job):
    """Shapes, minimum and per-mode FLOPs, minimum bytes and the floor (bf16 on CUDA only)."""
    dims = PRESETS[job["preset"]]
    pass_ = job["pass"]
    family = cost.mode_family(job["mode"], job["spelling"])
    floor = cost.preset_floor(dims, job["dtype"], ACT, pass_) if job["device_type"] == "cuda" else None
    return dict(
        dims,
        flops_min=cost.evaluate(cost.region_flops(cost.MINIMUM, ACT, pass_), dims),
        flops_mode=cost.evaluate(cost.region_flops(family, ACT, pass_, job["spelling"], **family_work(family, dims)),
                                 dims),
        bytes_min=cost.evaluate(cost.region_bytes(ACT, pass_, True, cost.DTYPE_BYTES[job["dtype"]]), dims),
        floor_s=floor,
    )


def error_line(error):
    """A row's error: the exception's type and first line, and the next where the first only
    introduces it (Dynamo's "BackendCompilerFailed: backend='inductor' raised:" says what failed
    on the line after), at most 400 characters."""
    lines = [line.strip() for line in f"{type(error).__name__}: {error}".splitlines() if line.strip()]
    line = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else lines[0]
    return line[:400]


def _measure(job, cache, quick):
    device = job["device_type"]
    key = ("reference", job["preset"], job["dtype"])
    if key not in cache:
        cache[key] = cases.reference(job["preset"], job["dtype"], device, (cases.INPUT_SEED, cases.OTHER_SEED))
        _drop_cublas_workspaces(device)  # the reference's, which this row's step may not use
    refs = cache[key]  # (out, grads, ties) of the first batch, then of the other

    model = cases.make_model(job["preset"], job["spelling"], job["dtype"], device)
    ctx, tok, grad_out = cases.make_inputs(job["preset"], job["dtype"], device)
    # The timed steps alternate between the batch and a second one at other addresses, as a
    # training loop's batches come: mha_compile's step graphs read an input found where the first
    # call had it in place, and on one batch every step our rows skipped the copy-in that torch's
    # CUDA-graph trees (max-autotune's, reduce-overhead's) pay each replay (a helper's audit). The
    # second holds values of its own and is checked too: a copy of the first let a step that
    # computed on a stale batch pass (a review's audit).
    other = tuple(cases.make_inputs(job["preset"], job["dtype"], device, cases.OTHER_SEED)[:2])
    training = job["pass"] == "fwd+bwd"
    leaves = timed_leaves = other_leaves = []
    if training:
        for t in (ctx, tok, *other):
            t.requires_grad_(True)
        leaves = [ctx, tok, *model.parameters()]
        other_leaves = [*other, *model.parameters()]
        timed_leaves = leaves + list(other)
    torch._dynamo.reset()  # each compiled row starts from a clean cache: no reuse, no recompiles
    fn = modes.build(job["mode"], model)

    step = timed_step(fn, ctx, tok, grad_out, timed_leaves, training, other)

    result = {}
    _, result["first_call_s"] = timing.timed_call(step, device)
    result["host_probe_ms"] = timing.host_probe_ms()  # the host's speed just before the timing
    result["time_ms"] = timing.median_ms(step, device, quick, timed_leaves or None)
    # The check runs after timing, on the path that was timed (CUDA graphs replay only by now),
    # on each batch, the upstream gradient zero in the rows near a top-k tie of either
    # (cases.reference): zeroed in place, where the graphs read it (a new tensor would be a moved
    # input, and a moved input a new capture, whose warm-up would count in the peak).
    cases.zero_tie_rows_(grad_out, refs[0][2] | refs[1][2])
    # The second batch first, one step as timed, so that its tensors are gone before the peak:
    # a loop's next batch is its loader's.
    out = timed_step(fn, *other, grad_out, other_leaves, training)()
    checks = [cases.errors(out, [t.grad for t in other_leaves] if training else None, *refs[1])]
    del out, step, other, other_leaves, timed_leaves
    for t in leaves:
        t.grad = None
    out, *memory = timing.peak_memory_call(timed_step(fn, ctx, tok, grad_out, leaves, training), device)
    result["peak_mib"], result["peak_delta_mib"], result["graph_pool_mib"] = memory
    checks.insert(0, cases.errors(out, [t.grad for t in leaves] if training else None, *refs[0]))
    result.update(cases.merge_errors(checks))
    if job["mode"] in modes.MHA_MODES:
        # asked once a pass: a training compile can decide otherwise than an inference one (the
        # rewrite keeps copies there, and a failure only it meets would time eager under our name)
        key = ("lowering", job["preset"], job["dtype"], job["spelling"], job["mode"], job["pass"])
        if key not in cache:
            cache[key] = lowering_summary(job["mode"], model, ctx.detach(), tok.detach(), training)
        result.update(cache[key])
    return result


def timed_step(fn, ctx, tok, grad_out, leaves, training, other=None):
    """The step a row times: fn(ctx, tok), and with `training` its backward of grad_out into the
    leaves, which start from no gradients; else under no_grad. other: a second (ctx, tok), which
    the steps alternate with the first (from the first step on: first, other, first, ...)."""
    batches = itertools.cycle([(ctx, tok)] + ([other] if other is not None else []))

    def step():
        ctx, tok = next(batches)
        # CUDA-graph trees reuse output memory between replays; marking each step's start is how
        # a training loop tells them the previous step's outputs are dead (else: "overwritten").
        torch.compiler.cudagraph_mark_step_begin()
        if training:
            # A training step starts from no gradients (zero_grad(set_to_none=True)). do_bench
            # clears them only in its timed loop: in its warmup the backward accumulated into
            # last step's .grad, which under CUDA graphs is a replay output since overwritten.
            for t in leaves:
                t.grad = None
            out = fn(ctx, tok)
            out.backward(grad_out)
            return out
        with torch.no_grad():
            return fn(ctx, tok)
    return step


def lowering_summary(mode, model, ctx, tok, training=False):
    """Did backend="mha" replace the region? The backend falls back to the graph as captured
    when it matches nothing, and then a row would time eager under our name (the seed's
    dead-fast-path failure). Asked through the public mha_compile.explain, after the timing, in
    the row's pass: with training, grad on and ctx and tok taking gradients, as the timed step."""
    import mha_compile

    explain = mha_compile.explain
    if not callable(explain):  # importing the submodule mha_compile.explain shadows the function
        explain = explain.explain
    try:
        with torch.set_grad_enabled(training):
            explained = explain(model, ctx.requires_grad_(training), tok.requires_grad_(training),
                                options=modes.mha_options(mode))
    except Exception as error:  # noqa: BLE001 - a broken explain must not lose the timing
        return {"regions_replaced": None, "lowering_note": f"explain failed: {type(error).__name__}: {error}"[:300]}
    finally:
        torch._dynamo.reset()
    fallbacks = [g.fallback for g in explained.graphs if getattr(g, "fallback", None)]
    return {"regions_replaced": len(explained.matches),
            "kernels_chosen": [m.get("kernels") for m in explained.matches],
            "lowering_note": "; ".join(fallbacks + [m.get("reason", "") for m in explained.near_misses])[:300] or None}


def _cleanup(device_type):
    torch._dynamo.reset()
    region_graphs.clear()  # the region's own CUDA graphs (options graphs=) outlive Dynamo's reset
    gc.collect()
    _drop_cublas_workspaces(device_type)
    if device_type == "cuda":
        torch.cuda.empty_cache()


def _drop_cublas_workspaces(device_type):
    """Free cuBLAS's workspaces, so that a row's peak counts only those its own step makes. A
    thread's first cuBLAS call on a stream allocates one (32 MiB on Hopper, plus cuBLASLt's) that
    stays for the process: the fp32 reference (eager, on this GPU) and the peers' matmuls make
    them, our fused kernels make none, and torch's CUDA-graph trees free them as they record.
    Session 53: the step graphs' small row peaked at 98 MiB, 65 of it the reference's workspaces
    (the trees' row, after its recording, 31)."""
    if device_type == "cuda":
        torch._C._cuda_clearCublasWorkspaces()
