"""Graph dumps: MHA_COMPILE_DUMP=folder or options={"dump": folder}.

Each process writes into its own run folder (folder/run-<time>-<pid>), one subfolder per
compiled graph in compile order, so runs never overwrite each other. A dump that cannot be
written is reported once and never fails the user's compile.
"""
import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("mha_compile")
_run_folders = {}
_warned = set()


def run_folder(folder):
    """This process's run folder under `folder` (created on first use)."""
    key = os.path.abspath(folder)
    if key not in _run_folders:
        path = Path(folder) / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        path.mkdir(parents=True, exist_ok=False)
        _run_folders[key] = path
    return _run_folders[key]


def write_dump(folder, report, captured, lowered):
    """Write the graph before/after, and the report as text and JSON. Returns the graph folder."""
    try:
        out = run_folder(folder) / f"graph_{report.index:03d}"
        out.mkdir()
        (out / "captured.py").write_text(captured.code)
        (out / "rewritten.py").write_text(lowered.code)
        (out / "report.txt").write_text(str(report) + "\n")
        (out / "report.json").write_text(json.dumps(report.to_json(), indent=2, default=str))
        return out
    except OSError as error:
        if folder not in _warned:
            _warned.add(folder)
            log.warning("mha_compile: cannot write graph dumps to %r (%s); compiling without dumps", folder, error)
        return None
