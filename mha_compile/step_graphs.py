"""mode="reduce-overhead" with rest="eager" (options step_graphs "auto", the default, or True):
the compiled step replayed through two CUDA graphs of our own, its forward and its backward,
behind one autograd.Function, instead of torch's CUDA-graph trees behind AOTAutograd.

Why: at small and medium a step under reduce-overhead is bound by the host, and most of that
host time is torch's runtime around the graphs, not the graphs: under the profiler a medium step's
`CompiledFunction` took 276 us of its own, `CompiledFunctionBackward` 316 and "Torch-Compiled
Region" 115, for ~0.61 ms of GPU work (H200, torch 2.11, bench/PERF_NOTES.md v48). Replaying the
step the way torch.cuda.make_graphed_callables does skips AOTAutograd's wrappers and the trees'
bookkeeping; a replay then costs the input copies, a graph launch and the output copies.

How, per compiled graph (Dynamo guards every input's shape, strides, dtype, device and
requires_grad and the grad mode, so a graph meets one signature; training and inference are
still kept apart):
1. the first call runs eagerly: it compiles and autotunes every kernel, and where each input
   lies is noted;
2. the second captures: inputs found where the first call had them (parameters, buffers, a batch
   buffer the caller refills) are read in place, every other one is copied into a static input,
   and so is an output of the caller's autograd graph (a non-leaf) wherever it lies: the caller
   may write it in place before the backward (a residual, `h += block(h, tok)`), which eager
   allows where its ops saved none of it, and a backward reading it in place would have to raise;
   after a warm-up on the side stream, the forward is captured with autograd recording and the
   backward as torch.autograd.grad of its outputs, into the step's own memory pool;
3. each call copies its moved inputs in, replays the forward and hands out copies of the outputs
   (the next replay overwrites the graph's own); the backward copies ∂out in, replays, and hands
   autograd views of the graph's input gradients, which AccumulateGrad takes as .grad with no
   copy. Before the next replay, forward's or backward's (the forward's may write there too: the
   graphs share a pool), each tensor known to still hold one (a leaf input's .grad, accumulated
   or zeroed in place; a gradient torch.autograd.grad returned through a retained graph) gets
   memory of its own, the same values in the same tensor object (`_Step.move_gradients_out`);
   a view of one made elsewhere makes the steps run eagerly until it is dropped, and a backward
   raise, since a replay would overwrite it. Every input read in place
   is held until the backward, and a change to one in place before then raises, as eager's saved tensors
   do, though the backward may not read it (a batch whose copy the op keeps, refilled before the
   backward: eager trains there). Session 51 held only those the warm-up's saved-tensor hooks saw
   saved, and took the garbage gradients of test_gradients_accumulate_without_zeroing for its
   fault; their cause was the forward's replay writing over .grad views (session 52). Holding
   fewer would rest on the hooks seeing every tensor the backward reads, which a Function keeping
   one as an attribute hides from them: all are held.

Random numbers (dropout) are taken where they come from the inputs' device's default generator,
which a CUDA graph registers: each replay draws anew, and the backward's replay reads the masks
its forward's replay saved in the pool (the warm-up draws once more than eager would).

Refused when compiled, said in the log (a warning where step_graphs=True asked for these graphs),
torch's CUDA-graph trees then taking the step as they do with step_graphs=False: an input that
is not a CUDA tensor (a size under dynamic shapes), no input, and a graph that writes into one
of its inputs, draws random numbers from a generator of its own or on another device, or
returns an input's or another output's memory (`why_not`).

At run time: under saved-tensor hooks (activation checkpointing, save_on_cpu) a training call
runs eagerly; an input read in place that has moved makes the call capture again with it copied;
a forward while the last one's backward is still to come (its saved values live in the graphs'
pool: a siamese pair's second call, micro-batches summed into one backward) replays graphs of
its own, a capture at the next depth with a pool of its own, up to MAX_PENDING such forwards
(the rest run eagerly), and so does a forward while a backward's graph is retained
(retain_graph=True: another backward may read its saved values); a backward whose forward's
values a later replay overwrote raises (a safety net: a depth is replayed again only once its
graph is freed); a failed capture runs the step eagerly from then on, with a warning (at a depth
past 0, only the calls that deep; options strict=True raises instead).
"""
import logging
import operator
import threading
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from mha_compile.double_backward import refuse_batched
from mha_compile.kernels import region_graphs

log = logging.getLogger("mha_compile")
# Forwards whose backwards are still to come that the step's graphs replay, each at a depth of
# its own (a capture, its own memory pool: a siamese pair's calls, micro-batches summed into one
# backward); calls past them run eagerly. Bounded since each depth holds a pool (~0.2 GB at
# medium, ~0.8 at large, bench/results/h200_s53_*.md) for as long as the step lives.
MAX_PENDING = 4


def compile(gm, example_inputs, run, fallback, asked=True, strict=False):
    """A callable replaying the step `run` (gm's graph, run eagerly) through its own CUDA graphs,
    or fallback(gm, example_inputs) where why_not refuses gm, said in the log: as a warning where
    step_graphs=True asked for these graphs (asked), else as information ("auto"). strict (options
    strict): a capture that fails raises, where the step would run eagerly."""
    reason = why_not(gm, example_inputs, CudaGraphs.takes)
    if reason is not None:
        log.log(logging.WARNING if asked else logging.INFO,
                "mha_compile: torch's CUDA-graph trees take this graph, not mha_compile's step graphs%s, since %s",
                " (step_graphs=True)" if asked else "", reason)
        return fallback(gm, example_inputs)
    log.info("mha_compile: the step replays through mha_compile's own CUDA graphs (options step_graphs)")
    return StepGraphs(run, CudaGraphs, [t for _, t in held_tensors(gm)], strict)


def why_not(gm, example_inputs, on_device):
    """Why gm's step cannot replay through step graphs (None: it can): an input that is not a
    tensor for which on_device is true (the recorder's `takes`), or what running gm on fake
    copies of its inputs shows (_Watch)."""
    for i, value in enumerate(example_inputs):
        if not isinstance(value, torch.Tensor):
            return f"input {i} is a {type(value).__name__}, not a tensor (a size, under dynamic shapes)"
        if not on_device(value):
            return f"input {i} is on {value.device}, not on a CUDA device"
    if not example_inputs:
        return "it takes no inputs (nothing says which device its graphs would be captured on)"
    if len({t.device for t in example_inputs}) > 1:
        return f"the inputs are on several devices ({sorted({str(t.device) for t in example_inputs})})"
    for name, t in held_tensors(gm):
        if t.requires_grad:
            return (f"it holds {name} itself rather than taking it as an input: the backward graph would give it no "
                    "gradient")
    try:
        # no_grad: what is checked does not need autograd, and a caller's saved-tensor hooks (a
        # checkpoint compiling the step inside its forward) would count what autograd saved here
        with torch.no_grad():
            outputs, watch = _fake_run(gm, example_inputs, _Watch)
    except Exception as error:  # noqa: BLE001 (what cannot be checked is not captured)
        return f"running it on fake inputs to check it failed ({type(error).__name__}: {error})"
    if watch.found is not None:
        return watch.found
    seen = {}
    for j, out in enumerate(torch.utils._pytree.tree_leaves(outputs)):
        if not isinstance(out, torch.Tensor):
            return f"output {j} is a {type(out).__name__}, not a tensor"
        storage = StorageWeakRef(out.untyped_storage())
        if storage in watch.inputs:
            return f"output {j} is a view of input {watch.inputs[storage]} (its copy would be handed out, not it)"
        if storage in seen:
            return f"outputs {seen[storage]} and {j} share memory (copies would not)"
        seen[storage] = j
    return None


def held_tensors(gm):
    """(name, tensor) of each tensor gm reads as its own attribute (parameters and buffers of its
    modules, constants), not as an input. Dynamo lifts a module's parameters and buffers to inputs
    (inline_inbuilt_nn_modules); what it leaves are constants."""
    held = {id(t): (name, t) for name, t in [*gm.named_parameters(), *gm.named_buffers()]}
    for node in gm.graph.find_nodes(op="get_attr"):
        value = operator.attrgetter(node.target)(gm)
        if isinstance(value, torch.Tensor):
            held.setdefault(id(value), (node.target, value))
    return list(held.values())


class _Watch(TorchDispatchMode):
    """Notes the first aten op that writes into an input's memory, or draws random numbers other
    than from the inputs' device's default generator."""

    def __init__(self, inputs):
        super().__init__()
        self.inputs = {StorageWeakRef(t.untyped_storage()): i for i, t in enumerate(inputs)}
        self.device = inputs[0].device
        self.found = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.found is None:
            self.found = self._finding(func, args, kwargs, result)
        return result

    def _finding(self, func, args, kwargs, result):
        if torch.Tag.nondeterministic_seeded in func.tags:
            # A CUDA graph registers the capturing device's default generator: each replay draws
            # anew from it (its Philox offset advanced on the host), as the trees' replays do.
            # A generator of the caller's own is not registered, and draws on another device are
            # not captured: a replay would repeat the capture's numbers.
            if kwargs.get("generator") is not None or any(isinstance(a, torch.Generator) for a in args):
                return (f"it draws random numbers from a generator of its own ({func}), which a replay would "
                        "repeat (only the device's default generator draws anew each replay)")
            for t in torch.utils._pytree.tree_leaves(result):
                if isinstance(t, torch.Tensor) and t.device != self.device:
                    return (f"it draws random numbers on {t.device} ({func}), not on the inputs' {self.device}: "
                            "a replay would repeat the capture's numbers")
        for index, name in _writes_into(func, args, kwargs, self.inputs):
            return f"it writes into input {index} ({func}, argument {name}), which a replay would not"
        return None


def _writes_into(func, args, kwargs, inputs):
    """(input position, argument name) for each argument the aten call `func` writes (its schema's
    write alias: add_'s self, out=, a custom op's mutates_args) whose memory is an input's
    (`inputs`: storage -> position), through any view of it."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()) in inputs:
                yield inputs[StorageWeakRef(t.untyped_storage())], argument.name


class _Writes(TorchDispatchMode):
    """Notes every input that an aten op writes into (_writes_into), and with it every input that
    shares its memory (views of one another)."""

    def __init__(self, inputs):
        super().__init__()
        self.inputs, self.sharing = {}, {}
        for i, t in enumerate(inputs):
            if isinstance(t, torch.Tensor):
                storage = StorageWeakRef(t.untyped_storage())
                self.inputs.setdefault(storage, i)
                self.sharing.setdefault(self.inputs[storage], []).append(i)
        self.written = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, _ in _writes_into(func, args, kwargs, self.inputs):
            self.written.update(self.sharing[i])
        return func(*args, **kwargs)


def written_inputs(gm, inputs):
    """Positions of the inputs that gm writes in place, in whatever spelling (add_, +=, x[i] = v,
    out=, .data, through views, a custom op's mutates_args): gm run on fake copies of `inputs`
    (_fake_run), each aten op's written arguments noted by their memory. Raises what the fake run
    raises."""
    return _fake_run(gm, inputs, _Writes)[1].written


class _FakeHeld(torch.fx.Interpreter):
    """An Interpreter that reads gm's own tensors (get_attr) as fake copies: a graph that writes a
    constant it holds writes the copy."""

    def __init__(self, gm, fake_mode):
        super().__init__(gm)
        self.fake_mode = fake_mode

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        return self.fake_mode.from_tensor(value) if isinstance(value, torch.Tensor) else value


def _fake_run(gm, inputs, watching):
    """(gm's outputs, the dispatch mode watching(fakes)) from a run of gm on fake copies of
    `inputs` under that mode (inside the fake mode, so that it sees each aten op): no real work and
    nothing real written, its own tensors read as fakes too (_FakeHeld), and the grad mode and
    autocast state it sets (the graph's _set_grad_enabled and _enter_autocast nodes run for real)
    put back as found, also where the run raises midway (a nonzero under no_grad left grad mode
    off, and a compile after it built an inference graph for training)."""
    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [_fake_copy(fake_mode, t) for t in inputs]
    watch = watching(fakes)
    grad = torch.is_grad_enabled()
    autocast = {device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                for device in ("cpu", "cuda")}
    try:
        with fake_mode, watch:
            return _FakeHeld(gm, fake_mode).run(*fakes), watch
    finally:
        torch.set_grad_enabled(grad)
        for device, (enabled, dtype) in autocast.items():
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)


def _fake_copy(fake_mode, value):
    """value as a fake of fake_mode; one with symbolic sizes (Dynamo's example inputs under dynamic
    shapes), and a symbolic size itself, at its hints. A run on Dynamo's own symbols adds guards to
    Dynamo's shape environment: rest="inductor" in training then compiled a graph per batch size,
    and mark_dynamic raised (a review's)."""
    if isinstance(value, torch.SymInt):
        return _hint(value)
    if not isinstance(value, torch.Tensor):
        return value
    if not any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride(), value.storage_offset())):
        return fake_mode.from_tensor(value)
    with fake_mode:
        copy = torch.empty_strided([_hint(s) for s in value.shape], [_hint(s) for s in value.stride()],
                                   dtype=value.dtype, device=value.device)
    return copy.requires_grad_(value.requires_grad)


def _hint(size):
    """A size's value: an int as it is, a SymInt's hint (Dynamo's example value for it), read
    without a guard. A size with no hint (data-dependent) raises."""
    if isinstance(size, int):
        return size
    hint = size.node.hint
    if hint is None:
        raise ValueError(f"the size {size} has no example value")
    return int(hint)


class StepGraphs:
    """The compiled step: its first call eager, later ones replays of its graphs (module docstring).
    run: the graph run eagerly; recorder(device): what captures and replays (CudaGraphs); held:
    the tensors the graph reads as attributes (held_tensors), read where they are: one that
    moves makes the step capture again. strict: a failed capture raises (options strict)."""

    def __init__(self, run, recorder, held=(), strict=False):
        self.run, self.recorder, self.held, self.strict = run, recorder, list(held), strict
        # training -> a list by depth (how many forwards before it still await their backwards: a
        # siamese pair's second call, a second micro-batch) of _Seen | _Step
        self.entries = {}
        # training -> how many depths may replay: MAX_PENDING, or the depth a capture failed at
        # (0: the step runs eagerly from then on)
        self.depths_allowed = {}
        self.lock = threading.RLock()
        self.said = set()

    def __call__(self, *args):
        if torch.is_inference_mode_enabled():
            return self.run(*args)  # static inputs made under inference mode could not be copied into outside it
        training = torch.is_grad_enabled() and any(a.requires_grad for a in args)
        if training and torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            self._say("hooks", "saved-tensor hooks are on (activation checkpointing, save_on_cpu): the step's graphs "
                      "(mode='reduce-overhead') run it eagerly under them, since a replay saves its values in the "
                      "graphs' memory, out of the hooks' reach (and a checkpoint's recomputation must save what "
                      "its first forward saved)")
            return self.run(*args)
        with self.lock:
            depths = self.entries.get(training)
            if depths is None:
                self.entries[training] = [_Seen(args)]
                return self.run(*args)
            # the first depth whose graphs hold no forward still awaiting its backward (inference
            # keeps none); chosen before any capture again: a micro-batch's inputs are new tensors,
            # and capturing the busy depth for them would only replace it
            depth = next((d for d, entry in enumerate(depths) if not (training and entry.pending())), len(depths))
            if depth >= self.depths_allowed.get(training, MAX_PENDING):
                if depth == MAX_PENDING:  # else a capture failed at this depth (said then)
                    self._say("pending", f"the step's graphs (mode='reduce-overhead') were called while "
                              f"{MAX_PENDING} earlier calls still awaited their backwards (a backward to come, or an "
                              "output kept with its autograd graph); such calls run eagerly (each depth holds its "
                              "saved values in graphs of its own, step_graphs.MAX_PENDING); options "
                              "step_graphs=False gives such steps to torch's CUDA-graph trees instead")
                return self.run(*args)
            entry = depths[depth] if depth < len(depths) else None
            if not isinstance(entry, _Step) or not entry.addresses_hold(args):
                basis = entry if entry is not None else depths[0]  # a new depth: what depth 0 reads in place
                entry = self._capture(args, basis.in_place(args), training, depth)
                if entry is None:
                    return self.run(*args)
            if not training:
                return tuple(entry.forward(args))
            if entry.move_gradients_out(args):
                self._say("held", "a view of a gradient the step's graphs (mode='reduce-overhead') handed out is "
                          "still held; steps run eagerly while it is, since the next replay would overwrite it")
                return self.run(*args)
            return _Replay.apply(entry, *args)

    def _say(self, what, message):
        """Log `message` as a warning, once for each `what`."""
        if what not in self.said:
            self.said.add(what)
            log.warning("mha_compile: %s", message)

    def _capture(self, args, in_place, training, depth):
        """A _Step for args at `depth` (remembered), or None with a warning where capturing fails
        (calls at that depth or deeper then run eagerly from then on)."""
        depths = self.entries[training]
        old = depths[depth] if depth < len(depths) else None
        try:
            entry = _Step(self.run, args, in_place, training, self.recorder(args[0].device), self.held)
        except Exception as error:  # noqa: BLE001 (any capture failure: run eagerly instead)
            if self.strict:
                raise RuntimeError(f"mha_compile: capturing the step as CUDA graphs (mode='reduce-overhead', at depth "
                                   f"{depth}) failed ({type(error).__name__}: {error}); options strict=True raises "
                                   "where the step would run without them") from error
            # at a depth past 0 (out of memory for another pool, say), only calls that deep run
            # eagerly: the depths before it keep replaying
            log.warning("mha_compile: capturing the step as CUDA graphs failed (%s: %s); %s", type(error).__name__,
                        error, "it runs without them" if depth == 0 else
                        f"calls while {depth} or more earlier ones await their backwards run without them")
            self.depths_allowed[training] = depth
            del depths[depth:]  # what they hold is not replayed again
            return None
        if isinstance(old, _Step):
            old.recorder.synchronize()  # its last replay may still be reading what it holds
        if old is None:
            depths.append(entry)
        else:
            depths[depth] = entry
        return entry


class _Seen:
    """A step called once (eagerly): where its inputs were."""

    def __init__(self, args):
        self.addresses = [a.data_ptr() for a in args]

    def pending(self):
        return False  # an eager call's backward needs no graphs

    def in_place(self, args):
        return [_readable_in_place(a, at) for a, at in zip(args, self.addresses)]


class _Step:
    """One capture: static inputs for the copied arguments, the graphs, their static outputs and
    gradients, and which forward's values the graphs' memory holds (generation)."""

    def __init__(self, run, args, in_place, training, recorder, held):
        self.recorder, self.read_in_place = recorder, in_place
        self.addresses = [a.data_ptr() if keep else None for a, keep in zip(args, in_place)]
        self.held = [(t, t.data_ptr()) for t in held]
        with torch.no_grad():
            surface = [a.detach() if keep else region_graphs.static_copy(a) for a, keep in zip(args, in_place)]
        for static, a in zip(surface, args):
            static.requires_grad_(training and a.requires_grad)
        self.copied = [(i, static) for i, (static, keep) in enumerate(zip(surface, in_place)) if not keep]

        def forward():
            with torch.enable_grad() if training else torch.no_grad():
                return list(run(*surface))

        def backward(outputs, grad_outputs):
            return torch.autograd.grad([o for o, g in zip(outputs, grad_outputs) if g is not None],
                                       [s for s in surface if s.requires_grad],
                                       [g for g in grad_outputs if g is not None], allow_unused=True)

        recorder.warm_up(forward, backward if training else None)
        self.outputs, self.replay_forward = recorder.capture_forward(forward)
        self.grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in self.outputs]
        grads, self.replay_backward = (), None
        if any(g is not None for g in self.grad_outputs):  # else no output takes a gradient: no backward
            grads, self.replay_backward = recorder.capture_backward(
                lambda outputs: backward(outputs, self.grad_outputs), self.outputs)
        # The capture's autograd graph is done with: holding it would hold the inputs read in
        # place (their views are its leaves), as region_graphs holds none of them either.
        self.differentiable = [o.requires_grad for o in self.outputs]
        self.outputs = [o.detach() for o in self.outputs]
        grads = iter(grads)
        self.grad_of = [next(grads) if static.requires_grad else None for static in surface]  # by input
        # Each gradient storage (one object kept for it, read without making another) and the
        # references to it that are the step's own (two gradients sharing one count twice, an
        # output sharing it once more): any beyond them are someone else's.
        storages = {_storage(g): g.untyped_storage() for g in self.grad_of if g is not None}
        self.grad_storages = {ptr: (storage, _uses(storage)) for ptr, storage in storages.items()}
        # The inputs read in place, as (position, address): read every step, so worked out once here.
        self.kept = [(i, at) for i, at in enumerate(self.addresses) if at is not None]
        self.generation, self.last, self.backward_done = 0, None, False
        self.holders = []  # (weak reference, whether its .grad is what may hold them): move_gradients_out

    def addresses_hold(self, args):
        return (all(_readable_in_place(args[i], at) for i, at in self.kept)
                and all(t.data_ptr() == at for t, at in self.held))

    def in_place(self, args):
        """What stays read in place when the step is captured again (an input moved)."""
        return [keep and _readable_in_place(a, at) for a, keep, at in zip(args, self.read_in_place, self.addresses)]

    def _gradients_held(self):
        return any(_uses(storage) != own for storage, own in self.grad_storages.values())

    def move_gradients_out(self, args=()):
        """Move each tensor known to hold the graphs' gradients into memory of its own, the same
        values in the same tensor object (so a caller holding it keeps them), before a replay
        writes there: a leaf input's .grad (args', and the last forward's inputs'), and a gradient
        a backward handed out that something else keeps (torch.autograd.grad's result, through a
        retained graph). The backward's replay writes the gradients, and so may the forward's: the
        two graphs share a pool, and the backward's capture may have put a gradient in a block the
        forward's capture freed (on the GPU, session 52: ∂pool.query came out 1.6e38 where
        gradients accumulated over steps).

        Returns whether anything still holds the graphs' gradients after (a view the caller made
        of one), which the next replay would overwrite."""
        if not self._gradients_held():
            return False  # nothing holds them (.grad set to None since): the usual step, answered without a walk
        for a in args:
            if a.is_leaf:
                self._move(a.grad)
        for ref, its_grad in self.holders:
            t = ref()
            self._move(t.grad if its_grad and t is not None else t)
        return self._gradients_held()

    def _move(self, t):
        if t is not None and _storage(t) in self.grad_storages:
            t.data = t.clone()

    def pending(self):
        """Whether the last forward's backward is still to come, or may come again (a backward
        with retain_graph=True ran): its autograd node alive, the graphs' saved values needed."""
        return self.last is not None and self.last() is not None and not self.backward_done

    def forward(self, args, ctx=None):
        """Replay the forward on args; copies of its outputs. ctx: the autograd node a backward
        will come through (training)."""
        self.recorder.before_replay()
        if self.copied:
            region_graphs.copy_pairs([(static, args[i]) for i, static in self.copied])
        self.replay_forward()
        self.generation += 1
        if ctx is not None:
            self.last, self.backward_done = weakref.ref(ctx), False
            # whose .grad the backward's gradients may become (move_gradients_out)
            self.holders = [(weakref.ref(a), True) for a in args if a.is_leaf and a.requires_grad]
        # one clone an output: a step has one or two, so _foreach_copy_'s grouping saves no
        # launch here and costs ~5 us of host (bench/step_graphs_host.py)
        return [o.clone() for o in self.outputs]

    def backward(self, generation, grads):
        """Replay the backward for the forward `generation` with ∂out = grads; a gradient per input.

        The gradients go to autograd as views of the graphs' own, so AccumulateGrad takes each as
        .grad where .grad is None, with no copy (a copy each cost ~20 us of host a parameter on
        the H200); before the next replay, move_gradients_out gives whatever still holds one
        memory of its own (a second backward through a retained graph comes here with the
        first's gradients held)."""
        if generation != self.generation:
            raise RuntimeError("mha_compile: backward through a step whose CUDA graphs have replayed a later forward "
                               "since: the values it saved are overwritten (the step graphs keep one forward's)")
        if self.move_gradients_out():
            raise RuntimeError("mha_compile: a view of a gradient the step's CUDA graphs (mode='reduce-overhead') "
                               "handed out is held, and this backward's replay would overwrite it; copy it with "
                               ".clone() to keep it")
        self.recorder.before_replay()
        region_graphs.copy_pairs([(static, g) for static, g in zip(self.grad_outputs, grads) if static is not None])
        self.replay_backward()
        # done unless the graph is retained: a later backward through it reads this forward's
        # values, so a forward meanwhile takes another depth (eager trains there: a GAN's
        # discriminator loss, backward with retain_graph, then another forward before the next)
        self.backward_done = not torch._C._autograd._get_current_graph_task_keep_graph()
        handed = [None if g is None else g.detach() for g in self.grad_of]
        self.holders += [(weakref.ref(g), False) for g in handed if g is not None]
        return handed


# Added to autograd's error where an input the step's graphs read in place changed before the
# backward (module docstring, 3.).
CHANGED_IN_PLACE = ("mha_compile: the step replays through mha_compile's own CUDA graphs (mode='reduce-overhead', "
                    "options step_graphs), which read this input where it lies and so must find it unchanged at the "
                    "backward; change it after the backward, or give options step_graphs=False (torch's CUDA-graph "
                    "trees copy their inputs in)")

# Raised by a backward with create_graph=True rather than hand out gradients a second derivative
# would take for constants (double_backward.py: once_differentiable's error can go unreached).
NOT_TWICE = ("mha_compile: the step's backward replays as a CUDA graph of mha_compile's own (mode='reduce-overhead', "
             "options step_graphs), whose gradients cannot be differentiated again; a backward with "
             "create_graph=True (a gradient penalty, a Hessian-vector product) needs torch.compile without "
             "mode='reduce-overhead'")


class _Replay(torch.autograd.Function):
    """A training step's replay: forward and backward graphs as one autograd node."""

    @staticmethod
    def forward(ctx, step, *args):
        outputs = step.forward(args, ctx)
        ctx.step, ctx.generation = step, step.generation
        # The inputs read in place stay alive until the backward, and an in-place change to one
        # before it raises, as eager autograd's saved tensors do (module docstring, 3.).
        ctx.save_for_backward(*[args[i] for i, _ in step.kept])
        ctx.mark_non_differentiable(*[o for o, wanted in zip(outputs, step.differentiable) if not wanted])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        refuse_batched(*grads)  # a replay copies one cotangent into its static buffers
        if torch.is_grad_enabled():  # create_graph=True: a replay records no ops to differentiate
            raise RuntimeError(NOT_TWICE)
        try:  # unpacking checks that no input read in place changed since the forward
            ctx.saved_tensors
        except RuntimeError as error:
            if "modified by an inplace operation" not in str(error):
                raise
            raise RuntimeError(f"{error}\n{CHANGED_IN_PLACE}") from error
        return (None, *ctx.step.backward(ctx.generation, grads))


def _readable_in_place(a, at):
    """Whether step input a can be read where it lies: at the address `at` it had before, and
    not an output of the caller's autograd graph (module docstring, 2.)."""
    return a.data_ptr() == at and a.grad_fn is None


def _storage(t):
    """Where t's storage starts (its identity among live storages)."""
    return t.untyped_storage().data_ptr()


def _uses(storage):
    """References to a storage (an UntypedStorage): its tensors' and its storage objects'."""
    return torch._C._storage_Use_Count(storage._cdata)


class CudaGraphs:
    """Capture and replay on `device`: one private memory pool a step, the device's side stream
    (region_graphs.side_stream) for the warm-up and the captures."""

    def __init__(self, device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = region_graphs.side_stream(device)
        self.last_stream = None

    @staticmethod
    def takes(t):
        """Whether a step input can be read by these graphs."""
        return t.is_cuda

    def warm_up(self, forward, backward):
        """One forward (and backward, with ∂out = 1) on the side stream: what the eager call left
        uncompiled or unallocated for the static inputs and this stream (cuBLAS's workspace) is
        done now, not inside a capture."""
        with torch.cuda.device(self.device):
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                outputs = forward()
                if backward is not None and any(o.requires_grad for o in outputs):
                    backward(outputs, [torch.ones_like(o) if o.requires_grad else None for o in outputs])
            torch.cuda.current_stream().wait_stream(self.stream)

    def capture_forward(self, forward):
        """(forward's outputs, captured, and the replay of what made them)."""
        return self._capture(forward)

    def capture_backward(self, backward, outputs):
        """(backward(outputs), captured, and its replay): it reads what the forward's replay left."""
        return self._capture(lambda: backward(outputs))

    def _capture(self, fn):
        # The capture error mode is torch.cuda.graph's default, "global", as in
        # make_graphed_callables: the backward's kernels are issued by the autograd engine's device
        # thread, not the one that began the capture.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                result = fn()
        return result, graph.replay

    def before_replay(self):
        """A replay on another stream than the last one waits for it (they share the pool)."""
        self.last_stream = region_graphs.after_last_replay(self.last_stream, self.device)

    def synchronize(self):
        torch.cuda.synchronize(self.device)
