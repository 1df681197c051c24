"""`lossscale.keras.LossScaleLogger` in this process (Keras on torch).

The loss scale (and with telemetry the skipped steps) in `fit`'s logs, per
epoch and per batch, equal to the optimizer's summary; before any step the
initial scale; fail-fast out of `fit` at the failing batch; refusals. The
same callback in `fit` on every Keras backend: test_fit.py.
"""

import os

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import lossscale as ls  # noqa: E402
import lossscale.keras as lsk  # noqa: E402


def _model(seed=0, **settings):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = lsk.LossScaleOptimizer(keras.optimizers.SGD(0.01), 2.0**8, 2, **settings)
    model.compile(optimizer, loss="mse")
    return model, optimizer


def _data(bad_batches=(), batch_size=4, batches=6):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((batch_size * batches, 3)).astype("float32")
    y = rng.standard_normal((batch_size * batches, 2)).astype("float32")
    for b in bad_batches:
        x[b * batch_size] = np.inf  # the loss, and so the gradients, overflow
    return x, y


class _Scales(keras.callbacks.Callback):
    """The optimizer's summary after each batch, and the logs each batch got."""

    def __init__(self):
        super().__init__()
        self.summaries, self.logs = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.summaries.append(self.model.optimizer.summary())
        self.logs.append(dict(logs))


@pytest.mark.parametrize("every_batch", [False, True])
def test_the_logs_hold_the_optimizer_s_values(every_batch):
    model, optimizer = _model(telemetry=True)
    seen = _Scales()
    x, y = _data(bad_batches=(1, 4))
    history = model.fit(
        x,
        y,
        batch_size=4,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[lsk.LossScaleLogger(every_batch=every_batch), seen],
    )
    per_epoch = [seen.summaries[5], seen.summaries[11]]
    assert history.history["loss_scale"] == [s["dynamic_scale"] for s in per_epoch]
    assert history.history["skipped_steps"] == [s["skipped_steps"] for s in per_epoch] == [2, 4]
    for logs, summary in zip(seen.logs, seen.summaries):
        if every_batch:
            assert logs["loss_scale"] == summary["dynamic_scale"]
            assert logs["skipped_steps"] == summary["skipped_steps"]
        else:
            assert "loss_scale" not in logs and "skipped_steps" not in logs


def test_without_telemetry_only_the_scale_is_logged():
    model, _ = _model()
    x, y = _data()
    history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[lsk.LossScaleLogger()])
    # Six finite steps, growth every 2: 2**8 -> 2**11.
    assert history.history["loss_scale"] == [2.0**11] and "skipped_steps" not in history.history


def test_before_any_step_the_initial_scale_is_logged():
    model, optimizer = _model()
    logger = lsk.LossScaleLogger()
    logger.set_model(model)
    logs = {"loss": 1.0}
    logger.on_epoch_end(0, logs)
    assert not optimizer.built and logs == {"loss": 1.0, "loss_scale": 256.0}
    logger.on_epoch_end(0, None)  # nothing to write into: nothing happens
    logger.on_train_batch_end(0, None)


def test_a_fail_fast_limit_ends_fit_at_the_failing_batch():
    model, optimizer = _model(max_consecutive_skips=1)
    seen = _Scales()
    x, y = _data(bad_batches=(2, 3))
    with pytest.raises(ls.LossScaleError, match="Loss scaling failed at step 3"):
        model.fit(
            x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[lsk.LossScaleLogger(), seen]
        )
    assert len(seen.summaries) == 3  # the batch that crossed the limit raised
    # A compiled step cannot raise by itself: the callback's check does,
    # after every batch, for as long as the error stays recorded.
    logger = lsk.LossScaleLogger()
    logger.set_model(model)
    with pytest.raises(ls.LossScaleError, match="Loss scaling failed at step 3"):
        logger.on_train_batch_end(4, {})


def test_every_batch_must_be_a_boolean():
    with pytest.raises(ValueError, match=r"`every_batch` must be a boolean"):
        lsk.LossScaleLogger(every_batch=1)


def test_logger_needs_our_optimizer():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(), loss="mse")
    with pytest.raises(ValueError, match="compiled with lossscale.keras.LossScaleOptimizer"):
        model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0, callbacks=[lsk.LossScaleLogger()])


def test_docstring_example():
    import doctest

    import lossscale.keras.callback

    result = doctest.testmod(lossscale.keras.callback, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
