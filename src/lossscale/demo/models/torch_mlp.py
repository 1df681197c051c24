"""The demo network as a PyTorch `nn.Module`, with a float16 working copy."""

import contextlib
import copy

import numpy as np
import torch
import torch.nn.functional as F
from threadpoolctl import threadpool_limits
from torch import nn

from lossscale.demo.models import check_precision, wrap


@contextlib.contextmanager
def single_threaded():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        torch.set_num_threads(previous)


class _Net(nn.Module):
    def __init__(self, inputs, hidden, classes):
        super().__init__()
        self.hidden = nn.Linear(inputs, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


class MLP:
    """Float32 master `nn.Module` plus a float16 copy refreshed before each float16 pass."""

    backend = "torch"

    def __init__(self, weights):
        w1, b1, w2, b2 = weights
        self.net = _Net(w1.shape[0], w1.shape[1], w2.shape[1])
        with torch.no_grad():
            # nn.Linear stores (out, in): the transposes of the shared weights.
            for param, value in zip(self.net.parameters(), (w1.T, b1, w2.T, b2)):
                param.copy_(torch.from_numpy(np.ascontiguousarray(value)))
        self.half_net = copy.deepcopy(self.net).half()
        self.variables = wrap(list(self.net.parameters()))

    def gradients(self, x, y, precision, loss_weight, scale_loss):
        check_precision(precision)
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        net = self.net
        if precision == "float16":
            with torch.no_grad():
                torch._foreach_copy_(list(self.half_net.parameters()), list(self.net.parameters()))
            net, x = self.half_net, x.half()
        loss = F.cross_entropy(net(x).float(), y)
        grads = torch.autograd.grad(scale_loss(loss * loss_weight), list(net.parameters()))
        return loss.detach(), list(grads)

    def evaluate(self, x, y):
        with torch.no_grad():
            logits = self.net(torch.from_numpy(x))
            y = torch.from_numpy(y)
            loss = F.cross_entropy(logits, y)
            accuracy = (logits.argmax(dim=1) == y).float().mean()
        return float(loss), float(accuracy)
