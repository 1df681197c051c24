"""Runs each benchmark job in its own Python subprocess.

Separate processes share no thread pools, allocator state or Keras backend,
and a crash takes no other down. On Linux the runner also measures how busy
other processes kept the CPUs meanwhile, so a report can flag disturbed rows.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

# The worker prints this before its JSON result, on the last line of stdout.
RESULT_PREFIX = "LOSSSCALE_BENCH_RESULT "
# A job during which other processes kept more cores busy counts as disturbed.
DISTURBED_CORES = 0.1
# `wait_for_idle` waits for the CPUs to be at most this busy over IDLE_WINDOW
# seconds, and gives up after IDLE_LIMIT seconds.
IDLE_BUSY_FRACTION = 0.1
IDLE_WINDOW = 3.0
IDLE_LIMIT = 600.0


def _environment(extra):
    env = dict(os.environ)
    env.update(extra)
    # The worker must import this same lossscale, installed or not.
    source_root = str(pathlib.Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    return env


def run_job(job, env=None, timeout=None):
    """Runs `job` (see `worker`) in a fresh interpreter: its result, or `{"error": message}`."""
    command = [sys.executable, "-m", "lossscale.bench.worker", json.dumps(job)]
    before = _cpu_seconds()
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=_environment(env or {})
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    others = _others_cores(before, _cpu_seconds())
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
            if others is not None:
                result["others_cores"] = others
            return result
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"error": f"exit status {proc.returncode}: {tail}"}


def _cpu_seconds():
    """`(wall, busy CPU seconds of the machine, CPU seconds of our children)`, or None."""
    try:
        import resource

        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (ImportError, OSError, ValueError):
        return None
    # user, nice, system, irq, softirq, steal (guest time is inside user).
    busy = sum(ticks[i] for i in (0, 1, 2, 5, 6, 7)) / os.sysconf("SC_CLK_TCK")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic(), busy, usage.ru_utime + usage.ru_stime


def _others_cores(before, after):
    """Mean number of cores that processes other than the job kept busy meanwhile."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    busy, own = after[1] - before[1], after[2] - before[2]
    return round(max(0.0, busy - own) / (after[0] - before[0]), 2)


def wait_for_idle():
    """Waits until the CPUs were <= IDLE_BUSY_FRACTION busy over IDLE_WINDOW seconds; whether so."""
    cpus = os.cpu_count() or 1
    deadline = time.monotonic() + IDLE_LIMIT
    while time.monotonic() < deadline:
        before = _cpu_seconds()
        if before is None:
            return False
        time.sleep(IDLE_WINDOW)
        after = _cpu_seconds()
        if (after[1] - before[1]) / (after[0] - before[0]) <= IDLE_BUSY_FRACTION * cpus:
            return True
    return False


def run_job_retrying(job, env=None, timeout=None, retries=0):
    """`run_job`, rerun up to `retries` times while other processes disturb it.

    With `retries > 0` each attempt first waits for idle CPUs. Returns the
    least disturbed result (or the first error).
    """
    best = None
    for _ in range(retries + 1):
        if retries:
            wait_for_idle()
        result = run_job(job, env=env, timeout=timeout)
        if "error" in result or "others_cores" not in result:
            return result
        if best is None or result["others_cores"] < best["others_cores"]:
            best = result
        if result["others_cores"] <= DISTURBED_CORES:
            break
    return best


def cuda_available(timeout=120):
    """Whether torch is installed and sees a CUDA device (asked in a subprocess)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False
    proc = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.stdout.strip().endswith("True")
