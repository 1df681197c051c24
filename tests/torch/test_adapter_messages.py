"""`lossscale/torch/adapter_messages.py`: the native adapters' value checks and messages, verbatim."""

import re

import numpy as np
import pytest
import torch

import lossscale as ls
from lossscale.torch import TorchAdapter
from lossscale.torch.adapter_messages import STATELESS_MESSAGE, check_value, store_message


def variable(shape=(2, 3), dtype=torch.float32):
    return ls.Variable(torch.zeros(shape, dtype=dtype), name="kernel")


@pytest.mark.parametrize(
    "value",
    [
        torch.ones(2, 3),
        torch.ones(2, 3, dtype=torch.float16),  # a float fits a float, whatever its width
        np.ones((2, 3), np.float64),
        np.float32(1.0) * np.ones((2, 3), np.float32),
    ],
)
def test_values_of_the_shape_and_kind_pass(value):
    assert check_value("state['w']", value, variable()) is None


def test_numbers_fit_scalar_variables_of_their_kind():
    check_value("step", 3, variable((), torch.int64))
    check_value("step", np.int32(3), variable((), torch.int64))
    check_value("lr", 0.5, variable((), torch.float32))
    check_value("lr", np.float64(0.5), variable((), torch.float32))


@pytest.mark.parametrize("value", ["1.0", [1.0, 2.0], None, True])
def test_what_is_not_an_array_or_a_number_is_refused(value):
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"`state['w']` must be a tensor, a NumPy array or a number. Received: {value!r}"
        ),
    ):
        check_value("state['w']", value, variable())


def test_the_shape_must_be_the_variables():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`state['w']` must have the shape (2, 3) of optimizer variable 'kernel'. "
            "Received: shape (3, 2)"
        ),
    ):
        check_value("state['w']", torch.ones(3, 2), variable())
    with pytest.raises(ValueError, match=re.escape("Received: shape ()")):
        check_value("state['w']", 1.0, variable())


def test_the_kind_must_be_the_variables():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`step` must hold int values like optimizer variable 'kernel' (int64). "
            "Received: tensor(0.5000)"
        ),
    ):
        check_value("step", torch.tensor(0.5), variable((), torch.int64))
    with pytest.raises(ValueError, match=r"must hold float values .* \(float32\). Received: 2$"):
        check_value("lr", 2, variable((), torch.float32))
    with pytest.raises(ValueError, match=r"must hold float values"):
        check_value("w", np.ones((2, 3), np.bool_), variable())


def test_the_adapter_raises_the_messages():
    w = torch.nn.Parameter(torch.ones(2))
    adapter = TorchAdapter(torch.optim.SGD([w], lr=0.1))
    assert store_message("save_own_variables", adapter.optimizer) == (
        "TorchAdapter does not support `save_own_variables`: the wrapped SGD keeps its state "
        "in `optimizer.state`, not in lossscale variables, so a variable store would hold the "
        "step counter only. Use `state_dict()` and `load_state_dict()` (with torch.save / "
        "torch.load) instead."
    )
    with pytest.raises(NotImplementedError) as raised:
        adapter.save_own_variables({})
    assert str(raised.value) == store_message("save_own_variables", adapter.optimizer)
    with pytest.raises(NotImplementedError) as raised:
        adapter.load_own_variables({})
    assert str(raised.value) == store_message("load_own_variables", adapter.optimizer)
    assert STATELESS_MESSAGE.startswith("TorchAdapter does not support stateless application")
    with pytest.raises(NotImplementedError) as raised:
        adapter.stateless_apply([], [w.grad], [w])
    assert str(raised.value) == STATELESS_MESSAGE
