"""`LossScaleOptimizer` on every backend: the state machine, skipping, config."""

import numpy as np
import pytest

import lossscale as ls
from lossscale.optimizers import SGD, Adam, LossScaleOptimizer
from reference import F32_MAX, F32_TINY, ReferenceLossScale, ReferenceOptimizer, adam_rule

SHAPES = [(4, 3), (3,)]


def setup(backend, rng, inner=None, **kwargs):
    init = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    variables = [ls.Variable(backend.array(x), name=f"v{i}") for i, x in enumerate(init)]
    opt = LossScaleOptimizer(inner or Adam(learning_rate=0.01), **kwargs)
    return init, variables, opt


def snapshot(backend, variables):
    return [backend.numpy(v).copy() for v in variables]


def scalar(backend, x):
    return np.asarray(backend.numpy(x)).item()


# A step pattern: "f" finite, "inf" an inf somewhere, "nan" a NaN somewhere.
PATTERN = ["f", "f", "inf", "f", "f", "f", "nan", "f", "f", "f", "f", "inf", "inf", "f"]


def test_trajectory_matches_reference(backend, rng):
    init, variables, opt = setup(backend, rng, initial_scale=64.0, dynamic_growth_steps=3)
    ref = ReferenceOptimizer(adam_rule(), init, lr=0.01)
    ref_scale = ReferenceLossScale(64.0, 3)
    for kind in PATTERN:
        grads = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
        scaled = [g * np.float32(ref_scale.scale) for g in grads]
        if kind != "f":
            scaled[kind == "nan"][0] = np.inf if kind == "inf" else np.nan
        before_inner = snapshot(backend, variables + opt.inner_optimizer.variables)
        opt.apply([backend.array(g) for g in scaled], variables)
        if kind == "f":
            ref.apply(grads)
        else:
            # A skipped step leaves every model and inner variable untouched.
            after = snapshot(backend, variables + opt.inner_optimizer.variables)
            for b, a in zip(before_inner, after):
                np.testing.assert_array_equal(a, b)
        ref_scale.step(kind == "f")
        assert scalar(backend, opt.dynamic_scale) == ref_scale.scale
        assert scalar(backend, opt.step_counter) == ref_scale.counter
        assert scalar(backend, opt.iterations) == ref.iterations
        for v, w in zip(variables, ref.w):
            np.testing.assert_allclose(backend.numpy(v), w, rtol=1e-5, atol=1e-6)
    assert ref_scale.scale == 16.0  # 64 32 64 32 64 32 16 16


def test_growth_after_dynamic_growth_steps(backend, rng):
    _, variables, opt = setup(backend, rng, inner=SGD(0.0), initial_scale=2.0,
                              dynamic_growth_steps=2)
    scales, counters = [], []
    for _ in range(5):
        opt.apply([backend.array(np.ones(s, np.float32)) for s in SHAPES], variables)
        scales.append(scalar(backend, opt.dynamic_scale))
        counters.append(scalar(backend, opt.step_counter))
    assert scales == [2.0, 4.0, 4.0, 8.0, 8.0]
    assert counters == [1, 0, 1, 0, 1]


def test_growth_never_reaches_inf(backend, rng):
    _, variables, opt = setup(backend, rng, inner=SGD(0.0), initial_scale=2.0 ** 127,
                              dynamic_growth_steps=1)
    for _ in range(3):
        opt.apply([backend.array(np.ones(s, np.float32)) for s in SHAPES], variables)
        assert scalar(backend, opt.dynamic_scale) == 2.0 ** 127
        assert scalar(backend, opt.step_counter) == 0
    assert 2.0 ** 127 * 2 > F32_MAX


def test_backoff_stops_at_smallest_normal(backend, rng):
    _, variables, opt = setup(backend, rng, inner=SGD(0.1), initial_scale=4 * F32_TINY)
    bad = [backend.array(np.full(s, np.nan, np.float32)) for s in SHAPES]
    for expected in (2 * F32_TINY, F32_TINY, F32_TINY):
        opt.apply(bad, variables)
        assert scalar(backend, opt.dynamic_scale) == pytest.approx(expected, rel=1e-6)
    # At the floor, finite gradients still apply and stay finite.
    before = snapshot(backend, variables)
    opt.apply([backend.array(np.full(s, 1e-37, np.float32)) for s in SHAPES], variables)
    assert all(np.isfinite(backend.numpy(v)).all() for v in variables)
    assert not np.array_equal(before[0], backend.numpy(variables[0]))


def test_finite_gradient_overflowing_after_unscale_is_skipped(backend, rng):
    _, variables, opt = setup(backend, rng, inner=SGD(0.1), initial_scale=2 * F32_TINY)
    before = snapshot(backend, variables)
    opt.apply([backend.array(np.full(s, 1e30, np.float32)) for s in SHAPES], variables)
    for b, v in zip(before, variables):
        np.testing.assert_array_equal(backend.numpy(v), b)
    assert scalar(backend, opt.dynamic_scale) == pytest.approx(F32_TINY, rel=1e-6)


def test_overwrite_with_gradient_is_not_unscaled(backend, rng):
    _, variables, opt = setup(backend, rng, inner=SGD(0.5), initial_scale=8.0)
    variables[1].overwrite_with_gradient = True
    g1 = rng.normal(size=3).astype(np.float32)
    opt.apply([backend.array(np.full((4, 3), 8.0, np.float32)), backend.array(g1)], variables)
    np.testing.assert_array_equal(backend.numpy(variables[1]), g1)


def test_inner_loss_scale_factor_disabled():
    inner = SGD(loss_scale_factor=4.0)
    LossScaleOptimizer(inner)
    assert inner.loss_scale_factor is None


def test_base_keyword_arguments_rejected():
    for key, value in [("clipnorm", 1.0), ("weight_decay", 0.1), ("use_ema", True),
                       ("gradient_accumulation_steps", 2), ("loss_scale_factor", 2.0)]:
        with pytest.raises(ValueError, match=f"does not support `{key}`. Instead, set `{key}` on the `inner_optimizer`"):
            LossScaleOptimizer(SGD(), **{key: value})
    LossScaleOptimizer(SGD(), clipnorm=None, use_ema=False, ema_momentum=0.99)  # defaults pass
    with pytest.raises(ValueError, match=r"does not support arguments: \['foo'\]"):
        LossScaleOptimizer(SGD(), foo=1)
    with pytest.raises(ValueError, match="no longer supports `dynamic=False`"):
        LossScaleOptimizer(SGD(), dynamic=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"initial_scale": 0.0}, r"`initial_scale` must be a finite number > 0 and <= .*Received: initial_scale=0.0"),
    ({"initial_scale": -2.0}, r"Received: initial_scale=-2.0"),
    ({"initial_scale": float("inf")}, r"Received: initial_scale=inf"),
    ({"initial_scale": float("nan")}, r"Received: initial_scale=nan"),
    ({"initial_scale": "big"}, r"Received: initial_scale='big'"),
    ({"dynamic_growth_steps": 0}, r"`dynamic_growth_steps` must be an integer >= 1. Received: dynamic_growth_steps=0"),
    ({"dynamic_growth_steps": 2.5}, r"Received: dynamic_growth_steps=2.5"),
])
def test_constructor_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossScaleOptimizer(SGD(), **kwargs)


def test_inner_optimizer_type_error():
    with pytest.raises(ValueError, match="`inner_optimizer` must be a lossscale.optimizers.Optimizer instance. Received: inner_optimizer='adam'"):
        LossScaleOptimizer("adam")


def test_accumulation_skips_overflowing_micro_step(backend, rng):
    init, variables, opt = setup(backend, rng, inner=Adam(0.01, gradient_accumulation_steps=2),
                                 initial_scale=16.0)
    ref = ReferenceOptimizer(adam_rule(), init, lr=0.01, gradient_accumulation_steps=2)
    for kind in ["f", "inf", "f", "f", "f"]:
        scale = scalar(backend, opt.dynamic_scale)
        grads = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
        scaled = [g * np.float32(scale) for g in grads]
        if kind == "inf":
            scaled[0][1, 1] = np.inf
        else:
            ref.apply(grads)
        opt.apply([backend.array(g) for g in scaled], variables)
        for v, w in zip(variables, ref.w):
            np.testing.assert_allclose(backend.numpy(v), w, rtol=1e-5, atol=1e-6)
        for acc, ref_acc in zip(opt.inner_optimizer._accumulated_gradients, ref.acc):
            np.testing.assert_allclose(backend.numpy(acc), ref_acc, rtol=1e-5, atol=1e-6)
    assert ref.raw_iterations == 4


def test_clipping_sees_unscaled_gradients(backend, rng):
    init, variables, opt = setup(backend, rng, inner=Adam(0.01, global_clipnorm=0.5),
                                 initial_scale=1024.0)
    ref = ReferenceOptimizer(adam_rule(), init, lr=0.01, global_clipnorm=0.5)
    grads = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    opt.apply([backend.array(g * 1024) for g in grads], variables)
    ref.apply(grads)
    for v, w in zip(variables, ref.w):
        np.testing.assert_allclose(backend.numpy(v), w, rtol=1e-5, atol=1e-6)


def test_ema_and_finalize_delegate(backend, rng):
    init, variables, opt = setup(backend, rng, inner=SGD(0.1, use_ema=True, ema_momentum=0.5),
                                 initial_scale=4.0)
    ref = ReferenceOptimizer(adam_rule(), init)  # only its EMA bookkeeping is used
    ref.use_ema, ref.ema_momentum = True, 0.5
    for kind in ["f", "nan", "f"]:
        grads = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
        if kind == "nan":
            grads[0][0, 0] = np.nan
        scale = np.float32(scalar(backend, opt.dynamic_scale))
        opt.apply([backend.array(g * scale) for g in grads], variables)
        if kind == "f":
            ref.w = [w - 0.1 * g for w, g in zip(ref.w, grads)]
            m = 0.0 if ref.raw_iterations == 0 else 0.5
            ref.avg = [m * a + (1 - m) * w for a, w in zip(ref.avg, ref.w)]
            ref.raw_iterations += 1
    opt.finalize_variable_values(variables)
    for v, a in zip(variables, ref.avg):
        np.testing.assert_allclose(backend.numpy(v), a, rtol=1e-5, atol=1e-6)


def test_scale_loss_before_and_after_build(backend, rng):
    _, variables, opt = setup(backend, rng, initial_scale=8.0)
    assert opt.scale_loss(2.0) == 16.0
    opt.build(variables)
    scaled = opt.scale_loss(backend.array(np.float32(3.0)))
    assert float(backend.numpy(scaled)) == 24.0


def test_check_finite(backend):
    opt = LossScaleOptimizer(SGD())
    ok = opt.check_finite([backend.array(np.ones(3)), None])
    bad = opt.check_finite([backend.array(np.ones(3)), backend.array(np.array([1.0, np.nan]))])
    assert bool(backend.numpy(ok)) is True and bool(backend.numpy(bad)) is False
    assert type(ok).__module__.split(".")[0] == type(backend.array(np.ones(1))).__module__.split(".")[0]


def test_properties_read_and_write_through(backend, rng):
    _, variables, opt = setup(backend, rng, inner=SGD(0.1))
    opt.learning_rate = 0.25
    assert float(backend.numpy(opt.inner_optimizer.learning_rate)) == 0.25
    opt.apply([backend.array(np.ones(s, np.float32)) for s in SHAPES], variables)
    assert opt.iterations is opt.inner_optimizer.iterations
    opt.iterations = 7
    assert scalar(backend, opt.inner_optimizer.iterations) == 7
    names = [v.name for v in opt.variables]
    assert names[:2] == ["step_counter", "dynamic_scale"]
    assert names[2:] == [v.name for v in opt.inner_optimizer.variables]
    assert opt.dynamic_scale.dtype == "float32"
    assert opt.step_counter.dtype.startswith("int")


def test_config_round_trip_and_custom_objects():
    class MySGD(SGD):
        pass

    opt = LossScaleOptimizer(MySGD(0.3, momentum=0.5), initial_scale=128.0,
                             dynamic_growth_steps=7, name="ls")
    config = opt.get_config()
    assert sorted(config) == ["dynamic_growth_steps", "initial_scale", "inner_optimizer", "name"]
    with pytest.raises(ValueError, match="Unknown class_name 'MySGD'"):
        LossScaleOptimizer.from_config(config)
    clone = LossScaleOptimizer.from_config(config, custom_objects={"MySGD": MySGD})
    assert isinstance(clone.inner_optimizer, MySGD)
    assert clone.get_config() == config
    assert clone.inner_optimizer.momentum == 0.5


def test_save_load_continues_trajectory(backend, rng):
    _, variables, opt = setup(backend, rng, initial_scale=32.0, dynamic_growth_steps=2)
    steps = [[rng.normal(size=s).astype(np.float32) * 32 for s in SHAPES] for _ in range(6)]
    steps[2][0][0, 0] = np.inf
    for grads in steps[:3]:
        opt.apply([backend.array(g) for g in grads], variables)
    store = {}
    opt.save_own_variables(store)
    saved_model = snapshot(backend, variables)
    clone = LossScaleOptimizer.from_config(opt.get_config())
    twins = [ls.Variable(backend.array(x), name=v.name) for x, v in zip(saved_model, variables)]
    clone.build(twins)
    clone.load_own_variables(store)
    for grads in steps[3:]:
        opt.apply([backend.array(g) for g in grads], variables)
        clone.apply([backend.array(g) for g in grads], twins)
    for a, b in zip(variables + opt.variables, twins + clone.variables):
        np.testing.assert_array_equal(backend.numpy(a), backend.numpy(b))


def test_stateless_apply_matches_apply(backend, rng):
    init, variables, opt = setup(backend, rng, initial_scale=16.0, dynamic_growth_steps=2)
    twins = [ls.Variable(backend.array(x), name=f"t{i}") for i, x in enumerate(init)]
    functional = LossScaleOptimizer(Adam(learning_rate=0.01), initial_scale=16.0,
                                    dynamic_growth_steps=2)
    functional.build(twins)
    opt_values, model_values = [v.value for v in functional.variables], [v.value for v in twins]
    for kind in ["f", "inf", "f", "f", "nan", "f"]:
        grads = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
        if kind != "f":
            grads[1][0] = np.inf if kind == "inf" else np.nan
        native = [backend.array(g) for g in grads]
        opt.apply(native, variables)
        model_values, opt_values = functional.stateless_apply(opt_values, native, model_values)
    for v, x in zip(variables + opt.variables, model_values + opt_values):
        np.testing.assert_allclose(backend.numpy(x), backend.numpy(v), rtol=1e-6)
    for v, x in zip(twins, init):
        np.testing.assert_array_equal(backend.numpy(v), x)


def test_jit_stateless_apply_matches_eager(rng):
    import jax
    import jax.numpy as jnp

    init = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    eager = LossScaleOptimizer(Adam(0.01), initial_scale=16.0, dynamic_growth_steps=2)
    jitted = LossScaleOptimizer(Adam(0.01), initial_scale=16.0, dynamic_growth_steps=2)
    eager_vars = [ls.Variable(jnp.asarray(x)) for x in init]
    jitted.build([ls.Variable(jnp.asarray(x)) for x in init])
    step = jax.jit(jitted.stateless_apply)
    opt_values, model_values = [v.value for v in jitted.variables], [jnp.asarray(x) for x in init]
    for kind in ["f", "inf", "f", "f", "nan", "f", "f"]:
        grads = [jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in SHAPES]
        if kind != "f":
            grads[0] = grads[0].at[0, 0].set(jnp.inf if kind == "inf" else jnp.nan)
        eager.apply(grads, eager_vars)
        model_values, opt_values = step(opt_values, grads, model_values)
    for v, x in zip(eager_vars + eager.variables, model_values + opt_values):
        np.testing.assert_allclose(np.asarray(x), np.asarray(v.value), rtol=1e-5)
    assert float(opt_values[1]) == 16.0 * 0.5 * 2 * 0.5 * 2


def test_torch_module_updated_in_place():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = LossScaleOptimizer(Adam(0.01), initial_scale=256.0)
    x = torch.randn(8, 5)
    before = [p.detach().clone() for p in model.parameters()]
    losses = []
    for _ in range(5):
        model.zero_grad()
        loss = model(x).pow(2).mean()
        opt.scale_loss(loss).backward()
        opt.apply([p.grad for p in model.parameters()], list(model.parameters()))
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for p, b in zip(model.parameters(), before):
        assert not torch.equal(p.detach(), b) and p.requires_grad
