"""mha-compile: a torch.compile backend for the multi-horizon attention + top-k MoE region.

    torch.compile(model, backend="mha", options={"kernels": "auto", "rest": "eager"})
    mha_compile.explain(model, *example_inputs)  # what matched, what nearly did, and why

Importing this package does no work: the op registers when the backend first runs.
"""
from mha_compile.options import Options


def explain(model_or_fn, *args, **kwargs):
    from mha_compile.debug.explain import explain as _explain
    return _explain(model_or_fn, *args, **kwargs)


def __getattr__(name):
    if name == "models":
        import importlib
        return importlib.import_module("mha_compile.models")
    raise AttributeError(f"module 'mha_compile' has no attribute {name!r}")


__all__ = ["Options", "explain", "models"]
