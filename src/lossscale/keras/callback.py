"""`LossScaleLogger`: the loss scale in `fit`'s logs, and fail-fast out of `fit`."""

from __future__ import annotations

import keras

from lossscale import validation


class LossScaleLogger(keras.callbacks.Callback):
    """Adds `loss_scale` (and with telemetry `skipped_steps`) to `fit`'s logs.

    The values join each epoch's logs (one host read per epoch), and with
    `every_batch=True` each batch's. When the optimizer has `min_scale` or
    `max_consecutive_skips` set, `optimizer.check()` runs after every batch,
    so `LossScaleError` ends `fit` at the failing step. Place it before other
    callbacks that read the logs.

    Args:
        every_batch: Boolean. Whether to add the values to every batch's logs.
            Defaults to False.

    Examples:
        >>> import keras, numpy as np, lossscale.keras as lsk
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> model.compile(lsk.LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
        >>> history = model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0,
        ...                     callbacks=[lsk.LossScaleLogger()])
        >>> history.history["loss_scale"]
        [32768.0]
    """

    def __init__(self, every_batch: bool = False) -> None:
        super().__init__()
        self.every_batch = validation.check_bool("every_batch", every_batch)

    def _optimizer(self):
        from lossscale.keras.optimizer import LossScaleOptimizer

        optimizer = self.model.optimizer
        if not isinstance(optimizer, LossScaleOptimizer):
            raise ValueError(
                "LossScaleLogger needs a model compiled with lossscale.keras.LossScaleOptimizer. "
                f"Received: model.optimizer={optimizer!r}"
            )
        return optimizer

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self._optimizer()
        if optimizer.policy.fails_fast:
            optimizer.check()
        if self.every_batch and logs is not None:
            logs.update(_values(optimizer))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(_values(self._optimizer()))


def _values(optimizer):
    if not optimizer.built:  # no step taken yet
        return {"loss_scale": float(optimizer.initial_scale)}
    summary = optimizer.summary()
    values = {"loss_scale": summary["dynamic_scale"]}
    if "skipped_steps" in summary:
        values["skipped_steps"] = summary["skipped_steps"]
    return values
