"""Step time of `model.fit` with lossscale.keras's wrapper and with Keras's own, per backend.

```bash
python benchmarks/keras_fit.py                           # tensorflow, jax, torch; 5 rounds
python benchmarks/keras_fit.py --backends torch --rounds 9 --steps 64
```

Each backend runs in its own process (Keras reads `KERAS_BACKEND` at import).
There, two identical models (a small MLP in `mixed_float16`, Adam, one
compile each, `jit_compile="auto"`: XLA on TensorFlow and JAX, eager on
torch) are warmed up with one epoch, then timed one epoch each per round,
taking turns and swapping who goes first every round. A round's figure is
the median time between consecutive batch ends (Keras reads the loss there,
so the step has finished), which leaves out `fit`'s per-call setup. Every
round is printed, then the medians of the rounds and their ratio (ours /
Keras's).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WRAPPERS = ("lossscale", "keras")


def child(steps, rounds, batch, width):
    import keras
    import numpy as np

    import lossscale.keras as lsk

    keras.mixed_precision.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, width)).astype("float32")
    y = rng.normal(size=(steps * batch, 1)).astype("float32")
    global StepClock
    StepClock = step_clock_class()
    models = {}
    for name in WRAPPERS:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((width,)),
                keras.layers.Dense(width, activation="relu"),
                keras.layers.Dense(width, activation="relu"),
                keras.layers.Dense(1, dtype="float32"),
            ]
        )
        wrapper = (
            lsk.LossScaleOptimizer if name == "lossscale" else keras.optimizers.LossScaleOptimizer
        )
        model.compile(optimizer=wrapper(keras.optimizers.Adam(1e-3)), loss="mse")
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)  # compile, warm up
        models[name] = model
    times = {name: [] for name in WRAPPERS}
    for r in range(rounds):
        for name in WRAPPERS if r % 2 == 0 else WRAPPERS[::-1]:
            clock = StepClock()
            models[name].fit(
                x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[clock]
            )
            times[name].append(clock.median_ms())
    return times


def step_clock_class():
    import keras

    class StepClock(keras.callbacks.Callback):
        """Time between consecutive batch ends (Keras reads the loss there: the step is done)."""

        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

        def median_ms(self):
            gaps = [b - a for a, b in zip(self.ends, self.ends[1:])]
            return statistics.median(gaps) * 1e3

    return StepClock


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tensorflow,jax,torch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32, help="timed steps per round")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.steps, args.rounds, args.batch, args.width)))
        return
    print(
        f"model.fit step time, ms (MLP {args.width} wide, batch {args.batch}, mixed_float16, "
        f"{args.steps} steps per round, alternating order)\n"
    )
    print("| backend | wrapper | median | every round |")
    print("|---|---|---:|---|")
    for backend in args.backends.split(","):
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
        command = [sys.executable, __file__, "--child", *sys.argv[1:]]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"| {backend} | failed | | {proc.stderr.strip().splitlines()[-1]} |")
            continue
        times = json.loads(proc.stdout.strip().splitlines()[-1])
        medians = {name: statistics.median(values) for name, values in times.items()}
        for name in WRAPPERS:
            rounds = ", ".join(f"{t:.3f}" for t in times[name])
            print(f"| {backend} | {name} | {medians[name]:.3f} | {rounds} |")
        ratio = medians["lossscale"] / medians["keras"]
        print(f"| {backend} | ratio | {ratio:.2f}x | lossscale / keras |")


if __name__ == "__main__":
    main()
