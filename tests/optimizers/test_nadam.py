"""Nadam: its running product is optimizer state; the shared scenarios are `test_rules.py`'s."""

import pytest

import lossscale as ls
from lossscale.optimizers import Nadam
from tests import optimizer_cases as cases


def test_u_product_is_a_variable_on_the_model_backend(backend):
    opt = Nadam()
    variables = cases.model_variables(backend, cases.weights())
    opt.build(variables)
    u_product = opt.variables[-1]
    assert (u_product.name, u_product.shape, u_product.dtype, u_product.backend) == (
        "u_product",
        (),
        "float32",
        backend.name,
    )
    assert float(u_product.numpy()) == 1.0


def test_u_product_advances_once_per_optimizer_step_with_accumulation(backend):
    opt = Nadam(learning_rate=0.01, gradient_accumulation_steps=2)
    variables = cases.model_variables(backend, cases.weights())
    grads = cases.gradients()
    for step_grads in grads[:4]:
        opt.apply([backend.array(g) for g in step_grads], variables)
    expected = 0.9 * (1 - 0.5 * 0.96) * 0.9 * (1 - 0.5 * 0.96**2)
    assert float(opt.variables[-1].numpy()) == pytest.approx(expected, rel=1e-6)


def test_wrapper_saves_u_product(backend):
    wrapped = ls.LossScaleOptimizer(Nadam(learning_rate=0.01))
    variables = cases.model_variables(backend, cases.weights())
    scale = float(wrapped.scale_loss(1.0))
    wrapped.apply([backend.array(g * scale) for g in cases.gradients()[0]], variables)
    store = {}
    wrapped.save_own_variables(store)
    assert float(store[str(len(store) - 1)]) == pytest.approx(0.9 * (1 - 0.5 * 0.96), rel=1e-6)
