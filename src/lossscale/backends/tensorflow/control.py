"""Branches on device values: undone writes in eager mode, `tf.cond` in a graph.

Eagerly both branches run, each followed by `where(keep, written, before)`
over the variables, so the predicate is never read on the host. In a
`tf.function`, `tf.cond`: variables bound to plain tensors pass their values
in and out of the branches, as with JAX's `lax.cond`.
"""

import tensorflow as tf

from lossscale.backends._common import bound, unwrap
from lossscale.backends.tensorflow import ops


def _plain(pred):
    """The Python bool of a host predicate, or None for a tensor."""
    pred = unwrap(pred)
    if isinstance(pred, tf.Variable):
        return None
    return None if isinstance(pred, tf.Tensor) else bool(pred)


def cond(pred, true_fn, false_fn, variables):
    """Runs `true_fn` where `pred` holds and `false_fn` (None: nothing) where it does not.

    A Python or NumPy `pred` takes a plain `if`; `variables`: every `Variable`
    either branch may write.
    """
    host = _plain(pred)
    if host is not None:
        branch = true_fn if host else false_fn
        if branch is not None:
            branch()
        return
    pred = tf.cast(ops.read(unwrap(pred)), tf.bool)
    variables = list(variables)
    if tf.executing_eagerly():
        _where(pred, true_fn, variables)
        if false_fn is not None:
            _where(tf.logical_not(pred), false_fn, variables)
        return
    _graph_cond(pred, true_fn, false_fn or (lambda: None), variables)


def cond_values(pred, true_fn, false_fn):
    """`true_fn()` where `pred` holds, else `false_fn()`: tuples of tensors alike (no host read)."""
    host = _plain(pred)
    if host is not None:
        return true_fn() if host else false_fn()
    pred = tf.cast(ops.read(unwrap(pred)), tf.bool)
    if not tf.executing_eagerly():
        return tuple(tf.cond(pred, lambda: tuple(true_fn()), lambda: tuple(false_fn())))
    return tuple(tf.where(pred, a, b) for a, b in zip(true_fn(), false_fn()))


def _where(keep, fn, variables):
    """Runs `fn`, then keeps its writes to `variables` only where `keep` holds."""
    saved = [tf.identity(ops.read(v.storage)) for v in variables]
    fn()
    for v, old in zip(variables, saved):
        v.rebind(ops.assign(v.storage, tf.where(keep, ops.read(v.storage), old)))


def _graph_cond(pred, true_fn, false_fn, variables):
    # tf.Variables are written by the branches; tensors pass through them.
    carried = [v for v in variables if not ops.is_variable(v.storage)]
    values = [v.storage for v in carried]

    def branch(fn):
        def run():
            with bound(carried, values):
                fn()
                return [v.storage for v in carried]

        return run

    new = tf.cond(pred, branch(true_fn), branch(false_fn))
    for v, value in zip(carried, new or ()):
        v.rebind(value)
