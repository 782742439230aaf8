"""Run a bench probe's `--offline` mode (compile for the H200 without a GPU) and read its rows."""
import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def offline_rows(script):
    """The JSON rows `python script --offline` prints, outside the interpreter (it compiles)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    run = subprocess.run([sys.executable, script, "--offline"], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
