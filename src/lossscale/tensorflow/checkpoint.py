"""`trackable(optimizer)`: an optimizer's variables for `tf.train.Checkpoint`."""

import tensorflow as tf


class OptimizerVariables(tf.Module):
    """The `tf.Variable`s of a built lossscale optimizer on TensorFlow, by path.

    `tf.train.Checkpoint` tracks them under their paths
    (`"loss_scale_optimizer/dynamic_scale"`, `"adam/w0_momentum"`, ...), so a
    checkpoint restores into an optimizer of the same structure built for
    the same model, and TensorFlow's `assert_consumed()` reports anything
    that did not match.

    Args:
        optimizer: A built `lossscale.optimizers.Optimizer` whose variables
            live on TensorFlow.

    Examples:
        >>> import tensorflow as tf, lossscale as ls, lossscale.tensorflow
        >>> w = tf.Variable([1.0, 2.0])
        >>> opt = ls.LossScaleOptimizer(ls.optimizers.Adam())
        >>> opt.build([w])
        >>> checkpoint = tf.train.Checkpoint(w=w, optimizer=ls.tensorflow.trackable(opt))
        >>> sorted(checkpoint.optimizer.by_path)[:2]
        ['adam/iteration', 'adam/learning_rate']
    """

    def __init__(self, optimizer):
        super().__init__(name=None)
        self.by_path = {v.path: v.storage for v in optimizer.variables}


def trackable(optimizer):
    """Returns `optimizer`'s variables as an object `tf.train.Checkpoint` tracks.

    Args:
        optimizer: A built `lossscale.optimizers.Optimizer` on TensorFlow.

    Returns:
        An `OptimizerVariables` (a `tf.Module`): pass it to
        `tf.train.Checkpoint` next to the model, e.g.
        `tf.train.Checkpoint(model=model, optimizer=trackable(opt))`.
    """
    from lossscale.optimizers.base import Optimizer

    if not isinstance(optimizer, Optimizer):
        raise ValueError(
            "`optimizer` must be a lossscale.optimizers.Optimizer. "
            f"Received: optimizer={optimizer!r}"
        )
    if not optimizer.built:
        raise ValueError(
            "`optimizer` must be built, so that all of its variables exist: call "
            "`optimizer.build(model.trainable_variables)` before making the checkpoint."
        )
    other = sorted({v.backend for v in optimizer.variables} - {"tensorflow"})
    if other:
        raise ValueError(
            "`optimizer` must be built for TensorFlow variables to be saved by "
            f"tf.train.Checkpoint. Received: an optimizer on {other[0]!r}"
        )
    return OptimizerVariables(optimizer)
