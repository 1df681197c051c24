"""Shared scenarios for the tests of the optimizer family (not a test module).

Each optimizer's test module writes the published update rule once, as a
float64 NumPy `Rule` (written from the papers and Keras's documented
behaviour, independently of `src/`), and runs the scenarios below with it:

- `check_reference`: >= 5 steps of seeded random gradients against the
  float64 rule, comparing every model and optimizer variable after every
  step (slots are matched by name, so a missing or extra slot fails);
- `check_loss_scale`: the same scenario inside `LossScaleOptimizer` with an
  injected overflow equals the unwrapped optimizer fed the unscaled
  gradients, minus the skipped step;
- `check_stateless`, `check_jit`: `stateless_apply` equals `apply`, and
  `jax.jit(stateless_apply)` equals eager;
- `check_config_round_trip`, `check_resume`: configs survive JSON and an
  optimizer rebuilt from `get_config()` continues a trajectory identically
  after `load_own_variables`.
"""

import doctest
import json
import math

import numpy as np

import lossscale as ls

SHAPES = ((3, 4), (5,))
STEPS = 6
# float32 arithmetic against a float64 oracle, over a handful of steps.
RTOL, ATOL = 2e-5, 1e-6


def weights(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape).astype(np.float32) for shape in SHAPES]


def gradients(seed=1, steps=STEPS):
    rng = np.random.default_rng(seed)
    return [[rng.normal(size=shape).astype(np.float32) for shape in SHAPES] for _ in range(steps)]


class Rule:
    """A float64 update rule: `slots(w)` makes the state, `step` applies one update.

    `step(g, w, state, lr, t)` returns the new `w` and updates `state` in
    place; `t` is the number of optimizer steps already taken. State keys
    are the library's slot names. Keys listed in `shared` are one variable
    per optimizer (not per weight); every weight's state holds its own copy.
    """

    shared = ()

    def slots(self, w):
        raise NotImplementedError

    def step(self, g, w, state, lr, t):
        raise NotImplementedError


def _clip(grads, clipnorm=None, clipvalue=None, global_clipnorm=None):
    if clipnorm is not None:
        return [g * clipnorm / max(np.linalg.norm(g), clipnorm) for g in grads]
    if global_clipnorm is not None:
        norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads))
        return [g * global_clipnorm / max(norm, global_clipnorm) for g in grads]
    if clipvalue is not None:
        return [np.clip(g, -clipvalue, clipvalue) for g in grads]
    return grads


def reference_trajectory(rule, initial, grads, learning_rate, weight_decay=None, **clip):
    """Snapshots `{name: float64 array}` after each step, named like the library's variables."""
    w = [np.asarray(x, np.float64) for x in initial]
    state = [rule.slots(x) for x in w]
    history = []
    for t, step_grads in enumerate(grads):
        step_grads = _clip([np.asarray(g, np.float64) for g in step_grads], **clip)
        for i, g in enumerate(step_grads):
            if weight_decay is not None:
                w[i] = w[i] - w[i] * weight_decay * learning_rate
            w[i] = rule.step(g, w[i], state[i], learning_rate, t)
        snapshot = {"iteration": np.float64(t + 1), "learning_rate": np.float64(learning_rate)}
        for i, s in enumerate(state):
            snapshot[f"w{i}"] = w[i].copy()
            for key, value in s.items():
                name = key if key in rule.shared else f"w{i}_{key}"
                snapshot[name] = np.array(value, np.float64)
        history.append(snapshot)
    return history


def model_variables(backend, initial):
    return [ls.Variable(backend.array(x), name=f"w{i}") for i, x in enumerate(initial)]


def snapshot(optimizer, variables):
    """`{name: numpy value}` of the model variables and every optimizer variable."""
    out = {v.name: v.numpy() for v in variables}
    for v in optimizer.variables:
        assert v.name not in out, f"two variables named {v.name!r}"
        out[v.name] = v.numpy()
    return out


def assert_same_snapshot(actual, expected, rtol=RTOL, atol=ATOL, context=""):
    assert sorted(actual) == sorted(expected), context
    for name in expected:
        np.testing.assert_allclose(
            np.asarray(actual[name], np.float64),
            expected[name],
            rtol=rtol,
            atol=atol,
            err_msg=f"{context} variable {name}",
        )


def check_reference(backend, make, rule, learning_rate, weight_decay=None, **clip):
    """The library's trajectory equals the float64 rule's, every variable, every step."""
    initial, grads = weights(), gradients()
    optimizer = make(learning_rate=learning_rate, weight_decay=weight_decay, **clip)
    variables = model_variables(backend, initial)
    expected = reference_trajectory(rule, initial, grads, learning_rate, weight_decay, **clip)
    for t, (step_grads, want) in enumerate(zip(grads, expected)):
        optimizer.apply([backend.array(g) for g in step_grads], variables)
        assert_same_snapshot(snapshot(optimizer, variables), want, context=f"step {t + 1}")


def check_loss_scale(backend, make, overflow_step=2, **kwargs):
    """Wrapped with scaled gradients and one overflow == unwrapped with unscaled ones."""
    initial, grads = weights(), gradients()
    plain = make(**kwargs)
    wrapped = ls.LossScaleOptimizer(make(**kwargs), initial_scale=2.0**10, dynamic_growth_steps=2)
    plain_vars, wrapped_vars = model_variables(backend, initial), model_variables(backend, initial)
    for t, step_grads in enumerate(grads):
        # The loss is scaled as a user would; the gradients of a scaled loss
        # are the unscaled ones times the scale. Powers of two: scaling and
        # unscaling are exact in float32.
        scale = float(wrapped.scale_loss(1.0))
        scaled = [g * np.float32(scale) for g in step_grads]
        if t == overflow_step:
            scaled[1] = scaled[1].copy()
            scaled[1][0] = np.inf
        wrapped.apply([backend.array(g) for g in scaled], wrapped_vars)
        if t != overflow_step:
            plain.apply([backend.array(g) for g in step_grads], plain_vars)
        want = snapshot(plain, plain_vars)
        got = snapshot(wrapped.inner_optimizer, wrapped_vars)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"step {t}: {name}")
    skipped = 1
    assert int(wrapped.iterations.numpy()) == STEPS - skipped
    # Growth every 2 finite steps, one halving at the overflow.
    assert float(wrapped.dynamic_scale.numpy()) == 2.0**10 * 2**2 / 2


def check_stateless(backend, make, **kwargs):
    """Threading values through `stateless_apply` equals stateful `apply`; nothing mutates."""
    initial, grads = weights(), gradients(steps=3)
    stateful, stateless = make(**kwargs), make(**kwargs)
    stateful_vars, stateless_vars = (
        model_variables(backend, initial),
        model_variables(backend, initial),
    )
    stateless.build(stateless_vars)
    before = snapshot(stateless, stateless_vars)
    model = [v.value for v in stateless_vars]
    state = [v.value for v in stateless.variables]
    for step_grads in grads:
        native = [backend.array(g) for g in step_grads]
        stateful.apply(native, stateful_vars)
        model, state = stateless.stateless_apply(state, native, model)
    assert_same_snapshot(
        snapshot(stateless, stateless_vars),
        {k: np.asarray(v, np.float64) for k, v in before.items()},
        rtol=0,
        atol=0,
        context="stateless_apply mutated state",
    )
    got = {v.name: backend.numpy(x) for v, x in zip(stateless_vars, model)}
    got.update({v.name: backend.numpy(x) for v, x in zip(stateless.variables, state)})
    want = snapshot(stateful, stateful_vars)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def check_jit(make, **kwargs):
    """`jax.jit(optimizer.stateless_apply)` compiles once and equals the eager call."""
    import jax
    import jax.numpy as jnp

    initial, grads = weights(), gradients(steps=3)
    optimizer = make(**kwargs)
    variables = [ls.Variable(jnp.asarray(x), name=f"w{i}") for i, x in enumerate(initial)]
    optimizer.build(variables)
    traces = []

    def counted(state, g, model):
        traces.append(1)
        return optimizer.stateless_apply(state, g, model)

    jitted = jax.jit(counted)
    model = [v.value for v in variables]
    state = [v.value for v in optimizer.variables]
    eager_model, eager_state = model, state
    for step_grads in grads:
        native = [jnp.asarray(g) for g in step_grads]
        model, state = jitted(state, native, model)
        eager_model, eager_state = optimizer.stateless_apply(eager_state, native, eager_model)
    assert len(traces) == 1
    for got, want in zip(model + state, eager_model + eager_state):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    assert int(np.asarray(state[0])) == len(grads)


def check_config_round_trip(cls, **kwargs):
    """`from_config(get_config())` and a JSON trip through `serialize` keep every setting."""
    optimizer = cls(**kwargs)
    config = optimizer.get_config()
    for key, value in kwargs.items():
        if key == "learning_rate":  # held in a float32 variable, as in Keras
            assert config[key] == float(np.float32(value))
        else:
            assert config[key] == value, key
    assert cls.from_config(config).get_config() == config
    payload = json.loads(json.dumps(ls.optimizers.serialize(optimizer)))
    rebuilt = ls.optimizers.deserialize(payload)
    assert type(rebuilt) is cls
    assert rebuilt.get_config() == config


def check_resume(backend, make, steps_before=3, **kwargs):
    """An optimizer rebuilt from `get_config()` and `load_own_variables` continues identically."""
    initial, grads = weights(), gradients()
    original = make(**kwargs)
    variables = model_variables(backend, initial)
    for step_grads in grads[:steps_before]:
        original.apply([backend.array(g) for g in step_grads], variables)
    store = {}
    original.save_own_variables(store)
    resumed = type(original).from_config(original.get_config())
    resumed_vars = model_variables(backend, [v.numpy() for v in variables])
    resumed.build(resumed_vars)
    resumed.load_own_variables(store)
    for step_grads in grads[steps_before:]:
        original.apply([backend.array(g) for g in step_grads], variables)
        resumed.apply([backend.array(g) for g in step_grads], resumed_vars)
    want, got = snapshot(original, variables), snapshot(resumed, resumed_vars)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def check_doctest(module):
    """The runnable example in `module`'s public docstrings holds."""
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
