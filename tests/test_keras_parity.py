"""Parity with Keras 3 (torch backend) for the core: LossScaleOptimizer around SGD and Adam.

The same random scenario, with injected inf and NaN steps, runs through
Keras's optimizer and ours; every variable, the scale and the counter are
compared after every step.
"""

import contextlib
import os
import warnings

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import lossscale as ls  # noqa: E402

# The scenario feeds pre-scaled gradients directly, as the comparison needs.
pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")

SHAPES = [(6, 4), (4,), (4, 1)]
PATTERN = ["f", "f", "inf", "f", "nan", "f", "f", "f", "inf", "f", "f", "f"]

CASES = {
    "adam": (lambda: keras.optimizers.Adam(0.01), lambda: ls.optimizers.Adam(0.01)),
    "adam_amsgrad_wd": (
        lambda: keras.optimizers.Adam(0.01, amsgrad=True, weight_decay=0.05),
        lambda: ls.optimizers.Adam(0.01, amsgrad=True, weight_decay=0.05),
    ),
    "sgd_nesterov_clip": (
        lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True, clipnorm=0.5),
        lambda: ls.optimizers.SGD(0.05, momentum=0.9, nesterov=True, clipnorm=0.5),
    ),
    "sgd_accumulation_ema": (
        lambda: keras.optimizers.SGD(
            0.05,
            gradient_accumulation_steps=2,
            use_ema=True,
            ema_momentum=0.9,
            ema_overwrite_frequency=2,
        ),
        lambda: ls.optimizers.SGD(
            0.05,
            gradient_accumulation_steps=2,
            use_ema=True,
            ema_momentum=0.9,
            ema_overwrite_frequency=2,
        ),
    ),
    "adam_global_clipnorm": (
        lambda: keras.optimizers.Adam(0.02, global_clipnorm=0.3),
        lambda: ls.optimizers.Adam(0.02, global_clipnorm=0.3),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_scale_optimizer_matches_keras(case):
    make_keras, make_ours = CASES[case]
    rng = np.random.default_rng(42)
    init = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    k_vars = [keras.Variable(x.copy()) for x in init]
    o_vars = [ls.Variable(torch.from_numpy(x.copy())) for x in init]
    k_opt = keras.optimizers.LossScaleOptimizer(
        make_keras(), initial_scale=256.0, dynamic_growth_steps=3
    )
    o_opt = ls.LossScaleOptimizer(make_ours(), initial_scale=256.0, dynamic_growth_steps=3)
    for kind in PATTERN:
        grads = [rng.normal(size=s).astype(np.float32) * 256 for s in SHAPES]
        if kind != "f":
            grads[1][2] = np.inf if kind == "inf" else np.nan
        k_opt.apply([torch.from_numpy(g.copy()) for g in grads], k_vars)
        o_opt.apply([torch.from_numpy(g.copy()) for g in grads], o_vars)
        for k, o in zip(k_vars, o_vars):
            np.testing.assert_allclose(
                o.numpy(), keras.ops.convert_to_numpy(k), rtol=1e-5, atol=1e-6
            )
        assert float(o_opt.dynamic_scale) == float(keras.ops.convert_to_numpy(k_opt.dynamic_scale))
        assert int(o_opt.step_counter) == int(keras.ops.convert_to_numpy(k_opt.step_counter))
        assert int(o_opt.iterations) == int(keras.ops.convert_to_numpy(k_opt.iterations))
    for name in ("step_counter", "dynamic_scale", "iterations"):  # int32, float32, int32
        assert getattr(o_opt, name).dtype == getattr(k_opt, name).dtype, name
    # Inner optimizer state matches slot for slot (Keras lists its own
    # unused iteration/learning-rate variables first; ours does not).
    k_inner = [keras.ops.convert_to_numpy(v) for v in k_opt.inner_optimizer.variables]
    o_inner = [v.numpy() for v in o_opt.inner_optimizer.variables]
    assert len(k_inner) == len(o_inner)
    for k, o in zip(k_inner, o_inner):
        assert o.dtype == k.dtype
        np.testing.assert_allclose(o, k, rtol=1e-5, atol=1e-6)


def test_config_keys_match_keras():
    ours = ls.LossScaleOptimizer(ls.optimizers.Adam()).get_config()
    theirs = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()).get_config()
    assert sorted(ours) == sorted(theirs)
    assert sorted(ours["inner_optimizer"]["config"]) == sorted(theirs["inner_optimizer"]["config"])
    for name in ("Adam", "SGD"):
        assert sorted(getattr(ls.optimizers, name)().get_config()) == sorted(
            getattr(keras.optimizers, name)().get_config()
        )


def _apply_keras_and_ours(make_keras, make_ours, wrap, steps, shapes, seed):
    """Runs one scenario of gradients (with `None`s and overflows) through both."""
    rng = np.random.default_rng(seed)
    init = [rng.normal(size=s).astype(np.float32) for s in shapes]
    k_vars = [keras.Variable(x.copy()) for x in init]
    o_vars = [ls.Variable(torch.from_numpy(x.copy())) for x in init]
    k_opt, o_opt = make_keras(), make_ours()
    if wrap:
        k_opt = keras.optimizers.LossScaleOptimizer(k_opt, initial_scale=64.0)
        o_opt = ls.LossScaleOptimizer(o_opt, initial_scale=64.0)
    for present, kind in steps:
        grads = [
            rng.normal(size=s).astype(np.float32) * (64.0 if wrap else 1.0) if p else None
            for s, p in zip(shapes, present)
        ]
        if kind != "f":
            next(g for g in grads if g is not None)[0] = np.inf
        with warnings.catch_warnings():  # "Gradients do not exist for variables ..."
            warnings.simplefilter("ignore", UserWarning)
            k_opt.apply([None if g is None else torch.from_numpy(g.copy()) for g in grads], k_vars)
            o_opt.apply([None if g is None else torch.from_numpy(g.copy()) for g in grads], o_vars)
        for k, o in zip(k_vars, o_vars):
            np.testing.assert_allclose(
                o.numpy(), keras.ops.convert_to_numpy(k), rtol=1e-5, atol=1e-6
            )
    return k_opt, o_opt


def test_accumulation_window_with_a_none_gradient_matches_keras():
    # The example: the second variable has no gradient at an update
    # step; Keras drops its partial sum there (ends at -99, not -104).
    k_vars = [keras.Variable(np.ones(1, np.float32)) for _ in range(2)]
    o_vars = [ls.Variable(torch.ones(1)) for _ in range(2)]
    k_opt = keras.optimizers.SGD(1.0, gradient_accumulation_steps=2)
    o_opt = ls.optimizers.SGD(1.0, gradient_accumulation_steps=2)
    for g1, g2 in [(1, 10), (1, None), (1, 100), (1, 100)]:
        grads = [torch.tensor([float(g1)]), None if g2 is None else torch.tensor([float(g2)])]
        with pytest.warns(UserWarning) if g2 is None else contextlib.nullcontext():
            k_opt.apply(grads, k_vars)
        with (
            pytest.warns(UserWarning, match=r"Gradients do not exist")
            if g2 is None
            else (contextlib.nullcontext())
        ):
            o_opt.apply(grads, o_vars)
    expected = [keras.ops.convert_to_numpy(v).tolist() for v in k_vars]
    assert expected == [[-1.0], [-99.0]]
    assert [v.numpy().tolist() for v in o_vars] == expected


@pytest.mark.parametrize("wrap", [False, True], ids=["bare", "loss_scaled"])
def test_accumulation_with_none_gradients_and_overflows_matches_keras(wrap):
    shapes = [(3, 2), (2,), (4,)]
    both, first, last = (True, True, True), (True, False, True), (False, True, True)
    steps = [(both, "f"), (first, "f"), (last, "f"), (both, "f"), (first, "f"), (both, "f")]
    if wrap:  # an overflow inside a window: skipped, the window does not move
        steps[3:3] = [(both, "inf")]
        steps += [(last, "inf"), (both, "f"), (first, "f")]
    k_opt, o_opt = _apply_keras_and_ours(
        lambda: keras.optimizers.Adam(0.05, gradient_accumulation_steps=3),
        lambda: ls.optimizers.Adam(0.05, gradient_accumulation_steps=3),
        wrap,
        steps,
        shapes,
        seed=7,
    )
    assert int(o_opt.iterations) == int(keras.ops.convert_to_numpy(k_opt.iterations))
