"""`lossscale.adapters`: registered adapters wrap what they accept, in registration order."""

import numpy as np
import pytest

from lossscale import adapters


class Plain:
    """An optimizer no adapter accepts."""


class Wrapped:
    def __init__(self, inner, tag):
        self.inner, self.tag = inner, tag


def _is_plain(optimizer):
    return isinstance(optimizer, Plain)


@pytest.fixture
def registry(monkeypatch):
    """The registered adapters, restored after the test.

    The adapters of the libraries already loaded register first, into the
    real registry: a module registers once, when imported, and would be
    lost with the copy.
    """
    adapters.adapt(None)
    monkeypatch.setattr(adapters, "_ADAPTERS", list(adapters._ADAPTERS))
    return adapters._ADAPTERS


def test_what_no_adapter_accepts_comes_back_unchanged(registry):
    optimizer = Plain()
    assert adapters.adapt(optimizer) is optimizer
    array = np.zeros(3)
    assert adapters.adapt(array) is array


def test_a_registered_adapter_wraps_what_it_accepts(registry):
    adapters.register(_is_plain, lambda o: Wrapped(o, "first"))
    optimizer = Plain()
    wrapped = adapters.adapt(optimizer)
    assert type(wrapped) is Wrapped and wrapped.inner is optimizer and wrapped.tag == "first"
    assert adapters.adapt("not an optimizer") == "not an optimizer"


def test_registering_the_same_test_twice_keeps_the_first(registry):
    before = len(registry)
    adapters.register(_is_plain, lambda o: Wrapped(o, "first"))
    adapters.register(_is_plain, lambda o: Wrapped(o, "second"))
    assert len(registry) == before + 1
    assert adapters.adapt(Plain()).tag == "first"


def test_the_first_adapter_that_accepts_wins(registry):
    adapters.register(_is_plain, lambda o: Wrapped(o, "first"))
    adapters.register(lambda o: True, lambda o: Wrapped(o, "catch_all"))
    assert adapters.adapt(Plain()).tag == "first"
    assert adapters.adapt(1.5).tag == "catch_all"


def test_a_loaded_library_registers_its_adapter_on_first_use():
    # The real registry: lossscale.torch.adapter registers there, once.
    import torch

    from lossscale.torch.adapter import TorchAdapter

    parameter = torch.nn.Parameter(torch.ones(2))
    native = torch.optim.SGD([parameter], lr=0.1)
    adapted = adapters.adapt(native)
    assert type(adapted) is TorchAdapter
    assert adapters.ADAPTER_MODULES["torch"] == TorchAdapter.__module__
