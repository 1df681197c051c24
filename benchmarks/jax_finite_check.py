"""The JAX finite check alone, jitted: an older `multi.py` against this checkout's.

Usage: `python benchmarks/jax_finite_check.py OLD_COMMIT [ROUNDS]`. Rows:
`old` (OLD_COMMIT's `finite_unscaled(arrays, scale)`), `division` and
`reciprocal` (this checkout's, `reciprocal=False` / `True`), on the `tiny`,
`many_small` and `large` workloads' gradients at the default scale 2^15.
The rows alternate in each round (A B C, then C B A); every round's median
is printed.
"""

import subprocess
import sys
import time
import types

import jax
import numpy as np

from lossscale.backends.jax import multi
from lossscale.bench import workloads

STEPS = {"tiny": 2000, "many_small": 200, "large": 20}


def _old_module(commit):
    source = subprocess.run(
        ["git", "show", f"{commit}:src/lossscale/backends/jax/multi.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    module = types.ModuleType("old_multi")
    exec(compile(source, f"{commit}:multi.py", "exec"), module.__dict__)  # noqa: S102
    return module


def _median_ms(check, grads, scale, steps):
    for _ in range(steps // 10 + 1):
        check(grads, scale).block_until_ready()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        check(grads, scale).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main(commit, rounds):
    old = _old_module(commit)
    checks = {
        "old": jax.jit(old.finite_unscaled),
        "division": jax.jit(lambda a, s: multi.finite_unscaled(a, s, reciprocal=False)),
        "reciprocal": jax.jit(lambda a, s: multi.finite_unscaled(a, s, reciprocal=True)),
    }
    scale = jax.numpy.float32(workloads.LOSS_SCALE)
    for name, steps in STEPS.items():
        grads = [jax.numpy.asarray(g) for g in workloads.arrays(workloads.get(name))[1]]
        assert all(bool(c(grads, scale)) for c in checks.values())
        rows = {k: [] for k in checks}
        for r in range(rounds):
            for k in list(checks) if r % 2 == 0 else list(checks)[::-1]:
                rows[k].append(_median_ms(checks[k], grads, scale, steps))
        for k, ms in rows.items():
            rounds_text = " / ".join(f"{m:.4f}" for m in ms)
            print(f"{name:10s} {k:10s} median {np.median(ms):.4f} ms  rounds {rounds_text}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4)
