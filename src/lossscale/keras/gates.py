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


def run_stateful(backend: str, take, step: Callable, grads: list, variables: Sequence) -> None:
    """Runs `step(grads)` so that its writes to `variables` take effect only where `take` holds.

    Args:
        backend: `"tensorflow"` or `"torch"` (JAX applies through `run_stateless`).
        take: Backend boolean scalar, the same on every replica.
        step: `step(grads)` writes some of `variables` in place.
        grads: The (unscaled) gradients for `step`.
        variables: Every Keras variable `step` may write.
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

    A strategy that synchronises through `merge_call` (MirroredStrategy on
    CPUs) cannot have one inside a replica-context `tf.cond`, and the inner
    optimizer's update has one: the branch is then taken in cross-replica
    context, on the first replica's `take` (they all agree), and the update
    runs for each replica, as Keras's wrapper does.
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

    # Keras's torch optimizers update the values given to `stateless_apply`
    # in place: the old ones are copied first.
    old = tuple([None if x is None else x.clone() for x in part] for part in skipped())
    new = applied()
    return tuple(
        [None if a is None else torch.where(take, a, b) for a, b in zip(new_part, old_part)]
        for new_part, old_part in zip(new, old)
    )
