"""Agreement across the replicas of a `tf.distribute` strategy.

Inside `strategy.run` the replicas' flags are all-reduced (one scalar, no
`merge_call`), so every replica takes the same skip decision and writes the
same values. `tf.distribute` reduces by sum or mean only: `all_true` sums
"not finite" flags, `all_max` gathers the values.
"""

import tensorflow as tf

from lossscale.backends.tensorflow import ops


def _replica_context(group):
    if group is not None:
        raise ValueError(
            "`process_group` applies to torch.distributed only; on TensorFlow the replicas "
            "of the current tf.distribute strategy agree on every skip. Received: "
            f"process_group={group!r}"
        )
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context


def all_true(flag, group=None):
    """Whether boolean scalar `flag` holds on every replica in sync."""
    flag = ops._tensor(flag)
    context = _replica_context(group)
    if context is None:
        return flag
    failed = context.all_reduce(
        tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(flag), tf.float32)
    )
    return tf.equal(failed, 0.0)


def several_participants(group=None):
    """Whether several replicas of a `tf.distribute` strategy run in sync here."""
    return _replica_context(group) is not None


def all_max(x, group=None):
    """The maximum of scalar `x` over the replicas in sync (NaN if any is NaN)."""
    x = ops._tensor(x)
    context = _replica_context(group)
    if context is None:
        return x
    gathered = context.all_gather(tf.reshape(tf.cast(x, tf.float32), [1]), axis=0)
    nan = tf.reduce_any(tf.math.is_nan(gathered))
    peak = tf.where(nan, tf.constant(float("nan")), tf.reduce_max(gathered))
    return tf.cast(peak, x.dtype)
