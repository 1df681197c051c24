"""The step benchmark behind `lossscale bench` (see `benchmarks/README.md`).

`main(argv)` times one optimizer step of every registered implementation in
its own subprocess against the memory floor measured in the same run.
Importing this package imports neither torch nor jax.
"""

from lossscale.bench.cli import main

__all__ = ["main"]
