"""Blocks shared among threads: partitioning, the worker count, the pool.

`peak_magnitude` is tested through the backend's `max_abs` in
`test_numpy_ops.py`; the kernels that run on these helpers in
`test_numpy_fused.py` (with small blocks and several workers forced).
"""

import threading

import pytest

from lossscale.backends.numpy import parallel as numpy_parallel


def test_partition_balances_blocks():
    blocks = [(0, 0, 10), (1, 0, 64), (1, 64, 128), ((2, 3), 0, 40), (4, 0, 64), (5, 0, 6)]
    parts = numpy_parallel.partition(blocks, 3)
    assert len(parts) == 3 and [b for p in parts for b in p] == blocks
    sizes = [sum(stop - start for _, start, stop in p) for p in parts]
    assert max(sizes) - min(sizes) <= 64


def test_partition_never_makes_empty_runs():
    assert numpy_parallel.partition([(0, 0, 100)], 4) == [[(0, 0, 100)]]
    assert numpy_parallel.partition([], 2) == [[]]


def test_workers_follow_size_and_cpus(monkeypatch):
    monkeypatch.setattr(numpy_parallel, "cpu_count", lambda: 8)
    big = [(0, i, i + (1 << 17)) for i in range(0, 1 << 22, 1 << 17)]  # 32 blocks, 4M elements
    assert numpy_parallel.workers(big) == 8
    assert numpy_parallel.workers(big[:8]) == 2  # 1M elements: two workers' worth
    assert numpy_parallel.workers([(0, 0, 100)] * 400) == 1  # small blocks: one thread
    monkeypatch.setattr(numpy_parallel, "cpu_count", lambda: 1)
    assert numpy_parallel.workers(big) == 1


def test_run_parts_runs_each_part_once_first_on_the_caller():
    threads = {}

    def work(i):
        threads[i] = threading.get_ident()
        return i * 10

    assert numpy_parallel.run_parts(work, ["a", "b", "c"]) == [0, 10, 20]
    assert threads[0] == threading.get_ident() and set(threads) == {0, 1, 2}


def test_run_parts_waits_for_every_part_before_raising():
    finished = []

    def work(i):
        if i == 0:
            raise RuntimeError("part 0 failed")
        finished.append(i)

    with pytest.raises(RuntimeError, match="part 0 failed"):
        numpy_parallel.run_parts(work, [0, 1, 2])
    assert sorted(finished) == [1, 2]


def test_executor_is_recreated_after_fork(monkeypatch):
    first = numpy_parallel.executor()
    assert numpy_parallel.executor() is first
    monkeypatch.setitem(numpy_parallel._pool, "pid", -1)
    assert numpy_parallel.executor() is not first
