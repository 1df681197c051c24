"""JAX integration: `jax.jit(optimizer.stateless_apply)` and stateful `apply` on JAX arrays.

For every optimizer in `lossscale.optimizers.ALL_OPTIMIZERS` (wrapped in a
`LossScaleOptimizer`, with injected inf and NaN gradients), the jitted
stateless step equals the eager stateful one, compiles once over 20 steps,
supports buffer donation, and returns exactly the dtypes and weak types it
was given.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossscale as ls
from lossscale import optimizers, schedules
from lossscale.optimizers import LossScaleOptimizer
from tests.reference import ReferenceLossScale, ReferenceOptimizer, adam_rule

# The tests feed gradients that are already scaled, as `jax.grad` of a scaled
# loss would give them, so the stateful wrapper's reminder does not apply.
pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")
SHAPES = [(4, 3), (5,)]
STEPS = 20
# Gradients are scaled by 8; overflow at step 3 (inf) and 7 (NaN), growth
# every 2 finite steps: the scale moves both ways within 20 steps.
INITIAL_SCALE, GROWTH_STEPS = 8.0, 2
BAD_STEPS = {3: np.inf, 7: np.nan, 12: -np.inf}
RTOL, ATOL = 1e-5, 1e-6

INNER_CLASSES = [cls for cls in optimizers.ALL_OPTIMIZERS if cls is not LossScaleOptimizer]


def make_weights(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


def make_gradients(seed=1, steps=STEPS, dtype=np.float32):
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        grads = [(rng.normal(size=s) * INITIAL_SCALE).astype(dtype) for s in SHAPES]
        if step in BAD_STEPS:
            grads[step % 2].flat[step % 3] = BAD_STEPS[step]
        out.append(grads)
    return out


def wrapped(inner, **settings):
    return LossScaleOptimizer(
        inner, initial_scale=INITIAL_SCALE, dynamic_growth_steps=GROWTH_STEPS, **settings
    )


def run_eager(make_inner, weights, grads, **settings):
    """Stateful `apply` on JAX Variables; returns (model values, optimizer values)."""
    opt = wrapped(make_inner(), **settings)
    variables = [ls.Variable(jnp.asarray(w), name=f"w{i}") for i, w in enumerate(weights)]
    for g in grads:
        opt.apply([jnp.asarray(x) for x in g], variables)
    return [v.value for v in variables], [v.value for v in opt.variables], opt


def run_jit(make_inner, weights, grads, settings=None, **jit_kwargs):
    """`jax.jit(stateless_apply)` over the same steps; also returns the trace count."""
    opt = wrapped(make_inner(), **(settings or {}))
    opt.build([ls.Variable(jnp.asarray(w), name=f"w{i}") for i, w in enumerate(weights)])
    traces = []

    def step(optimizer_values, g, model_values):
        traces.append(1)
        return opt.stateless_apply(optimizer_values, g, model_values)

    step = jax.jit(step, **jit_kwargs)
    model = [jnp.asarray(w) for w in weights]
    own = [v.value for v in opt.variables]
    for g in grads:
        model, own = step(own, [jnp.asarray(x) for x in g], model)
    return model, own, len(traces)


def assert_values_close(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(
            np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=RTOL, atol=ATOL
        )


@pytest.mark.parametrize("cls", INNER_CLASSES, ids=lambda c: c.__name__)
def test_jit_equals_eager_for_every_optimizer(cls):
    weights, grads = make_weights(), make_gradients()

    def make_inner():
        return cls(learning_rate=0.05)

    eager_model, eager_own, eager_opt = run_eager(make_inner, weights, grads)
    jit_model, jit_own, traces = run_jit(make_inner, weights, grads)
    assert traces == 1
    assert_values_close(jit_model, eager_model)
    assert_values_close(jit_own, eager_own)
    ref = ReferenceLossScale(INITIAL_SCALE, GROWTH_STEPS)
    for step in range(STEPS):
        ref.step(step not in BAD_STEPS)
    assert float(eager_opt.dynamic_scale.value) == ref.scale
    assert int(eager_opt.iterations.value) == STEPS - len(BAD_STEPS)


def test_jit_of_the_bound_method_directly():
    weights, grads = make_weights(), make_gradients(steps=4)
    opt = wrapped(optimizers.Adam(0.01))
    opt.build([jnp.asarray(w) for w in weights])
    step = jax.jit(opt.stateless_apply)
    model, own = [jnp.asarray(w) for w in weights], [v.value for v in opt.variables]
    for g in grads:
        model, own = step(own, [jnp.asarray(x) for x in g], model)
    eager_model, eager_own, _ = run_eager(lambda: optimizers.Adam(0.01), weights, grads)
    assert_values_close(model, eager_model)
    assert_values_close(own, eager_own)
    # stateless_apply mutated nothing: the optimizer still holds its initial state.
    assert int(opt.iterations.value) == 0 and float(opt.dynamic_scale.value) == INITIAL_SCALE


class Halving(schedules.LearningRateSchedule):
    def __call__(self, step):
        return 0.05 * 0.5 ** (step // 4)

    def get_config(self):
        return {}


# Base-optimizer options and learning-rate forms that put extra state and
# branches in the compiled step.
OPTION_CASES = {
    "amsgrad": dict(amsgrad=True),
    "ema": dict(use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3),
    "accumulation": dict(gradient_accumulation_steps=3),
    "clipnorm": dict(clipnorm=0.5),
    "global_clipnorm": dict(global_clipnorm=0.5),
    "clipvalue": dict(clipvalue=0.3),
    "weight_decay": dict(weight_decay=0.1),
    "schedule_subclass": dict(learning_rate=Halving()),
    "exponential_decay": dict(
        learning_rate=schedules.ExponentialDecay(
            0.05, decay_steps=3, decay_rate=0.5, staircase=True
        )
    ),
    "piecewise_constant": dict(
        learning_rate=schedules.PiecewiseConstantDecay([3, 6], [0.05, 0.02, 0.01])
    ),
    "cosine_restarts": dict(learning_rate=schedules.CosineDecayRestarts(0.05, 4)),
    "callable": dict(learning_rate=lambda: 0.02),
}


@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_options_trace_once_and_equal_eager(case):
    weights, grads = make_weights(), make_gradients(steps=12)

    def make_inner():
        return optimizers.Adam(**{"learning_rate": 0.05, **OPTION_CASES[case]})

    eager_model, eager_own, _ = run_eager(make_inner, weights, grads)
    jit_model, jit_own, traces = run_jit(make_inner, weights, grads)
    assert traces == 1
    assert_values_close(jit_model, eager_model)
    assert_values_close(jit_own, eager_own)


# The wrapper's own settings beyond Keras: each adds state or selects to the step.
WRAPPER_CASES = {
    "telemetry": dict(telemetry=True),
    "hysteresis": dict(hysteresis=2),
    "headroom": dict(growth_policy="headroom"),
    "factors_and_cap": dict(growth_factor=4.0, backoff_factor=0.25, max_scale=16.0),
    "fail_fast_limits": dict(min_scale=1e-3, max_consecutive_skips=5),
}


@pytest.mark.parametrize("case", sorted(WRAPPER_CASES))
def test_wrapper_settings_trace_once_and_equal_eager(case):
    weights, grads = make_weights(), make_gradients()
    settings = WRAPPER_CASES[case]

    def make_inner():
        return optimizers.Adam(0.05)

    eager_model, eager_own, eager_opt = run_eager(make_inner, weights, grads, **settings)
    jit_model, jit_own, traces = run_jit(make_inner, weights, grads, settings)
    assert traces == 1
    assert_values_close(jit_model, eager_model)
    assert_values_close(jit_own, eager_own)
    eager, jitted = eager_opt.summary(), eager_opt.summary(jit_own)
    # `apply` keeps its last decision; the values of a jitted step tell it only with telemetry.
    assert jitted.pop("last_step_skipped", eager["last_step_skipped"]) == eager["last_step_skipped"]
    eager.pop("last_step_skipped")
    assert jitted == eager


def test_outputs_keep_input_dtypes_and_weak_types():
    """Python scalars (weakly typed under jit) fed back step after step never retrace."""
    weights, grads = make_weights(), make_gradients(steps=STEPS)
    opt = wrapped(optimizers.Adam(0.05))
    opt.build([jnp.asarray(w) for w in weights])
    names = [v.path for v in opt.variables]
    own = [v.value for v in opt.variables]
    python_scalars = {
        "loss_scale_optimizer/step_counter": 0,
        "loss_scale_optimizer/dynamic_scale": INITIAL_SCALE,
        "adam/learning_rate": 0.05,
    }
    own = [python_scalars.get(n, x) for n, x in zip(names, own)]
    traces = []

    def step(o, g, m):
        traces.append(1)
        return opt.stateless_apply(o, g, m)

    step = jax.jit(step)
    model = [jnp.asarray(w) for w in weights]
    model, own = step(own, [jnp.asarray(x) for x in grads[0]], model)
    signature = [(x.dtype, x.weak_type) for x in own]
    expected = [(v.value.dtype, n in python_scalars) for n, v in zip(names, opt.variables)]
    assert signature == expected
    for g in grads[1:]:
        model, own = step(own, [jnp.asarray(x) for x in g], model)
        assert [(x.dtype, x.weak_type) for x in own] == signature
    assert len(traces) == 1  # Python scalars and the weakly typed arrays returned: same avals
    assert all(not x.weak_type and x.dtype == jnp.float32 for x in model)


def test_buffer_donation():
    weights, grads = make_weights(), make_gradients(steps=6)
    model, own, traces = run_jit(
        lambda: optimizers.Adam(0.05), weights, grads, donate_argnums=(0, 2)
    )
    plain_model, plain_own, _ = run_jit(lambda: optimizers.Adam(0.05), weights, grads)
    assert traces == 1
    assert_values_close(model, plain_model)
    assert_values_close(own, plain_own)
    opt = wrapped(optimizers.Adam(0.05))
    opt.build([jnp.asarray(w) for w in weights])
    inputs = ([jnp.array(v.value) for v in opt.variables], [jnp.asarray(w) for w in weights])
    jax.jit(opt.stateless_apply, donate_argnums=(0, 2))(
        inputs[0], [jnp.asarray(g) for g in grads[0]], inputs[1]
    )
    assert all(x.is_deleted() for x in inputs[0] + inputs[1])


def test_donation_in_output_order_updates_every_buffer_in_place():
    """With inputs donated in output order, the compiled step copies no full-size buffer.

    The skip decision is a `lax.cond` around the inner update, so a taken
    step writes each parameter and slot once, into its own donated buffer
    (a select over every array would read both versions and copy).
    """
    weights = make_weights()
    opt = wrapped(optimizers.Adam(0.05))
    opt.build([jnp.asarray(w) for w in weights])
    step = jax.jit(lambda model, own, g: opt.stateless_apply(own, g, model), donate_argnums=(0, 1))
    text = (
        step.lower(
            [jnp.asarray(w) for w in weights],
            [v.value for v in opt.variables],
            [jnp.asarray(w) for w in weights],
        )
        .compile()
        .as_text()
    )
    copies = [
        line
        for line in text.splitlines()
        if re.search(r"= [a-z0-9]+\[\d+(,\d+)*\]\S* copy\(", line)
    ]
    assert copies == []


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_gradients_with_float32_parameters(dtype):
    """Scaled half gradients are unscaled in float32 and applied to float32 weights."""
    weights = make_weights()
    rng = np.random.default_rng(3)
    scale = 2.0**12
    # Small true gradients: many of them underflow in half precision unscaled.
    true = [[(rng.normal(size=s) * 1e-5).astype(np.float32) for s in SHAPES] for _ in range(5)]
    scaled = [[jnp.asarray(g * scale, dtype=dtype) for g in step] for step in true]
    scaled[2][1] = scaled[2][1].at[0].set(jnp.inf)
    opt = LossScaleOptimizer(optimizers.Adam(0.01), initial_scale=scale, dynamic_growth_steps=100)
    opt.build([jnp.asarray(w) for w in weights])
    step = jax.jit(opt.stateless_apply)
    model, own = [jnp.asarray(w) for w in weights], [v.value for v in opt.variables]
    ref = ReferenceOptimizer(adam_rule(), weights, lr=0.01)
    ref_scale = ReferenceLossScale(scale, 100)
    for g in scaled:
        model, own = step(own, g, model)
        finite = all(bool(jnp.all(jnp.isfinite(x))) for x in g)
        if finite:
            # The reference sees exactly the half-precision values, divided in float64.
            ref.apply([np.asarray(x, np.float64) / ref_scale.scale for x in g])
        ref_scale.step(finite)
    assert all(m.dtype == jnp.float32 for m in model)
    for m, w in zip(model, ref.w):
        np.testing.assert_allclose(np.asarray(m), w, rtol=1e-5, atol=1e-7)
    scale_index = [v.path for v in opt.variables].index("loss_scale_optimizer/dynamic_scale")
    assert float(own[scale_index]) == ref_scale.scale == scale / 2


def test_stateful_apply_rebinds_jax_values():
    """Keras-style `apply` on JAX: Variables are rebound; matches the NumPy backend."""
    weights, grads = make_weights(), make_gradients(steps=8)
    originals = [jnp.asarray(w) for w in weights]
    jax_vars = [ls.Variable(x, name=f"w{i}") for i, x in enumerate(originals)]
    np_vars = [ls.Variable(w.copy(), name=f"w{i}") for i, w in enumerate(weights)]
    jax_opt, np_opt = wrapped(optimizers.Adam(0.05)), wrapped(optimizers.Adam(0.05))
    for step, g in enumerate(grads):
        before = [v.value for v in jax_vars]
        jax_opt.apply([jnp.asarray(x) for x in g], jax_vars)
        np_opt.apply([x.copy() for x in g], np_vars)
        if step in BAD_STEPS:  # skipped: the very same arrays are still bound
            assert all(v.value is b for v, b in zip(jax_vars, before))
        else:
            assert all(v.value is not b for v, b in zip(jax_vars, before))
    for a, b in zip(jax_vars + jax_opt.variables, np_vars + np_opt.variables):
        assert isinstance(a.value, jax.Array)
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=RTOL, atol=ATOL)
    # JAX arrays are immutable: the arrays the Variables were created from are unchanged.
    for original, w in zip(originals, weights):
        np.testing.assert_array_equal(np.asarray(original), w)


def test_stateful_apply_with_native_arrays_builds_and_skips():
    weights = make_weights()
    opt = wrapped(optimizers.SGD(0.1))
    arrays = [jnp.asarray(w) for w in weights]
    opt.apply([jnp.ones_like(a) * INITIAL_SCALE for a in arrays], arrays)
    # The optimizer wrapped the arrays once and rebound its own Variables.
    assert int(opt.iterations.value) == 1
    opt.apply([jnp.full_like(a, jnp.nan) for a in arrays])
    assert int(opt.iterations.value) == 1 and float(opt.dynamic_scale.value) == INITIAL_SCALE / 2
