"""`lossscale.keras.LossScaleOptimizer` in this process (Keras on torch): a crossed fail-fast limit.

Once `max_consecutive_skips` or `min_scale` is crossed, the state records
the error and freezes: every later step is skipped, finite ones included,
so the model's weights never move again (`apply`, which raises
`LossScaleError` after each such step, and `stateless_apply`, whose
`check(values)` raises).
"""

import os

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import lossscale.keras as lsk  # noqa: E402
from lossscale.mixed_precision import LossScaleError  # noqa: E402

SCALE = 2.0**10
# `(settings, steps up to and including the crossing one)`: "f" finite, "inf" / "nan"
# one such value in one gradient. Finite steps follow the crossing one.
LIMITS = {
    # Three skips in a row: more than two.
    "max_consecutive_skips": ({"max_consecutive_skips": 2}, ["f", "inf", "f", "nan", "inf", "inf"]),
    # 1024 -> 512 -> 256, then a backoff to 128 would go below 200.
    "min_scale": ({"min_scale": 200.0}, ["f", "nan", "f", "inf", "f", "inf"]),
}
FINITE_AFTER = 4


def make_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    return model, list(model.trainable_variables)


def gradients(variables, rng, kind, scale):
    grads = [
        torch.from_numpy(rng.normal(size=tuple(v.shape)).astype("float32") * np.float32(scale))
        for v in variables
    ]
    if kind != "f":
        target = grads[int(rng.integers(len(grads)))].view(-1)
        target[int(rng.integers(target.numel()))] = np.inf if kind == "inf" else np.nan
    return grads


def snapshot(variables):
    return [keras.ops.convert_to_numpy(v.value).copy() for v in variables]


def assert_same(before, after, what):
    assert len(before) == len(after)
    for b, a in zip(before, after):
        a = keras.ops.convert_to_numpy(a)
        assert b.dtype == a.dtype and b.shape == a.shape, what
        bits = lambda x: np.ascontiguousarray(x).reshape(-1).view(np.uint8)  # noqa: E731
        assert np.array_equal(bits(b), bits(a)), what


@pytest.mark.parametrize("inner", ["adam", "sgd"])
@pytest.mark.parametrize("mode", ["apply", "stateless_apply"])
@pytest.mark.parametrize("limit", sorted(LIMITS))
def test_after_a_crossed_limit_no_step_moves_the_weights(limit, mode, inner):
    settings, steps = LIMITS[limit]
    _, variables = make_model()
    rule = keras.optimizers.Adam(1e-3) if inner == "adam" else keras.optimizers.SGD(0.1, 0.9)
    opt = lsk.LossScaleOptimizer(rule, SCALE, 1000, **settings)
    opt.build(variables)
    opt.scale_loss(torch.ones(()))  # the gradients below are of a scaled loss
    rng = np.random.default_rng(sorted(LIMITS).index(limit))

    def step(kind):
        grads = gradients(
            variables, rng, kind, float(keras.ops.convert_to_numpy(opt.dynamic_scale))
        )
        if mode == "apply":
            opt.apply(grads, variables)
            return
        new_values, new_opt = opt.stateless_apply(
            [v.value for v in opt.variables], grads, [v.value for v in variables]
        )
        for v, x in zip([*variables, *opt.variables], [*new_values, *new_opt]):
            v.assign(x)
        opt.check(new_opt)  # stateless_apply never raises: its values are checked

    # Up to the crossing step: no error, the finite steps applied.
    for kind in steps[:-1]:
        before = snapshot(variables)
        step(kind)
        moved = [not np.array_equal(b, a) for b, a in zip(before, snapshot(variables))]
        assert all(moved) if kind == "f" else not any(moved), kind
    applied = steps.count("f")
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == applied

    # The crossing step: skipped, the error recorded and raised.
    before = snapshot(variables)
    with pytest.raises(LossScaleError):
        step(steps[-1])
    assert_same(before, [v.value for v in variables], "the crossing step")
    frozen = snapshot(opt.variables)

    # Every later step, finite as it is: skipped, the state as it was, raising again.
    for k in range(FINITE_AFTER):
        with pytest.raises(LossScaleError):
            step("f")
        assert_same(before, [v.value for v in variables], f"finite step {k} after the crossing")
        assert_same(frozen, [v.value for v in opt.variables], f"optimizer state, step {k}")
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == applied
