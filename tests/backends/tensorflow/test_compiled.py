"""Eager steps traced once: cached per optimizer, masked by `tf.cond`, exact.

The traced graph must equal the eager ops bit for bit, which holds only
with the graph optimizer's arithmetic rewrites off (`x / sqrt(y)` becomes
`x * rsqrt(y)` otherwise): Adagrad, which divides by a root, checks it.
"""

import gc
import weakref

import numpy as np
import pytest
import tensorflow as tf

import lossscale as ls

pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")


def _model(seed=0):
    rng = np.random.default_rng(seed)
    return [tf.Variable(rng.normal(size=s).astype(np.float32)) for s in [(6, 4), (4,)]]


def _grads(seed, steps=4):
    rng = np.random.default_rng(seed)
    return [
        [tf.constant(rng.normal(size=s).astype(np.float32)) for s in [(6, 4), (4,)]]
        for _ in range(steps)
    ]


def _train(make, use_kernels, monkeypatch=None, grads=None):
    if not use_kernels:
        monkeypatch.setattr(ls.backends.get_ops("tensorflow"), "fused_update", lambda name: None)
    variables, opt = _model(), make()
    for step in grads or _grads(1):
        opt.apply(step, variables)
    if not use_kernels:
        monkeypatch.undo()
    return [v.numpy() for v in variables] + [v.numpy() for v in opt.variables], opt


def _traced(opt):
    """The traced functions kept in the optimizer's kernel cache."""
    return {k: f for k, f in opt._kernel_cache.items() if k[0] == "tensorflow traced"}


@pytest.mark.parametrize("name", ["Adagrad", "RMSprop", "Adam"])
def test_traced_steps_equal_eager_ops_bit_for_bit(name, monkeypatch):
    make = lambda: getattr(ls.optimizers, name)(0.05)  # noqa: E731
    eager, _ = _train(make, False, monkeypatch)
    traced, opt = _train(make, True)
    for got, want in zip(traced, eager):
        np.testing.assert_array_equal(got, want)
    functions = _traced(opt)
    assert len(functions) == 1
    (function,) = functions.values()
    assert function.experimental_get_tracing_count() == 1  # four steps, one trace


def test_a_changed_hyperparameter_traces_again_and_is_followed(monkeypatch):
    def run(use_kernels):
        if not use_kernels:
            monkeypatch.setattr(
                ls.backends.get_ops("tensorflow"), "fused_update", lambda name: None
            )
        variables, opt = _model(), ls.optimizers.SGD(0.1, momentum=0.5)
        for i, step in enumerate(_grads(2)):
            if i == 2:
                opt.momentum = 0.9
            opt.apply(step, variables)
        monkeypatch.undo()
        return [v.numpy() for v in variables], opt

    (want, _), (got, opt) = run(False), run(True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert len(_traced(opt)) == 2


def test_a_skipped_step_writes_no_bit():
    variables = [tf.Variable(np.array([-0.0, 0.0, 2.0], np.float32))]
    opt = ls.LossScaleOptimizer(ls.optimizers.AdamW(0.1, weight_decay=0.1), initial_scale=2.0)
    opt.apply([tf.constant([2.0, -2.0, 2.0])], variables)
    before = [v.numpy().tobytes() for v in variables + [x.storage for x in opt.variables[2:]]]
    opt.apply([tf.constant([np.nan, 1.0, 1.0])], variables)
    after = [v.numpy().tobytes() for v in variables + [x.storage for x in opt.variables[2:]]]
    assert after == before and float(opt.dynamic_scale) == 1.0


def test_stateless_steps_carry_their_values_through_the_same_graph():
    opt = ls.optimizers.RMSprop(0.01, momentum=0.5, centered=True)
    twin = ls.optimizers.RMSprop(0.01, momentum=0.5, centered=True)
    stateful, model = _model(), _model()
    opt.build(model)
    values, state = [v.value() for v in model], [v.value for v in opt.variables]
    for step in _grads(4):
        twin.apply(step, stateful)
        values, state = opt.stateless_apply(state, step, values)
    for got, want in zip(values + state, stateful + [v.storage for v in twin.variables]):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_inside_a_tf_function_the_rule_joins_the_callers_graph():
    variables, opt = _model(), ls.optimizers.Adam()
    step = tf.function(lambda grads: opt.apply(grads, variables))
    opt.build(variables)
    for grads in _grads(5, steps=2):
        step(grads)
    assert not _traced(opt)


def test_traced_functions_do_not_keep_their_optimizer_alive():
    variables, opt = _model(), ls.optimizers.Adam()
    opt.apply(_grads(6, steps=1)[0], variables)
    assert _traced(opt)
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
