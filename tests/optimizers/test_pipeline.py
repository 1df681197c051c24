"""optimizers/pipeline.py: the apply pipeline, in the order a step runs it.

Each stage (weight decay, clipping, EMA, accumulation, a static loss-scale
factor, constraints) against the float64 reference optimizer, on every
backend; then the contract wrappers call, `_step(..., keep=...)`: a skipped
step writes nothing, whether the kernel folds `keep` or runs under `cond`.
"""

import numpy as np
import pytest

import lossscale as ls
from lossscale.optimizers import SGD, Adam
from tests.reference import ReferenceOptimizer, adam_rule, sgd_rule

from .test_base import assert_close, make_vars, random_grads

PIPELINES = {
    "plain": {},
    "weight_decay": {"weight_decay": 0.1},
    "clipnorm": {"clipnorm": 0.5},
    "clipvalue": {"clipvalue": 0.3},
    "global_clipnorm": {"global_clipnorm": 0.7},
    "ema": {"use_ema": True, "ema_momentum": 0.9, "ema_overwrite_frequency": 3},
    "accumulation": {"gradient_accumulation_steps": 3},
    "accumulation_ema": {
        "gradient_accumulation_steps": 2,
        "use_ema": True,
        "ema_momentum": 0.8,
        "ema_overwrite_frequency": 2,
    },
    "loss_scale_factor": {"loss_scale_factor": 128.0},
}


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_pipeline_matches_reference(backend, rng, pipeline, rule):
    kwargs = PIPELINES[pipeline]
    init, variables = make_vars(backend, rng)
    if rule == "sgd":
        opt = SGD(learning_rate=0.05, momentum=0.9, nesterov=True, **kwargs)
        ref = ReferenceOptimizer(sgd_rule(momentum=0.9, nesterov=True), init, lr=0.05, **kwargs)
    else:
        opt = Adam(learning_rate=0.05, **kwargs)
        ref = ReferenceOptimizer(adam_rule(), init, lr=0.05, **kwargs)
    for _ in range(7):
        grads = random_grads(rng, scale=kwargs.get("loss_scale_factor", 1.0))
        opt.apply([backend.array(g) for g in grads], variables)
        ref.apply(grads)
        assert_close(backend, variables, ref.w)
        assert int(np.asarray(backend.numpy(opt._iterations.value))) == ref.raw_iterations
        assert int(np.asarray(backend.numpy(opt.iterations))) == ref.iterations
    if kwargs.get("use_ema"):
        opt.finalize_variable_values(variables)
        assert_close(backend, variables, ref.avg)


def test_constraint_applied_after_update(backend):
    v = ls.Variable(
        backend.array(np.array([1.0, -1.0])), name="w", constraint=lambda x: x * 0 + 0.25
    )
    SGD(learning_rate=0.1).apply([backend.array(np.array([1.0, 1.0]))], [v])
    np.testing.assert_allclose(backend.numpy(v), [0.25, 0.25])


# --- `_step(..., keep=...)`: the contract wrappers call ------------------------


@pytest.mark.parametrize("pipeline", ["plain", "weight_decay", "ema", "accumulation", "clipnorm"])
def test_a_step_not_kept_writes_nothing_and_a_kept_one_is_apply(backend, rng, pipeline):
    kwargs = PIPELINES[pipeline]
    init, variables = make_vars(backend, rng)
    twin = [ls.Variable(backend.array(x), name=v.name) for x, v in zip(init, variables)]
    stepped, applied = Adam(learning_rate=0.05, **kwargs), Adam(learning_rate=0.05, **kwargs)
    stepped.build(variables)
    applied.build(twin)
    ops = stepped._ops
    # Whether the kernel folds `keep` or the step runs under `cond`.
    folds = stepped._step_plan(variables).folds_keep
    if pipeline in ("ema", "accumulation"):
        assert not folds
    for step, kept in enumerate([True, False, True, True, False, True]):
        grads = [backend.array(g) for g in random_grads(rng)]
        before = [backend.numpy(v).copy() for v in variables + stepped.variables]
        stepped._step(grads, variables, keep=ops.asarray(np.array(kept)))
        if kept:
            applied.apply(grads, twin)
        after = [backend.numpy(v) for v in variables + stepped.variables]
        if not kept:
            for a, b in zip(after, before):
                np.testing.assert_array_equal(a, b)
        for a, v in zip(after, twin + applied.variables):
            np.testing.assert_array_equal(a, backend.numpy(v), err_msg=f"step {step}")
    assert int(backend.numpy(stepped._iterations.value)) == 4  # the raw count


def test_hyperparameters_are_the_constructor_s_then_the_kernel_s():
    from lossscale.optimizers import pipeline

    class Kerneled(SGD):
        kernel_hyperparameters = ("extra", "momentum")

    base_keys = set(ls.optimizers.Optimizer._config_keys())
    hyper = pipeline.hyper_type(Kerneled, base_keys)
    assert hyper.__name__ == "KerneledHyper" and hyper._fields == ("momentum", "nesterov", "extra")
    assert pipeline.hyper_type(Kerneled, base_keys) is hyper  # made once per class
    assert pipeline.hyper_type(SGD, base_keys)._fields == ("momentum", "nesterov")
