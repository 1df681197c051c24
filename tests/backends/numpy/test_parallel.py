"""Blocks shared among threads: the shared queue, the worker count, the pool.

`peak_magnitude` is tested through the backend's `max_abs` in
`tests/backends/numpy/test_ops.py`; the kernels that run on these helpers in
`tests/backends/numpy/test_fused.py` (with small blocks and several workers forced).
"""

import threading
import time

import pytest

from lossscale.backends.numpy import parallel as numpy_parallel


def test_workers_follow_size_and_cpus(monkeypatch):
    monkeypatch.setattr(numpy_parallel, "cpu_count", lambda: 8)
    big = [(0, i, i + (1 << 17)) for i in range(0, 1 << 22, 1 << 17)]  # 32 blocks, 4M elements
    assert numpy_parallel.workers(big) == 8
    assert numpy_parallel.workers(big[:8]) == 2  # 1M elements: two workers' worth
    assert numpy_parallel.workers([(0, 0, 100)] * 400) == 1  # small blocks: one thread
    monkeypatch.setattr(numpy_parallel, "cpu_count", lambda: 1)
    assert numpy_parallel.workers(big) == 1


def _taking(log, delay=0.0):
    def work(worker, take):
        mine = []
        while (item := take()) is not None:
            mine.append(item)
            log.append((worker, threading.get_ident(), item))
            time.sleep(delay)
        return mine

    return work


def test_share_gives_every_item_once_in_order_first_worker_on_the_caller():
    log = []
    results = numpy_parallel.share(_taking(log, delay=0.001), list("abcdefgh"), 3)
    assert len(results) == 3
    assert sorted(i for r in results for i in r) == list("abcdefgh")
    # Taken in the order given (each worker's own items too), none twice.
    assert [item for _, _, item in log] == list("abcdefgh")
    assert all(r == sorted(r) for r in results)
    idents = {worker: ident for worker, ident, _ in log}
    assert idents.get(0, threading.get_ident()) == threading.get_ident()  # the caller
    assert len(set(idents.values())) == len(idents)  # one thread per worker


def test_share_lets_free_workers_take_a_stalled_workers_share():
    # Worker 0 (the caller) stalls after its first item, as if preempted:
    # the other takes everything else.
    started, drained = threading.Event(), threading.Event()

    def work(worker, take):
        if worker == 0:
            mine = [take()]
            started.set()
            assert drained.wait(30)
            assert take() is None
            return mine
        assert started.wait(30)
        mine = list(iter(take, None))
        drained.set()
        return mine

    assert numpy_parallel.share(work, range(40), 2) == [[0], list(range(1, 40))]


def test_share_with_one_worker_runs_on_the_caller_only():
    log = []
    assert numpy_parallel.share(_taking(log), [1, 2, 3], 1) == [[1, 2, 3]]
    assert {ident for _, ident, _ in log} == {threading.get_ident()}
    assert numpy_parallel.share(_taking(log), [], 2) == [[], []]


def test_share_waits_for_every_worker_before_raising():
    finished = []

    def work(worker, take):
        if worker == 0:
            raise RuntimeError("worker 0 failed")
        time.sleep(0.02)
        while take() is not None:
            pass
        finished.append(worker)

    with pytest.raises(RuntimeError, match="worker 0 failed"):
        numpy_parallel.share(work, range(5), 3)
    assert sorted(finished) == [1, 2]


def test_executor_is_recreated_after_fork(monkeypatch):
    first = numpy_parallel.executor()
    assert numpy_parallel.executor() is first
    monkeypatch.setitem(numpy_parallel._pool, "pid", -1)
    assert numpy_parallel.executor() is not first
