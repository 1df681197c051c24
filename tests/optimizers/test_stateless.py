"""optimizers/stateless.py: `stateless_apply`, the apply pipeline run against given values.

It equals `apply` and writes nothing it was given, on every backend; it
refuses an unbuilt optimizer and values that do not fit, naming them.
"""

import numpy as np
import pytest

import lossscale as ls
from lossscale.optimizers import SGD, Adam

from .test_base import make_vars, random_grads


def test_stateless_apply_equals_apply_and_mutates_nothing(backend, rng):
    init, variables = make_vars(backend, rng)
    twin = [ls.Variable(backend.array(x), name=v.name) for x, v in zip(init, variables)]
    kwargs = dict(
        learning_rate=0.05,
        weight_decay=0.01,
        use_ema=True,
        ema_overwrite_frequency=2,
        gradient_accumulation_steps=2,
    )
    stateful, stateless = Adam(**kwargs), Adam(**kwargs)
    stateless.build(twin)
    opt_values = [v.value for v in stateless.variables]
    model_values = [v.value for v in twin]
    frozen = [backend.numpy(v).copy() for v in twin + stateless.variables]
    for _ in range(5):
        grads = [backend.array(g) for g in random_grads(rng)]
        stateful.apply(grads, variables)
        model_values, opt_values = stateless.stateless_apply(opt_values, grads, model_values)
    for v, new in zip(variables + stateful.variables, model_values + opt_values):
        np.testing.assert_allclose(backend.numpy(new), backend.numpy(v), rtol=1e-6)
    for v, f in zip(twin + stateless.variables, frozen):
        np.testing.assert_array_equal(backend.numpy(v), f)


def test_stateless_apply_errors(backend, rng):
    _, variables = make_vars(backend, rng)
    opt = SGD()
    with pytest.raises(ValueError, match="must be built"):
        opt.stateless_apply([], [], [])
    opt.build(variables)
    values = [v.value for v in opt.variables]
    with pytest.raises(
        ValueError, match=r"`optimizer_variables` must be a list .* \(2 expected\). Received: 1"
    ):
        opt.stateless_apply(values[:1], [None] * 3, [v.value for v in variables])
    with pytest.raises(
        ValueError, match=r"`trainable_variables` entry for 'kernel' must have shape \(3, 4\)"
    ):
        opt.stateless_apply(
            values, [None] * 3, [backend.array(np.ones(2))] + [v.value for v in variables[1:]]
        )


def test_an_unbuilt_optimizer_is_refused_naming_its_class():
    message = (
        r"^To call `stateless_apply`, Adam must be built \(i.e. its variables must have been "
        r"created\). Call `optimizer.build\(trainable_variables\)`.$"
    )
    with pytest.raises(ValueError, match=message):
        Adam().stateless_apply([], [], [])


@pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")
@pytest.mark.parametrize("where", ["first", "last", "random"])
def test_a_skipped_step_returns_the_values_it_was_given(backend, rng, where):
    # Inside LossScaleOptimizer: an inf or NaN in one gradient skips the
    # inner step; the model values come back bit for bit, the scale halved,
    # as `apply` does on a twin.
    init, variables = make_vars(backend, rng)
    twin = [ls.Variable(backend.array(x), name=v.name) for x, v in zip(init, variables)]
    stateless, stateful = (
        ls.LossScaleOptimizer(Adam(0.05), initial_scale=2.0**8, dynamic_growth_steps=2)
        for _ in range(2)
    )
    stateless.build(twin)
    stateful.build(variables)
    model_values = [v.value for v in twin]
    opt_values = [v.value for v in stateless.variables]
    for step in range(4):
        grads = random_grads(rng, scale=2.0**8)
        if step == 2:
            flat = grads[0].reshape(-1)
            index = {"first": 0, "last": flat.size - 1, "random": int(rng.integers(flat.size))}
            flat[index[where]] = np.nan if where == "random" else np.inf
        grads = [backend.array(g) for g in grads]
        before = [backend.numpy(x).copy() for x in model_values]
        model_values, opt_values = stateless.stateless_apply(opt_values, grads, model_values)
        stateful.apply(grads, variables)
        if step == 2:
            for x, b in zip(model_values, before):
                np.testing.assert_array_equal(backend.numpy(x), b)
        for new, v in zip(model_values + opt_values, variables + stateful.variables):
            np.testing.assert_array_equal(backend.numpy(new), backend.numpy(v))
    scale = {v.name: backend.numpy(x) for v, x in zip(stateless.variables, opt_values)}
    assert float(scale["dynamic_scale"]) == 2.0**8  # grew after 2 steps, halved at the skip
    # The optimizer's own variables were left as they were built.
    assert float(stateless.dynamic_scale) == 2.0**8 and int(stateless.iterations) == 0
    for v, x in zip(twin, init):
        np.testing.assert_array_equal(backend.numpy(v), x)


class _Failing(SGD):
    def update_step(self, gradient, variable, learning_rate):
        variable.assign_sub(gradient)  # a write the failure must not leave behind
        raise RuntimeError("update failed")


def test_an_error_inside_the_step_restores_the_bindings_and_the_flag(backend, rng):
    init, variables = make_vars(backend, rng)
    opt = _Failing(0.1)
    opt.build(variables)
    storages = [v.storage for v in variables + opt.variables]
    grads = [backend.array(g) for g in random_grads(rng)]
    with pytest.raises(RuntimeError, match="update failed"):
        opt.stateless_apply(
            [v.value for v in opt.variables], grads, [backend.array(x) for x in init]
        )
    assert opt._stateless is False
    assert all(v.storage is s for v, s in zip(variables + opt.variables, storages))
    for v, x in zip(variables, init):
        np.testing.assert_array_equal(backend.numpy(v), x)
