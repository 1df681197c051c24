"""How each Keras backend skips the inner optimizer's step without a host read.

The decision `take` is a backend boolean scalar. Keras's own wrapper
branches on it with `keras.ops.cond`, which is a Python `if` on torch (a
host synchronisation per step). Here:

- TensorFlow: `tf.cond` (inside `fit`'s `tf.function` a graph branch; under
  `tf.distribute` every replica has the same `take`, agreed beforehand);
- JAX: `jax.lax.cond` over values (the stateless step `fit` runs);
- torch: the step runs, and each variable it may write is then selected
  back, in place, where `take` is False (`torch.where`): no host read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def run_stateful(backend: str, take, step: Callable[[], None], variables: Sequence) -> None:
    """Runs `step()` so that its writes to `variables` take effect only where `take` holds.

    Args:
        backend: `"tensorflow"` or `"torch"` (JAX applies through `run_stateless`).
        take: Backend boolean scalar.
        step: Writes some of `variables` in place.
        variables: Every Keras variable `step` may write.
    """
    if backend == "tensorflow":
        import tensorflow as tf

        def applied():
            step()
            return tf.constant(True)

        tf.cond(take, applied, lambda: tf.constant(False))
        return
    if backend != "torch":
        raise ValueError(
            f"`backend` must be 'tensorflow' or 'torch'. Received: backend={backend!r}"
        )
    import torch

    values = [v.value for v in variables]
    with torch.no_grad():
        saved = [x.clone() for x in values]
    step()
    with torch.no_grad():
        for x, old in zip(values, saved):
            torch.where(take, x, old, out=x)


def run_stateless(backend: str, take, applied: Callable[[], tuple], skipped: Callable[[], tuple]):
    """`applied()` where `take` holds, else `skipped()`: two structures of arrays alike.

    Args:
        backend: `"jax"`, `"tensorflow"` or `"torch"`.
        take: Backend boolean scalar.
        applied: Returns the new values (a tuple of lists of arrays).
        skipped: Returns the old values, in the same structure.
    """
    if backend == "jax":
        import jax

        return jax.lax.cond(take, applied, skipped)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.cond(take, applied, skipped)
    if backend != "torch":
        raise ValueError(
            f"`backend` must be 'jax', 'tensorflow' or 'torch'. Received: backend={backend!r}"
        )
    import torch

    new, old = applied(), skipped()
    return tuple(
        [None if a is None else torch.where(take, a, b) for a, b in zip(new_part, old_part)]
        for new_part, old_part in zip(new, old)
    )
