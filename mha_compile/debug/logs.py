"""Our logger in torch's logging: TORCH_LOGS="+mha_compile" and tlparse artifacts.

`TORCH_LOGS="+mha_compile"` works because torch accepts any importable module name there;
`register()` also registers the name as a torch log (so it is listed in TORCH_LOGS="help"
after first use and `torch._logging.set_logs(modules={"mha_compile": logging.DEBUG})` works).
Under TORCH_TRACE, `trace_report` writes each graph's report as structured-trace artifacts
named `mha_compile_report` (JSON) and `mha_compile_report_text`, which tlparse lists under
the graph's compile id. Every torch API here is private: a missing one is skipped, silently
for registration, never failing a compile.
"""
import json
import logging

log = logging.getLogger("mha_compile")
_registered = False


def register():
    """Register "mha_compile" with torch._logging (once; skipped where the API is missing)."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        from torch._logging import _internal
        if not _internal.log_registry.is_log("mha_compile"):
            _internal.register_log("mha_compile", ["mha_compile"])
    except (ImportError, AttributeError, TypeError) as error:
        log.debug("mha_compile: torch._logging has no register_log here (%s); TORCH_LOGS still works by module name",
                  error)


def trace_report(doc, text):
    """Emit the report as structured-trace artifacts (a no-op unless TORCH_TRACE is set)."""
    try:
        from torch._logging import trace_structured
    except ImportError:
        return
    try:
        trace_structured("artifact", metadata_fn=lambda: {"name": "mha_compile_report", "encoding": "json"},
                         payload_fn=lambda: json.dumps(doc, default=str))
        trace_structured("artifact", metadata_fn=lambda: {"name": "mha_compile_report_text", "encoding": "string"},
                         payload_fn=lambda: text)
    except Exception as error:  # tracing is a side channel: it may never fail a compile
        log.debug("mha_compile: structured trace artifact not written (%s)", error)
