"""`lossscale.keras.LossScaleOptimizer` in this process (Keras on torch): construction and config.

What needs `fit` on every backend is in `test_fit.py`; the callback in
`test_callback.py`, the step's pieces in `test_step.py` and `test_gates.py`.
"""

import os

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import lossscale as ls  # noqa: E402
import lossscale.keras as lsk  # noqa: E402


def test_it_is_keras_s_wrapper():
    opt = lsk.LossScaleOptimizer(keras.optimizers.Adam(), hysteresis=2)
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
    assert isinstance(opt, keras.optimizers.Optimizer)
    assert keras.optimizers.get(opt) is opt
    assert opt.hysteresis == 2 and opt.initial_scale == 2.0**15


def test_config_holds_keras_keys_then_changed_extras():
    inner = keras.optimizers.SGD(0.5, name="sgd")
    ours = lsk.LossScaleOptimizer(inner, 128.0, 10, name="ls", min_scale=1.0, telemetry=True)
    theirs = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.5, name="sgd"), 128.0, 10, name="ls"
    )
    config = ours.get_config()
    assert config == {**theirs.get_config(), "min_scale": 1.0, "telemetry": True}
    again = lsk.LossScaleOptimizer.from_config(config)
    assert again.get_config() == config and config["min_scale"] == 1.0  # not consumed
    # Keras's own wrapper reads a default config of ours.
    plain = lsk.LossScaleOptimizer(keras.optimizers.SGD(0.5)).get_config()
    # (a copy: Keras's from_config consumes the dict it is given)
    assert keras.optimizers.LossScaleOptimizer.from_config(dict(plain)).get_config() == plain


def test_stateless_apply_equals_apply():
    rng = np.random.default_rng(0)
    values = [rng.normal(size=s).astype("float32") for s in [(3, 2), (2,)]]
    runs = []
    for stateless in (False, True):
        rng = np.random.default_rng(1)  # the same gradients for both
        variables = [keras.Variable(v.copy(), name=f"w{i}") for i, v in enumerate(values)]
        opt = lsk.LossScaleOptimizer(keras.optimizers.Adam(0.1), 8.0, 2, telemetry=True)
        opt.build(variables)
        for i in range(5):
            grads = [
                torch.from_numpy(rng.normal(size=v.shape).astype("float32") * 8) for v in values
            ]
            if i == 2:
                grads[0][1, 1] = torch.nan
            if stateless:
                new_vars, new_opt = opt.stateless_apply(
                    [v.value for v in opt.variables], grads, [v.value for v in variables]
                )
                for v, x in zip(variables, new_vars):
                    v.assign(x)
                for v, x in zip(opt.variables, new_opt):
                    v.assign(x)
            else:
                opt.apply(grads, variables)
        runs.append(([keras.ops.convert_to_numpy(v) for v in variables], opt.summary()))
    (a, summary_a), (b, summary_b) = runs
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert summary_a == summary_b and summary_a["skipped_steps"] == 1
    # The scale each step used (not the one after it: the history's last
    # entry is the scale variable's value, written in the same step).
    assert summary_a["scale_history"][-5:] == [8.0, 8.0, 16.0, 8.0, 8.0]


class _NoHostRead:
    """Makes every read of a torch tensor's value on the host raise, while active."""

    NAMES = ("__bool__", "item", "tolist", "__int__", "__float__", "numpy")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def refuse(*args, **kwargs):
            raise AssertionError("host read")

        for n in self.NAMES:
            setattr(torch.Tensor, n, refuse)

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("inject", [False, True])
def test_torch_step_reads_nothing_on_the_host(inject):
    variables = [keras.Variable(np.ones((4, 3), "float32")), keras.Variable(np.zeros(3, "float32"))]
    grads = [torch.full((4, 3), 64.0), torch.full((3,), 64.0)]
    if inject:
        grads[1][0] = torch.inf
    ours = lsk.LossScaleOptimizer(keras.optimizers.Adam(0.1), 64.0, 2)
    theirs = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.1), 64.0, 2)
    for opt in (ours, theirs):
        opt.build(variables)
    with _NoHostRead():
        ours.apply(grads, variables)
        with pytest.raises(AssertionError, match="host read"):  # Keras's `if` on the flag
            theirs.apply(grads, variables)
    expected = 32.0 if inject else 64.0
    assert float(keras.ops.convert_to_numpy(ours.dynamic_scale)) == expected
    assert int(keras.ops.convert_to_numpy(ours.iterations)) == (0 if inject else 1)


BAD = [
    (lambda: lsk.LossScaleOptimizer(ls.optimizers.Adam()), "must be a Keras optimizer"),
    (lambda: lsk.LossScaleOptimizer("adam"), "must be a keras.optimizers.Optimizer instance"),
    (
        lambda: lsk.LossScaleOptimizer(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
        ),
        "already a LossScaleOptimizer",
    ),
    (
        lambda: lsk.LossScaleOptimizer(lsk.LossScaleOptimizer(keras.optimizers.Adam())),
        "already a LossScaleOptimizer",
    ),
    (
        lambda: lsk.LossScaleOptimizer(keras.optimizers.Adam(), dynamic_growth_steps=0),
        r"`dynamic_growth_steps` must be an integer >= 1. Received: dynamic_growth_steps=0",
    ),
    (
        lambda: lsk.LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=float("inf")),
        r"`initial_scale` must be a finite number > 0 .* Received: initial_scale=inf",
    ),
    (
        lambda: lsk.LossScaleOptimizer(keras.optimizers.Adam(), hysteresis=0),
        r"`hysteresis` must be an integer >= 1. Received: hysteresis=0",
    ),
    (
        lambda: lsk.LossScaleOptimizer(keras.optimizers.Adam(), growth_policy="up"),
        r"`growth_policy` must be one of .* Received: growth_policy='up'",
    ),
    (
        lambda: lsk.LossScaleOptimizer(keras.optimizers.Adam(), clipnorm=1.0),
        "does not support `clipnorm`. Instead, set `clipnorm` on the `inner_optimizer`",
    ),
    (
        lambda: lsk.LossScaleOptimizer(keras.optimizers.Adam(), diagnostics_every=0),
        r"diagnostics_every",
    ),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_input_is_refused_before_anything_is_built(case):
    make, message = BAD[case]
    inner_before = keras.optimizers.Adam()
    with pytest.raises(ValueError, match=message):
        make()
    assert inner_before.loss_scale_factor is None and not inner_before.built


def test_import_lossscale_imports_no_keras():
    import subprocess
    import sys

    code = "import sys, lossscale; print('keras' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_docstring_example():
    name = "lossscale.keras.optimizer"
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_a_float16_variable_s_gradient_is_unscaled_in_float32_where_keras_keeps_float16():
    # Keras's wrapper on torch divides a half gradient by the float32 0-d
    # scale, which torch computes in float16; ours unscales half gradients
    # in float32 on every backend, so small values keep their precision.
    rng = np.random.default_rng(2)
    start = rng.normal(size=(64, 32)).astype("float16")
    grad = torch.from_numpy((rng.normal(size=(64, 32)) * 2.0**-6).astype("float16"))
    seen, values = {}, {}
    for name, wrapper in (
        ("keras", keras.optimizers.LossScaleOptimizer),
        ("ours", lsk.LossScaleOptimizer),
    ):
        variable = keras.Variable(start.copy(), dtype="float16", name="w")
        inner = keras.optimizers.SGD(1.0)
        apply = inner.apply

        def spy(grads, trainable_variables=None, apply=apply, name=name):
            seen[name] = (grads[0].dtype, grads[0].clone())
            return apply(grads, trainable_variables)

        inner.apply = spy
        opt = wrapper(inner, initial_scale=2.0**13)
        opt.apply([grad * 2.0**13], [variable])
        values[name] = np.asarray(variable.numpy(), np.float32)
    assert seen["keras"][0] == torch.float16 and seen["ours"][0] == torch.float32
    exact = grad.double() * 2.0**13 / 2.0**13
    assert torch.equal(seen["ours"][1].double(), exact)
    expected = (torch.from_numpy(start).float() - seen["ours"][1]).half().float().numpy()
    np.testing.assert_array_equal(values["ours"], expected)


def test_a_resumed_wrapper_measures_on_the_uninterrupted_run_s_steps():
    # On torch the diagnostics cadence is a host count: a load sets it from `steps`.
    def run(split=None):
        rng = np.random.default_rng(0)

        def make(value):
            variable = keras.Variable(value, name="w")
            opt = lsk.LossScaleOptimizer(
                keras.optimizers.Adam(0.01),
                256.0,
                1,
                growth_policy="statistics",
                diagnostics_every=2,
            )
            opt.build([variable])
            return variable, opt

        variable, opt = make(np.ones(64, "float32"))
        scales = []
        for k in range(7):
            if k == split:
                store = {}
                opt.save_own_variables(store)
                variable, opt = make(variable.numpy())
                opt.load_own_variables(store)
            size = 20.0 if k % 3 == 0 else 0.01  # no room to grow on these
            grad = rng.normal(size=64).astype("float32") * size * float(opt.dynamic_scale.numpy())
            opt.apply([torch.from_numpy(grad)], [variable])
            scales.append(float(opt.dynamic_scale.numpy()))
        return scales

    assert run(split=3) == run()


def _socket_model(**settings):
    keras.utils.set_random_seed(0)
    variables = [
        keras.Variable(np.random.default_rng(i).normal(size=s).astype("float32"), name=f"w{i}")
        for i, s in enumerate([(64, 33), (4097,), (7,)])
    ]
    opt = lsk.LossScaleOptimizer(keras.optimizers.Adam(1e-3), **settings)
    opt.build(variables)
    return variables, opt


def _socket_step(opt, variables, loss=1.0, bad=()):
    rng = np.random.default_rng(int(opt.iterations.numpy()) + 10 * len(bad))
    opt.scale_loss(torch.tensor(loss))
    scale = float(opt.dynamic_scale.numpy())
    grads = [rng.normal(size=v.shape).astype("float32") * scale for v in variables]
    for i in bad:
        grads[i].reshape(-1)[rng.integers(grads[i].size)] = np.nan
    opt.apply([torch.from_numpy(g) for g in grads], variables)


def test_the_socket_records_each_skip_s_cause():
    from lossscale.mixed_precision import LossScaleError

    variables, opt = _socket_model(initial_scale=2.0**5, on_persistent="raise")
    assert opt.policy.records_details  # "raise" turns the telemetry on
    _socket_step(opt, variables, loss=float("nan"), bad=(0, 1, 2))
    _socket_step(opt, variables)
    with pytest.raises(LossScaleError, match=r"^Loss scaling: step 6 was skipped, persistent: "):
        for _ in range(8):  # 16 -> 1 in four back-offs, then the same variable again
            _socket_step(opt, variables, bad=(1,))
    causes = [o["cause"] for o in opt.summary()["overflows"]]
    assert causes == ["nonfinite_loss"] + ["overflow"] * 4 + ["persistent"]
    assert opt.summary()["overflows"][-1]["variables"] == ["w1"]


def test_the_socket_warns_of_a_loss_scaled_twice():
    from lossscale.mixed_precision import ScaleMismatchWarning

    variables, opt = _socket_model()
    loss = torch.tensor([0.5, 0.25])
    with pytest.warns(ScaleMismatchWarning, match="the loss was scaled twice"):
        opt.scale_loss(opt.scale_loss(loss))
