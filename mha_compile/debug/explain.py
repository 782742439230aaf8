"""`mha_compile.explain(model_or_fn, *args, **kwargs)`: what the backend would do, without training."""
import torch

from mha_compile import backend
from mha_compile.debug.report import ExplainReport


def explain(model_or_fn, *args, options=None, **kwargs):
    """Compile with backend="mha", run once under no_grad, and return an ExplainReport."""
    reports = []

    def observe(report, gm, lowered):
        reports.append(report)

    def mha(gm, example_inputs):
        return backend.mha_backend(gm, example_inputs, options=options)

    backend.observers.append(observe)
    try:
        compiled = torch.compile(model_or_fn, backend=mha)
        with torch.no_grad():
            compiled(*args, **kwargs)
    finally:
        backend.observers.remove(observe)
    return ExplainReport(reports)
