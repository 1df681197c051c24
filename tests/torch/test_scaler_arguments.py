"""`lossscale.torch.scaler_arguments`: `GradScaler`'s arguments as torch accepts them."""

import numpy as np
import pytest
import torch

from lossscale.torch.scaler_arguments import as_enabled, as_number, is_real


@pytest.mark.parametrize(
    "enabled, expected",
    [(True, True), (False, False), (1, True), (0, False), (np.bool_(True), True)],
)
def test_enabled_is_a_bool_or_zero_or_one(enabled, expected):
    got = as_enabled(enabled)
    assert type(got) is bool and got is expected


@pytest.mark.parametrize("enabled", [2, -1, "yes", None, 1.0])
def test_other_enabled_values_raise(enabled):
    with pytest.raises(ValueError) as raised:
        as_enabled(enabled)
    assert str(raised.value) == (
        f"`enabled` must be a boolean (or 0 or 1). Received: enabled={enabled!r}"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64])
def test_a_one_element_real_tensor_is_a_float(dtype):
    for shape in ((), (1,), (1, 1)):
        got = as_number("init_scale", torch.full(shape, 8, dtype=dtype))
        assert type(got) is float and got == 8.0


def test_other_values_pass_through_unchanged():
    for value in (8, 8.5, "8", None):
        assert as_number("init_scale", value) is value


@pytest.mark.parametrize(
    "tensor, described",
    [
        (torch.ones(2), "tensor of shape (2,), dtype torch.float32"),
        (torch.ones((), dtype=torch.complex64), "tensor of shape (), dtype torch.complex64"),
        (torch.tensor(True), "tensor of shape (), dtype torch.bool"),
        (torch.ones(0), "tensor of shape (0,), dtype torch.float32"),
    ],
)
def test_other_tensors_raise_with_their_shape_and_dtype(tensor, described):
    with pytest.raises(ValueError) as raised:
        as_number("growth_factor", tensor)
    assert str(raised.value) == (
        "`growth_factor` must be a positive number or a one-element real tensor. "
        f"Received: growth_factor={described}"
    )


def test_is_real_leaves_out_bools_and_complex_numbers():
    assert [is_real(x) for x in (1, 1.5, np.float32(2), np.int64(3))] == [True] * 4
    assert [is_real(x) for x in (True, np.bool_(True), 1j, "1", None)] == [False] * 5
