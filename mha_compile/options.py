"""The backend's settings: one dataclass, defaults as named constants, validation with clear errors."""
import collections.abc
import dataclasses
import os

KERNELS = ("auto", "fused", "staged", "reference")
REST = ("eager", "inductor")
GRAPHS = ("auto", "on", "off")
STEP_GRAPHS = ("auto", True, False)
# torch.compile's modes the backend honours (None and "default": no CUDA graphs, no autotuning)
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DEFAULT_KERNELS = "auto"
DEFAULT_REST = "eager"
DEFAULT_GRAPHS = "auto"
DEFAULT_STEP_GRAPHS = "auto"
DUMP_ENV = "MHA_COMPILE_DUMP"


@dataclasses.dataclass(frozen=True)
class Options:
    """Settings of `torch.compile(m, backend="mha", options={...})`.

    kernels: which kernels replace the region ("auto": fused on CUDA where supported, else
        the reference path). rest: how everything outside the region runs. dump: a folder for
        graph dumps (default: $MHA_COMPILE_DUMP; "~" is the home folder; False: none, whatever the
        environment says). verify: run the original region beside the
        replacement on the first call and fall back with a warning if they disagree.
        strict: raise instead of falling back when the backend fails (verify's disagreement and a
            failed capture of mode="reduce-overhead"'s step graphs included).
        graphs: whether the region's kernels replay as a CUDA graph per call signature inside
            the op, which cuts the host time of a step without mode="reduce-overhead" ("auto":
            on CUDA at sizes whose graphs hold little memory, see kernels/region_graphs.py; "on":
            at every size; "off": never). The graphs hold memory that the plain path frees
            after each call. Under mode="reduce-overhead" (or an Inductor mode with CUDA
            graphs) the whole graph is captured instead and this is ignored.
        keep_hidden: the fused and staged kernels keep the experts' pre-activations u = x W1 + b1
            ([R·k, F] in the weights' dtype: 66 MiB at the medium preset, 520 MiB at large in
            bf16) from the forward for the backward, which then reads them instead of computing
            them again: on the H200 a large training step's GPU time 5.42 → 4.99 ms; at medium no
            gain (bench/PERF_NOTES.md v40, v41). Not with swiglu. False: computed again (the
            least memory).
        mode: torch.compile's `mode`, given here because torch.compile refuses `mode` and
            `options` together: options={"rest": "inductor", "mode": "reduce-overhead"} is
            mode="reduce-overhead" with these options. None: torch.compile's own `mode`.
        step_graphs: under mode="reduce-overhead" with rest="eager", replay the step through
            mha_compile's own two CUDA graphs (forward and backward, behind one autograd node,
            as torch.cuda.make_graphed_callables does) instead of torch's CUDA-graph trees behind
            AOTAutograd, whose runtime binds small and medium steps on the host (an H100
            training step at small 0.574 ms against the trees' 0.796, medium 0.656 against
            0.685, bench/PERF_NOTES.md v55). "auto" (the default): there, and nowhere else;
            True: the same, and an error for any other mode or rest; False: the trees. Graphs it
            cannot take (step_graphs.why_not: inputs it writes into, random numbers not from the
            device's default generator, outputs that alias) go to the trees, said in the log (a
            warning with True). Dropout replays with a new mask each step.
    """

    kernels: str = DEFAULT_KERNELS
    rest: str = DEFAULT_REST
    dump: str | bool | None = None
    verify: bool = False
    strict: bool = False
    graphs: str = DEFAULT_GRAPHS
    keep_hidden: bool = False
    mode: str | None = None
    step_graphs: str | bool = DEFAULT_STEP_GRAPHS

    def __post_init__(self):
        _check_choice("kernels", self.kernels, KERNELS)
        _check_choice("rest", self.rest, REST)
        _check_choice("graphs", self.graphs, GRAPHS)
        _check_choice("mode", self.mode, MODES)
        for name in ("verify", "strict", "keep_hidden"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"mha options: {name}={getattr(self, name)!r} must be True or False")
        if not (isinstance(self.step_graphs, bool) or self.step_graphs == "auto"):
            raise ValueError(f"mha options: step_graphs={self.step_graphs!r} is not allowed; expected one of "
                             f"{STEP_GRAPHS}")
        if self.step_graphs is True and self.rest != "eager":
            raise ValueError(f"mha options: step_graphs=True replays the step through mha_compile's own CUDA graphs "
                             f"with rest='eager'; rest={self.rest!r} takes its own (Inductor's)")
        if self.dump is not None and self.dump is not False and not isinstance(self.dump, (str, os.PathLike)):
            raise TypeError(f"mha options: dump={self.dump!r} must be a folder path (str or os.PathLike), or False "
                            f"for no dumps")
        if isinstance(self.dump, (str, os.PathLike)) and not os.fspath(self.dump):
            raise ValueError("mha options: dump='' names no folder; give a folder path, or dump=False for no dumps "
                             f"(${DUMP_ENV} too)")

    def own_step_graphs(self, mode):
        """Whether a step captured whole under torch.compile's `mode` replays through
        mha_compile's own step graphs rather than torch's CUDA-graph trees."""
        return self.step_graphs is not False and self.rest == "eager" and mode == "reduce-overhead"

    @classmethod
    def parse(cls, options):
        """Options from the dict given to torch.compile (None: defaults); unknown keys raise."""
        allowed = [f.name for f in dataclasses.fields(cls)]
        if options is not None and not isinstance(options, collections.abc.Mapping):
            raise TypeError(f"mha options: options={options!r} must be a mapping of settings (a dict), e.g. "
                            f"options={{'kernels': 'fused'}}; allowed keys are {allowed}")
        options = dict(options or {})
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"mha options: unknown key(s) {unknown}; allowed keys are {allowed}")
        if options.get("dump") is None and os.environ.get(DUMP_ENV):
            options["dump"] = os.environ[DUMP_ENV]
        if isinstance(options.get("dump"), (str, os.PathLike)):  # "~/dumps" is the home folder's, as a shell's
            options["dump"] = os.path.expanduser(options["dump"])
        return cls(**options)


def env_mib(name, text, default, what, zero=False):
    """Bytes from an environment variable's text in MiB (None: `default` MiB), with a clear error
    naming the variable and the value for anything but a finite number of MiB above 0 (from 0
    with zero=True); `what` says what the size bounds."""
    if text is None:
        return int(default * 2**20)
    try:
        mib = float(text)
    except ValueError:
        mib = float("nan")
    if not ((mib >= 0 if zero else mib > 0) and mib < float("inf")):
        wanted = "a number of MiB from 0" if zero else "a positive number of MiB"
        raise ValueError(f"{name}={text!r}: expected {wanted} ({default} by default), {what}")
    return int(mib * 2**20)


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"mha options: {name}={value!r} is not allowed; expected one of {allowed}")
