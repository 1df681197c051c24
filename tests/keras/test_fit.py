"""`model.fit` with `lossscale.keras.LossScaleOptimizer` on Keras's TensorFlow, JAX and torch backends.

Each backend runs `fit_worker.py` once, in a subprocess with `KERAS_BACKEND`
set (Keras reads it at import); the tests read what it wrote. Against
Keras's own wrapper, in `mixed_float16`, with inf and NaN batches: the
weights, the inner optimizer's state and the scale / counter / iterations
after every batch are compared exactly.
"""

import json
import math
import os
import pathlib
import re
import subprocess

import numpy as np
import pytest

from tests import workers

WORKER = pathlib.Path(__file__).with_name("fit_worker.py")
BACKENDS = ("tensorflow", "jax", "torch")


# Each backend's tests are one xdist group: one test process runs them, and
# that backend's subprocess once there, however pytest orders the tests of
# the three parameters; the three subprocesses run in both test processes.
@pytest.fixture(
    scope="module",
    params=[pytest.param(b, marks=pytest.mark.xdist_group(f"keras_fit_{b}")) for b in BACKENDS],
)
def run(request, tmp_path_factory):
    if request.param not in _RESULTS:
        _RESULTS[request.param] = _run_worker(request.param, tmp_path_factory)
    return request.param, _RESULTS[request.param]


_RESULTS = {}


def _run_worker(backend, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"keras_{backend}") / "out.json"
    env = {**os.environ, "KERAS_BACKEND": backend, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        workers.command(WORKER, out),
        cwd=workers.ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("jit", ["jit=False", "jit=True"])
def test_fit_matches_keras_bit_for_bit_with_overflows(run, jit):
    backend, results = run
    runs = results["parity"][jit]
    # On torch, compiled, ours runs with telemetry and diagnostics (the
    # embedding scenario's run with the extras elsewhere).
    name = "ours_extras" if (backend, jit) == ("torch", "jit=True") else "ours"
    keras_run, ours = runs["keras"], runs[name]
    assert set(runs) == {"keras", name}
    assert ours["type"] == "lossscale.keras.optimizer"  # compile kept it as it is
    assert ours["steps"] == keras_run["steps"]
    assert ours["weights"] == keras_run["weights"]
    assert ours["inner"] == keras_run["inner"]
    scales = [s for s, _, _ in ours["steps"]]
    # Both the injected inf batch and the NaN batch were skipped, and the
    # scale also grew: the trajectory exercises every branch.
    skips = [i for i in range(1, len(scales)) if scales[i] < scales[i - 1]]
    assert len(skips) >= 2 and any(b > a for a, b in zip(scales, scales[1:]))
    iterations = [it for _, _, it in ours["steps"]]
    assert iterations[-1] < len(iterations)


def test_a_scale_no_power_of_two_fits_as_under_keras_and_its_history_holds_the_scales_used(run):
    backend, results = run
    out = results["odd_scale"]
    jits = ["jit=False"] if backend == "torch" else ["jit=False", "jit=True"]
    assert sorted(k for k in out if k != "history") == jits
    for jit in jits:
        keras_run, ours = out[jit]["keras"], out[jit]["ours"]
        assert ours["steps"] == keras_run["steps"], jit
        assert ours["weights"] == keras_run["weights"], jit
        scales = [s for s, _, _ in ours["steps"]]
        assert scales[0] == 3.0 * 2**10 and len(set(scales)) > 1
    assert out["history"] == {"used": [8.0, 8.0, 16.0, 8.0], "scale_history": [8.0, 8.0, 16.0, 8.0]}


def test_an_embedding_trains_as_under_keras_its_sparse_gradient_kept(run):
    backend, results = run
    # On torch the gradient is dense: compiled, the run is `parity`'s.
    jits = ["jit=False"] if backend == "torch" else ["jit=False", "jit=True"]
    assert sorted(results["embedding"]) == jits
    for jit in jits:
        runs = results["embedding"][jit]
        keras_run = runs["keras"]
        assert set(runs) == {"keras", "ours", "ours_extras"}
        for name in set(runs) - {"keras"}:
            assert runs[name]["steps"] == keras_run["steps"], (jit, name)
            assert runs[name]["weights"] == keras_run["weights"], (jit, name)
            assert runs[name]["inner"] == keras_run["inner"], (jit, name)
        scales = [s for s, _, _ in keras_run["steps"]]
        assert scales[2] < scales[1]  # the NaN batch was skipped
        if backend == "tensorflow":
            # The inner optimizer gets the sparse gradient, as from Keras's wrapper.
            for name in ("keras", "ours", "ours_extras"):
                assert runs[name]["gradient_kinds"] == ["IndexedSlices"], (jit, name)


def test_keras_scale_reaches_inf_ours_keeps_training(run):
    _, results = run
    keras_run, ours = results["guards"]["inf"]["keras"], results["guards"]["inf"]["ours"]
    steps = len(ours["steps"])
    # Keras: 2**127 doubles to inf after the first step; every later step skipped.
    assert keras_run["steps"][-1][0] == math.inf and keras_run["steps"][-1][2] == 1
    # Ours: the growth is not taken, every step is applied.
    assert ours["steps"][-1] == [2.0**127, 0, steps]
    assert all(np.isfinite(np.asarray(w)).all() for w in ours["weights"])


def test_keras_scale_reaches_zero_ours_keeps_training(run):
    _, results = run
    keras_run, ours = results["guards"]["zero"]["keras"], results["guards"]["zero"]["ours"]
    steps = len(ours["steps"])
    # The first batch is NaN: Keras halves 2**-149 to 0.0, then applies 0/0.
    assert keras_run["steps"][-1][0] == 0.0
    assert any(np.isnan(np.asarray(w)).any() for w in keras_run["weights"])
    # Ours stops at the smallest normal float32 and trains on.
    assert ours["steps"][0] == [float(np.finfo(np.float32).tiny), 0, 0]
    assert ours["steps"][-1][2] == steps - 1
    assert all(np.isfinite(np.asarray(w)).all() for w in ours["weights"])


@pytest.mark.parametrize("every_batch", [False, True])
def test_history_has_loss_scale_and_skipped_steps(run, every_batch):
    _, results = run
    got = results["telemetry"][f"every_batch={every_batch}"]
    history, steps, summary = got["history"], got["steps"], got["summary"]
    per_epoch = len(steps) // 2
    assert history["loss_scale"] == [steps[per_epoch - 1][0], steps[-1][0]]
    assert history["loss_scale"][-1] == summary["dynamic_scale"]
    assert history["skipped_steps"][-1] == summary["skipped_steps"] == len(steps) - steps[-1][2]
    assert 0 < history["skipped_steps"][0] < history["skipped_steps"][1]
    logged = {"loss", "loss_scale", "skipped_steps"}
    assert all(set(keys) == (logged if every_batch else {"loss"}) for keys in got["batch_keys"])


def test_keras_file_round_trip_and_bit_for_bit_resume(run):
    _, results = run
    saving = results["saving"]
    assert saving["type"] == "lossscale.keras.optimizer.LossScaleOptimizer"
    assert saving["loaded_config"] == saving["config"]
    assert {"hysteresis": 2, "telemetry": True, "max_scale": 2.0**20}.items() <= saving[
        "config"
    ].items()
    assert saving["loaded_values"] == saving["saved_values"]
    original, loaded = saving["resumed"]
    assert loaded == original


def test_fail_fast_raises_out_of_fit(run):
    backend, results = run
    messages = results["fail_fast"]
    assert set(messages) == ({"jit=False"} if backend == "torch" else {"jit=False", "jit=True"})
    for jit, message in messages.items():
        assert message is not None
        first, second = message.splitlines()[:2]
        # The cause first: NaN inputs make a NaN loss, recorded where Keras's step
        # runs the write in `scale_loss` (torch; TensorFlow compiled: its eager
        # relu maps NaN to 0, so the loss is finite and one kernel overflows).
        assert first.startswith("Loss scaling failed at step 2: ")
        if backend == "jax":  # Keras's JAX step drops what `scale_loss` writes
            assert "(the loss was not recorded)" in first
        elif backend == "torch" or jit == "jit=True":
            assert "nonfinite_loss: the loss itself was NaN or inf at step 2" in first
        assert second.startswith("Stopped because more than `max_consecutive_skips` steps in a row")
        assert "Steps skipped in a row: 3; in total: 3 of 3." in message
        assert "/dense" in message  # variables named by their Keras paths
        assert len(message) < 4000


def test_nan_labels_are_a_nonfinite_loss_where_keras_keeps_the_flag(run):
    backend, results = run
    for jit, window in results["nan_labels"].items():
        # Batch 2's labels are NaN; batch 3 holds an inf input.
        assert [o["step"] for o in window] == [2, 3], jit
        every = [o["variables"] for o in window]
        assert all(len(names) == 4 for names in every), jit
        if backend == "jax":
            # Keras's JAX trainer calls `scale_loss` in a scope whose writes it drops.
            assert [(o["cause"], o["loss_finite"]) for o in window] == [("overflow", None)] * 2
        else:
            assert [(o["cause"], o["loss_finite"]) for o in window] == [
                ("nonfinite_loss", False)
            ] * 2, jit


def test_a_bad_gradient_list_is_refused_with_nothing_written(run):
    _, results = run
    got = results["edges"]
    expected = {
        "one_for_two": "`grads` must match the trainable variables one to one. Received: 1 "
        "gradients for 2 variables",
        "second_shape": "The gradient for variable 'w1' must have the variable's shape "
        "(7,). Received: gradient shape (8,)",
        "second_dtype": "The gradient for variable 'w1' must have a floating-point "
        "dtype. Received: gradient dtype int32",
    }
    for case, message in expected.items():
        assert got[case] == {"apply": message, "stateless_apply": message, "unchanged": True}


@pytest.mark.parametrize("value", ["nan", "-4.0"])
def test_a_keras_file_with_a_bad_scale_is_refused_by_load_model(run, value):
    _, results = run
    message = results["edges"][f"load scale={value}"]
    assert message is not None
    assert (
        f"`store['3']` holds {value}, but the loss scale's `scale` must be a normal float32 "
        "number > 0 (from 1.17549e-38 to 3.40282e+38). Nothing was loaded."
    ) in message


def test_keras_takes_it_as_its_own(run):
    _, results = run
    got = results["serialization"]
    assert got["registered"] == "lossscale>LossScaleOptimizer"
    assert got["deserialized"] == ["LossScaleOptimizer", True]
    assert got["get"] == ["lossscale.keras.optimizer", 3]
    assert got["compiled_is_ours"]  # mixed_float16 did not wrap it again
    assert got["auto_wrapped"] == "keras.src.optimizers.loss_scale_optimizer"
    assert got["our_keys"] == got["keras_keys"]


def test_mirrored_strategy_matches_keras_and_replicas_agree(run):
    backend, results = run
    if backend != "tensorflow":
        assert "mirrored" not in results
        return
    got = results["mirrored"]
    assert got["replicas"] == 2
    assert got["ours"] == got["keras"]
    assert got["ours"]["steps"][2][0] < got["ours"]["steps"][1][0]  # the inf batch: skipped
    # One replica's half overflowed: both skipped it (the scale halved once,
    # iterations did not move), and training went on.
    steps = got["one_replica"]["steps"]
    assert steps[2][0] == steps[1][0] / 2 and steps[2][2] == steps[1][2]
    assert steps[-1][2] == len(steps) - 1


def test_keras_variables_work_with_lossscale_optimizers(run):
    _, results = run
    got = results["variables"]
    # The model's own variables were updated in place, exactly as plain
    # arrays of the same values are; the inf step was skipped.
    assert got["after"] != got["before"]
    assert got["after"] == got["reference"]
    assert got["iterations"] == 3
    assert re.fullmatch(r"sequential\w*/dense\w*/kernel", got["paths"][0])
    # Named by their Keras paths in telemetry and errors.
    assert got["summary"]["nonfinite_variables"] == [got["paths"][1]]
    assert got["error"] == (
        f"The gradient for variable '{got['paths'][0]}' must have the variable's shape (4, 8). "
        "Received: gradient shape (3, 3)"
    )


def _float64_range(grad):
    a = np.abs(np.asarray(grad, np.float64)).ravel()
    return {
        "zero": np.count_nonzero(a == 0) / a.size,
        "subnormal": np.count_nonzero((a > 0) & (a < 2.0**-14)) / a.size,
        "near_max": np.count_nonzero(a >= 65504 / 2) / a.size,
        "max_abs": float(np.float32(a.max())),
    }


def test_float16_range_of_an_eager_apply_equals_a_float64_count(run):
    _, results = run
    got = results["diagnostics"]["apply"]
    summary = got["summary"]
    assert summary["float16_range_step"] == 2  # measured at steps 0 and 2
    for path, grad in zip(got["paths"], got["sent"][2]):
        want = _float64_range(grad)
        measured = summary["float16_range"][path]
        assert measured["max_abs"] == want["max_abs"], path
        for key in ("zero", "subnormal", "near_max"):
            assert measured[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (path, key)
    assert summary["float16_range"][got["paths"][1]]["max_abs"] == math.inf


def test_fit_measures_every_n_steps_compiled_as_eagerly(run):
    backend, results = run
    got = results["diagnostics"]
    runs = [got[key] for key in ("jit=False", "jit=True") if key in got]
    eager = runs[0]
    assert [step for step, _ in eager] == [0, 0, 2, 2, 4, 4]
    for _, ranges in eager:
        assert len(ranges) == 4  # two Dense layers' kernels and biases
        for shares in ranges.values():
            assert all(0 <= shares[k] <= 1 for k in ("zero", "subnormal", "near_max"))
    assert eager[-1][1] != eager[0][1]

    def values(records):
        # By position (each fit builds a model of its own, named anew), NaN as text.
        return [
            [step, [[repr(v[k]) for k in sorted(v)] for v in ranges.values()]]
            for step, ranges in records
        ]

    for other in runs[1:]:
        if backend != "tensorflow":
            assert values(other) == values(eager)
            continue
        # TensorFlow's XLA-compiled backward pass rounds some float16
        # gradients differently from its eager one: the same cadence and
        # non-finite entries, magnitudes within a few float16 steps.
        assert [step for step, _ in other] == [step for step, _ in eager]
        for (_, a), (_, b) in zip(other, eager):
            for x, y in zip(a.values(), b.values()):
                assert math.isfinite(x["max_abs"]) == math.isfinite(y["max_abs"])
                if math.isfinite(x["max_abs"]):
                    assert x["max_abs"] == pytest.approx(y["max_abs"], rel=1e-2)
                assert all(abs(x[k] - y[k]) <= 0.25 for k in ("zero", "subnormal", "near_max"))


def test_statistics_policy_trains_in_fit(run):
    _, results = run
    got = results["diagnostics"]["statistics"]
    assert got["config"]["growth_policy"] == "statistics"
    assert got["config"]["diagnostics_every"] == 2
    assert all(np.isfinite(np.asarray(w)).all() for w in got["weights"])
    scales = [scale for scale, _, _ in got["steps"]]
    assert all(np.finfo(np.float32).tiny <= s < np.inf for s in scales)
