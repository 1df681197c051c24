"""The memory floor: the bytes a fused step must move over measured bandwidth.

A fused, loss-scaled Adam step reads the gradient (twice: the finite check),
the parameter and two moments, and writes three: 8 x 4 = 32 bytes per
float32 parameter, so `floor_ms = 32 * n / bandwidth`. Bandwidth is measured
as a large array copy on every core (torch's `copy_`, else NumPy copies in
threads; on CUDA a device-to-device `copy_`).
"""

import os
import time

import numpy as np

BYTES_PER_PARAMETER = 8 * 4


def floor_ms(parameters, bandwidth_gb_s):
    """Milliseconds needed to move a fused step's bytes at `bandwidth_gb_s` (GB/s, 1e9)."""
    return BYTES_PER_PARAMETER * parameters / (bandwidth_gb_s * 1e9) * 1e3


def _cpus():
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _best_rate(copy, nbytes, repeats, sync=lambda: None):
    copy()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copy()
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def measure(device="cpu", quick=False):
    """Measures copy bandwidth on `device` (`"cpu"` or `"cuda"`).

    `quick`: a small array and few repeats (for tests). Returns a dict with
    `gb_per_s`, `method` and `bytes` (the size of one array).
    """
    if device == "cuda":
        return _measure_cuda(quick)
    if device != "cpu":
        raise ValueError(f"`device` must be 'cpu' or 'cuda'. Received: device={device!r}")
    try:
        import torch
    except ImportError:
        return _measure_numpy(quick)
    return _measure_torch_cpu(torch, quick)


def _sizes(quick, full):
    return (1 << 20, 3) if quick else (full, 10)


def _measure_torch_cpu(torch, quick):
    n, repeats = _sizes(quick, 1 << 26)  # 256 MiB per array, far beyond any L3
    threads, previous = _cpus(), torch.get_num_threads()
    # Every core for the copy, then the caller's count back.
    torch.set_num_threads(threads)
    try:
        src = torch.empty(n, dtype=torch.float32).uniform_(0.5, 1.5)
        dst = torch.empty_like(src)
        rate = _best_rate(lambda: dst.copy_(src), 4 * n, repeats)
    finally:
        torch.set_num_threads(previous)
    return {"gb_per_s": rate, "method": f"torch copy_, {threads} threads", "bytes": 4 * n}


def _measure_numpy(quick):
    from concurrent.futures import ThreadPoolExecutor

    n, repeats = _sizes(quick, 1 << 26)
    threads = _cpus()
    src = np.random.default_rng(0).random(n, dtype=np.float32) + np.float32(0.5)
    dst = np.empty_like(src)
    bounds = np.linspace(0, n, threads + 1).astype(int)
    pieces = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    with ThreadPoolExecutor(threads) as pool:

        def copy():
            list(pool.map(lambda s: np.copyto(dst[s], src[s]), pieces))

        rate = _best_rate(copy, 4 * n, repeats)
    return {"gb_per_s": rate, "method": f"numpy copyto, {threads} threads", "bytes": 4 * n}


def _measure_cuda(quick):
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("The CUDA bandwidth floor needs a CUDA device, and torch sees none.")
    n, repeats = _sizes(quick, 1 << 28)  # 1 GiB per array
    src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_(0.5, 1.5)
    dst = torch.empty_like(src)
    rate = _best_rate(lambda: dst.copy_(src), 4 * n, repeats, torch.cuda.synchronize)
    return {
        "gb_per_s": rate,
        "bytes": 4 * n,
        "method": f"torch copy_ on {torch.cuda.get_device_name()}",
    }
