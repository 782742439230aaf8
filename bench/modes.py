"""The benchmark's modes: how each one turns a model into the callable that is timed.

Only public entry points: torch.compile with backend="inductor" or backend="mha". A mode whose
backend cannot be built (e.g. mha_compile.backend not landed yet) raises here, and the
harness records the message in that row.
"""
import torch

# Peers are what a user has without us: eager and Inductor, on any spelling.
PEER_MODES = ("eager", "inductor", "inductor-max-autotune")
# mha-fused: the defaults (graphs="auto": the region replays its own CUDA graphs at small and
# medium); mha-fused-nographs: the same kernels issued from Python every call (graphs="off");
# mha-fused-keep: mha-fused-cudagraphs with options keep_hidden=True (the experts' u kept from the
# forward for the backward: less time, more memory); mha-fused-keep-plain: mha-fused with it;
# mha-fused-cudagraphs: mode="reduce-overhead", whose step replays through mha_compile's own step
# graphs (options step_graphs="auto", the default since session 52, mha_compile/step_graphs.py);
# mha-fused-trees: the same through torch's CUDA-graph trees instead (step_graphs=False), the
# default before session 52 (rows named mha-fused-stepgraphs in older results were step_graphs=True,
# beside mha-fused-cudagraphs on the trees).
MHA_MODES = ("mha-reference", "mha-staged", "mha-fused", "mha-fused-nographs", "mha-fused-cudagraphs",
             "mha-fused-keep", "mha-fused-keep-plain", "mha-fused-trees")
MODES = PEER_MODES + MHA_MODES
SPELLINGS = ("dense", "loop", "grouped_mm")
# The grouped-GEMM spelling: every peer, and the backend's two main modes on it (matched since
# session 44, lowering/moe_grouped.py), not its other variants (the table's rows are many already).
GROUPED_MM_MODES = PEER_MODES + ("mha-fused", "mha-fused-cudagraphs", "mha-fused-trees")


def build(mode, model):
    """The callable to time for `mode`; compiled ones compile lazily on their first call."""
    if mode == "eager":
        return model
    if mode == "inductor":
        return torch.compile(model, dynamic=False)
    if mode == "inductor-max-autotune":
        return torch.compile(model, mode="max-autotune", dynamic=False)
    if mode == "mha-fused-cudagraphs":
        # torch.compile refuses mode and options together; kernels "auto" picks fused on CUDA.
        return torch.compile(model, backend="mha", mode="reduce-overhead", dynamic=False)
    if mode in MHA_MODES:
        return torch.compile(model, backend="mha", options=mha_options(mode), dynamic=False)
    raise ValueError(f"mode={mode!r}: expected one of {MODES}")


def mha_options(mode):
    """The backend options a mha-* mode compiles with, as the timed compile gets them (the lowering
    check's explain compiles with these too)."""
    if mode == "mha-fused-cudagraphs":
        # build() passes mode= to torch.compile (what a user writes), which hands it to the backend;
        # explain takes options alone, and a check compiled without the mode checked another compile.
        return {"mode": "reduce-overhead"}
    if mode == "mha-fused-nographs":
        return {"kernels": "fused", "graphs": "off"}
    if mode == "mha-fused-keep":
        return {"mode": "reduce-overhead", "keep_hidden": True}
    if mode == "mha-fused-keep-plain":
        return {"kernels": "fused", "keep_hidden": True}
    if mode == "mha-fused-trees":
        return {"mode": "reduce-overhead", "step_graphs": False}
    return {"kernels": mode.split("-", 1)[1]}


def kernels_named(mode):
    """The kernel set a mha-* mode's name says it times (None for a peer): the backend falls back
    fused -> staged -> reference where a set cannot run (lowering/select.py: on the CPU always,
    on CUDA for some dtypes and shapes), and a row that ran another set is not its mode's. The
    modes with kernels "auto" (cudagraphs, keep, trees) are named for fused, which auto picks on CUDA."""
    if mode == "mha-reference":
        return "reference"
    if mode == "mha-staged":
        return "staged"
    return "fused" if mode.startswith("mha-fused") else None
