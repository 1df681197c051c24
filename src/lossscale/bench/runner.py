"""Runs each benchmark job in its own Python subprocess.

Separate processes keep the frameworks from sharing thread pools, allocator
state or a Keras backend (chosen once per process), and let one
implementation crash without taking the others down.
"""

import json
import os
import pathlib
import subprocess
import sys

# The worker prints this before its JSON result, on the last line of stdout.
RESULT_PREFIX = "LOSSSCALE_BENCH_RESULT "


def _environment(extra):
    env = dict(os.environ)
    env.update(extra)
    # The worker must import this same lossscale, installed or not.
    source_root = str(pathlib.Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (source_root, env.get("PYTHONPATH")) if p)
    return env


def run_job(job, env=None, timeout=None):
    """Runs `job` (see `worker`) in a fresh interpreter.

    Returns:
        The worker's result dict, or `{"error": message}` when the worker
        failed, timed out or printed no result.
    """
    command = [sys.executable, "-m", "lossscale.bench.worker", json.dumps(job)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=_environment(env or {}))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"error": f"exit status {proc.returncode}: {tail}"}


def cuda_available(timeout=120):
    """Whether torch is installed and sees a CUDA device (asked in a subprocess)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                          capture_output=True, text=True, timeout=timeout)
    return proc.stdout.strip().endswith("True")
