"""The step benchmark behind `lossscale bench` (see `benchmarks/README.md`).

`main(argv)` runs it. The harness times one optimizer step of every
registered implementation (ours on NumPy, torch and JAX; GradScaler, Keras 3
and optax/jmp peers) in its own subprocess and compares each with the memory
floor measured in the same run. Importing this package imports neither
torch nor jax; only the worker subprocesses do.
"""

from lossscale.bench.cli import main

__all__ = ["main"]
