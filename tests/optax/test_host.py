"""`loss_scale`, `scale_loss`, `summary`, `check`: the state found wherever it sits.

`summary` and `check` say exactly what `LossScaleOptimizer.summary()` and
`check()` say for the same gradients: one state machine, one message.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls
import lossscale.optax as lso
from lossscale.mixed_precision import LossScaleError

pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")


def test_found_inside_a_chain_and_any_container():
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), lso.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0)
    )
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    for tree in (state, {"opt_state": state, "step": jnp.asarray(3)}, [params, state]):
        assert float(lso.loss_scale(tree)) == 8.0
        assert lso.summary(tree) == {
            "dynamic_scale": 8.0,
            "step_counter": 0,
            "last_step_skipped": False,
        }
    loss = jnp.asarray(0.25, jnp.float16)
    scaled = lso.scale_loss(loss, state)
    assert scaled.dtype == jnp.float32 and float(scaled) == 2.0  # promoted, as jmp's scale
    tree = lso.scale_loss({"a": jnp.ones(2), "b": jnp.asarray(0.5)}, state)
    assert tree["a"].tolist() == [8.0, 8.0] and float(tree["b"]) == 4.0
    # Inside a jitted step, where the scale is traced.
    assert float(jax.jit(lambda s: lso.scale_loss(1.5, s))(state)) == 12.0


def test_summary_and_check_say_what_the_wrapper_says():
    settings = dict(initial_scale=16.0, dynamic_growth_steps=2, max_consecutive_skips=2)
    tx = lso.dynamic_loss_scale(optax.sgd(0.1), **settings)
    params = {"bias": jnp.zeros(2), "kernel": jnp.ones((2, 2))}
    state = tx.init(params)
    reference = ls.LossScaleOptimizer(ls.optimizers.SGD(0.1), **settings)
    variables = [
        ls.Variable(np.zeros(2, np.float32), name="bias"),
        ls.Variable(np.ones((2, 2), np.float32), name="kernel"),
    ]
    step = jax.jit(lambda g, s: tx.update(g, s, params)[1])
    rng = np.random.default_rng(0)
    for k in range(6):
        grads = {
            "bias": rng.normal(size=2).astype(np.float32),
            "kernel": rng.normal(size=(2, 2)).astype(np.float32),
        }
        if k >= 2:
            grads["kernel"][0, 1] = np.nan
        state = step(jax.tree_util.tree_map(jnp.asarray, grads), state)
        try:
            reference.apply([grads["bias"], grads["kernel"]], variables)
        except LossScaleError as error:
            expected = str(error)
        assert lso.summary(state) == reference.summary()
        if k < 4:
            lso.check(state)  # two skips in a row are allowed
    with pytest.raises(LossScaleError) as info:
        lso.check(state)
    assert str(info.value) == expected
    assert expected.startswith(
        "Loss scaling failed at step 4: overflow: gradients of 1 variable (kernel)"
    )
    summary = lso.summary(state)
    assert summary["error"] == "more than `max_consecutive_skips` steps in a row were skipped"
    assert summary["error_step"] == 4 and summary["consecutive_skips"] == 3
    # Without a limit there is nothing to check, and nothing is read.
    lso.check(lso.dynamic_loss_scale(optax.sgd(0.1)).init(params))


def test_errors():
    tx = lso.dynamic_loss_scale(optax.sgd(0.1))
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    with pytest.raises(
        ValueError,
        match=r"`loss_scale` needs a state made by `lossscale.optax.dynamic_loss_scale` \(the "
        r"state itself, or a tree holding it: an optax.chain state, a Flax TrainState, "
        r"nnx.Optimizer.opt_state\). Received: a value of type tuple holding no "
        r"DynamicLossScaleState",
    ):
        lso.loss_scale(optax.adam(0.1).init(params))
    with pytest.raises(ValueError, match=r"`summary` needs a state made by .* type dict"):
        lso.summary({"w": jnp.ones(2)})
    with pytest.raises(
        ValueError,
        match=r"`check` found 2 DynamicLossScaleStates in the tree it was given, and cannot "
        r"tell which one is meant",
    ):
        lso.check([state, state])
    with pytest.raises(
        ValueError,
        match=r"`summary` reads the state on the host, between steps; it cannot run inside "
        r"jax.jit or another JAX transformation.*use `metrics` inside the step. Received: a traced state",
    ):
        jax.jit(lso.summary)(state)
    failing = lso.dynamic_loss_scale(optax.sgd(0.1), min_scale=1.0)
    with pytest.raises(ValueError, match=r"`check` reads the state on the host"):
        jax.jit(lso.check)(failing.init(params))


def test_scale_loss_refuses_what_is_not_a_number():
    state = lso.dynamic_loss_scale(optax.sgd(0.1)).init({"w": jnp.ones(2)})
    for loss in ("x", None, {"a": "f4"}):
        with pytest.raises(
            TypeError,
            match=r"`loss` must be a number or a numeric array \(or a pytree of them\), such as "
            r"the float32 scalar a loss function returns. Received: loss=",
        ):
            lso.scale_loss(loss, state)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_scale_loss_takes_every_floating_loss_eagerly_and_under_grad(dtype):
    # bfloat16 is no NumPy number (an ml_dtypes type): it was refused.
    state = lso.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**15).init({"w": jnp.ones(2)})
    loss = jnp.asarray(3.0, dtype)
    scaled = lso.scale_loss(loss, state)
    assert scaled.dtype == jnp.float32 and float(scaled) == 3.0 * 2.0**15
    w = jnp.linspace(-1.0, 1.0, 1000, dtype=jnp.float32)
    grad = jax.grad(lambda w: lso.scale_loss(jnp.sum(jnp.square(w).astype(dtype)), state))(w)
    want = jax.grad(lambda w: jnp.sum(jnp.square(w).astype(dtype)).astype(jnp.float32) * 2.0**15)(w)
    np.testing.assert_array_equal(grad, want)


SETTINGS = dict(initial_scale=16.0, dynamic_growth_steps=2, max_consecutive_skips=1)


def _steps(tx, state, params, bad_steps, n=4):
    step = jax.jit(lambda g, s: (tx.update(g, s, params)[1], lso.metrics(s)))
    for k in range(n):
        grads = {"w": jnp.full(2, 1.0 + k), "b": jnp.ones(3)}
        if k in bad_steps:
            grads["w"] = grads["w"].at[0].set(jnp.nan)
        state, _ = step(grads, state)
    return state


def test_metrics_reads_every_field_inside_jit_as_summary_does_outside():
    tx = lso.dynamic_loss_scale(optax.adam(0.1), **SETTINGS)
    params = {"w": jnp.ones(2), "b": jnp.ones(3)}
    state = _steps(tx, tx.init(params), params, bad_steps={2, 3})
    got = jax.jit(lso.metrics)(state)
    expected = lso.summary(state)
    window = {
        "loss_finite",
        "streak_scale",
        "overflow_steps",
        "overflow_loss",
        "overflow_cause",
        "overflow_bits",
    }
    assert set(got) == set(expected) - {"nonfinite_variables", "overflows"} | {"nonfinite"} | window
    assert float(got["dynamic_scale"]) == expected["dynamic_scale"] == 8.0
    assert int(got["error"]) == 2 and expected["error"].startswith("more than")
    assert int(got["error_step"]) == expected["error_step"] == 3
    assert (
        got["scale_history"].shape == (8,)
        and got["scale_history"][-4:].tolist() == (expected["scale_history"])
    )
    assert got["nonfinite"].tolist() == [False, True]  # paths ('b', 'w')
    assert expected["nonfinite_variables"] == ["w"]
    assert bool(got["last_step_skipped"]) is expected["last_step_skipped"] is True
    # Without telemetry: the two Keras fields and the last step's skip.
    plain = lso.dynamic_loss_scale(optax.sgd(0.1)).init(params)
    assert sorted(jax.jit(lso.metrics)(plain)) == [
        "dynamic_scale",
        "last_step_skipped",
        "step_counter",
    ]


def test_a_vmap_stacked_state_is_read_per_member():
    tx = lso.dynamic_loss_scale(optax.sgd(0.1), **SETTINGS)
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones((2, 3))}
    states = jax.vmap(tx.init)(params)
    grads = {"w": jnp.asarray([[1.0, 2.0], [jnp.nan, 1.0]]), "b": jnp.ones((2, 3))}
    step = jax.jit(jax.vmap(lambda g, s, p: tx.update(g, s, p)[1]))
    states = step(grads, states, params)
    assert lso.loss_scale(states).tolist() == [16.0, 8.0]
    summaries = lso.summary(states)
    assert [s["dynamic_scale"] for s in summaries] == [16.0, 8.0]
    assert summaries[1]["nonfinite_variables"] == ["w"] and summaries[0]["skipped_steps"] == 0
    lso.check(states)  # one skip is allowed
    states = step(grads, states, params)
    with pytest.raises(
        LossScaleError, match=r"^Member 1 of the stacked state: Loss scaling failed"
    ):
        lso.check(states)


def test_found_in_train_state_multisteps_and_nnx_split_states():
    from flax import nnx
    from flax.training import train_state

    tx = lso.dynamic_loss_scale(optax.adam(1e-3), initial_scale=8.0)
    params = {"w": jnp.ones(2)}
    trained = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    assert float(lso.loss_scale(trained)) == 8.0 and lso.summary(trained)["dynamic_scale"] == 8.0
    accumulating = optax.MultiSteps(tx, every_k_schedule=2)
    assert lso.summary(accumulating.init(params)) == {
        "dynamic_scale": 8.0,
        "step_counter": 0,
        "last_step_skipped": False,
    }

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split(optimizer)
    assert float(lso.loss_scale(state)) == 8.0  # the bare State: by the fields' names
    assert float(jax.jit(lambda s: lso.scale_loss(0.5, s))(state)) == 4.0
    assert float(jax.jit(lso.metrics)(state)["dynamic_scale"]) == 8.0
    assert lso.summary((graphdef, state)) == {
        "dynamic_scale": 8.0,
        "step_counter": 0,
        "last_step_skipped": False,
    }
    lso.check((graphdef, state))
    with pytest.raises(
        ValueError,
        match=r"holding no DynamicLossScaleState \(an nnx.split state holds the arrays but not "
        r"the settings: pass the \(graphdef, state\) pair, or nnx.merge\(graphdef, state\)\)",
    ):
        lso.summary(state)


def _trained_nnx(inner, **settings):
    """An `nnx.Optimizer` of a 1000-parameter model after a finite, a NaN and a finite step."""
    from flax import nnx

    model = nnx.Linear(40, 25, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, lso.dynamic_loss_scale(inner, 2.0**10, **settings), wrt=nnx.Param
    )
    rng = np.random.default_rng(4)
    for bad in (False, True, False):
        grads = nnx.State(
            {
                "bias": nnx.Param(jnp.asarray(rng.standard_normal(25), jnp.float32)),
                "kernel": nnx.Param(jnp.asarray(rng.standard_normal((40, 25)), jnp.float32)),
            }
        )
        if bad:
            grads["kernel"].value = grads["kernel"].value.at[17, 3].set(jnp.nan)
        optimizer.update(model, grads)
    return model, optimizer


@pytest.mark.parametrize("inner", ["adam", "sgd"])
@pytest.mark.parametrize("telemetry", [True, False])
def test_every_reader_on_a_bare_nnx_split_state(inner, telemetry):
    # What `lax.scan` over an `nnx.split` model carries: arrays keyed by name, no settings;
    # a stateless inner transformation (`optax.sgd`) holds no `inner_state` there at all.
    from flax import nnx

    _, optimizer = _trained_nnx(
        optax.adam(1e-3) if inner == "adam" else optax.sgd(0.1), telemetry=telemetry
    )
    graphdef, state = nnx.split(optimizer)
    expected = jax.tree_util.tree_map(np.asarray, lso.metrics(optimizer))
    got = jax.jit(lso.metrics)(state)
    assert sorted(got) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(np.asarray(got[name]), expected[name], err_msg=name)
    assert float(lso.loss_scale(state)) == float(jax.jit(lso.loss_scale)(state)) == 2.0**9
    assert float(jax.jit(lso.scale_loss)(0.5, state)) == 2.0**8
    summary = lso.summary((graphdef, state))
    assert summary == lso.summary(optimizer)
    assert summary["last_step_skipped"] is False and summary["step_counter"] == 1
    if telemetry:
        assert summary["skipped_steps"] == 1 and summary["nonfinite_variables"] == ["kernel"]
        assert got["nonfinite"].tolist() == [False, True]  # paths ('bias', 'kernel')
    lso.check((graphdef, state))


def test_last_step_skipped_is_kept_without_telemetry():
    tx = lso.dynamic_loss_scale(optax.adam(1e-3), 2.0**8)
    params = {"b": jnp.zeros(300), "w": jnp.ones((64, 33))}
    state = tx.init(params)
    step = jax.jit(tx.update)
    rng = np.random.default_rng(2)
    seen = []
    for bad in (False, True, True, False):
        grads = jax.tree_util.tree_map(
            lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params
        )
        if bad:
            position = int(rng.integers(64 * 33))
            grads["w"] = grads["w"].reshape(-1).at[position].set(jnp.inf).reshape(64, 33)
        _, state = step(grads, state, params)
        metrics = jax.jit(lso.metrics)(state)
        assert sorted(metrics) == ["dynamic_scale", "last_step_skipped", "step_counter"]
        seen.append((bool(metrics["last_step_skipped"]), lso.summary(state)["last_step_skipped"]))
    assert seen == [(False, False), (True, True), (True, True), (False, False)]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("scale", np.nan, "`state.scale` holds nan, but the loss scale's `scale` must be a normal"),
        ("scale", 0.0, "`state.scale` holds 0.0, but the loss scale's `scale` must be a normal"),
        ("scale", -4.0, "`state.scale` holds -4.0, but the loss scale's `scale` must be a normal"),
        ("counter", -1, "`state.counter` holds -1, but the loss scale's `counter` must be an "),
        ("scale_history", np.inf, "`state.scale_history[0]` holds inf, but the loss scale's"),
    ],
)
def test_check_refuses_a_restored_state_no_step_could_leave(field, value, message):
    from lossscale.mixed_precision.state import replaced

    tx = lso.dynamic_loss_scale(optax.sgd(0.1), telemetry=True)
    state = tx.init({"w": jnp.ones(5)})
    lso.check(state)
    fields = state.loss_scale_state
    held = getattr(fields, field)
    if isinstance(held, tuple):
        bad = (jnp.asarray(value, held[0].dtype), *held[1:])
    else:
        bad = jnp.asarray(value, held.dtype)
    restored = state.replace(replaced(fields, **{field: bad}))
    with pytest.raises(ValueError, match=re.escape(message)):
        lso.check({"opt_state": restored})
    with pytest.raises(ValueError, match=re.escape(message)):
        lso.check(jax.device_get(restored))  # as a checkpointer hands it back
