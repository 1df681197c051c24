"""demo/models/torch_mlp.py: the `nn.Module` and its float16 copy train, in float32 and float16."""

import pytest

from tests.demo_model_cases import (
    batch,
    check_gradients_have_the_variables_shapes_and_the_pass_dtype,
    check_single_threaded_limits_the_pools_and_restores_them,
    check_training_lowers_the_loss,
    model,
)

PRECISIONS = ["float32", "float16"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_gradients_have_the_variables_shapes_and_the_pass_dtype(precision):
    check_gradients_have_the_variables_shapes_and_the_pass_dtype("torch", precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_training_lowers_the_loss(precision):
    check_training_lowers_the_loss("torch", precision)


def test_single_threaded_limits_the_pools_and_restores_them():
    check_single_threaded_limits_the_pools_and_restores_them("torch")


def test_torch_variables_wrap_the_module_parameters_in_place():
    import numpy as np
    import torch

    net = model("torch")
    for v, p in zip(net.variables, net.net.parameters(), strict=True):
        assert v.storage is p
    net.variables[1].assign(np.ones(16, np.float32))
    assert torch.equal(net.net.hidden.bias.detach(), torch.ones(16))


def test_the_float16_pass_runs_on_a_copy_of_the_current_master_weights():
    import numpy as np
    import torch

    net = model("torch")
    x, y = batch()
    # w1 = 0 and b1 = 0 (the initial biases): no hidden unit is active, if the
    # float16 copy took the new master weights.
    net.variables[0].assign(np.zeros((16, 64), np.float32))
    _, grads = net.gradients(x, y, "float16", 1.0, lambda loss: loss)
    for half, master in zip(net.half_net.parameters(), net.net.parameters(), strict=True):
        assert half.dtype == torch.float16 and master.dtype == torch.float32
        assert torch.equal(half.detach(), master.detach().half())
    assert not grads[0].any() and not grads[2].any()
    assert grads[3].any()  # the output bias still learns


def test_single_threaded_restores_torchs_thread_count():
    import torch

    from lossscale.demo.models import single_threaded

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with single_threaded("torch"):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
