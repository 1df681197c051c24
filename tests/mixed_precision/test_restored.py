"""Loss-scale fields a checkpoint restores must hold values the step can reach.

Each file here is edited and then made consistent again (the digest
recomputed), so only the value checks can refuse it.
"""

import os
import re

import numpy as np
import pytest

import lossscale as ls
from lossscale import checkpoint_files as files
from lossscale import pytree, saving
from lossscale.mixed_precision import restored
from lossscale.mixed_precision.state import STATE_FIELD_NAMES
from lossscale.optimizers import SGD, Adam, LossScaleOptimizer


def edit(path, name, value, format_name):
    """Sets the array saved as `name` to `value`, recomputing its digest."""
    checkpoint = files.read(os.fspath(path), format_name)
    arrays = list(checkpoint.arrays)
    (index,) = [i for i, e in enumerate(checkpoint.entries) if e["path"] == name]
    arrays[index] = np.asarray(value, dtype=arrays[index].dtype)
    entries = [files.entry(e["path"], a) for e, a in zip(checkpoint.entries, arrays)]
    files.write(path, arrays, files.metadata(format_name, checkpoint.config, entries))


def message(name, value, field, accepted):
    return re.escape(
        f"{name!r} holds {value!r}, but the loss scale's `{field}` must be {accepted}; "
        "the file was changed after it was saved. Nothing was restored"
    )


POSITIVE = "a float32 number from 1 to 3.40282e+38"  # SETTINGS: min_scale=1.0
COUNT = "an integer >= 0"
STEP = "an integer >= -1"
HISTORY = "a finite number >= 0 (0 before the first step)"
# (variable, key path, field, bad value, accepted)
BAD = [
    ("dynamic_scale", ".scale", "scale", -8.0, POSITIVE),
    ("dynamic_scale", ".scale", "scale", 0.0, POSITIVE),
    ("dynamic_scale", ".scale", "scale", np.nan, POSITIVE),
    ("dynamic_scale", ".scale", "scale", np.inf, POSITIVE),
    ("step_counter", ".counter", "counter", -5, COUNT),
    ("consecutive_skips", ".consecutive_skips", "consecutive_skips", -1, COUNT),
    ("steps", ".steps", "steps", -3, COUNT),
    ("skipped_steps", ".skipped", "skipped", -1, COUNT),
    ("last_overflow_step", ".last_overflow_step", "last_overflow_step", -2, STEP),
    ("scale_history_3", ".scale_history[3]", "scale_history", np.nan, HISTORY),
    ("scale_history_0", ".scale_history[0]", "scale_history", -4.0, HISTORY),
    ("error", ".error", "error", 7, "an integer in [0, 2]"),
    ("error_step", ".error_step", "error_step", -9, STEP),
]
SETTINGS = dict(initial_scale=8.0, telemetry=True, min_scale=1.0, max_consecutive_skips=4)


def test_every_field_but_the_boolean_one_has_a_rule():
    # (`iteration`: an optimizer's own step count, checked beside them.)
    assert set(restored.RULES) - {"iteration"} | {"nonfinite"} == set(STATE_FIELD_NAMES)


def trained_optimizer(backend, rng):
    w = ls.Variable(backend.array(rng.standard_normal(4)), name="w")
    opt = LossScaleOptimizer(Adam(0.1), **SETTINGS)
    opt.scale_loss(1.0)
    for g in ([1.0, 2.0, 3.0, 4.0], [np.inf, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]):
        opt.apply([backend.array(np.asarray(g) * 8.0)], [w])
    return w, opt


def snapshot(backend, opt):
    return [backend.numpy(v).copy() for v in opt.variables]


def test_restore_refuses_a_bad_loss_scale_value_and_writes_nothing(backend, rng, tmp_path):
    _, opt = trained_optimizer(backend, rng)
    saved = tmp_path / "saved.safetensors"
    saving.save(opt, saved)
    twin = LossScaleOptimizer(Adam(0.1), **SETTINGS)
    twin.build([ls.Variable(backend.array(np.zeros(4)), name="w")])
    before = snapshot(backend, twin)
    for variable, _, field, value, accepted in BAD:
        path = tmp_path / f"{variable}.safetensors"
        path.write_bytes(saved.read_bytes())
        name = f"loss_scale_optimizer/{variable}"
        edit(path, name, value, files.FORMAT)
        shown = np.asarray(value, "float32" if field in ("scale", "scale_history") else "int32")
        expected = message(name, shown.item(), field, accepted)
        # Into a built twin: nothing of the file is written.
        with pytest.raises(saving.CheckpointError, match=expected):
            saving.restore(twin, path)
        for b, v in zip(before, twin.variables):
            np.testing.assert_array_equal(backend.numpy(v), b)
        with pytest.raises(saving.CheckpointError, match=expected):
            saving.load(path, [ls.Variable(backend.array(np.zeros(4)), name="w")])


def test_valid_edge_values_restore(rng, tmp_path):
    from tests.conftest import Backend

    numpy = Backend("numpy")
    _, opt = trained_optimizer(numpy, rng)
    path = tmp_path / "opt.safetensors"
    saving.save(opt, path)
    for variable, value in [
        ("dynamic_scale", np.float32(1.0)),  # `min_scale` itself
        ("step_counter", 0),
        ("last_overflow_step", -1),
        ("scale_history_0", 0.0),
        ("error", 2),
    ]:
        edit(path, f"loss_scale_optimizer/{variable}", value, files.FORMAT)
    saving.restore(opt, path)
    assert float(opt.dynamic_scale) == 1.0 and int(opt.step_counter) == 0


def test_a_scale_outside_the_policys_bounds_is_refused(rng, tmp_path):
    from tests.conftest import Backend

    _, opt = trained_optimizer(Backend("numpy"), rng)  # min_scale=1.0
    path = tmp_path / "opt.safetensors"
    saving.save(opt, path)
    edit(path, "loss_scale_optimizer/dynamic_scale", np.float32(2.0**-24), files.FORMAT)
    expected = message(
        "loss_scale_optimizer/dynamic_scale",
        2.0**-24,
        "scale",
        "a float32 number from 1 to 3.40282e+38",
    )
    with pytest.raises(saving.CheckpointError, match=expected):
        saving.restore(opt, path)


def test_a_wrapper_under_another_name_is_checked_too(rng, tmp_path):
    w = ls.Variable(np.ones(2, np.float32), name="w")
    opt = LossScaleOptimizer(SGD(0.1), initial_scale=4.0, name="scaler")
    opt.build([w])
    path = tmp_path / "opt.safetensors"
    saving.save(opt, path)
    edit(path, "scaler/dynamic_scale", np.nan, files.FORMAT)
    with pytest.raises(saving.CheckpointError, match=r"'scaler/dynamic_scale' holds nan"):
        saving.restore(opt, path)
    assert float(opt.dynamic_scale) == 4.0


@pytest.mark.parametrize("variable, _, field, value, accepted", BAD[:5])
def test_a_transform_state_with_a_bad_value_is_refused(
    rng, tmp_path, variable, _, field, value, accepted
):
    tx = pytree.transform(LossScaleOptimizer(SGD(0.1), initial_scale=8.0))
    params = [rng.standard_normal(3).astype(np.float32)]
    state = tx.init(params)
    path = tmp_path / "state.safetensors"
    saving.save(tx, path, state=state)
    name = f"loss_scale_optimizer/{variable}"
    edit(path, name, value, files.STATE_FORMAT)
    with pytest.raises(saving.CheckpointError, match=rf"{name!r} holds"):
        saving.restore(tx, path, state=tx.init(params))


def test_an_optax_state_with_a_bad_value_is_refused(tmp_path):
    import jax
    import jax.numpy as jnp
    import optax

    import lossscale.optax as lso

    params = {"w": jnp.arange(3.0)}
    # In a chain, so the loss-scale state sits below the chain's own key ([0]).
    tx = optax.chain(lso.dynamic_loss_scale(optax.adam(0.1), **SETTINGS), optax.identity())
    state = tx.init(params)
    target = jax.eval_shape(tx.init, params)
    path = tmp_path / "state.safetensors"
    for _, key, field, value, accepted in BAD:
        saving.save(tx, path, state=state)
        edit(path, f"[0]{key}", value, files.STATE_FORMAT)
        shown = np.asarray(value, "float32" if field in ("scale", "scale_history") else "int32")
        with pytest.raises(
            saving.CheckpointError, match=message(f"[0]{key}", shown.item(), field, accepted)
        ):
            saving.restore(tx, path, state=target)
    # The inner state's own fields are not loss-scale fields: its count is the
    # inner transformation's business.
    saving.save(tx, path, state=state)
    edit(path, "[0].inner_state[0].count", -1, files.STATE_FORMAT)
    assert int(saving.restore(tx, path, state=state)[0].inner_state[0].count) == -1
