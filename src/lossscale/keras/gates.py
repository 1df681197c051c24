"""How each Keras backend skips the inner optimizer's step without a host read.

Keras's own `keras.ops.cond` is a Python `if` on torch. Here TensorFlow
takes `tf.cond`, JAX `jax.lax.cond` over values, and torch runs the step and
selects each variable back in place where `take` is False.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def run_stateful(backend: str, take, step: Callable, grads: list, variables: Sequence) -> None:
    """Runs `step(grads)` so that its writes to `variables` take effect only where `take` holds.

    `backend`: `"tensorflow"` or `"torch"` (JAX applies through `run_stateless`);
    `take`: a backend boolean scalar, the same on every replica; `variables`:
    every Keras variable `step` may write.
    """
    if backend == "tensorflow":
        _tf_run(take, step, grads)
        return
    if backend != "torch":
        raise ValueError(
            f"`backend` must be 'tensorflow' or 'torch'. Received: backend={backend!r}"
        )
    import torch

    values = [v.value for v in variables]
    with torch.no_grad():
        saved = [x.clone() for x in values]
    step(grads)
    with torch.no_grad():
        for x, old in zip(values, saved):
            torch.where(take, x, old, out=x)


def _tf_run(take, step, grads):
    """`tf.cond` around `step(grads)`, in cross-replica context where the strategy needs it.

    A `merge_call` (the inner update's) cannot sit inside a replica-context
    `tf.cond`: the branch is then taken on the first replica's `take`.
    """
    import tensorflow as tf

    def cond(pred, fn):
        def applied():
            fn()
            return tf.constant(True)

        tf.cond(pred, applied, lambda: tf.constant(False))

    if not tf.distribute.has_strategy() or (
        tf.__internal__.distribute.strategy_supports_no_merge_call()
    ):
        cond(take, lambda: step(grads))
        return

    def cross_replica(distribution, take, grads):
        first = distribution.experimental_local_results(take)[0]
        cond(first, lambda: distribution.extended.call_for_each_replica(step, args=(grads,)))

    tf.distribute.get_replica_context().merge_call(cross_replica, args=(take, grads))


def run_stateless(backend: str, take, applied: Callable[[], tuple], skipped: Callable[[], tuple]):
    """`applied()` where `take` holds, else `skipped()`: two structures of arrays alike."""
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

    # Keras's torch optimizers update `stateless_apply`'s values in place.
    old = tuple([None if x is None else x.clone() for x in part] for part in skipped())
    new = applied()
    return tuple(
        [None if a is None else torch.where(take, a, b) for a, b in zip(new_part, old_part)]
        for new_part, old_part in zip(new, old)
    )
