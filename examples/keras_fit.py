import keras
import numpy as np

import lossscale.keras as lsk

keras.mixed_precision.set_dtype_policy("mixed_float16")  # float16 compute, float32 weights
rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 16)).astype("float32")
y = (x[:, :8].sum(1) > x[:, 8:].sum(1)).astype("float32")
hidden = keras.layers.Dense(32, activation="relu")
output = keras.layers.Dense(1, activation="sigmoid", dtype="float32")  # a float32 output
model = keras.Sequential([keras.Input((16,)), hidden, output])
# Keras's own wrapper (compile keeps it as it is), on lossscale's state machine:
optimizer = lsk.LossScaleOptimizer(keras.optimizers.Adam(1e-2), telemetry=True)
model.compile(optimizer=optimizer, loss="binary_crossentropy", metrics=["accuracy"])
logger = lsk.LossScaleLogger()  # loss_scale and skipped_steps in fit's logs (History)
history = model.fit(x, y, batch_size=64, epochs=5, verbose=0, callbacks=[logger])
last = {name: values[-1] for name, values in history.history.items()}
steps = int(optimizer.iterations) + last["skipped_steps"]
print(f"accuracy {last['accuracy']:.3f}  loss scale {last['loss_scale']:g}  steps {steps}")
