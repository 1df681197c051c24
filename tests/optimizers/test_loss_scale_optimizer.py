"""`LossScaleOptimizer` on every backend: the state machine, skipping, config."""

import numpy as np
import pytest

import lossscale as ls
from lossscale.optimizers import SGD, Adam, LossScaleOptimizer
from tests.reference import F32_MAX, F32_TINY, ReferenceLossScale, ReferenceOptimizer, adam_rule

SHAPES = [(4, 3), (3,)]

# Most tests here hand pre-scaled gradients to `apply` without `scale_loss`.
pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")


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
    _, variables, opt = setup(
        backend, rng, inner=SGD(0.0), initial_scale=2.0, dynamic_growth_steps=2
    )
    scales, counters = [], []
    for _ in range(5):
        opt.apply([backend.array(np.ones(s, np.float32)) for s in SHAPES], variables)
        scales.append(scalar(backend, opt.dynamic_scale))
        counters.append(scalar(backend, opt.step_counter))
    assert scales == [2.0, 4.0, 4.0, 8.0, 8.0]
    assert counters == [1, 0, 1, 0, 1]


def test_growth_never_reaches_inf(backend, rng):
    _, variables, opt = setup(
        backend, rng, inner=SGD(0.0), initial_scale=2.0**127, dynamic_growth_steps=1
    )
    for _ in range(3):
        opt.apply([backend.array(np.ones(s, np.float32)) for s in SHAPES], variables)
        assert scalar(backend, opt.dynamic_scale) == 2.0**127
        assert scalar(backend, opt.step_counter) == 0
    assert 2.0**127 * 2 > F32_MAX


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
    for key, value in [
        ("clipnorm", 1.0),
        ("weight_decay", 0.1),
        ("use_ema", True),
        ("gradient_accumulation_steps", 2),
        ("loss_scale_factor", 2.0),
    ]:
        with pytest.raises(
            ValueError,
            match=f"does not support `{key}`. Instead, set `{key}` on the `inner_optimizer`",
        ):
            LossScaleOptimizer(SGD(), **{key: value})
    LossScaleOptimizer(SGD(), clipnorm=None, use_ema=False, ema_momentum=0.99)  # defaults pass
    with pytest.raises(ValueError, match=r"does not support arguments: \['foo'\]"):
        LossScaleOptimizer(SGD(), foo=1)
    with pytest.raises(ValueError, match="no longer supports `dynamic=False`"):
        LossScaleOptimizer(SGD(), dynamic=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"initial_scale": 0.0},
            r"`initial_scale` must be a finite number > 0 and <= .*Received: initial_scale=0.0",
        ),
        ({"initial_scale": -2.0}, r"Received: initial_scale=-2.0"),
        ({"initial_scale": float("inf")}, r"Received: initial_scale=inf"),
        ({"initial_scale": float("nan")}, r"Received: initial_scale=nan"),
        ({"initial_scale": "big"}, r"Received: initial_scale='big'"),
        (
            {"dynamic_growth_steps": 0},
            r"`dynamic_growth_steps` must be an integer >= 1. Received: dynamic_growth_steps=0",
        ),
        ({"dynamic_growth_steps": 2.5}, r"Received: dynamic_growth_steps=2.5"),
    ],
)
def test_constructor_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossScaleOptimizer(SGD(), **kwargs)


AXIS_MESSAGE = (
    r"^`axis_name` must be a mapped axis name \(a non-empty string\) or a non-empty tuple of "
    r"them, or None. Received: axis_name="
)


@pytest.mark.parametrize(
    "axis_name, shown",
    [(3, "3"), ("", "''"), ((), r"\(\)"), (("model", 1), r"\('model', 1\)"), (["x"], r"\['x'\]")],
)
def test_a_bad_axis_name_is_refused(axis_name, shown):
    with pytest.raises(ValueError, match=AXIS_MESSAGE + shown + "$"):
        LossScaleOptimizer(SGD(), axis_name=axis_name)


def test_axis_name_and_process_group_together_are_refused():
    with pytest.raises(
        ValueError,
        match=r"^Pass `process_group` \(torch.distributed\) or `axis_name` \(JAX `shard_map` / "
        r"`pmap`\), not both. Received: process_group=.*, axis_name='model'$",
    ):
        LossScaleOptimizer(SGD(), axis_name="model", process_group=object())


def test_axis_name_is_jax_only_and_refused_before_anything_is_built(backend, rng):
    opt = LossScaleOptimizer(SGD(), axis_name=("data", "model"))
    assert opt.axis_name == ("data", "model") and "axis_name" not in opt.get_config()
    if backend.name == "jax":
        return  # used inside `shard_map`: tests/test_distributed.py
    variables = [ls.Variable(backend.array(rng.normal(size=(3,)).astype(np.float32)))]
    with pytest.raises(
        ValueError,
        match=r"^`axis_name` names `shard_map` / `pmap` axes and applies to JAX only; on "
        rf"{backend.name} leave it None \(torch.distributed: `process_group`\). Received: "
        r"axis_name=\('data', 'model'\)$",
    ):
        opt.build(variables)
    assert not opt.built and not opt.inner_optimizer.built


def test_inner_optimizer_type_error():
    with pytest.raises(
        ValueError,
        match="`inner_optimizer` must be a lossscale.optimizers.Optimizer, a torch.optim.Optimizer or an optax.GradientTransformation instance. Received: inner_optimizer='adam'",
    ):
        LossScaleOptimizer("adam")


def test_a_wrapper_cannot_wrap_a_wrapper():
    inner = LossScaleOptimizer(SGD())
    with pytest.raises(
        ValueError,
        match=r"`inner_optimizer` is already a LossScaleOptimizer: wrapping it again would "
        r"scale the loss twice\. .*Received: inner_optimizer=<LossScaleOptimizer",
    ):
        LossScaleOptimizer(inner)
    config = ls.optimizers.serialize(LossScaleOptimizer(SGD()))
    nested = {"name": "outer", "inner_optimizer": config}
    with pytest.raises(ValueError, match="already a LossScaleOptimizer"):
        LossScaleOptimizer.from_config(nested)


def test_accumulation_skips_overflowing_micro_step(backend, rng):
    init, variables, opt = setup(
        backend, rng, inner=Adam(0.01, gradient_accumulation_steps=2), initial_scale=16.0
    )
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
    init, variables, opt = setup(
        backend, rng, inner=Adam(0.01, global_clipnorm=0.5), initial_scale=1024.0
    )
    ref = ReferenceOptimizer(adam_rule(), init, lr=0.01, global_clipnorm=0.5)
    grads = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    opt.apply([backend.array(g * 1024) for g in grads], variables)
    ref.apply(grads)
    for v, w in zip(variables, ref.w):
        np.testing.assert_allclose(backend.numpy(v), w, rtol=1e-5, atol=1e-6)


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
    assert (
        type(ok).__module__.split(".")[0]
        == type(backend.array(np.ones(1))).__module__.split(".")[0]
    )


def test_config_round_trip_and_custom_objects():
    class MySGD(SGD):
        pass

    opt = LossScaleOptimizer(
        MySGD(0.3, momentum=0.5), initial_scale=128.0, dynamic_growth_steps=7, name="ls"
    )
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
    functional = LossScaleOptimizer(
        Adam(learning_rate=0.01), initial_scale=16.0, dynamic_growth_steps=2
    )
    functional.build(twins)
    opt_values, model_values = [v.value for v in functional.variables], [v.value for v in twins]
    for kind in ["f", "inf", "f", "f", "nan", "f"]:
        grads = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
        if kind != "f":
            grads[1][0] = np.inf if kind == "inf" else np.nan
        # Separate arrays: torch's fused path leaves unscaled values in the
        # gradients `apply` receives (as GradScaler does).
        opt.apply([backend.array(g) for g in grads], variables)
        model_values, opt_values = functional.stateless_apply(
            opt_values, [backend.array(g) for g in grads], model_values
        )
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


# --- beyond Keras -------------------------------------------------------------

import dataclasses  # noqa: E402
import inspect  # noqa: E402
import re  # noqa: E402
import warnings  # noqa: E402

from hypothesis import given, settings  # noqa: E402

from lossscale.mixed_precision import (  # noqa: E402
    LossScaleError,
    LossScalePolicy,
    UnscaledLossWarning,
    diagnostics,
)
from lossscale.mixed_precision.telemetry import summarize  # noqa: E402
from tests.conftest import BACKENDS, Backend  # noqa: E402
from tests.mixed_precision.test_loss_scale import STEPS, Model, policies  # noqa: E402


def grads_for(backend, scale, kinds, magnitude=1.0):
    """Scaled gradients, one per SHAPES entry: "f" finite, "inf", "nan", or None."""
    out = []
    for shape, kind in zip(SHAPES, kinds):
        if kind is None:
            out.append(None)
            continue
        g = np.full(shape, np.float32(magnitude) * np.float32(scale), np.float32)
        if kind != "f":
            g.flat[1] = np.inf if kind == "inf" else np.nan
        out.append(backend.array(g))
    return out


def test_signature_lists_the_policy_fields():
    parameters = inspect.signature(LossScaleOptimizer.__init__).parameters
    named = {
        n: p.default
        for n, p in parameters.items()
        if n not in ("self", "inner_optimizer", "name", "process_group", "axis_name", "kwargs")
    }
    assert named == {f.name: f.default for f in dataclasses.fields(LossScalePolicy)}
    for f in dataclasses.fields(LossScalePolicy):
        assert getattr(LossScaleOptimizer(SGD()), f.name) == f.default


def test_options_through_the_optimizer(backend, rng):
    _, variables, opt = setup(
        backend,
        rng,
        inner=SGD(0.1),
        initial_scale=16.0,
        dynamic_growth_steps=2,
        growth_factor=4.0,
        backoff_factor=0.25,
        hysteresis=2,
        max_scale=128.0,
    )
    scales = []
    for kinds in [
        ("f", "f"),
        ("f", "f"),
        ("inf", "f"),
        ("f", "f"),
        ("f", "f"),
        ("f", "nan"),
        ("inf", "f"),
        ("f", "inf"),
        ("f", "f"),
        ("f", "f"),
    ]:
        before = snapshot(backend, variables + opt.inner_optimizer.variables)
        opt.apply(grads_for(backend, scalar(backend, opt.dynamic_scale), kinds), variables)
        if kinds != ("f", "f"):
            for b, a in zip(before, snapshot(backend, variables + opt.inner_optimizer.variables)):
                np.testing.assert_array_equal(a, b)
        scales.append(scalar(backend, opt.dynamic_scale))
    assert scales == [16.0, 64.0, 64.0, 64.0, 128.0, 128.0, 32.0, 8.0, 8.0, 32.0]
    assert scalar(backend, opt.iterations) == 6


@pytest.mark.filterwarnings("ignore:Gradients do not exist")
def test_telemetry_after_a_known_sequence(backend, rng):
    _, variables, opt = setup(
        backend, rng, inner=SGD(0.1), initial_scale=8.0, dynamic_growth_steps=2, telemetry=True
    )
    assert [v.name for v in opt.variables[:2]] == ["step_counter", "dynamic_scale"]
    for kinds in [
        ("f", "f"),
        ("f", "nan"),
        ("inf", "inf"),
        ("f", "f"),
        ("f", "f"),
        ("f", None),
        ("inf", None),
        ("f", "f"),
    ]:
        opt.apply(grads_for(backend, scalar(backend, opt.dynamic_scale), kinds), variables)
    assert opt.summary() == {
        "dynamic_scale": 2.0,
        "step_counter": 1,
        "consecutive_skips": 0,
        "steps": 8,
        "skipped_steps": 3,
        "last_overflow_step": 6,
        "scale_history": [8.0, 8.0, 4.0, 2.0, 2.0, 4.0, 4.0, 2.0],
        "nonfinite_variables": ["v0"],
        # `scale_loss` was never called: the loss's flag is not known.
        "overflows": [
            {"step": 1, "variables": ["v1"], "module": None, "loss_finite": None},
            {"step": 2, "variables": ["v0", "v1"], "module": None, "loss_finite": None},
            {"step": 6, "variables": ["v0"], "module": None, "loss_finite": None},
        ],
    }
    names = [v.name for v in opt.variables]
    assert names[-len(opt.inner_optimizer.variables) - 4 : -len(opt.inner_optimizer.variables)] == [
        "v0_nonfinite",
        "v1_nonfinite",
        "v0_overflow_bits",
        "v1_overflow_bits",
    ]


def test_summary_before_build_and_without_telemetry():
    opt = LossScaleOptimizer(SGD(), initial_scale=4.0)
    assert opt.summary() == {"dynamic_scale": 4.0, "step_counter": 0}
    assert opt.check() is None
    summary = LossScaleOptimizer(SGD(), telemetry=True).summary()
    assert summary["steps"] == 0 and summary["last_overflow_step"] is None
    assert summary["scale_history"] == [] and summary["nonfinite_variables"] == []


def test_min_scale_raises_naming_variables_step_and_history(backend, rng):
    _, variables, opt = setup(
        backend, rng, inner=Adam(0.01), initial_scale=4.0, dynamic_growth_steps=3, min_scale=1.0
    )
    opt.apply(grads_for(backend, 4.0, ("f", "f")), variables)
    opt.apply(grads_for(backend, 4.0, ("f", "nan")), variables)
    opt.apply(grads_for(backend, 2.0, ("inf", "nan")), variables)
    before = snapshot(backend, variables + opt.variables)
    with pytest.raises(LossScaleError) as info:
        opt.apply(grads_for(backend, 1.0, ("f", "nan")), variables)
    message = str(info.value)
    assert message.startswith(
        "Loss scaling failed at step 3: the loss scale would fall below "
        "`min_scale` (min_scale=1.0, max_consecutive_skips=None, "
        "hysteresis=1, backoff_factor=0.5)."
    )
    assert "Steps skipped in a row: 3; in total: 3 of 4." in message
    assert "Loss scale of the last steps, oldest first: [4, 4, 2, 1]; now 1." in message
    assert "non-finite at that step: ['v1']." in message
    assert "not from float16 overflow" in message
    after = snapshot(backend, variables + opt.variables)
    changed = [
        v.name
        for v, b, a in zip(variables + opt.variables, before, after)
        if not np.array_equal(a, b, equal_nan=True)
    ]
    # The failing step touched only the loss-scale state.
    assert set(changed) <= {
        "consecutive_skips",
        "steps",
        "skipped_steps",
        "last_overflow_step",
        "error",
        "error_step",
        "v0_nonfinite",
        "v1_nonfinite",
        "v0_overflow_bits",
        "v1_overflow_bits",
    } | {f"{n}_{i}" for n in ("scale_history", "overflow_steps", "overflow_loss") for i in range(8)}
    assert "  step 3: gradients overflowed (the loss was not recorded), non-finite in ['v1']" in (
        message
    )
    assert scalar(backend, opt.iterations) == 1
    frozen = snapshot(backend, variables + opt.variables)
    with pytest.raises(LossScaleError, match="failed at step 3"):
        opt.apply(grads_for(backend, 1.0, ("f", "f")), variables)  # finite, but frozen
    for b, a in zip(frozen, snapshot(backend, variables + opt.variables)):
        np.testing.assert_array_equal(a, b)


def test_max_consecutive_skips_raises(backend, rng):
    _, variables, opt = setup(
        backend, rng, inner=SGD(0.1), initial_scale=2.0**10, max_consecutive_skips=2
    )
    for _ in range(2):
        opt.apply(grads_for(backend, 1.0, ("inf", "f")), variables)
    with pytest.raises(
        LossScaleError,
        match=re.escape(
            "Loss scaling failed at step 2: more than `max_consecutive_skips` steps in a row "
            "were skipped (min_scale=None, max_consecutive_skips=2,"
        ),
    ) as info:
        opt.apply(grads_for(backend, 1.0, ("inf", "f")), variables)
    assert "[1024, 512, 256]; now 128." in str(info.value)
    assert "['v0']" in str(info.value)


def test_stateless_apply_records_and_check_raises(backend, rng):
    init, variables, opt = setup(backend, rng, inner=SGD(0.1), initial_scale=2.0, min_scale=1.0)
    opt.build(variables)
    values, model = [v.value for v in opt.variables], [v.value for v in variables]
    own_before = snapshot(backend, opt.variables)
    for kinds in [("nan", "f"), ("nan", "f"), ("f", "f")]:
        model, values = opt.stateless_apply(values, grads_for(backend, 1.0, kinds), model)
    with pytest.raises(LossScaleError, match="failed at step 1"):
        opt.check(values)
    assert opt.summary(values)["error_step"] == 1
    assert opt.summary(values)["nonfinite_variables"] == ["v0"]
    for x, w in zip(model, init):  # every step was skipped: the model is untouched
        np.testing.assert_array_equal(backend.numpy(x), w)
    for b, v in zip(own_before, opt.variables):
        np.testing.assert_array_equal(backend.numpy(v), b)
    opt.check()  # the optimizer's own state holds no error
    with pytest.raises(
        ValueError,
        match=r"`optimizer_variables` must hold one value per "
        r"optimizer variable \(\d+\). Received: 1 values",
    ):
        opt.summary(values[:1])


def test_jit_fail_fast_traces_once_and_freezes(rng):
    import jax
    import jax.numpy as jnp

    backend = Backend("jax")
    init, variables, opt = setup(
        backend,
        rng,
        inner=Adam(0.01),
        initial_scale=8.0,
        dynamic_growth_steps=2,
        max_consecutive_skips=1,
        growth_policy="headroom",
        telemetry=True,
    )
    opt.build(variables)
    traces = []

    def step(values, grads, model):
        traces.append(1)
        return opt.stateless_apply(values, grads, model)

    jitted = jax.jit(step)
    values, model = [v.value for v in opt.variables], [v.value for v in variables]
    for kinds in [("f", "f"), ("f", "f"), ("inf", "f"), ("f", "f"), ("f", "nan"), ("nan", "f")]:
        scale = float(values[1])
        model, values = jitted(values, grads_for(backend, scale, kinds), model)
        opt.check(values) if kinds != ("nan", "f") else None
    frozen_model = [np.asarray(x) for x in model]
    with pytest.raises(LossScaleError, match="failed at step 5"):
        opt.check(values)
    model, values = jitted(values, grads_for(backend, 1.0, ("f", "f")), model)
    for a, b in zip(model, frozen_model):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert opt.summary(values)["nonfinite_variables"] == ["v0"]
    assert len(traces) == 1
    assert jnp.asarray(values[1]).dtype == jnp.float32


def test_headroom_growth_through_the_optimizer(backend, rng):
    _, variables, opt = setup(
        backend,
        rng,
        inner=SGD(0.0),
        initial_scale=8.0,
        dynamic_growth_steps=1,
        growth_policy="headroom",
    )
    scales = []
    # Scaled gradients of 5000 cannot double below 65504 / 8; of 100 they can.
    for magnitude in [100.0, 5000.0, 100.0]:
        scale = scalar(backend, opt.dynamic_scale)
        opt.apply(grads_for(backend, scale, ("f", "f"), magnitude / scale), variables)
        scales.append(scalar(backend, opt.dynamic_scale))
    assert scales == [16.0, 16.0, 32.0]
    opt.apply(grads_for(backend, 32.0, ("f", "nan")), variables)
    assert scalar(backend, opt.dynamic_scale) == 16.0


def test_headroom_still_checks_overwrite_with_gradient_variables(backend, rng):
    _, variables, opt = setup(
        backend, rng, inner=SGD(0.5), initial_scale=8.0, growth_policy="headroom"
    )
    variables[1].overwrite_with_gradient = True
    before = snapshot(backend, variables)
    opt.apply(grads_for(backend, 8.0, ("f", "nan")), variables)
    for b, a in zip(before, snapshot(backend, variables)):
        np.testing.assert_array_equal(a, b)
    assert scalar(backend, opt.dynamic_scale) == 4.0


def test_unscaled_loss_warning_once_and_silenceable(backend, rng):
    _, variables, opt = setup(backend, rng, inner=SGD(0.1), initial_scale=8.0)
    grads = grads_for(backend, 8.0, ("f", "f"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.apply(grads, variables)
        opt.apply(grads, variables)
    assert [w.category for w in caught] == [UnscaledLossWarning]
    assert "`scale_loss()` was never called" in str(caught[0].message)
    assert "category=lossscale.mixed_precision.UnscaledLossWarning" in str(caught[0].message)
    assert caught[0].filename == __file__
    _, variables, scaled = setup(backend, rng, inner=SGD(0.1))
    scaled.scale_loss(backend.array(np.float32(1.0)))
    functional = LossScaleOptimizer(SGD(0.1))
    functional.build(variables)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaled.apply(grads, variables)
        functional.stateless_apply(
            [v.value for v in functional.variables], grads, [v.value for v in variables]
        )
    _, variables, silenced = setup(backend, rng, inner=SGD(0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=UnscaledLossWarning)
        silenced.apply(grads, variables)


def test_config_holds_changed_settings_and_round_trips():
    opt = LossScaleOptimizer(
        SGD(0.3),
        initial_scale=64.0,
        hysteresis=2,
        min_scale=0.5,
        growth_policy="headroom",
        telemetry=True,
    )
    config = opt.get_config()
    assert sorted(config) == [
        "dynamic_growth_steps",
        "growth_policy",
        "hysteresis",
        "initial_scale",
        "inner_optimizer",
        "min_scale",
        "name",
        "telemetry",
    ]
    clone = LossScaleOptimizer.from_config(config)
    assert clone.policy == opt.policy and clone.get_config() == config
    assert [v.name for v in clone.variables] == [v.name for v in opt.variables]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"hysteresis": 0}, "`hysteresis` must be an integer >= 1. Received: hysteresis=0"),
        ({"growth_policy": "auto"}, "Received: growth_policy='auto'"),
        ({"telemetry": "yes"}, "`telemetry` must be a boolean. Received: telemetry='yes'"),
        ({"min_scale": 4.0, "initial_scale": 2.0}, "Received: min_scale=4.0, initial_scale=2.0"),
        ({"max_consecutive_skips": 1.5}, "Received: max_consecutive_skips=1.5"),
        (
            {"bogus": 1},
            r"does not support arguments: \['bogus'\]. Accepted: inner_optimizer, name, "
            r"initial_scale, dynamic_growth_steps, growth_factor, backoff_factor, "
            r"hysteresis, min_scale, max_scale, max_consecutive_skips, growth_policy, "
            r"telemetry",
        ),
    ],
)
def test_new_constructor_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossScaleOptimizer(SGD(), **kwargs)


def test_save_load_own_variables_with_telemetry(backend, rng):
    _, variables, opt = setup(
        backend, rng, initial_scale=32.0, telemetry=True, hysteresis=2, max_consecutive_skips=5
    )
    steps = [
        grads_for(backend, 32.0, kinds)
        for kinds in [
            ("f", "f"),
            ("inf", "f"),
            ("f", "nan"),
            ("f", "f"),
            ("nan", "nan"),
            ("f", "f"),
        ]
    ]
    for grads in steps[:3]:
        opt.apply(grads, variables)
    store = {}
    opt.save_own_variables(store)
    twins = [ls.Variable(backend.array(backend.numpy(v)), name=v.name) for v in variables]
    clone = LossScaleOptimizer.from_config(opt.get_config())
    clone.build(twins)
    clone.load_own_variables(store)
    assert clone.summary() == opt.summary()
    for grads in steps[3:]:  # each `apply` gets its own copy (torch unscales in place)
        opt.apply([backend.array(backend.numpy(g)) for g in grads], variables)
        clone.apply(grads, twins)
    assert clone.summary() == opt.summary()
    for a, b in zip(variables + opt.variables, twins + clone.variables):
        np.testing.assert_array_equal(backend.numpy(a), backend.numpy(b))


# The whole optimizer against the model of tests/mixed_precision/test_loss_scale.py: random
# options and step sequences, stateful and stateless, on every backend.
KIND = {True: "f", False: "inf", None: None}


@settings(max_examples=15, deadline=None)
@given(policy=policies(), steps=STEPS)
@pytest.mark.parametrize("name", BACKENDS)  # as many examples on each backend
def test_optimizer_matches_model(name, policy, steps):
    backend = Backend(name)
    settings_ = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    rng = np.random.default_rng(0)
    init = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    variables = [ls.Variable(backend.array(x), name=f"v{i}") for i, x in enumerate(init)]
    opt = LossScaleOptimizer(SGD(0.125), **settings_)
    functional = LossScaleOptimizer(SGD(0.125), **settings_)
    functional.build([ls.Variable(backend.array(x), name=f"v{i}") for i, x in enumerate(init)])
    values, model_values = [v.value for v in functional.variables], [backend.array(x) for x in init]
    model = Model(policy, len(SHAPES))
    weights = [x.astype(np.float64) for x in init]
    ranges = [[0.0] * 4 for _ in SHAPES]  # each variable's last measured float16 range
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for flags, peak, _, _ in steps:
            flags = flags[: len(SHAPES)]
            if all(ok is None for ok in flags):
                continue
            magnitude = 1.0 if peak < 1000 else 30000.0  # far from the headroom limits
            scale = np.float32(scalar(backend, opt.dynamic_scale))
            grads = grads_for(backend, 1.0, [KIND[ok] for ok in flags], magnitude)
            if flags[0] is False and flags[1] is True:
                grads[0] = backend.array(
                    np.where(np.arange(12).reshape(4, 3) == 5, np.nan, backend.numpy(grads[0]))
                )
            with np.errstate(over="ignore"):
                unscaled = np.float32(magnitude) / scale
            # A finite gradient that overflows when unscaled counts as non-finite.
            flags = [ok and bool(np.isfinite(unscaled)) if ok is not None else None for ok in flags]
            finite = all(ok is not False for ok in flags)
            applied = finite and not model.error
            if policy.diagnoses and model.steps % policy.diagnostics_every == 0:
                for i, g in enumerate(grads):
                    if g is not None:
                        ranges[i] = float16_range_of(backend.numpy(g), policy.growth_factor)
            near, measured_peak = max(r[2] for r in ranges), max(r[3] for r in ranges)
            statistics = policy.growth_policy == "statistics"
            model.step(finite, measured_peak if statistics else magnitude, flags, -1, near)
            if applied:
                weights = [
                    w - 0.125 * np.float64(unscaled) if ok is not None else w
                    for w, ok in zip(weights, flags)
                ]
            try:
                # torch unscales what `apply` is given in place: a copy for it.
                opt.apply(
                    [g if g is None else backend.array(backend.numpy(g)) for g in grads], variables
                )
            except LossScaleError:
                assert model.error
            model_values, values = functional.stateless_apply(values, grads, model_values)
            for value, v, w in zip(model_values, variables, weights):
                np.testing.assert_allclose(backend.numpy(v), w, rtol=1e-5, atol=1e-6)
                np.testing.assert_array_equal(backend.numpy(value), backend.numpy(v))
            expected = model.expected()
            expected.setdefault("nonfinite", [])
            for k, field in enumerate(diagnostics.FIELDS):
                expected[field] = [r[k] for r in ranges]
            expected = summarize(expected, policy, ["v0", "v1"])
            got = opt.summary()
            if model.error and policy.diagnoses:
                # Once frozen, nothing is decided: measuring then is not specified.
                expected["float16_range"] = got["float16_range"]
            assert nan_named(got) == nan_named(expected)
            if model.error and policy.diagnoses:
                continue
            assert nan_named(functional.summary(values)) == nan_named(got)


def nan_named(x):
    """`x` with every float NaN replaced by the string "nan" (NaN != NaN in comparisons)."""
    if isinstance(x, dict):
        return {k: nan_named(v) for k, v in x.items()}
    if isinstance(x, list):
        return [nan_named(v) for v in x]
    return "nan" if isinstance(x, float) and np.isnan(x) else x


def float16_range_of(g, growth_factor):
    """`[zero, subnormal, near_max, max_abs]` of a scaled gradient, counted in float64."""
    a = np.abs(np.asarray(g, np.float64))
    with np.errstate(invalid="ignore"):
        shares = [
            np.mean(a == 0),
            np.mean((a > 0) & (a < 2.0**-14)),
            np.mean(a >= 65504.0 / growth_factor),
        ]
    peak = np.nan if np.isnan(a).any() else np.max(a)
    return [float(np.float32(x)) for x in shares] + [float(np.float32(peak))]


def test_torch_unscales_the_callers_gradients_in_place(rng):
    # As torch.amp.GradScaler does: no unscaled copies of the gradients; the
    # tensors passed to `apply` hold the unscaled values afterwards. The
    # step equals the one on copies (clipping reads the gradients first,
    # and a gradient of an autograd graph is never written).
    import torch

    init = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    in_place = [ls.Variable(torch.from_numpy(x.copy())) for x in init]
    copied = [ls.Variable(torch.from_numpy(x.copy())) for x in init]
    fast = LossScaleOptimizer(Adam(0.01), initial_scale=8.0, dynamic_growth_steps=2)
    slow = LossScaleOptimizer(Adam(0.01), initial_scale=8.0, dynamic_growth_steps=2)
    for kind in ["f", "f", "inf", "f", "nan", "f", "f"]:
        grads = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
        if kind != "f":
            grads[0][1, 1] = np.inf if kind == "inf" else np.nan
        scale = np.float32(float(fast.dynamic_scale))
        passed = [torch.from_numpy(g * scale) for g in grads]
        in_graph = [torch.from_numpy(g * scale).requires_grad_() * 1.0 for g in grads]
        fast.scale_loss(1.0), slow.scale_loss(1.0)
        fast.apply(passed, in_place)
        slow.apply(in_graph, copied)
        np.testing.assert_array_equal(passed[1].numpy(), grads[1])  # unscaled: 8 and 16 are exact
        np.testing.assert_array_equal(in_graph[1].detach().numpy(), grads[1] * scale)  # untouched
    for a, b in zip(in_place + fast.variables, copied + slow.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # stateless_apply never writes what it was given.
    given = [torch.from_numpy(rng.normal(size=s).astype(np.float32)) for s in SHAPES]
    before = [g.clone() for g in given]
    fast.stateless_apply([v.value for v in fast.variables], given, [v.value for v in in_place])
    for g, b in zip(given, before):
        assert torch.equal(g, b)


def test_overflow_after_unscaling_is_caught_on_torch():
    import torch

    w = ls.Variable(torch.ones(3))
    opt = LossScaleOptimizer(Adam(0.1), initial_scale=2 * F32_TINY)
    opt.scale_loss(1.0)
    opt.apply([torch.full((3,), 1e30)], [w])  # finite, but 1e30 / 2.4e-38 overflows
    np.testing.assert_array_equal(w.numpy(), [1.0, 1.0, 1.0])
    assert float(opt.dynamic_scale) == pytest.approx(F32_TINY, rel=1e-6)
