"""shared_handles.py: a process group is shared by copies and refused by pickle, by name."""

import copy
import pickle
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

import lossscale as ls
import lossscale.torch as lt
from lossscale.shared_handles import SharedHandle


class Holder:
    """An object whose state holds a handle, as the optimizers' do."""

    def __init__(self, handle):
        self.handle = handle
        self.values = [1.0, 2.0]

    def __getstate__(self):
        return {**self.__dict__, "handle": SharedHandle.wrap(self.handle, "handle", "Holder")}

    def __setstate__(self, state):
        self.__dict__.update({**state, "handle": SharedHandle.unwrap(state["handle"])})


def test_copies_share_the_handle_and_copy_the_rest():
    lock = threading.Lock()  # a live object no pickle can write
    holder = Holder(lock)
    for made in (copy.deepcopy(holder), copy.copy(holder)):
        assert made.handle is lock and made.values == holder.values
    assert copy.deepcopy(holder).values is not holder.values


def test_pickle_names_the_argument_and_the_value():
    holder = Holder(threading.Lock())
    with pytest.raises(TypeError, match=r"A Holder with a `handle` cannot be pickled") as error:
        pickle.dumps(holder)
    assert "handle=None" in str(error.value) and "Received: handle=<unlocked" in str(error.value)


def test_without_a_handle_nothing_is_wrapped_and_pickle_works():
    assert SharedHandle.wrap(None, "handle", "Holder") is None
    assert SharedHandle.unwrap(None) is None
    assert pickle.loads(pickle.dumps(Holder(None))).handle is None


@pytest.fixture
def group(tmp_path):
    """A one-rank gloo process group of this process (and the default group), torn down after."""
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


def _overflowing_step(opt, param):
    """A step of `opt` (a LossScaleOptimizer) whose gradient holds an inf: skipped."""
    opt.scale_loss(1.0)
    opt.apply([torch.tensor([1.0, np.inf, 2.0])], [param])


def test_a_loss_scale_optimizer_copy_shares_the_group_and_steps_over_it(group):
    param = torch.nn.Parameter(torch.ones(3))
    opt = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3), process_group=group)
    _overflowing_step(opt, param)
    made, copied_param = copy.deepcopy((opt, param))  # the model copied along, as torch's
    assert made.process_group is group and opt.process_group is group
    _overflowing_step(made, copied_param)  # agreed over the group, skipped
    assert float(made.dynamic_scale.numpy()) == float(opt.dynamic_scale.numpy()) / 2
    assert torch.equal(copied_param.detach(), param.detach())
    with pytest.raises(TypeError, match=r"LossScaleOptimizer with a `process_group` cannot be"):
        pickle.dumps(opt)
    assert opt.process_group is group  # the failed pickle left it as it was
    plain = ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3))
    assert pickle.loads(pickle.dumps(plain)).process_group is None


def test_a_grad_scaler_copy_shares_the_group_and_steps_over_it(group):
    model = torch.nn.Linear(3, 1)
    scaler = lt.GradScaler("cpu", init_scale=2.0**10, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    made = copy.deepcopy(scaler)
    assert made.process_group is group and scaler.process_group is group
    assert made.state_dict() == scaler.state_dict()
    copied_model = copy.deepcopy(model)
    copied_opt = torch.optim.SGD(copied_model.parameters(), lr=0.1)
    made.scale(copied_model(torch.full((2, 3), np.inf)).sum()).backward()
    made.step(copied_opt)  # agreed over the group: skipped
    made.update()
    assert made.get_scale() == scaler.get_scale() / 2
    assert all(torch.equal(a, b) for a, b in zip(copied_model.parameters(), model.parameters()))
    with pytest.raises(TypeError, match=r"GradScaler with a `process_group` cannot be pickled"):
        pickle.dumps(scaler)
    assert pickle.loads(pickle.dumps(lt.GradScaler("cpu"))).process_group is None
