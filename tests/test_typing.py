"""Every public callable of lossscale's API carries type hints, and they resolve.

"Public" is what the API reference documents: the names each public module
exports, and for each class every method and property not starting with `_`
(plus `__init__` and `__call__`) that a lossscale module defines; what a
class inherits from torch is torch's to annotate. Hints are read with
`inspect.signature` (no evaluation) and then resolved with
`typing.get_type_hints`, names from `if TYPE_CHECKING:` blocks included, so
that a misspelt or unimportable hint fails here and not only in a type
checker. `import lossscale` importing no framework despite the hints is
`test_backends.test_import_pulls_in_neither_torch_nor_jax_nor_tensorflow`.
"""

import ast
import functools
import importlib
import inspect
import sys
import typing

import pytest
import torch

import lossscale.optax
import lossscale.torch
from lossscale.optimizers import ALL_OPTIMIZERS

PUBLIC_MODULES = [
    "lossscale",
    "lossscale.optimizers",
    "lossscale.schedules",
    "lossscale.mixed_precision",
    "lossscale.pytree",
    "lossscale.saving",
    "lossscale.serialization",
    "lossscale.torch",
    "lossscale.optax",
]
# Called by users although no public module lists them in `__all__`.
EXTRA = [*ALL_OPTIMIZERS, lossscale.optimizers.Optimizer]


def _public_objects():
    seen = {}
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        names = getattr(module, "__all__", None) or [n for n in vars(module) if n[0] != "_"]
        for n in names:
            obj = getattr(module, n)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and _ours(obj):
                seen.setdefault(id(obj), obj)
    for obj in EXTRA:
        seen.setdefault(id(obj), obj)
    return list(seen.values())


def _ours(obj):
    return getattr(obj, "__module__", "").startswith("lossscale")


def _members(cls):
    """`(label, function, skip_first)` for each public callable `cls` defines in lossscale."""
    out = []
    for name in dir(cls):
        if name.startswith("_") and name not in ("__init__", "__call__"):
            continue
        owner = next(k for k in cls.__mro__ if name in vars(k))
        if not _ours(owner):
            continue  # object's, Exception's or torch's
        attr = vars(owner)[name]
        label = f"{cls.__name__}.{name}"
        if isinstance(attr, property):
            out.append((f"{label} (getter)", attr.fget, True))
            if attr.fset is not None:
                out.append((f"{label} (setter)", attr.fset, True))
        elif isinstance(attr, staticmethod):
            out.append((label, attr.__func__, False))
        elif isinstance(attr, classmethod):
            out.append((label, attr.__func__, True))
        elif inspect.isfunction(attr):
            out.append((label, attr, True))
    return out


def _callables():
    out = []
    for obj in _public_objects():
        if inspect.isclass(obj):
            out.extend(_members(obj))
        else:
            out.append((f"{obj.__module__}.{obj.__name__}", obj, False))
    return sorted(out, key=lambda c: c[0])


CALLABLES = _callables()


def test_the_api_is_found():
    labels = {label for label, _, _ in CALLABLES}
    # A sample from each area, so that a broken discovery cannot pass vacuously.
    for label in [
        "LossScaleOptimizer.__init__",
        "LossScaleOptimizer.stateless_apply",
        "LossScaleOptimizer.summary",
        "LossScaleOptimizer.initial_scale (getter)",
        "Optimizer.apply_gradients",
        "Lamb.update_step",
        "SGD.from_config",
        "CosineDecayRestarts.__call__",
        "Variable.assign_add",
        "LossScalePolicy.__init__",
        "lossscale.mixed_precision.loss_scale.next_loss_scale",
        "lossscale.saving.restore",
        "lossscale.serialization.deserialize",
        "lossscale.optimizers.get",
        "Transform.jit",
        "lossscale.pytree._transform.transform",
        "GradScaler.update",
        "GradScaler.load_state_dict",
        "TorchAdapter.build",
        "AppliedStepScheduler.get_last_lr",
        "lossscale.optax.transform.dynamic_loss_scale",
        "lossscale.optax.host.check",
        "DynamicLossScaleState.scale (getter)",
        "OptaxAdapter.__init__",
    ]:
        assert label in labels
    assert len(CALLABLES) > 250


@pytest.mark.parametrize("label, function, skip_first", CALLABLES, ids=[c[0] for c in CALLABLES])
def test_every_parameter_and_return_is_annotated(label, function, skip_first):
    signature = inspect.signature(function)
    parameters = list(signature.parameters.values())[1 if skip_first else 0 :]
    missing = [p.name for p in parameters if p.annotation is p.empty]
    assert not missing, f"{label}: no hint for {missing}"
    assert signature.return_annotation is not signature.empty, f"{label}: no return hint"
    if function.__name__ == "__init__":
        assert signature.return_annotation in (None, "None"), label


@functools.cache
def _type_checking_names(module_name):
    """What the `if TYPE_CHECKING:` blocks of a module import (imported here, for real)."""
    module = sys.modules[module_name]
    names = {}
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            exec(compile(ast.Module(node.body, []), module.__file__, "exec"), names)
    return names


def _hints(function):
    return typing.get_type_hints(function, localns=_type_checking_names(function.__module__))


@pytest.mark.parametrize("label, function, skip_first", CALLABLES, ids=[c[0] for c in CALLABLES])
def test_every_hint_resolves(label, function, skip_first):
    _hints(function)  # raises NameError / TypeError for a broken hint


def _shared_hints(ours, theirs):
    ours, theirs = _hints(ours), typing.get_type_hints(theirs)
    shared = sorted(set(ours) & set(theirs))
    return shared, ours, theirs


@pytest.mark.parametrize(
    "cls, base, names",
    [
        (
            lossscale.torch.GradScaler,
            torch.amp.GradScaler,
            [
                "__init__",
                "update",
                "get_scale",
                "set_growth_factor",
                "set_backoff_factor",
                "set_growth_interval",
                "state_dict",
                "load_state_dict",
                "__getstate__",
            ],
        ),
        (
            lossscale.torch.Optimizer,
            torch.optim.Optimizer,
            ["step", "state_dict", "load_state_dict", "add_param_group"],
        ),
        (
            lossscale.torch.AppliedStepScheduler,
            torch.optim.lr_scheduler.LRScheduler,
            ["get_last_lr", "state_dict", "load_state_dict"],
        ),
    ],
    ids=["GradScaler", "Optimizer", "AppliedStepScheduler"],
)
def test_torch_interfaces_speak_torchs_types(cls, base, names):
    for name in names:
        shared, ours, theirs = _shared_hints(getattr(cls, name), getattr(base, name))
        assert "return" in shared, f"{cls.__name__}.{name}"
        for key in shared:
            assert ours[key] == theirs[key], f"{cls.__name__}.{name}: {key}"


def test_from_config_returns_the_class_it_is_called_on():
    for cls in (lossscale.optimizers.Optimizer, lossscale.schedules.LearningRateSchedule):
        hints = _hints(cls.from_config)
        returned = hints["return"]
        assert isinstance(returned, typing.TypeVar)
        assert hints["cls"] == type[returned]
