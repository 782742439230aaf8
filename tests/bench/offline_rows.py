"""Run the bench's offline tools (they record or compile GPU launches without a GPU), and read a probe's `--offline` rows."""
import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run_offline(script, *args, timeout=900):
    """`python script args` outside the interpreter (the offline tools record or compile GPU
    launches), from the repository root; its CompletedProcess, which must have succeeded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    run = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-2000:]
    return run


def offline_rows(script):
    """The JSON rows `python script --offline` prints."""
    return [json.loads(line) for line in run_offline(script, "--offline").stdout.splitlines() if line.startswith("{")]
