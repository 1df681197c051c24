"""What Keras users plug in: loss scaling inside `model.compile` / `model.fit`.

```
import keras, lossscale.keras as lsk

keras.mixed_precision.set_dtype_policy("mixed_float16")
optimizer = lsk.LossScaleOptimizer(keras.optimizers.Adam(1e-3), telemetry=True)
model.compile(optimizer=optimizer, loss="mse")
model.fit(x, y, callbacks=[lsk.LossScaleLogger()])  # loss_scale, skipped_steps in History
```

`LossScaleOptimizer` is a `keras.optimizers.LossScaleOptimizer` on lossscale's
state machine; `LossScaleLogger` puts the loss scale in `fit`'s logs and
raises `LossScaleError` out of `fit`. Importing this package imports Keras;
`import lossscale` does not.
"""

try:
    import keras  # noqa: F401 - fails early, with the fix, if Keras is missing
except ImportError as error:
    raise ImportError(f"lossscale.keras needs Keras 3 ({error}): pip install keras") from error

from lossscale.keras.callback import LossScaleLogger
from lossscale.keras.optimizer import LossScaleOptimizer

__all__ = ["LossScaleLogger", "LossScaleOptimizer"]
