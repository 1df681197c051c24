"""The demo's networks, every backend at once: gradients against a float64 autograd oracle.

What each backend's model does on its own (training, shapes, its variables,
its threads) is in tests/demo/models/test_<backend>_mlp.py.
"""

import numpy as np
import pytest

from lossscale.backends import get_ops
from lossscale.demo import data as digits
from lossscale.demo.models import make_model


@pytest.fixture(scope="module")
def batch():
    data = digits.load_digits(0)
    return data.x_train[:64], data.y_train[:64]


@pytest.fixture(scope="module")
def weights():
    return digits.initial_weights(0, 16)


def _reference(weights, x, y, factor):
    """Float64 cross-entropy and gradients of `factor * cross_entropy`, by torch autograd."""
    import torch

    params = [torch.tensor(w, dtype=torch.float64, requires_grad=True) for w in weights]
    w1, b1, w2, b2 = params
    logits = torch.relu(torch.tensor(x, dtype=torch.float64) @ w1 + b1) @ w2 + b2
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(y))
    grads = torch.autograd.grad(loss * factor, params)
    accuracy = float((logits.argmax(1).numpy() == y).mean())
    return float(loss.detach()), [g.numpy() for g in grads], accuracy


def _shared_layout(backend, grads):
    """Float64 NumPy grads in the shared `(in, out)` layout (nn.Linear stores `(out, in)`)."""
    ops = get_ops(backend.name)
    out = [ops.to_numpy(g).astype(np.float64) for g in grads]
    return [g.T for g in out] if backend.name == "torch" else out


def _relative_error(grads, reference):
    diff = np.sqrt(sum(np.sum((g - r) ** 2) for g, r in zip(grads, reference)))
    return diff / np.sqrt(sum(np.sum(r**2) for r in reference))


def test_float32_gradients_match_float64(backend, weights, batch):
    x, y = batch
    model = make_model(backend.name, weights)
    loss, grads = model.gradients(x, y, "float32", 0.5, lambda loss: loss * 4.0)
    ref_loss, ref_grads, _ = _reference(weights, x, y, 2.0)
    assert [get_ops(backend.name).dtype_name(g) for g in grads] == ["float32"] * 4
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-6)
    for g, r in zip(_shared_layout(backend, grads), ref_grads):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=1e-6 * np.abs(r).max())


def test_float16_gradients_are_float16_and_close_when_scaled(backend, weights, batch):
    x, y = batch
    model = make_model(backend.name, weights)
    loss, grads = model.gradients(x, y, "float16", 1.0, lambda loss: loss * 1024.0)
    _, ref_grads, _ = _reference(weights, x, y, 1.0)
    assert [get_ops(backend.name).dtype_name(g) for g in grads] == ["float16"] * 4
    unscaled = [g / 1024.0 for g in _shared_layout(backend, grads)]
    assert _relative_error(unscaled, ref_grads) < 5e-3
    assert float(loss) == pytest.approx(_reference(weights, x, y, 1.0)[0], rel=5e-3)


def test_float16_flushes_small_gradients_and_scaling_restores_them(backend, weights, batch):
    x, y = batch
    model = make_model(backend.name, weights)
    _, ref_grads, _ = _reference(weights, x, y, 2.0**-24)
    live = sum(int(np.count_nonzero(r)) for r in ref_grads)

    def flushed(grads):
        return sum(
            int(np.count_nonzero((r != 0) & (g == 0)))
            for r, g in zip(ref_grads, _shared_layout(backend, grads))
        )

    _, plain = model.gradients(x, y, "float16", 2.0**-24, lambda loss: loss)
    _, scaled = model.gradients(x, y, "float16", 2.0**-24, lambda loss: loss * 2.0**24)
    assert flushed(plain) > 0.5 * live
    assert flushed(scaled) < 0.01 * live
    unscaled = [g * 2.0**-24 for g in _shared_layout(backend, scaled)]
    assert _relative_error(unscaled, ref_grads) < 5e-3


def test_float16_overflow_gives_non_finite_gradients(backend, weights, batch):
    x, y = batch
    model = make_model(backend.name, weights)
    _, grads = model.gradients(x, y, "float16", 1.0, lambda loss: loss * 2.0**40)
    assert not all(np.isfinite(g).all() for g in _shared_layout(backend, grads))


def test_evaluate_matches_float64(backend, weights, batch):
    x, y = batch
    loss, accuracy = make_model(backend.name, weights).evaluate(x, y)
    ref_loss, _, ref_accuracy = _reference(weights, x, y, 1.0)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert accuracy == pytest.approx(ref_accuracy, abs=1e-7)


def test_variables_are_the_master_weights(backend, weights):
    model = make_model(backend.name, weights)
    assert [v.name for v in model.variables] == ["w1", "b1", "w2", "b2"]
    assert [v.dtype for v in model.variables] == ["float32"] * 4
    values = _shared_layout(backend, [v.value for v in model.variables])
    for value, w in zip(values, weights):
        np.testing.assert_array_equal(value, w)


def test_bad_precision_and_backend(weights, batch):
    x, y = batch
    with pytest.raises(
        ValueError,
        match=r"`precision` must be one of \('float32', 'float16'\)"
        r"\. Received: precision='bfloat16'",
    ):
        make_model("numpy", weights).gradients(x, y, "bfloat16", 1.0, lambda loss: loss)
    with pytest.raises(
        ValueError,
        match=r"`backend` must be one of \('torch', 'numpy', 'jax', 'tensorflow'\)"
        r"\. Received: backend='mxnet'",
    ):
        make_model("mxnet", weights)
