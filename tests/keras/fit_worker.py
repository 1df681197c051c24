"""`model.fit` with lossscale.keras and with Keras's own wrapper, on one backend (not a test module).

Keras reads `KERAS_BACKEND` once, at import, so `tests/keras/test_fit.py`
runs this file in a subprocess per backend: `python -m tests.keras.fit_worker OUT.json`.
Each scenario trains tiny models for a few steps and writes what the tests
compare: weights, loss-scale trajectories (read after every batch), logs,
errors, configs.
"""

import json
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
BACKEND = os.environ["KERAS_BACKEND"]
if BACKEND == "tensorflow":
    import tensorflow as tf

    # Two logical CPUs for MirroredStrategy, before TensorFlow sets up devices.
    (cpu,) = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import lossscale.keras as lsk  # noqa: E402
from lossscale.mixed_precision import LossScaleError  # noqa: E402

BATCH = 8
# Compiling takes seconds per model (tens of seconds for torch.compile):
# the parity scenario runs compiled and not on every backend, fail-fast
# compiled on TensorFlow and JAX, the others uncompiled.
COMPILE = BACKEND != "torch"


def data(kind="parity"):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(6 * BATCH, 4)).astype("float32")
    y = rng.normal(size=(6 * BATCH, 1)).astype("float32")
    if kind == "parity":
        x[3 * BATCH + 3, 1] = np.inf  # batch 3 overflows
        y[4 * BATCH : 5 * BATCH] = np.nan  # batch 4: NaN
    elif kind == "guard":
        x *= 0.01  # gradients far below 1: finite even at a scale of 2**127
        y[:] = 0.0
    elif kind == "nan_first":
        x *= 0.01
        y[:] = 0.0
        x[0, 0] = np.nan
    elif kind == "always_nan":
        x[:, 0] = np.nan
    elif kind == "one_replica":
        x[2 * BATCH, 0] = np.inf  # one sample: the first replica's half of batch 2
    elif kind == "whole_batch":
        x[2 * BATCH : 3 * BATCH] = np.inf  # every replica of batch 2 overflows
    return x, y


def model(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )


def numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x), np.float64)


class Trajectory(keras.callbacks.Callback):
    """The scale, counter and iterations after every batch."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        opt = self.model.optimizer  # on JAX, `self.model` syncs the state
        self.steps.append(
            [
                float(numpy(opt.dynamic_scale)),
                int(numpy(opt.step_counter)),
                int(numpy(opt.iterations)),
            ]
        )


def fit(wrapper, x, y, jit, epochs=1, callbacks=(), strategy=None, seed=1, **settings):
    """Trains a fresh model; returns (model, optimizer, trajectory, history)."""
    import contextlib

    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        m = model(seed)
        inner = keras.optimizers.Adam(0.01)
        opt = wrapper(inner, **settings)
        m.compile(optimizer=opt, loss="mse", jit_compile=jit)
    trajectory = Trajectory()
    history = m.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[*callbacks, trajectory],
    )
    return m, opt, trajectory.steps, history.history


def weights(m):
    return [numpy(w).tolist() for w in m.weights]


def optimizer_values(opt):
    return [numpy(v).tolist() for v in opt.variables]


# The settings of the runs "with the extras".
EXTRAS = dict(telemetry=True, diagnostics_every=2)


def parity():
    """Keras's wrapper and ours, compiled and not; on torch ours compiled has the extras.

    (A torch.compile'd fit costs about 14 s: on torch the compiled run of
    ours is the one with the extras, which the embedding scenario has
    elsewhere; ours without them is the uncompiled run.)
    """
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    out = {}
    for jit in (False, True):
        x, y = data()
        runs = {}
        wrappers = [
            ("keras", keras.optimizers.LossScaleOptimizer, {}),
            ("ours", lsk.LossScaleOptimizer, {}),
        ]
        if BACKEND == "torch" and jit:
            wrappers[1] = ("ours_extras", lsk.LossScaleOptimizer, EXTRAS)
        for name, wrapper, settings in wrappers:
            if BACKEND == "torch" and jit:
                import torch

                torch._dynamo.reset()  # each compiled run starts afresh (see `embedding`)
            m, opt, steps, history = fit(wrapper, x, y, jit, dynamic_growth_steps=2, **settings)
            runs[name] = {
                "weights": weights(m),
                "steps": steps,
                "inner": [numpy(v).tolist() for v in opt.inner_optimizer.variables],
                "type": type(m.optimizer).__module__,
            }
        out[f"jit={jit}"] = runs
    keras.mixed_precision.set_dtype_policy("float32")
    return out


def odd_scale():
    """A scale that is no power of two (a Keras setting): fit, and the scales used.

    Keras's wrapper and ours, compiled and not (on torch only eagerly: the
    parity scenario compiles there); then four steps of `apply`, whose
    `scale_history` must hold the scale each step used.
    """
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    out = {}
    for jit in (False, True) if COMPILE else (False,):
        x, y = data()
        runs = {}
        for name, wrapper in (
            ("keras", keras.optimizers.LossScaleOptimizer),
            ("ours", lsk.LossScaleOptimizer),
        ):
            m, opt, steps, _ = fit(wrapper, x, y, jit, initial_scale=3.0 * 2**10)
            runs[name] = {"weights": weights(m), "steps": steps}
        out[f"jit={jit}"] = runs
    keras.mixed_precision.set_dtype_policy("float32")
    v = keras.Variable(np.zeros(3, np.float32))
    opt = lsk.LossScaleOptimizer(keras.optimizers.SGD(1e-3), 8.0, 2, telemetry=True)
    opt.build([v])
    used = []
    for t in range(4):
        used.append(float(numpy(opt.dynamic_scale)))
        grad = np.full(3, np.inf if t == 2 else 1.0, np.float32)
        opt.apply([keras.ops.convert_to_tensor(grad)], [v])
    out["history"] = {"used": used, "scale_history": opt.summary()["scale_history"][-4:]}
    return out


def guards():
    out = {}
    for kind, settings in (
        ("inf", {"initial_scale": 2.0**127, "dynamic_growth_steps": 1}),
        ("zero", {"initial_scale": 2.0**-149}),
    ):
        x, y = data("guard" if kind == "inf" else "nan_first")
        runs = {}
        for name, wrapper in (
            ("keras", keras.optimizers.LossScaleOptimizer),
            ("ours", lsk.LossScaleOptimizer),
        ):
            if name == "ours" and kind == "zero":
                # Ours refuses a subnormal scale: it starts at float32's smallest normal.
                settings = {"initial_scale": 2.0**-126}
            m, _, steps, _ = fit(wrapper, x, y, jit=False, **settings)
            runs[name] = {"weights": weights(m), "steps": steps}
        out[kind] = runs
    return out


def telemetry():
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    x, y = data()
    out = {}
    for every_batch in (False, True):
        keys = []

        class Recorder(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None, keys=keys):
                keys.append(sorted(logs))

        _, opt, steps, history = fit(
            lsk.LossScaleOptimizer,
            x,
            y,
            jit=False,
            epochs=2,
            callbacks=[lsk.LossScaleLogger(every_batch=every_batch), Recorder()],
            dynamic_growth_steps=3,
            telemetry=True,
        )
        out[f"every_batch={every_batch}"] = {
            "history": history,
            "batch_keys": keys,
            "summary": opt.summary(),
            "steps": steps,
        }
    keras.mixed_precision.set_dtype_policy("float32")
    return out


def saving(folder):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    x, y = data()
    settings = {"dynamic_growth_steps": 3, "hysteresis": 2, "telemetry": True, "max_scale": 2.0**20}
    m, opt, _, _ = fit(lsk.LossScaleOptimizer, x, y, jit=False, **settings)
    path = str(pathlib.Path(folder) / "m.keras")
    m.save(path)
    loaded = keras.models.load_model(path)
    out = {
        "type": f"{type(loaded.optimizer).__module__}.{type(loaded.optimizer).__name__}",
        "config": opt.get_config(),
        "loaded_config": loaded.optimizer.get_config(),
        "saved_values": optimizer_values(opt),
        "loaded_values": optimizer_values(loaded.optimizer),
    }
    resumed = []
    for each in (m, loaded):
        each.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        resumed.append({"weights": weights(each), "optimizer": optimizer_values(each.optimizer)})
    out["resumed"] = resumed
    keras.mixed_precision.set_dtype_policy("float32")
    return out


def fail_fast():
    out = {}
    x, y = data("always_nan")
    for jit in (False, COMPILE):
        try:
            fit(
                lsk.LossScaleOptimizer,
                x,
                y,
                jit,
                callbacks=[lsk.LossScaleLogger()],
                max_consecutive_skips=2,
            )
            out[f"jit={jit}"] = None
        except LossScaleError as error:
            out[f"jit={jit}"] = str(error)
    return out


def nan_labels():
    """NaN labels in one batch of `fit`: the loss is NaN there, as the state records it."""
    x, y = data()
    y[:] = x[:, :1]
    y[2 * BATCH : 3 * BATCH] = np.nan
    out = {}
    for jit in (False, COMPILE):
        _, opt, _, _ = fit(lsk.LossScaleOptimizer, x, y, jit, telemetry=True)
        out[f"jit={jit}"] = opt.summary()["overflows"]
    return out


def edges(folder):
    """What comes back in: a bad gradient list, a `.keras` file holding a bad scale."""
    import io
    import zipfile

    import h5py

    out = {}
    rng = np.random.default_rng(5)
    variables = [
        keras.Variable(rng.normal(size=s).astype("float32"), name=f"w{i}")
        for i, s in enumerate(((64, 33), (7,)))
    ]
    opt = lsk.LossScaleOptimizer(keras.optimizers.Adam(0.01), 2.0**4)
    opt.build(variables)

    def gradient(shape, dtype="float32"):
        return keras.ops.convert_to_tensor(rng.normal(size=shape).astype(dtype))

    bad = {
        "one_for_two": [gradient((64, 33))],
        "second_shape": [gradient((64, 33)), gradient((8,))],
        "second_dtype": [gradient((64, 33)), gradient((7,), "int32")],
    }
    before = [numpy(v).tolist() for v in variables + list(opt.variables)]
    for name, grads in bad.items():
        entry = {}
        for how in ("apply", "stateless_apply"):
            try:
                if how == "apply":
                    opt.apply(grads, variables)
                else:
                    opt.stateless_apply([v.value for v in opt.variables], grads, variables)
                entry[how] = None
            except ValueError as error:
                entry[how] = str(error)
        entry["unchanged"] = [numpy(v).tolist() for v in variables + list(opt.variables)] == before
        out[name] = entry

    x, y = data()
    m, saved, _, _ = fit(lsk.LossScaleOptimizer, x, y, jit=False)
    path = pathlib.Path(folder) / "edges.keras"
    m.save(path)
    index = [i for i, v in enumerate(saved.variables) if v is saved.dynamic_scale][0]
    for value in (np.nan, -4.0):
        with zipfile.ZipFile(path) as z:
            files = {n: z.read(n) for n in z.namelist()}
        buffer = io.BytesIO(files["model.weights.h5"])
        with h5py.File(buffer, "r+") as f:
            f[f"optimizer/vars/{index}"][...] = value
        files["model.weights.h5"] = buffer.getvalue()
        bad_path = pathlib.Path(folder) / f"scale_{value}.keras"
        with zipfile.ZipFile(bad_path, "w") as z:
            for n, data_ in files.items():
                z.writestr(n, data_)
        try:
            keras.models.load_model(bad_path)
            out[f"load scale={value}"] = None
        except ValueError as error:
            out[f"load scale={value}"] = str(error)
    return out


def diagnostics():
    """`diagnostics_every`: an eager `apply` of known gradients, and `fit` compiled or not."""
    out = {}
    rng = np.random.default_rng(3)
    shapes = [(6, 5), (5,), (300,)]
    variables = [keras.Variable(np.zeros(s, "float32"), name=f"w{i}") for i, s in enumerate(shapes)]
    opt = lsk.LossScaleOptimizer(keras.optimizers.SGD(0.0), 2.0**10, diagnostics_every=2)
    opt.build(variables)
    sent = []
    for k in range(3):
        grads = [
            (rng.standard_normal(s) * 10.0 ** rng.uniform(-9, 2, s)).astype("float32") * 2.0**10
            for s in shapes
        ]
        grads[2][k] = 0.0
        grads[1][k] = np.inf if k == 2 else 7e4
        sent.append([g.tolist() for g in grads])
        opt.apply([keras.ops.convert_to_tensor(g) for g in grads], variables)
    out["apply"] = {"sent": sent, "summary": opt.summary(), "paths": [v.path for v in variables]}
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    x, y = data()
    for jit in sorted({False, COMPILE}):
        records = []

        class Recorder(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None, records=records):
                summary = self.model.optimizer.summary()
                records.append([summary["float16_range_step"], summary["float16_range"]])

        fit(
            lsk.LossScaleOptimizer,
            x,
            y,
            jit,
            callbacks=[Recorder()],
            diagnostics_every=2,
            telemetry=True,
        )
        out[f"jit={jit}"] = records
    m, opt, steps, _ = fit(
        lsk.LossScaleOptimizer,
        x,
        y,
        jit=False,
        epochs=2,
        diagnostics_every=2,
        growth_policy="statistics",
        dynamic_growth_steps=2,
    )
    out["statistics"] = {"steps": steps, "weights": weights(m), "config": opt.get_config()}
    keras.mixed_precision.set_dtype_policy("float32")
    return out


def serialization():
    opt = lsk.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0, hysteresis=3)
    config = keras.optimizers.serialize(opt)
    again = keras.optimizers.deserialize(config)
    got = keras.optimizers.get(config)
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    m = model()
    m.compile(optimizer=opt, loss="mse")
    auto = model()
    auto.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    keras.mixed_precision.set_dtype_policy("float32")
    return {
        "registered": config.get("registered_name"),
        "deserialized": [type(again).__name__, again.get_config() == opt.get_config()],
        "get": [type(got).__module__, got.hysteresis],
        "compiled_is_ours": m.optimizer is opt,
        "auto_wrapped": type(auto.optimizer).__module__,
        "keras_keys": sorted(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()).get_config()
        ),
        "our_keys": sorted(lsk.LossScaleOptimizer(keras.optimizers.SGD()).get_config()),
    }


def variables():
    """`model.trainable_variables` passed to lossscale's own optimizers, as a custom loop does."""
    import lossscale as ls

    rng = np.random.default_rng(3)
    m = model()
    before = weights(m)
    # The reference: the same optimizer on plain backend arrays of the same values.
    reference = [
        ls.Variable(keras.ops.convert_to_tensor(np.array(numpy(v), np.float32)))
        for v in m.trainable_variables
    ]
    ours = ls.LossScaleOptimizer(ls.optimizers.Adam(0.01), initial_scale=64.0, telemetry=True)
    theirs = ls.LossScaleOptimizer(ls.optimizers.Adam(0.01), initial_scale=64.0)
    for i in range(4):
        grads = [rng.normal(size=w.shape).astype("float32") * 64 for w in m.trainable_variables]
        if i == 2:
            grads[1][0] = np.inf
        ours.scale_loss(1.0)
        ours.apply([keras.ops.convert_to_tensor(g) for g in grads], m.trainable_variables)
        theirs.scale_loss(1.0)
        theirs.apply([keras.ops.convert_to_tensor(g) for g in grads], reference)
    wrong = [keras.ops.convert_to_tensor(np.ones((3, 3), "float32"))] + [
        keras.ops.zeros(w.shape) for w in m.trainable_variables[1:]
    ]
    try:
        ours.apply(wrong, m.trainable_variables)
        error = None
    except ValueError as e:
        error = str(e)
    return {
        "before": before,
        "after": weights(m),
        "reference": [v.numpy().tolist() for v in reference],
        "paths": [v.path for v in m.trainable_variables],
        "summary": ours.summary(),
        "iterations": int(ours.iterations),
        "error": error,
    }


def embedding():
    """An Embedding (on TensorFlow its gradient is a sparse `tf.IndexedSlices`), rows repeated.

    Keras's wrapper hands the inner optimizer the sparse gradient, divided;
    so must ours, or the rows a batch repeats move otherwise (Keras's Adam
    updates sparse rows its own way). Also run with the extras, whose
    checks and measurements read the sparse gradients.
    """
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(5)
    vocabulary = 3000
    x = rng.integers(0, 40, size=(6 * BATCH, 5)).astype("int32")  # many repeats
    x[:, 0] = rng.integers(0, vocabulary, size=6 * BATCH)
    y = rng.normal(size=(6 * BATCH, 1)).astype("float32")
    y[2 * BATCH : 3 * BATCH] = np.nan  # batch 2 skipped

    def embedding_model():
        keras.utils.set_random_seed(3)
        i = keras.Input((5,), dtype="int32")
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(vocabulary, 16)(i))
        return keras.Model(i, keras.layers.Dense(1, dtype="float32")(h))

    out = {}
    # On torch the embedding's gradient is dense: compiled, it is a run like
    # `parity`'s, which has the compiled run with the extras there.
    for jit in (False,) if BACKEND == "torch" else (False, True):
        runs = {}
        wrappers = [
            ("keras", keras.optimizers.LossScaleOptimizer, {}),
            ("ours", lsk.LossScaleOptimizer, {}),
            ("ours_extras", lsk.LossScaleOptimizer, EXTRAS),
        ]
        for name, wrapper, settings in wrappers:
            if BACKEND == "torch":
                import torch

                # After the scenarios before, torch.compile's cache limits
                # would run some frames of one run compiled and of the next
                # eager, which round differently: each run starts afresh.
                torch._dynamo.reset()
            m = embedding_model()
            inner = keras.optimizers.Adam(0.01)
            kinds = set()
            apply = inner.apply

            def spy(grads, trainable_variables=None, apply=apply, kinds=kinds):
                kinds.add(type(grads[0]).__name__)
                return apply(grads, trainable_variables)

            inner.apply = spy
            m.compile(
                optimizer=wrapper(inner, dynamic_growth_steps=2, **settings),
                loss="mse",
                jit_compile=jit,
            )
            trajectory = Trajectory()
            m.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[trajectory])
            runs[name] = {
                "weights": weights(m),
                "steps": trajectory.steps,
                "inner": [numpy(v).tolist() for v in inner.variables],
                "gradient_kinds": sorted(kinds),
            }
        out[f"jit={jit}"] = runs
    keras.mixed_precision.set_dtype_policy("float32")
    return out


def mirrored():
    """MirroredStrategy over two logical CPUs, eagerly traced (not XLA-compiled).

    With `jit_compile=True` there, fit fails for every Keras optimizer, a
    plain `keras.optimizers.Adam` included: XLA cannot read a replica's
    variable on the other logical device (TensorFlow's "tf.Variable on a
    different device" known issue).
    """
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out = {"replicas": strategy.num_replicas_in_sync}
    x, y = data("whole_batch")
    for name, wrapper in (
        ("keras", keras.optimizers.LossScaleOptimizer),
        ("ours", lsk.LossScaleOptimizer),
    ):
        m, _, steps, _ = fit(wrapper, x, y, False, strategy=strategy, dynamic_growth_steps=2)
        out[name] = {"weights": weights(m), "steps": steps}
    # One sample of one replica's half overflows: both replicas skip.
    x, y = data("one_replica")
    m, _, steps, _ = fit(
        lsk.LossScaleOptimizer,
        x,
        y,
        False,
        strategy=strategy,
        dynamic_growth_steps=2,
        telemetry=True,
    )
    out["one_replica"] = {"weights": weights(m), "steps": steps}
    return out


if __name__ == "__main__":
    assert keras.backend.backend() == BACKEND
    import time

    scenarios = {
        "parity": parity,
        "odd_scale": odd_scale,
        "guards": guards,
        "telemetry": telemetry,
        "saving": lambda: saving(pathlib.Path(sys.argv[1]).parent),
        "fail_fast": fail_fast,
        "nan_labels": nan_labels,
        "edges": lambda: edges(pathlib.Path(sys.argv[1]).parent),
        "diagnostics": diagnostics,
        "serialization": serialization,
        "variables": variables,
        "embedding": embedding,
    }
    if BACKEND == "tensorflow":
        scenarios["mirrored"] = mirrored
    results = {}
    for name, scenario in scenarios.items():
        start = time.perf_counter()
        results[name] = scenario()
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(results, f, default=str)
