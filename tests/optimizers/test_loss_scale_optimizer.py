"""`LossScaleOptimizer` on every backend: the state machine, skipping, config.

Then on torch: operations per step, `torch.compile` and CUDA graphs; what it
records about its steps (the loss's flag, observers, snapshots, the
measurement's cadence); what it hands to its inner optimizer; `summary()`
and `check()` read between steps.
"""

import dataclasses  # noqa: E402
import inspect  # noqa: E402
import re  # noqa: E402
import warnings  # noqa: E402

import numpy as np
import pytest
import torch
from hypothesis import given, settings  # noqa: E402

import lossscale as ls
from lossscale.mixed_precision import (  # noqa: E402
    LossScaleError,
    LossScalePolicy,
    UnscaledLossWarning,
    diagnostics,
)
from lossscale.mixed_precision.telemetry import summarize  # noqa: E402
from lossscale.optimizers import SGD, Adam, LossScaleOptimizer
from tests.conftest import BACKENDS, Backend  # noqa: E402
from tests.mixed_precision.test_diagnostics import SHAPES as MEASURED_SHAPES
from tests.mixed_precision.test_diagnostics import build, scaled_grads
from tests.mixed_precision.test_loss_scale import STEPS, Model, policies  # noqa: E402
from tests.reference import F32_MAX, F32_TINY, ReferenceLossScale, ReferenceOptimizer, adam_rule
from tests.torch_cases import OPTIMIZERS, count_ops

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
        if n
        not in (
            "self",
            "inner_optimizer",
            "name",
            "on_persistent",
            "agreement_every",
            "process_group",
            "axis_name",
            "kwargs",
        )
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
        "persistent_step": None,
        "last_step_skipped": False,
        # `scale_loss` was never called: the loss's flag is not known.
        "overflows": [
            {
                "step": 1,
                "cause": "overflow",
                "variables": ["v1"],
                "module": None,
                "loss_finite": None,
            },
            {
                "step": 2,
                "cause": "overflow",
                "variables": ["v0", "v1"],
                "module": None,
                "loss_finite": None,
            },
            {
                "step": 6,
                "cause": "overflow",
                "variables": ["v0"],
                "module": None,
                "loss_finite": None,
            },
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
    assert opt.summary() == {"dynamic_scale": 4.0, "step_counter": 0, "last_step_skipped": False}
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
    # v1 non-finite through back-offs down to a scale of 1: no back-off can clear it.
    assert message.startswith(
        "Loss scaling failed at step 3: persistent: the same 1 variable (v1) stayed non-finite "
        "through back-offs since step 1, down to scale 1; backing off cannot help"
    )
    assert (
        "Stopped because the loss scale would fall below `min_scale` (min_scale=1.0, "
        "max_consecutive_skips=None, hysteresis=1, backoff_factor=0.5). Steps skipped in a "
        "row: 3; in total: 3 of 4."
    ) in message
    assert "Loss scale of the last steps, oldest first: [4, 4, 2, 1]; now 1." in message
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
        "streak_scale",
        "persistent_step",
    } | {
        f"{n}_{i}"
        for n in ("scale_history", "overflow_steps", "overflow_loss", "overflow_cause")
        for i in range(8)
    }
    assert "  step 3: persistent, loss not recorded; non-finite: 1 variable (v1)" in message
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
            "Loss scaling failed at step 2: overflow: gradients of 1 variable (v0) overflowed at "
            "step 2 (the loss was not recorded); backing off the scale clears an overflow.\n"
            "Stopped because more than `max_consecutive_skips` steps in a row were skipped "
            "(min_scale=None, max_consecutive_skips=2,"
        ),
    ) as info:
        opt.apply(grads_for(backend, 1.0, ("inf", "f")), variables)
    assert "[1024, 512, 256]; now 128." in str(info.value)
    assert "  steps 0-2: overflow, loss not recorded; non-finite: 1 variable (v0)" in str(
        info.value
    )


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
            expected["last_step_skipped"] = not applied  # `apply` keeps its decision
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
            stateless = functional.summary(values)
            if not policy.records_details:  # no telemetry to tell the skip from
                got.pop("last_step_skipped")
            assert nan_named(stateless) == nan_named(got)


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


# The fused paths: a step's every operation, 16 parameters in one group.
# torch.amp.GradScaler + torch.optim.Adam(fused=True) dispatches 13.
# The fused kernels take the AMP check's own `found_inf` (the explicit
# `found_inf` of `_step`: no select of a new one from `keep`). On the CPU
# Adam's step size is computed on the host from the step count (one read)
# and AdamW's decay is folded into torch's fused AdamW kernel.
FUSED_OPS = {
    "sgd": 9,
    "sgd_momentum": 9,
    "sgd_nesterov": 10,
    "adam": 10,
    "adam_amsgrad": 10,
    "adamw": 10,
}


# Where nothing is read on the host (a GPU, forced below by making the CPU
# not host-readable): Adam's step size is six kernels (`1 - beta**t` written
# into a kept pair whose elements are views made once: no `unbind`), and
# AdamW's decay its own pass (the factor kept while the learning rate does
# not change, a select of it under `keep`, one multiplication per group).
DEVICE_OPS = {"adam": 15, "adamw": 17}


def device_path(monkeypatch):
    """Makes the CPU not host-readable: the step then takes the path it takes on a GPU."""
    from lossscale.backends.torch import multi

    monkeypatch.setattr(multi, "HOST_READABLE", frozenset())


def ops_per_step(make, count, shape=(64, 32)):
    """The aten operations of one warm `apply` on `count` parameters."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for _ in range(count)]
    grads = [torch.randn(shape, generator=generator) * 1024 for _ in range(count)]
    opt = ls.LossScaleOptimizer(make(), initial_scale=1024.0)
    opt.scale_loss(1.0)
    for _ in range(3):  # builds, caches the plans and packing buffers
        opt.apply([g.clone() for g in grads], params)
    given = [g.clone() for g in grads]
    with count_ops() as ops:
        opt.apply(given, params)
    return ops


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_operations_per_step_do_not_grow_with_the_parameters(name):
    ops = ops_per_step(OPTIMIZERS[name], 16)
    assert len(ops_per_step(OPTIMIZERS[name], 32)) == len(ops), name
    if name in FUSED_OPS:
        assert len(ops) == FUSED_OPS[name] <= 18, ops
        # No per-tensor work at all (selects, reductions, aliases): each
        # kernel covers the whole group.
        per_tensor = {"aten.where.self_out", "aten.aminmax.default", "aten.detach.default"}
        assert not per_tensor & set(ops), ops


def test_the_adam_step_names_its_operations():
    ops = ops_per_step(OPTIMIZERS["adam"], 16)
    assert ops == [
        # A CPU scale is read on the host (nothing to wait for): a power of
        # two >= 1, so one AMP pass divides and checks the unscaled values
        # (tests/backends/torch/test_multi.py). A CUDA scale is not read: there
        # `_foreach_div_` unscales, and the AMP kernel checks at scale 1.
        "aten._local_scalar_dense.default",
        "aten.zeros.default",  # the found_inf flag
        "aten._amp_foreach_non_finite_check_and_unscale_.default",  # unscale, and check
        "aten.eq.Scalar",  # the flag as a boolean, for the step counter
        # The step count, read on the host: the step size is computed there
        # (the learning rate read once, kept while its tensor is unwritten).
        "aten._local_scalar_dense.default",
        "aten._fused_adam_.default",  # skips itself where the check's found_inf is 1
        "aten.add_.Tensor",  # iterations += finite
        "aten._amp_update_scale_.default",  # the scale and the counter, in place
        "aten.mul.Tensor",
        "aten.clamp_min_.Tensor",  # the backoff floor
    ]


def test_the_adamw_step_folds_the_decay_into_the_kernel():
    adam = ops_per_step(OPTIMIZERS["adam"], 16)
    adamw = ops_per_step(OPTIMIZERS["adamw"], 16)
    assert adamw == [op.replace("_fused_adam_", "_fused_adamw_") for op in adam]
    assert len(adamw) == FUSED_OPS["adamw"] <= 13


def test_the_device_adam_step_names_its_operations(monkeypatch):
    device_path(monkeypatch)
    ops = ops_per_step(OPTIMIZERS["adam"], 16)
    assert ops == [
        "aten._foreach_div_.Tensor",  # the scale is not read: divided, then checked at 1
        "aten.zeros.default",  # the found_inf flag
        "aten._amp_foreach_non_finite_check_and_unscale_.default",
        "aten.eq.Scalar",
        "aten.add.out",  # t = iterations + 1, cast as it is stored
        "aten.pow.Tensor_Tensor",  # (beta_1, beta_2) ** t
        "aten.sub.out",  # 1 - that, into the kept pair (views of it made once)
        "aten.sqrt.default",
        "aten.mul.Tensor",  # alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)
        "aten.div.Tensor",
        "aten._fused_adam_.tensor_lr",
        "aten.add_.Tensor",
        "aten._amp_update_scale_.default",
        "aten.mul.Tensor",
        "aten.clamp_min_.Tensor",
    ]
    assert len(ops) == DEVICE_OPS["adam"]


def test_the_device_adamw_step_adds_the_decay_select_and_multiplication(monkeypatch):
    device_path(monkeypatch)
    adam = ops_per_step(OPTIMIZERS["adam"], 16)
    adamw = ops_per_step(OPTIMIZERS["adamw"], 16)
    at = adam.index("aten.add.out")  # the decay runs before the Adam update
    assert adamw == adam[:at] + ["aten.where.self", "aten._foreach_mul_.Tensor"] + adam[at:]
    assert len(adamw) == DEVICE_OPS["adamw"]


def test_the_sgd_momentum_step_names_its_operations():
    ops = ops_per_step(OPTIMIZERS["sgd_momentum"], 16)
    assert ops == [
        "aten._local_scalar_dense.default",  # the CPU scale, read on the host
        "aten.zeros.default",  # the found_inf flag
        "aten._amp_foreach_non_finite_check_and_unscale_.default",
        "aten.eq.Scalar",  # the flag as a boolean, for the step counter
        # `-lr` as `1 - dampening` (the CPU rate read on the host once, kept
        # while the learning rate is unchanged): no `-lr * g` tensors.
        "aten._fused_sgd_.default",  # skips itself where the check's found_inf is 1
        "aten.add_.Tensor",  # iterations += finite
        "aten._amp_update_scale_.default",
        "aten.mul.Tensor",
        "aten.clamp_min_.Tensor",  # the backoff floor
    ]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_compiles_into_one_graph_that_never_recompiles(name):
    torch.compiler.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        runs = _compiled_and_eager(name)
    torch.compiler.reset()
    (compiled_trail, compiled_params), (eager_trail, eager_params) = runs
    assert compiled_trail == eager_trail
    # Compiled on the CPU, Adam runs the eager step as one opaque operation
    # (`lossscale::fused_adam_`, bit for bit: tests/backends/torch/test_fused.py);
    # SGD takes its foreach rule (torch cannot trace its fused kernels), which
    # rounds a little differently from the fused one.
    for a, b in zip(compiled_params, eager_params):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


# docs/torch_compile.md's lean compile: Dynamo's tensor guards only, no Inductor size asserts.
LEAN = {"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe, "size_asserts": False}


@pytest.mark.parametrize("options", [{}, LEAN], ids=["default", "lean"])
def test_an_inductor_compiled_adam_step_is_the_eager_step_bit_for_bit(options):
    """Inductor itself, with and without the lean options: one graph, and the eager run exactly.

    Compiled on the CPU, Adam's update is the eager step as one opaque
    operation (`lossscale::fused_adam_`); the unscale and finite check are
    Inductor's loops, over a gradient past torch's packing threshold and
    small ones, with an inf and a NaN at either end of a gradient.
    """
    shapes = [(300, 250), (7,), (3, 5)]  # 75,000 elements: past PACK_BELOW (2**16)
    bad = {2: (0, 0, float("inf")), 4: (0, -1, float("nan")), 5: (1, -1, float("-inf"))}
    runs = []
    for compiled in (True, False):
        generator = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
        opt = ls.LossScaleOptimizer(
            OPTIMIZERS["adam"](), initial_scale=64.0, dynamic_growth_steps=2
        )
        opt.scale_loss(1.0)
        opt.build(params)

        def step(grads, opt=opt, params=params):
            opt.apply(grads, params)

        if compiled:
            torch.compiler.reset()
            torch._dynamo.utils.counters.clear()
            step = torch.compile(step, fullgraph=True, options=options)
        trail = []
        for k in range(7):
            grads = [torch.randn(s, generator=generator) * 64 for s in shapes]
            if k in bad:
                which, at, value = bad[k]
                grads[which].view(-1)[at] = value
            with torch._dynamo.config.patch(error_on_recompile=True):
                step(grads)
            trail.append((float(opt.dynamic_scale), int(opt.iterations)))
        if compiled:
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
            torch.compiler.reset()
        runs.append((trail, [p.detach().clone() for p in params]))
    (compiled_trail, compiled_params), (eager_trail, eager_params) = runs
    assert compiled_trail == eager_trail
    assert [it for _, it in eager_trail] == [1, 2, 2, 3, 3, 3, 4]  # three skipped steps
    assert all(torch.equal(a, b) for a, b in zip(compiled_params, eager_params))


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_a_compiled_step_divides_the_gradients_inside_the_update(name):
    """Traced, Adam takes the loss scale into its kernel: no divided copy of a gradient.

    The eager step's one AMP pass (divide and check) became, traced, a loop
    writing the divided gradients into fresh buffers every step (on
    `large`, 64 MiB page-faulted in again each step: the compiled step 3.4x
    the eager one). Now a reduction reads the scaled gradients and torch's
    fused kernel divides them as it updates: after an applied step the
    caller's gradients hold the unscaled values, after a skipped one the
    scaled ones, untouched.
    """
    shapes = [(300, 250), (7,), (3, 5)]  # past PACK_BELOW, and small ones
    generator = torch.Generator().manual_seed(11)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    opt = ls.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=64.0, dynamic_growth_steps=2)
    opt.scale_loss(1.0)
    opt.build(params)
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch.compiler.reset()
    step = torch.compile(lambda grads: opt.apply(grads, params), fullgraph=True, backend=capture)
    for k, bad in enumerate([None, (0, -1), None, (2, 0), None]):
        grads = [torch.randn(s, generator=generator) * 64 for s in shapes]
        if bad is not None:
            grads[bad[0]].view(-1)[bad[1]] = float("nan")
        scaled, scale = [g.clone() for g in grads], float(opt.dynamic_scale)
        with torch._dynamo.config.patch(error_on_recompile=True):
            step(grads)
        expected = scaled if bad is not None else [g / scale for g in scaled]
        bits = [(g.view(torch.int32), e.view(torch.int32)) for g, e in zip(grads, expected)]
        assert all(torch.equal(g, e) for g, e in bits), k  # NaN included
    torch.compiler.reset()
    (graph,) = graphs
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    (adam,) = [n for n in calls if str(n.target) == "lossscale.fused_adam_.default"]
    assert adam.args[-1] is not None  # the scale, divided out in torch's kernel
    # Nothing else makes a tensor of a gradient's size: no divided copy.
    sizes = {int(np.prod(s)) for s in shapes if int(np.prod(s)) > 64}
    made = [
        str(n.target)
        for n in calls
        if n is not adam
        and isinstance(n.meta.get("example_value"), torch.Tensor)
        and n.meta["example_value"].numel() in sizes
    ]
    assert made == [], made


def test_the_unscaled_loss_warning_is_given_once_without_breaking_the_graph():
    # `scale_loss` never called: the warning is given while tracing (a
    # constant to the compiler), not replayed by the compiled step.
    torch.compiler.reset()
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3)]
    opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3), initial_scale=8.0)
    opt.build(params)
    step = torch.compile(lambda grads: opt.apply(grads, params), fullgraph=True, backend="eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            step([torch.randn(4, 3) for _ in range(3)])
    torch.compiler.reset()
    assert [type(w.message) for w in seen] == [ls.mixed_precision.UnscaledLossWarning]
    assert int(opt.inner_optimizer.iterations) == 3


def test_the_compiled_check_is_left_to_the_compiler():
    """No AMP check kernel in the traced step: it would run on functional copies.

    Compiled, the finite check is plain reductions the compiler fuses into
    the loops that unscale the gradients.
    """
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch.compiler.reset()
    generator = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in [(6, 4), (4,)]]
    opt = ls.LossScaleOptimizer(OPTIMIZERS["adam"](), initial_scale=64.0)
    opt.scale_loss(1.0)
    opt.build(params)
    grads = [torch.randn(p.shape, generator=generator) for p in params]
    torch.compile(lambda: opt.apply(grads, params), fullgraph=True, backend=capture)()
    torch.compiler.reset()
    (graph,) = graphs
    called = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert not any("non_finite_check" in name for name in called), called
    assert any("isfinite" in name for name in called), called


def _compiled_and_eager(name):
    runs = []
    for compiled in (True, False):
        generator = torch.Generator().manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in [(6, 4), (4,)]]
        opt = ls.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=64.0, dynamic_growth_steps=2)
        opt.scale_loss(1.0)
        opt.build(params)

        def step(grads, opt=opt, params=params):
            opt.apply(grads, params)

        if compiled:
            # fullgraph: any graph break is an error; aot_eager traces like
            # the default backend without generating code.
            step = torch.compile(step, fullgraph=True, backend="aot_eager")
        trail = []
        for kind in ["f", "f", "inf", "f", "nan", "f", "f"]:
            grads = [torch.randn(p.shape, generator=generator) * 64 for p in params]
            if kind != "f":
                grads[1][0] = float(kind)
            before = [p.detach().clone() for p in params]
            step(grads)
            if kind != "f":  # skipped: every parameter bit for bit as it was
                assert all(torch.equal(b, p) for b, p in zip(before, params))
            trail.append((float(opt.dynamic_scale), int(opt.iterations)))
        runs.append((trail, [p.detach().clone() for p in params]))
    return runs


def cuda_graph_replays_a_step(make):
    """A whole step captured once in a CUDA graph and replayed on new gradients.

    A GPU check, not collected on machines without CUDA (CI has none, and a
    skipped test would read as a missing feature).
    """
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    shapes = [(64, 32), (32,), (32, 8)]
    init = [torch.randn(s, device=device, generator=generator) for s in shapes]
    steps = [
        [torch.randn(s, device=device, generator=generator) * 8 for s in shapes] for _ in range(6)
    ]
    steps[3][1][0] = float("inf")

    def make_run():
        params = [torch.nn.Parameter(x.clone()) for x in init]
        opt = ls.LossScaleOptimizer(make(), initial_scale=8.0, dynamic_growth_steps=2)
        opt.scale_loss(1.0)
        return params, opt

    params, opt = make_run()
    static = [torch.zeros(s, device=device) for s in shapes]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for g, x in zip(static, steps[0]):
            g.copy_(x)
        opt.apply(static, params)  # warm: builds, caches plans and buffers
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.apply(static, params)
    eager_params, eager = make_run()
    eager.apply([x.clone() for x in steps[0]], eager_params)
    for grads in steps[1:]:
        for g, x in zip(static, grads):
            g.copy_(x)
        graph.replay()
        eager.apply([x.clone() for x in grads], eager_params)
    torch.cuda.synchronize()
    for a, b in zip(params, eager_params):
        assert torch.equal(a, b)
    assert float(opt.dynamic_scale) == float(eager.dynamic_scale)


if torch.cuda.is_available():
    test_cuda_graph_replays_a_step = pytest.mark.parametrize(
        "make",
        [OPTIMIZERS["adam"], OPTIMIZERS["adamw"], OPTIMIZERS["lion"]],
        ids=["adam", "adamw", "lion"],
    )(cuda_graph_replays_a_step)


def test_a_traced_loss_is_not_recorded():
    # Inside `jax.grad` the loss is a tracer, which no variable may keep.
    import jax
    import jax.numpy as jnp

    variables, opt = build(Backend("jax"), telemetry=True)
    jax.grad(lambda w: opt.scale_loss(jnp.sum(w)))(jnp.ones(3))
    assert int(opt._state["loss_finite"].value) == -1


@pytest.mark.parametrize("name", BACKENDS)
def test_snapshot_is_a_copy_later_steps_leave_alone(name):
    backend = Backend(name)
    variables, opt = build(backend, telemetry=True)
    opt.scale_loss(1.0)
    rng = np.random.default_rng(6)
    first = opt.snapshot()
    with np.errstate(invalid="ignore"):  # 0 * inf: NaN among the infs, on purpose
        bad = [g * np.inf for g in scaled_grads(rng, 1.0)]
    opt.apply([backend.array(g) for g in bad], variables)
    assert first["dynamic_scale"] == 2.0**10 and first["overflows"] == []
    assert opt.snapshot()["dynamic_scale"] == 2.0**9


class Recorder:
    """An observer: the steps it was told of, and a module for each overflow."""

    def __init__(self):
        self.calls = []

    def on_step(self, finite, step):
        self.calls.append((finite, step))

    def modules_at(self, steps):
        return {s: f"block{s}" for s in steps}


def test_observers_hear_every_step_and_name_the_module():
    backend = Backend("numpy")
    variables, opt = build(backend, telemetry=True)
    recorder = Recorder()
    handle = opt.register_step_observer(recorder)
    rng = np.random.default_rng(7)
    opt.scale_loss(1.0)
    for bad in (False, True):
        grads = scaled_grads(rng, float(opt.dynamic_scale))
        grads[0][0, 0] = np.inf if bad else grads[0][0, 0]
        opt.apply([backend.array(g) for g in grads], variables)
    assert [(bool(f), int(s)) for f, s in recorder.calls] == [(True, 0), (False, 1)]
    assert opt.summary()["overflows"][0]["module"] == "block1"
    handle.remove()
    opt.apply([backend.array(g) for g in scaled_grads(rng, 1.0)], variables)
    assert len(recorder.calls) == 2
    assert opt.summary()["overflows"][0]["module"] is None


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_starts_without_the_observers(how):
    """An observer is bound to a model: a copy does not call it, the original still does."""
    import copy
    import pickle

    backend = Backend("numpy")
    variables, opt = build(backend, telemetry=True)
    recorder = Recorder()
    opt.register_step_observer(recorder)
    copied_vars, copied = (
        copy.deepcopy((variables, opt))
        if how == "deepcopy"
        else pickle.loads(pickle.dumps((variables, opt)))
    )
    rng = np.random.default_rng(3)
    copied.scale_loss(1.0)
    copied.apply([backend.array(g) for g in scaled_grads(rng, 1.0)], copied_vars)
    assert recorder.calls == [] and copied._observers == []
    opt.scale_loss(1.0)
    opt.apply([backend.array(g) for g in scaled_grads(rng, 1.0)], variables)
    assert len(recorder.calls) == 1


def test_no_host_read_in_a_torch_step_with_diagnostics_and_telemetry():
    import torch

    from tests.torch_cases import count_ops

    def reads(**settings):
        params = [torch.nn.Parameter(torch.randn(s)) for s in MEASURED_SHAPES]
        opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3), initial_scale=1024.0, **settings)
        opt.build(params)
        counts = []
        for _ in range(3):  # the first step is measured
            grads = [torch.randn(s) * 1024 for s in MEASURED_SHAPES]
            with count_ops() as seen:
                opt.scale_loss(torch.tensor(1.0))
                opt.apply(grads, params)
            counts.append(seen.count("aten._local_scalar_dense.default"))
        return counts

    # The CPU scale read by the fused Adam step (above),
    # and nothing more: the cadence is counted on the host.
    reads()  # the process's one-time checks of the host arithmetic (backends/torch/host.py)
    plain = reads()
    assert reads(diagnostics_every=2) == plain
    assert reads(diagnostics_every=1, telemetry=True) == reads(telemetry=True)


def test_a_compiled_torch_step_decides_on_the_device_and_never_recompiles():
    # A host count would be a guard of the compiled step, which changes
    # every step: under torch.compile the cadence is the device's.
    import torch

    torch.compiler.reset()
    params = [torch.nn.Parameter(torch.randn(s)) for s in MEASURED_SHAPES]
    eager = [torch.nn.Parameter(p.detach().clone()) for p in params]
    settings = dict(initial_scale=8.0, diagnostics_every=2, telemetry=True)
    compiled_opt = ls.LossScaleOptimizer(ls.optimizers.SGD(1e-3), **settings)
    eager_opt = ls.LossScaleOptimizer(ls.optimizers.SGD(1e-3), **settings)
    for opt, ps in ((compiled_opt, params), (eager_opt, eager)):
        opt.scale_loss(1.0)
        opt.build(ps)
    step = torch.compile(lambda g: compiled_opt.apply(g, params), fullgraph=True, backend="eager")
    rng = np.random.default_rng(9)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(5):
            grads = [torch.from_numpy(g) for g in scaled_grads(rng, 8.0)]
            step([g.clone() for g in grads])
            eager_opt.apply([g.clone() for g in grads], eager)
    torch.compiler.reset()
    assert compiled_opt.summary() == eager_opt.summary()
    assert compiled_opt.summary()["float16_range_step"] == 4


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("where", ["first", "last", "random", "none"])
def test_a_loss_per_example_is_finite_only_if_every_entry_is(name, where):
    backend = Backend(name)
    _, opt = build(backend, telemetry=True)
    losses = np.random.default_rng(11).standard_normal(257).astype(np.float32)
    index = {"first": 0, "last": 256, "random": 93, "none": None}[where]
    if index is not None:
        losses[index] = np.nan if where == "random" else np.inf
    opt.scale_loss(backend.array(losses))
    assert int(backend.numpy(opt._state["loss_finite"])) == (index is None)
    opt.scale_loss(backend.array(np.float32(2.0)))  # a scalar
    assert int(backend.numpy(opt._state["loss_finite"])) == 1


@pytest.mark.parametrize("name", ["numpy", "torch"])
@pytest.mark.parametrize("loss", [1.5, float("nan"), float("-inf")])
def test_a_python_number_loss_is_flagged_on_the_host(name, loss):
    _, opt = build(Backend(name), telemetry=True)
    opt.scale_loss(loss)
    assert int(opt._state["loss_finite"].value) == int(np.isfinite(loss))


@pytest.mark.parametrize("name", ["numpy", "torch"])
def test_observers_keep_each_step_s_index_though_the_state_is_written_in_place(name):
    backend = Backend(name)
    variables, opt = build(backend, telemetry=True)
    first, second = Recorder(), Recorder()
    handle = opt.register_step_observer(first)
    opt.register_step_observer(second)
    rng = np.random.default_rng(12)
    opt.scale_loss(1.0)
    for _ in range(3):
        opt.apply([backend.array(g) for g in scaled_grads(rng, 1.0)], variables)
    assert [int(backend.numpy(s)) for _, s in first.calls] == [0, 1, 2]
    handle.remove()
    handle.remove()  # a second time: nothing, and the other observer stays
    opt.apply([backend.array(g) for g in scaled_grads(rng, 1.0)], variables)
    assert len(first.calls) == 3 and len(second.calls) == 4
    assert [int(backend.numpy(s)) for _, s in second.calls] == [0, 1, 2, 3]


# --- resuming: the measuring steps are the uninterrupted run's -----------------
def _statistics_run(make_params, load=None, split=3, steps=7):
    """Seven steps of the statistics policy (measuring every 2nd); `load` resumes at `split`.

    `load(opt, fresh, params)` moves the state of `opt` into `fresh`, built on
    `params`. Returns the scales and the last measured step.
    """
    import torch

    def make():
        return ls.LossScaleOptimizer(
            torch.optim.Adam(params, lr=0.01) if torch_native else ls.optimizers.Adam(0.01),
            initial_scale=256.0,
            dynamic_growth_steps=1,
            growth_policy="statistics",
            diagnostics_every=2,
            telemetry=True,
        )

    rng = np.random.default_rng(0)
    params, torch_native = make_params()
    opt = make()
    opt.scale_loss(1.0)
    scales = []
    for k in range(steps):
        if load is not None and k == split:
            params, _ = make_params(
                [np.asarray(p.detach() if torch_native else p.numpy()) for p in params]
            )
            fresh = make()
            load(opt, fresh, params)
            opt = fresh
            opt.scale_loss(1.0)
        # Large gradients every third step: no room to grow there.
        size = 20.0 if k % 3 == 0 else 0.01
        grads = [rng.normal(size=64).astype(np.float32) * size * float(opt.dynamic_scale)]
        if torch_native:
            grads = [torch.from_numpy(g) for g in grads]
        opt.apply(grads, params)
        scales.append(float(opt.dynamic_scale))
    return scales, opt.summary()["float16_range_step"]


def _numpy_params(values=None):
    values = values or [np.ones(64, np.float32)]
    return [ls.Variable(v.copy(), name="w") for v in values], False


def _torch_params(values=None):
    import torch

    values = values or [np.ones(64, np.float32)]
    return [torch.nn.Parameter(torch.from_numpy(v.copy())) for v in values], True


def _by_state_dict(opt, fresh, params):
    if not getattr(fresh.inner_optimizer, "keeps_native_state", False):
        fresh.build(params)  # a torch optimizer's wrapper loads unbuilt
    fresh.load_state_dict(opt.state_dict())


def _by_store(opt, fresh, params):
    store = {}
    opt.save_own_variables(store)
    fresh.build(params)
    fresh.load_own_variables(store)


def _by_weights(opt, fresh, params):
    fresh.build(params)
    fresh.set_weights([v.numpy() for v in opt.variables])


def _by_file(opt, fresh, params):
    import tempfile

    from lossscale import saving

    with tempfile.TemporaryDirectory() as folder:
        saving.save(opt, f"{folder}/opt.lossscale")
        fresh.build(params)
        saving.restore(fresh, f"{folder}/opt.lossscale")


@pytest.mark.parametrize(
    "make_params, load",
    [
        (_numpy_params, _by_state_dict),
        (_numpy_params, _by_store),
        (_numpy_params, _by_weights),
        (_numpy_params, _by_file),
        (_torch_params, _by_state_dict),  # the native optimizer's state dict
    ],
    ids=["state_dict", "own_variables", "set_weights", "saving", "torch_native"],
)
def test_a_resumed_run_measures_on_the_uninterrupted_run_s_steps(make_params, load):
    uninterrupted = _statistics_run(make_params)
    assert _statistics_run(make_params, load) == uninterrupted
    assert uninterrupted[1] == 6


def test_a_jitted_jax_step_reserves_no_copy_of_the_gradients_for_diagnostics():
    """XLA reserves the measurement branch's memory on every step, taken or not.

    `large`'s 16 gradients of 1M elements: with `diagnostics_every` the
    jitted `stateless_apply` reserves at most the measurement's packed
    elements more (`backends/jax/float16_range.py`), where packing every
    gradient reserved 69 MiB, a float32 copy of them all and the rows'
    counts.
    """
    import jax

    from lossscale.backends.jax import float16_range
    from lossscale.bench import frameworks, workloads

    params, grads = frameworks.jax_arrays(jax, workloads.get("large"))

    def reserved(every):
        opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3), diagnostics_every=every)
        opt.build(params)
        step = jax.jit(lambda p, v, g: opt.stateless_apply(v, g, p), donate_argnums=(0, 1))
        values = [v.value for v in opt.variables]
        return step.lower(params, values, grads).compile().memory_analysis().temp_size_in_bytes

    assert reserved(100) - reserved(None) <= 4 * float16_range.PACK_CAPACITY * 1.2


def _arrays_larger_than(hlo, elements):
    """`(operation, shape)` of each array over `elements` that XLA's optimized HLO writes out.

    Only the instructions of unfused computations make buffers (a fusion's
    inside does not); parameters, views (`bitcast`) and a loop's reads of
    its own state (`get-tuple-element`) are left out.
    """
    import re

    found, fused = [], False
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%(\S+) ", line)
        if header:  # a computation starts at the line's first column
            fused = "fused" in header.group(1) or header.group(1).startswith("wrapped_")
            continue
        match = re.match(r"\s*(?:ROOT )?\S+ = (\w+\[[\d,]*\])\{[^}]*\} (\S+)\(", line)
        if fused or match is None:
            continue
        shape, operation = match.groups()
        if operation in ("parameter", "bitcast", "get-tuple-element"):
            continue
        if np.prod([int(d) for d in re.findall(r"\d+", shape.split("[")[1])]) > elements:
            found.append((operation, shape))
    return sorted(found)


def test_an_xla_compiled_tensorflow_step_writes_out_no_gradient_sized_array_for_diagnostics():
    """Under `tf.function(jit_compile=True)` the measurement adds no array larger than a chunk.

    Measured whole, each of its comparisons was an int32 array of the
    largest gradient's size, which XLA reserves in the branch on every
    step; now a gradient of more than `CHUNK` (1M) elements is read a chunk
    at a time (`backends/tensorflow/float16_range.py`). The step with
    diagnostics writes out the same large arrays as the step without (the
    update's own).
    """
    import tensorflow as tf

    from lossscale.backends.tensorflow import float16_range

    shapes = [(3 * float16_range.CHUNK + 5,), (1500, 1001), (64,)]

    def large_arrays(every):
        variables = [tf.Variable(tf.zeros(s)) for s in shapes]
        opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3), diagnostics_every=every)
        opt.build(variables)

        @tf.function(jit_compile=True)
        def step(*grads):
            opt.scale_loss(1.0)
            opt.apply(list(grads), variables)

        specs = [tf.TensorSpec(s, tf.float32) for s in shapes]
        hlo = step.experimental_get_compiler_ir(*specs)(stage="optimized_hlo")
        return _arrays_larger_than(hlo, float16_range.CHUNK)

    without = large_arrays(None)
    assert without  # the update's own arrays are seen
    assert large_arrays(100) == without


def test_ema_and_finalize_delegate(backend, rng):
    init, variables, opt = setup(
        backend, rng, inner=SGD(0.1, use_ema=True, ema_momentum=0.5), initial_scale=4.0
    )
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


def test_exclude_from_weight_decay_reaches_the_inner_optimizer(backend, rng):
    init, variables, opt = setup(backend, rng, inner=SGD(0.1, weight_decay=0.5), initial_scale=2.0)
    opt.exclude_from_weight_decay(var_names=["v1"])
    opt.scale_loss(1.0)
    opt.apply([backend.array(np.zeros(s, np.float32)) for s in SHAPES], variables)
    np.testing.assert_allclose(backend.numpy(variables[0]), init[0] * (1 - 0.05), rtol=1e-6)
    np.testing.assert_array_equal(backend.numpy(variables[1]), init[1])


def built(backend, **kwargs):
    params = [backend.array(np.random.default_rng(0).normal(size=(3,)))]
    opt = ls.LossScaleOptimizer(ls.optimizers.SGD(0.1), initial_scale=8.0, **kwargs)
    opt.build(params)
    return params, opt


def test_summary_reads_given_values_instead_of_the_variables(backend):
    params, opt = built(backend, dynamic_growth_steps=2)
    values = [v.value for v in opt.variables]
    bad = [backend.array(np.array([np.inf, 1.0, 2.0]))]
    _, values = opt.stateless_apply(values, bad, [p for p in params])
    # Given values say nothing of the last step without telemetry.
    assert opt.summary(values) == {"dynamic_scale": 4.0, "step_counter": 0}
    assert opt.summary() == {  # untouched
        "dynamic_scale": 8.0,
        "step_counter": 0,
        "last_step_skipped": False,
    }


def test_check_raises_only_on_a_recorded_error(backend):
    params, opt = built(backend, max_consecutive_skips=0)
    values = [v.value for v in opt.variables]
    opt.check(values)  # nothing recorded yet
    bad = [backend.array(np.array([np.nan, 1.0, 2.0]))]
    _, values = opt.stateless_apply(values, bad, list(params))
    with pytest.raises(LossScaleError, match="Loss scaling failed at step 0"):
        opt.check(values)
    opt.check()  # the optimizer's own variables recorded nothing


def test_values_must_match_the_variables_one_for_one(backend):
    _, plain = built(backend)
    _, limited = built(backend, max_consecutive_skips=3)
    for opt, method in (
        (plain, plain.summary),
        (limited, limited.summary),
        (limited, limited.check),
    ):
        count = len(opt.variables)
        with pytest.raises(
            ValueError,
            match=(
                rf"`optimizer_variables` must hold one value per optimizer variable "
                rf"\({count}\). Received: {count - 1} values"
            ),
        ):
            method([v.value for v in opt.variables][:-1])
    with pytest.raises(ValueError, match=r"variable \(\d+\). Received: 0 values"):
        plain.check([])  # values to check: their count first
