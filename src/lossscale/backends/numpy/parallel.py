"""NumPy work in blocks shared among threads, and the blocked max-|x| reduction.

NumPy releases the GIL inside its loops, so a few threads on disjoint blocks
reach more memory bandwidth than one core. They share one queue of blocks,
so a thread the OS preempts holds up nobody.
"""

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from lossscale.backends._common import unwrap

# A worker is worth its dispatch cost only with a few blocks to itself.
MIN_ELEMENTS_PER_WORKER = 1 << 19
# Below this mean block size, extra threads only contend for the GIL.
MIN_MEAN_BLOCK_FOR_THREADS = 1 << 14
MAX_WORKERS = 16
# 512 KiB of float32: still in L2 cache for the second reduction over it.
REDUCE_BLOCK = 1 << 17
# Arrays smaller than this are reduced whole, on the calling thread.
REDUCE_WHOLE_BELOW = 1 << 17


def workers(blocks):
    """How many threads should share `blocks` (`(job, start, stop)` tuples)."""
    total = sum(stop - start for _, start, stop in blocks)
    if total < MIN_MEAN_BLOCK_FOR_THREADS * len(blocks):
        return 1
    return max(1, min(cpu_count(), MAX_WORKERS, total // MIN_ELEMENTS_PER_WORKER))


def share(work, items, count):
    """Runs `work(worker, take)` on `count` threads that share `items`, the first on this thread.

    `take()` returns the next item, or None once all are taken. Returns the
    results by worker, once every call has finished (even if one raised).
    """
    lock = threading.Lock()
    queue = iter(items)

    def take():
        with lock:  # not only the GIL: free-threaded Python has none
            return next(queue, None)

    futures = [executor().submit(work, worker, take) for worker in range(1, count)]
    try:
        first = work(0, take)
    finally:
        # No worker may outlive the call: the blocks belong to the caller.
        wait(futures)
    return [first] + [future.result() for future in futures]


def peak_magnitude(arrays):
    """Largest |x| over `arrays` (float32 0-d array; NaN if any NaN), in one pass.

    Large arrays are cut into blocks still in cache for the second reduction,
    read first to last (`fused` then updates last to first).
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

        def work(worker, take):
            block_highs, block_lows = [], []
            while (block := take()) is not None:
                j, start, stop = block
                piece = flats[j][start:stop]
                block_highs.append(np.maximum.reduce(piece))
                block_lows.append(np.minimum.reduce(piece))
            return block_highs, block_lows

        for h, lo in share(work, blocks, workers(blocks)):
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
    # A forked child inherits the executor but not its threads.
    with _pool_lock:
        if _pool["executor"] is None or _pool["pid"] != os.getpid():
            _pool["executor"] = ThreadPoolExecutor(
                max_workers=min(cpu_count(), MAX_WORKERS), thread_name_prefix="lossscale-numpy"
            )
            _pool["pid"] = os.getpid()
        return _pool["executor"]
