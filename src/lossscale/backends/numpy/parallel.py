"""NumPy work in blocks shared among threads, and the blocked max-|x| reduction.

NumPy releases the GIL inside its loops, so a few threads working on
disjoint blocks of the same arrays reach more of the memory bandwidth than
one core can. `fused` cuts its update kernels into blocks and runs
them here; `peak_magnitude` (the backend's `max_abs`) reduces in blocks the
same way.
"""

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from lossscale.backends._common import unwrap

# A worker is worth its dispatch cost only with a few blocks to itself.
MIN_ELEMENTS_PER_WORKER = 1 << 19
# Below this mean block size, Python overhead per block dominates and extra
# threads only contend for the GIL (400 small tensors run no faster on two).
MIN_MEAN_BLOCK_FOR_THREADS = 1 << 14
# Memory bandwidth saturates long before this many cores on any machine.
MAX_WORKERS = 16
# Elements per block of a reduction. Reductions make no temporaries, so
# blocks can be large (fewer Python calls, less GIL traffic); 4 MiB of
# float32 is still in L3 for the second reduction over the same block.
REDUCE_BLOCK = 1 << 20
# Arrays smaller than this are reduced whole, on the calling thread.
REDUCE_WHOLE_BELOW = 1 << 17


def partition(blocks, workers):
    """Cuts `blocks` into `workers` consecutive runs of about equal element counts.

    Args:
        blocks: `(job, start, stop)` tuples.
        workers: The number of runs wanted.

    Returns:
        A list of at most `workers` lists of blocks, in order. A cut goes
        before the block whose midpoint crosses the ideal boundary, so every
        run is within one block of its share.
    """
    total = sum(stop - start for _, start, stop in blocks)
    parts, current, done = [], [], 0
    for block in blocks:
        size = block[2] - block[1]
        if (
            current
            and len(parts) < workers - 1
            and (done + size / 2) * workers > total * (len(parts) + 1)
        ):
            parts.append(current)
            current = []
        current.append(block)
        done += size
    parts.append(current)
    return parts


def workers(blocks):
    """How many threads should share `blocks` (`(job, start, stop)` tuples)."""
    total = sum(stop - start for _, start, stop in blocks)
    if total < MIN_MEAN_BLOCK_FOR_THREADS * len(blocks):
        return 1
    return max(1, min(cpu_count(), MAX_WORKERS, total // MIN_ELEMENTS_PER_WORKER))


def run_parts(work, parts):
    """Calls `work(i)` for every index of `parts`, the first on this thread.

    Returns:
        The results, in the order of `parts`. Every call has finished when it
        returns, even if one raised (the first exception then propagates).
    """
    futures = [executor().submit(work, i) for i in range(1, len(parts))]
    try:
        first = work(0)
    finally:
        # No worker may outlive the call: the blocks belong to the caller.
        wait(futures)
    return [first] + [future.result() for future in futures]


def peak_magnitude(arrays):
    """Largest |x| over `arrays` (float32 0-d array; NaN if any NaN), in one pass.

    `max()` then `min()` of a whole large array read it from memory twice;
    here it is cut into blocks that are still in cache for the second
    reduction, shared among threads. Small arrays are reduced whole,
    combined once at the end.
    """
    highs, lows, flats = [], [], []
    for a in arrays:
        a = np.asarray(unwrap(a))
        if a.size >= REDUCE_WHOLE_BELOW and a.flags.c_contiguous:
            flats.append(a.reshape(-1))
        elif a.size:
            highs.append(a.max())
            lows.append(a.min())
    blocks = [
        (j, start, min(start + REDUCE_BLOCK, f.size))
        for j, f in enumerate(flats)
        for start in range(0, f.size, REDUCE_BLOCK)
    ]
    if blocks:
        parts = partition(blocks, workers(blocks))

        def work(i):
            pieces = [flats[j][start:stop] for j, start, stop in parts[i]]
            return [p.max() for p in pieces], [p.min() for p in pieces]

        for h, lo in run_parts(work, parts):
            highs += h
            lows += lo
    if not highs:
        return np.asarray(np.float32(0.0))
    # np.max / np.min propagate NaN, and so does np.maximum.
    peak = np.maximum(np.max(np.array(highs)), -np.min(np.array(lows)))
    return np.asarray(np.maximum(peak.astype(np.float32), np.float32(0.0)))


def cpu_count():
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_pool_lock = threading.Lock()
_pool = {"executor": None, "pid": None}


def executor():
    """The process's shared thread pool, created on first use."""
    # A forked child inherits the executor object but not its threads, so a
    # pool is only reused in the process that created it.
    with _pool_lock:
        if _pool["executor"] is None or _pool["pid"] != os.getpid():
            _pool["executor"] = ThreadPoolExecutor(
                max_workers=min(cpu_count(), MAX_WORKERS), thread_name_prefix="lossscale-numpy"
            )
            _pool["pid"] = os.getpid()
        return _pool["executor"]
