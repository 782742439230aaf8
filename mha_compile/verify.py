"""options["verify"]: on the first call, the rewritten graph beside the graph as captured; where
they disagree, a warning, and the captured graph from then on.

Forward: every output (integer ones exactly), and the inputs the graph writes. Training (grad
enabled and a gradient to take): both graphs also run on detached clones of the inputs, backward
with one random cotangent, and the gradient of every input is compared, and of every parameter
the graph holds as an attribute (Dynamo passes parameters as inputs, but as attributes under
inline_inbuilt_nn_modules=False).

fp32 and fp64 graphs are compared with each other, each output and gradient to its dtype's bound
(BOUND). A bf16 or fp16 graph as captured is itself far from its math: top-k choices flip through
rounding, and bf16 eager's output at the small preset was 4.8e-2 from the rewrite's, which keeps
an fp32 router and fp32 sums (3.4e-3 from the math at medium, bench/results). A direct comparison
failed right rewrites there, as it did under a bf16 autocast. So the rewrite is measured against
the captured graph run in fp32 (`promoted`: its inputs and every bf16 or fp16 dtype its nodes name
read as fp32, an ambient autocast off), SPEC §4's comparison (fp32 math on the same rounded inputs
and parameters), to the low dtype's bound. The message also gives the captured graph's own
distance from it (bf16 eager's gradients were 7-11% from it where the rewrite's were 0.16%:
allowing the rewrite as much let a 20% error through). A captured graph that does not run in fp32
is compared directly, and the log says so.

Every run compared starts from the state the call found (`_CallState`): its random-number state,
so a graph with dropout draws the same masks in each, and its inputs' values, so a graph that
writes an input in place (a BatchNorm's running statistics, or a parameter under no_grad:
_written_inputs) reads the same values in each. The call's own result, the rewrite's, leaves both
where its run took them, as without verify.
"""
import contextlib
import logging

import torch

from mha_compile import step_graphs

log = logging.getLogger("mha_compile")

BOUND = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
LOW = (torch.bfloat16, torch.float16)
# A gradient's floor, a part of the largest gradient's norm that it is compared to where its own
# norm is smaller (see _gradients_disagree).
GRAD_FLOOR = 1e-6


def verified(gm, original, compiled, report, strict=False, fell_back=None):
    """The graph's callable: on its first call `compiled` (the rewrite) checked against `original`
    (gm as captured, run as the rest would run it); where they disagree, strict raises instead of
    falling back. fell_back: called once report.fallback says why (the dump's refresh)."""
    state = {"use": None}
    zero_by_math = _zero_by_math(gm, report)
    attributes = _trained_attributes(gm)
    inputs = [node.name for node in gm.graph.find_nodes(op="placeholder")]

    def fall_back(what, args, found, error=None):
        report.fallback = f"verify: the rewritten graph disagrees with the original ({what}); using the original"
        if fell_back is not None:
            fell_back()
        if strict:
            found.restore()
            raise RuntimeError(f"mha_compile: {report.name}: verify: the rewritten graph disagrees with the "
                               f"original ({what}), and strict=True raises instead of using the original") from error
        log.warning("mha_compile: %s: %s", report.name, report.fallback)
        state["use"] = original
        found.restore()  # the call's result run from the state the rewrite's was, in its place
        return original(*args)

    def run(*args):
        if state["use"] is not None:
            return state["use"](*args)
        # The backward runs with retain_graph (_gradients): a graph Inductor compiles on this call
        # must donate no buffers (a checkpointed block under rest="inductor" raised there, and a
        # right rewrite fell back: a review's)
        with torch._functorch.config.patch(donated_buffer=False):
            return checked(*args)

    def checked(*args):
        found = _CallState(args, _written_inputs(gm, args, report))
        versions = [_version(t) for _, t in attributes]
        with torch.no_grad(), found.same() as stand_ins:
            expected = original(*stand_ins)
        unkept = [inputs[i] for i in found.unkept] + [name for (name, t), v in zip(attributes, versions)
                                                      if _version(t) != v]
        if unkept:
            log.warning("mha_compile: %s: verify: the graph wrote parameter(s) %s in place, which verify did "
                        "not find it writing (step_graphs.written_inputs), or held as its attributes, so it kept no "
                        "copy of them: each run verify compares writes them again on this call", report.name, unkept)
        try:
            got = compiled(*args)
        except Exception as error:  # the replacement must never be what breaks the user's run
            return fall_back(f"it raised {type(error).__name__}: {error}", args, found, error)
        precision, fp32 = _low_precision(args), None
        if precision is not None:
            try:
                with torch.no_grad(), found.same() as stand_ins:
                    fp32 = promoted(gm)(*_upcast(stand_ins))
            except Exception as error:
                log.info("mha_compile: %s: verify: the captured graph does not run in fp32 (%s: %s); "
                         "comparing the two directly", report.name, type(error).__name__, error)
        what = _outputs_disagree(_tensors(got), _tensors(expected), None if fp32 is None else _tensors(fp32), precision)
        if not what and found.written_by_original:
            what = _writes_disagree(args, found, precision, report, inputs)
        if what:
            return fall_back(what, args, found)
        nan_step = any(isinstance(e, torch.Tensor) and e.is_floating_point() and not torch.isfinite(e).all()
                       for e in _tensors(expected))
        trains = attributes or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        if torch.is_grad_enabled() and trains:
            try:
                what, nan_grads = _gradients_disagree(gm if fp32 is not None else None, original, compiled, args,
                                                      attributes, zero_by_math, precision, found)
            except Exception as error:
                return fall_back(f"its backward raised {type(error).__name__}: {error}", args, found, error)
            if what:
                return fall_back(what, args, found)
            nan_step = nan_step or nan_grads
        if nan_step:
            # The original gave NaN or inf: what was comparable agrees, but a NaN step can leave
            # whole gradients with nothing to compare (a NaN row's reaches every parameter), so
            # the rewrite is not settled on it: the next call is verified again.
            if not state.get("said"):
                state["said"] = True
                log.info("mha_compile: %s: verify: the captured graph gave non-finite values on this call; the "
                         "rewrite agrees where they can be compared, and the next call is verified again", report.name)
            return got
        state["use"] = compiled
        return got

    return run


def _written_inputs(gm, args, report):
    """step_graphs.written_inputs(gm, args): the inputs of which verify keeps a copy, parameters
    included, so that each run it compares starts from the values the call found and only the
    call's own run writes them (a `with torch.no_grad(): self.scale.add_(1)` in a forward moved the
    scale three times on a verified call, and the runs, each reading another scale, disagreed).
    None found where the fake run fails, which the log says (the version counters still tell a
    parameter written, _CallState.unkept)."""
    try:
        return step_graphs.written_inputs(gm, args)
    except Exception as error:  # noqa: BLE001 - what cannot be found is left to the version counters
        log.info("mha_compile: %s: verify: finding the inputs the graph writes failed (%s: %s)",
                 report.name, type(error).__name__, error)
        return set()


def _low_precision(args):
    """bf16 or fp16 where the graph computes in it: an input's dtype, or the ambient autocast's on
    the inputs' device (its parameters and outputs are then fp32, its products not); else None."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    low = next((a.dtype for a in tensors if a.dtype in LOW), None)
    if low is not None or not tensors:
        return low
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in LOW:
        return torch.get_autocast_dtype(device)
    return None


def _zero_by_math(gm, report):
    """The gradients (named as _gradients_disagree names them) of a matched region's key bias: its
    gradient is exactly zero in the math (SPEC §1), which the kernels give, and roundoff in the
    captured graph."""
    names = {m["params"].get("bk") for m in report.matches} - {None}
    inputs = {f"input {i}" for i, node in enumerate(gm.graph.find_nodes(op="placeholder")) if node.name in names}
    return inputs | {f"parameter {node.target}" for node in gm.graph.find_nodes(op="get_attr") if node.name in names}


def _trained_attributes(gm):
    """(name, tensor) of each tensor taking a gradient that gm reads as its own attribute."""
    return [(name, t) for name, t in step_graphs.held_tensors(gm) if t.requires_grad]


def _tensors(outs):
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _relative(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _writes_disagree(args, found, precision, report, names):
    """What disagrees between the values the call's inputs were written to by the captured graph
    and by the rewrite (a model that copies its result into a caller's buffer: a review's planted
    20% went through), or None. In bf16 or fp16 they are not compared (the captured graph's own
    writes are as far from its math as its outputs, which are measured in fp32), which the log says."""
    if precision is not None:
        log.info("mha_compile: %s: verify: the inputs the graph writes are not compared in %s", report.name, precision)
        return None
    for i, value in sorted(found.written_by_original.items()):
        what = _outputs_disagree([args[i]], [value], None)
        if what:
            return what.replace("output 0", f"input {names[i]} as written", 1)
    return None


def _outputs_disagree(got, expected, fp32, precision=None):
    """What disagrees among the outputs, or None; fp32: the captured graph's outputs in fp32, which
    the rewrite's are then measured against, to `precision`'s bound. Entries that are not finite
    must be where the captured graph's are (a NaN row of the user's own, a row with every key
    masked under a plain softmax, say); the finite rest is compared. Integer and bool outputs (the
    top-k's indices read outside) must be equal, to fp32's where it is given (a review's planted
    shift of the exported index went through)."""
    for i, (g, e) in enumerate(zip(got, expected)):
        if isinstance(e, torch.Tensor) and isinstance(g, torch.Tensor) and not e.is_floating_point() \
                and not e.is_complex():
            want = (e if fp32 is None or not isinstance(fp32[i], torch.Tensor) else fp32[i]).to(g.dtype)
            if g.shape != want.shape or not torch.equal(g, want):
                differ = int((g != want).sum()) if g.shape == want.shape else "all"
                return f"output {i} ({g.dtype}) differs in {differ} of {want.numel()} entries"
            continue
        if not isinstance(e, torch.Tensor) or not e.is_floating_point():
            continue
        g, e, yardstick = g.detach(), e.detach(), None if fp32 is None else fp32[i].detach()
        finite = torch.isfinite(g)
        if not torch.equal(finite, torch.isfinite(e)):
            return f"output {i} is not finite where the captured graph's is finite, or the other way round"
        if not finite.all():
            keep = finite if yardstick is None else finite & torch.isfinite(yardstick)
            g, e, yardstick = g[keep], e[keep], None if yardstick is None else yardstick[keep]
        bound = BOUND.get(precision or e.dtype, 1e-4)
        if yardstick is None:
            error = _relative(g, e)
            if error > bound:
                return f"output {i}: relative error {error:.3g}"
            continue
        error, own = _relative(g, yardstick), _relative(e, yardstick)
        if error > bound:
            return (f"output {i}: relative error {error:.3g} from the captured graph run in fp32, where the "
                    f"captured graph itself is {own:.3g} from it")
    return None


def _gradients_disagree(gm, original, compiled, args, attributes, zero_by_math, precision, found):
    """(what disagrees among the gradients of the inputs and of `attributes` (_trained_attributes),
    or None; whether the original's hold a NaN or inf); gm: the captured graph, run in fp32 as the
    yardstick (see the module) to `precision`'s bound, or None to compare the two with each other;
    found: the call's _CallState, which each run starts from."""
    names = ([f"input {i}" for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
             + [f"parameter {name}" for name, _ in attributes])
    tensors = [t for _, t in attributes]
    cotangents = []
    grads_o = _gradients(original, found, cotangents, tensors)
    if grads_o is None:
        return None, False
    grads_c = _gradients(compiled, found, cotangents, tensors)
    if grads_c is None:
        return "no output of the rewritten graph takes a gradient", False
    grads_r = grads_o if gm is None else _gradients(promoted(gm), found, [c.float() for c in cotangents], tensors,
                                                    upcast=True)
    largest = max([1.0] + [g.double()[torch.isfinite(g)].norm().item() for g in grads_r if g is not None])
    # A NaN step in the user's graph (a NaN row's, _outputs_disagree): which entries of each
    # gradient a NaN reaches follows each op's backward (masked_fill's zeroes the scores' where the
    # region's 0·NaN does not), so there the entries finite in all three are compared; in a step
    # whose gradients are all finite, a NaN of the rewrite's own is not.
    nan_step = any(g is not None and not torch.isfinite(g).all() for g in grads_o)
    for name, g_c, g_o, g_r in zip(names, grads_c, grads_o, grads_r):
        if g_o is None and g_c is None:
            continue
        like = g_o if g_o is not None else g_c
        g_o, g_c = (torch.zeros_like(like) if g is None else g for g in (g_o, g_c))
        g_r = torch.zeros_like(g_o, dtype=torch.float64) if g_r is None else g_r
        finite = torch.isfinite(g_c) & torch.isfinite(g_o) & torch.isfinite(g_r)
        if not finite.all():
            if not nan_step:
                return f"gradient of {name} is not finite where the captured graph's are all finite", nan_step
            g_c, g_o, g_r = g_c[finite], g_o[finite], g_r[finite]
        dtype = precision or g_o.dtype
        bound = BOUND.get(dtype, 1e-4)
        # A key bias's gradient is roundoff in the captured graph: fp32's ~1e-2 eps of the largest
        # gradient (1e-10 to 3e-9 of it; bf16 2e-6 to 1e-5). Against GRAD_FLOOR alone a right
        # rewrite fell back in bf16 always and in fp32 often. A key bias read elsewhere too has a
        # gradient of its own, and is compared to it.
        floor = torch.finfo(dtype).eps / bound if name in zero_by_math else GRAD_FLOOR
        scale = max(g_r.double().norm().item(), floor * largest, 1e-30)
        error = (g_c.double() - g_r.double()).norm().item() / scale
        own = 0.0 if gm is None else (g_o.double() - g_r.double()).norm().item() / scale
        if error > bound:
            return (f"gradient of {name}: relative error {error:.3g}"
                    + ("" if gm is None
                       else f" from the captured graph run in fp32, which itself is {own:.3g} from it"),
                    nan_step)
    return None, nan_step


def _gradients(fn, found, cotangents, attributes=(), upcast=False):
    """fn's gradients of new leaves standing for the call's arguments (upcast: as fp32, _upcast),
    then of the tensors `attributes` that fn reads itself (None where unused), with `cotangents`
    (filled with random ones on the first call, given the outputs), fn run from `found`
    (_CallState); None when no output takes a gradient. torch.autograd.grad leaves every .grad as
    it was.

    A leaf (a parameter) stands as a detached view of itself, at its address, as in the steps
    after this one (step_graphs, whose graphs capture on this call, then read the parameters in
    place rather than copying them in every replay); one the graph writes in place under no_grad
    (_written_inputs) stands as found.same()'s copy of its value as the call found it, elsewhere,
    which costs no replay a copy: step_graphs turn away a graph that writes an input
    (step_graphs.why_not). Another input stands as a clone of a new
    leaf, not the leaf itself: the graph may write it in place, as eager lets it write the
    caller's non-leaf (a leaf stand-in raised there, and a right rewrite fell back)."""
    parameters = [isinstance(a, torch.Tensor) and a.is_leaf for a in found.args]  # the call's own
    with found.same() as args:
        leaves, xs = [], []
        for a, parameter in zip(_upcast(args) if upcast else args, parameters):
            if not (isinstance(a, torch.Tensor) and a.requires_grad):
                xs.append(a)
                continue
            leaves.append((a.detach() if parameter else a.detach().clone()).requires_grad_(True))
            xs.append(leaves[-1] if parameter else leaves[-1].clone())
        outs = [o for o in _tensors(fn(*xs)) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outs:
            return None
        if not cotangents:
            cotangents.extend(torch.randn_like(o) for o in outs)
        # retain_graph: AOTAutograd compiles a backward on its first run, with its saved tensors'
        # buffers donated where that run frees them, and a later backward that retains its graph
        # then raises. Verify's run came first, so a user's first backward(retain_graph=True) (a
        # GAN's two losses, a gradient penalty) raised under rest="inductor" where it ran without
        # verify. The price, with verify on: that compiled backward, which every later step runs,
        # donates no buffers (a higher peak under Inductor). This run's graph goes with outs.
        return torch.autograd.grad(outs, leaves + list(attributes), cotangents, allow_unused=True, retain_graph=True)


class _CallState:
    """The state a call found: its random-number state (the CPU's and that of each CUDA device its
    inputs are on) and the values of its inputs but the parameters (leaves taking a gradient),
    parameters too where the graph writes them (`writes`, _written_inputs). `same()` runs a block
    from it and puts back the random-number state the block found; `restore()` goes back to it.

    The first block (the captured graph's run, before the rewrite's) runs on the inputs themselves;
    those it wrote in place (a BatchNorm's running statistics, a counter: their version counters
    moved or their values changed; eager's batch_norm moves no counter) get the values found back,
    and later blocks run on copies of them. So only the call's own result, the rewrite's run,
    writes the caller's tensors, once, as without verify, and no write of verify's moves a version
    counter the rewrite's backward checks. Until the first block ends, verify holds a copy of every
    such input."""

    def __init__(self, args, writes=()):
        self.devices = sorted({a.device.index for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.args = args
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        parameters = {i for i in tensors if args[i].is_leaf and args[i].requires_grad and i not in writes}
        self.found = {i: args[i].detach().clone() for i in tensors if i not in parameters}
        self.versions = {i: _version(args[i]) for i in tensors}
        self.written = None  # positions of the inputs a run writes, once the first block ran
        self.written_by_original = {}  # what the first block wrote into them
        self.unkept = []  # parameters the first block wrote, of which no copy was kept

    @contextlib.contextmanager
    def same(self):
        """A block from the state found, given the arguments to run on (stand-ins for the written)."""
        args = list(self.args)
        for i in self.written or ():
            args[i] = self.found[i].clone().requires_grad_(self.args[i].requires_grad)
        with torch.random.fork_rng(devices=self.devices):
            self._restore_draws()
            yield args
        if self.written is None:
            self.written = [i for i in self.found if _version(self.args[i]) != self.versions[i]
                            or not torch.equal(self.args[i], self.found[i])]
            self.unkept = [i for i in self.versions
                           if i not in self.found and _version(self.args[i]) != self.versions[i]]
            self.found = {i: self.found[i] for i in self.written}
            self.written_by_original = {i: self.args[i].detach().clone() for i in self.written}
            self._restore_written()

    def restore(self):
        """The random-number state and the written inputs as the call found them."""
        self._restore_draws()
        self._restore_written()

    def _restore_draws(self):
        torch.set_rng_state(self.cpu)
        for device, state in zip(self.devices, self.cuda):
            torch.cuda.set_rng_state(state, device)

    def _restore_written(self):
        with torch.no_grad():
            for i, value in self.found.items():
                self.args[i].copy_(value)


def _version(t):
    """t's version counter, or None for an inference tensor, which has none (verify on a call under
    inference_mode raised: a review's); a write into one shows in its value (_CallState.same)."""
    return None if t.is_inference() else t._version


def _upcast(args):
    """args with bf16 and fp16 tensors as fp32 (requires_grad kept)."""
    return [a.detach().float().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) and a.dtype in LOW else a
            for a in args]


def promoted(gm):
    """A callable running gm with every bf16 or fp16 dtype its nodes name read as fp32: casts
    (`x.to(torch.bfloat16)`, `.half()`, `.bfloat16()`), dtype= arguments, and low-precision
    attributes, and with the ambient autocast off; given fp32 inputs, the captured graph's math in
    fp32."""
    def run(*args):
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        with torch.autocast(device, enabled=False):
            return _Promoted(gm).run(*args)
    return run


class _Promoted(torch.fx.Interpreter):
    def run_node(self, node):
        with self._set_current_node(node):
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            args, kwargs = torch.fx.node.map_aggregate((args, kwargs), _fp32_dtype)
            target = "float" if node.op == "call_method" and node.target in ("bfloat16", "half") else node.target
            result = getattr(self, node.op)(target, args, kwargs)
        if node.op == "get_attr" and isinstance(result, torch.Tensor) and result.dtype in LOW:
            return result.float()
        return result


def _fp32_dtype(a):
    return torch.float32 if isinstance(a, torch.dtype) and a in LOW else a
