"""Steps inside `tf.function`, with and without `jit_compile=True`.

Every optimizer, wrapped in `LossScaleOptimizer`, trains a few steps with an
inf and a NaN step among them: the function traces once, every step after
the first replays it, and the result equals the same steps taken eagerly
(the graph optimizer and XLA may round a little differently from eager
ops, hence the tolerances). `stateless_apply` compiles too.
"""

import numpy as np
import pytest
import tensorflow as tf

import lossscale as ls

pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")

SHAPES = [(4, 3), (3,)]
# Per step: "f" finite, "inf" / "nan" in the first gradient.
PATTERN = ["f", "f", "inf", "f", "nan", "f"]
OPTIMIZERS = {
    "SGD": lambda: ls.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "Adam": lambda: ls.optimizers.Adam(0.02),
    "AdamW": lambda: ls.optimizers.AdamW(0.02, weight_decay=0.1),
    "RMSprop": lambda: ls.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "Adagrad": lambda: ls.optimizers.Adagrad(0.1),
    "Adadelta": lambda: ls.optimizers.Adadelta(1.0, epsilon=1e-3),
    "Adamax": lambda: ls.optimizers.Adamax(0.02),
    "Nadam": lambda: ls.optimizers.Nadam(0.02),
    "Lion": lambda: ls.optimizers.Lion(0.01),
    "Ftrl": lambda: ls.optimizers.Ftrl(0.1, l1_regularization_strength=0.01),
    "Lamb": lambda: ls.optimizers.Lamb(0.02),
    "Adam+schedule+clip+ema": lambda: ls.optimizers.Adam(
        ls.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5),
        global_clipnorm=1.0,
        use_ema=True,
        ema_overwrite_frequency=3,
    ),
    "SGD+accumulation": lambda: ls.optimizers.SGD(0.1, gradient_accumulation_steps=2),
}


def _scenario(seed=0):
    rng = np.random.default_rng(seed)
    weights = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    grads = []
    for kind in PATTERN:
        step = [rng.normal(size=s).astype(np.float32) * 8.0 for s in SHAPES]
        if kind != "f":
            step[0][1, 2] = np.inf if kind == "inf" else np.nan
        grads.append(step)
    return weights, grads


def _wrapped(name):
    return ls.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=8.0, dynamic_growth_steps=2)


def _train(name, compile_as):
    weights, grads = _scenario()
    variables = [tf.Variable(w) for w in weights]
    opt = _wrapped(name)
    opt.build(variables)  # else the first call traces twice (see below)

    def step(step_grads):
        opt.apply(step_grads, variables)

    if compile_as is not None:
        step = tf.function(step, jit_compile=compile_as == "xla")
    history = []
    for step_grads in grads:
        step([tf.constant(g) for g in step_grads])
        history.append([v.numpy() for v in variables + [x.storage for x in opt.variables]])
    return step, history, opt


@pytest.mark.parametrize("compile_as", ["graph", "xla"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_compiled_step_traces_once_and_equals_eager(name, compile_as):
    _, eager, _ = _train(name, None)
    step, compiled, opt = _train(name, compile_as)  # values: model, then optimizer
    assert step.experimental_get_tracing_count() == 1
    rtol = 1e-6 if compile_as == "graph" else 1e-5
    for t, (got, want) in enumerate(zip(compiled, eager)):
        for i, (g, w) in enumerate(zip(got, want)):
            # atol: Ftrl's linear slot cancels values of magnitude 10.
            np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-6, err_msg=f"step {t} value {i}")
    assert int(opt.inner_optimizer._iterations) == 4  # the inf and NaN steps were skipped


def test_scale_trajectory_inside_tf_function():
    step, _, opt = _train("Adam", "xla")
    # 8 -> f (counter 1) -> f (grow: 16) -> inf (8) -> f (1) -> nan (4) -> f (1).
    assert float(opt.dynamic_scale) == 4.0 and int(opt.step_counter) == 1
    assert int(opt.iterations) == 4


def test_build_on_the_first_traced_call():
    weights, grads = _scenario()
    variables = [tf.Variable(w) for w in weights]
    opt = _wrapped("Adam")

    @tf.function
    def step(step_grads):
        opt.apply(step_grads, variables)

    step([tf.constant(g) for g in grads[0]])
    assert opt.built
    assert all(isinstance(v.storage, tf.Variable) for v in opt.variables)
    # A tf.function that creates variables on its first call traces that
    # call twice (TensorFlow lifts the creation out, then traces without
    # it); later calls trace nothing.
    traces = step.experimental_get_tracing_count()
    for step_grads in grads[1:]:
        step([tf.constant(g) for g in step_grads])
    assert step.experimental_get_tracing_count() == traces <= 2
    assert int(opt.iterations) == 4


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_stateless_apply_compiles_and_equals_apply(jit_compile):
    weights, grads = _scenario(1)
    stateful_vars = [tf.Variable(w) for w in weights]
    stateful = _wrapped("Adam")
    stateless = _wrapped("Adam")
    stateless.build([tf.Variable(w) for w in weights])
    apply = tf.function(stateless.stateless_apply, jit_compile=jit_compile)
    model = [tf.constant(w) for w in weights]
    state = [v.value for v in stateless.variables]
    before = [v.numpy() for v in stateless.variables]
    for step_grads in grads:
        native = [tf.constant(g) for g in step_grads]
        stateful.apply(native, stateful_vars)
        model, state = apply(state, native, model)
    assert apply.experimental_get_tracing_count() == 1
    for got, want in zip(model, stateful_vars):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-7)
    for got, want in zip(state, stateful.variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-7)
    # Nothing of the optimizer itself moved.
    for v, b in zip(stateless.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def test_a_float16_step_under_xla():
    # float16 gradients of float32 variables, unscaled in float32 (as Keras does).
    variables = [tf.Variable(np.ones(3, np.float32))]
    opt = _wrapped("Adam")
    opt.build(variables)
    step = tf.function(lambda g: opt.apply([g], variables), jit_compile=True)
    step(tf.constant([8.0, -8.0, 16.0], tf.float16))
    step(tf.constant([np.inf, 1.0, 1.0], tf.float16))
    assert int(opt.iterations) == 1 and float(opt.dynamic_scale) == 4.0
    np.testing.assert_allclose(variables[0].numpy(), [0.98, 1.02, 0.98], rtol=1e-5)
