"""Every transformation of optax and `optax.contrib` inside `dynamic_loss_scale`, under `jit`.

The zoo (`optax_zoo.zoo()`) is enumerated from the installed modules, so a
transformation new to optax joins by itself. Each runs four jitted steps
(applied, skipped on inf, skipped on NaN, applied) beside the same
transformation alone, both in one jitted function (one compilation per
transformation): a skipped step keeps the whole inner state bit for bit and
returns `-0.0` updates; an applied step matches the transformation alone,
given the same state and the unscaled gradients, to `ULP_BOUND` units in
the last place, most of them bit for bit (docs/jax.md states both). A
transformation that cannot be skipped is refused at its first update with
the message in `REFUSED`.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale.optax as lso
from tests import optax_zoo

ZOO = optax_zoo.zoo()
SCALE = 2.0**10
# Units in the last place an applied step's updates and state may differ
# from the transformation's own jitted update (XLA fuses the unscaling into
# the update's loops, and may contract or order their arithmetic otherwise).
ULP_BOUND = 8
# Refused up front, with the message that says why and what to do.
REFUSED = {
    "optax.monitor": r"state of another structure.*\(optax.monitor\) can follow "
    r"dynamic_loss_scale in an optax.chain instead",
}


def test_the_zoo_is_enumerated_from_the_modules():
    assert len(ZOO) >= 120
    for name in ("optax.adam", "optax.contrib.muon", "optax.MultiSteps", "optax.contrib.dog"):
        assert name in ZOO
    assert "optax.softmax_cross_entropy" not in ZOO and "optax.apply_updates" not in ZOO


def _value_fn(params):
    return optax_zoo.loss(params)


def _extras(name, update, params, unscaled):
    """The extra arguments (loss, loss function, unscaled gradient) `update` accepts."""
    values = {"value": optax_zoo.loss(params), "value_fn": _value_fn, "grad": unscaled}
    if name in optax_zoo.OBJECTIVE:
        values["obj_fn"] = optax_zoo.loss
    signature = inspect.signature(update).parameters
    if any(p.kind is p.VAR_KEYWORD for p in signature.values()):
        return values
    return {k: v for k, v in values.items() if k in signature}


def _numpy(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _ulps(ours, theirs):
    """The largest difference, in units in the last place of the leaf's largest magnitude."""
    a, b = _numpy(ours), _numpy(theirs)
    if not np.issubdtype(a.dtype, np.floating) or not a.size:
        return 0.0 if np.array_equal(a, b) else np.inf
    if np.array_equal(a, b, equal_nan=True):
        return 0.0
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    unit = np.spacing(np.max(np.abs(b)).astype(b.dtype)).astype(np.float64)
    return float(np.max(np.abs(a64 - b64)) / unit)


def _run(name):
    """Four steps inside `dynamic_loss_scale`; returns the largest applied-step ulp distance."""
    transformation = optax_zoo.build(name, ZOO[name])
    alone = transformation
    if isinstance(alone, optax.MultiSteps):
        alone = alone.gradient_transformation()
    alone = optax.with_extra_args_support(alone)
    tx = lso.dynamic_loss_scale(transformation, initial_scale=SCALE)
    params = optax_zoo.wrapped_params(alone, optax_zoo.params())

    @jax.jit
    def step(scaled, unscaled, state, params):
        extras = _extras(name, alone.update, params, unscaled)
        ours = tx.update(scaled, state, params, **extras)
        theirs = alone.update(unscaled, state.inner_state, params, **extras)
        return ours, theirs

    state = tx.init(params)
    worst = 0.0
    for k, bad in enumerate([None, np.inf, np.nan, None]):
        unscaled = optax_zoo.grads(10 + k, name)
        scale = float(lso.loss_scale(state))
        scaled = {k: g * scale for k, g in unscaled.items()}
        if bad is not None:
            scaled["w"] = scaled["w"].at[(0,) * scaled["w"].ndim].set(bad)
        (updates, new_state), (ref_updates, ref_state) = step(scaled, unscaled, state, params)
        if bad is None:
            for a, b in zip(
                jax.tree_util.tree_leaves((updates, new_state.inner_state)),
                jax.tree_util.tree_leaves((ref_updates, ref_state)),
            ):
                assert a.dtype == b.dtype and a.shape == b.shape
                worst = max(worst, _ulps(a, b))
            assert float(new_state.scale) == scale
        else:
            for a, b in zip(
                jax.tree_util.tree_leaves(new_state.inner_state),
                jax.tree_util.tree_leaves(state.inner_state),
            ):
                a, b = _numpy(a), _numpy(b)
                np.testing.assert_array_equal(a, b)
                if np.issubdtype(a.dtype, np.floating):
                    assert np.array_equal(np.signbit(a), np.signbit(b))
            for u in jax.tree_util.tree_leaves(updates):
                assert np.all(np.asarray(u) == 0) and np.all(np.signbit(np.asarray(u)))
            assert float(new_state.scale) == scale / 2
        state = new_state
    return worst


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_transformation_runs_inside_dynamic_loss_scale(name):
    if name in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[name]):
            _run(name)
        return
    worst = _run(name)
    assert worst <= ULP_BOUND, f"{name}: {worst} ulp"
