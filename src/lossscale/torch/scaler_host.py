"""`GradScaler`'s state on the host: the extra fields, state dicts, summaries.

torch's `GradScaler` keeps two tensors, the scale and the growth tracker
(`LossScaleState.scale` and `.counter`). The fields a `LossScalePolicy` adds
(the overflow streak for `hysteresis`, the telemetry counters and scale
history, the fail-fast error) live next to them as 0-d tensors, created
with the scale on its device. Here they are made, read back to Python
values, and checked when a state dict brings them in.

`ScalerHostMixin` holds what `GradScaler` does with that state outside the
training step: its settings, `state_dict` / `load_state_dict`, pickling,
`summary` and `check`.

In a state dict the extra fields sit under one key, `STATE_KEY`, beside torch's five
entries, so torch's `GradScaler` loads our dicts (it reads only its own
keys) and we load torch's (the extra fields then start from their initial
values).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np
import torch

from lossscale import validation
from lossscale.mixed_precision import loss_scale
from lossscale.mixed_precision.loss_scale import MAX_SCALE, NO_ERROR
from lossscale.mixed_precision.state import per_variable
from lossscale.mixed_precision.telemetry import LossScaleError, failure_message, summarize
from lossscale.shared_handles import SharedHandle
from lossscale.torch.scaler_ranges import ParameterRanges

# torch's keys, which its `GradScaler.load_state_dict` reads.
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
STATE_KEY = "lossscale"
# `LossScaleState` fields kept elsewhere: torch's two tensors. Per-variable
# fields are not kept either: a scaler has no variables.
_NOT_EXTRA = ("scale", "counter")
_DTYPES = {"int32": torch.int32, "float32": torch.float32}


def extra_fields(policy):
    """The `LossScaleState` fields `policy` tracks beyond torch's scale and tracker."""
    return [
        f
        for f in loss_scale.state_fields(policy)
        if f.name not in _NOT_EXTRA and not per_variable(f)
    ]


def _key(field):
    # The name a field has everywhere the user sees it (`summary()`, the
    # wrapper's variables): `skipped_steps`, not `skipped`.
    return field.metadata["variable"] or field.name


def initial_values(policy):
    """`{field name: Python value}` for a scaler that has taken no step."""
    values = {}
    for f in extra_fields(policy):
        start = f.metadata["initial"]
        if f.metadata["per"] == "history":
            values[f.name] = [start] * policy.history_length
        else:
            values[f.name] = start
    return values


def make_tensors(values, policy, device):
    """The extra fields as 0-d tensors on `device` (tuples for the history)."""
    tensors = {}
    for f in extra_fields(policy):
        dtype = _DTYPES[f.metadata["dtype"]]
        value = values[f.name]
        if f.metadata["per"] == "history":
            tensors[f.name] = tuple(torch.full((), v, dtype=dtype, device=device) for v in value)
        else:
            tensors[f.name] = torch.full((), value, dtype=dtype, device=device)
    return tensors


def read_tensors(tensors, policy):
    """The extra fields' Python values, read in one transfer."""
    fields = extra_fields(policy)
    if not fields:
        return {}
    flat = []
    for f in fields:
        value = tensors[f.name]
        flat.extend(value if isinstance(value, tuple) else (value,))
    # One copy to the host. float64 holds every int32 and float32 exactly.
    numbers_ = torch.stack([t.to(torch.float64) for t in flat]).tolist()
    values, at = {}, 0
    for f in fields:
        cast = float if f.metadata["dtype"] == "float32" else int
        if f.metadata["per"] == "history":
            length = policy.history_length
            values[f.name] = [cast(x) for x in numbers_[at : at + length]]
            at += length
        else:
            values[f.name] = cast(numbers_[at])
            at += 1
    return values


def to_state_dict(values, policy):
    """The extra fields for a state dict, keyed as in `summary()`."""
    return {_key(f): values[f.name] for f in extra_fields(policy)}


def _fail(name, accepted, value):
    raise ValueError(f"`{name}` must be {accepted}. Received: {name}={value!r}")


def check_state_dict(state_dict, policy):
    """Validates a state dict; returns the extra fields it sets, as Python values.

    Fields `policy` tracks but the dict lacks (a dict from torch's
    `GradScaler`, or from a scaler with other settings) start from their
    initial values; fields it holds that `policy` does not track are
    ignored. Anything else that does not fit raises `ValueError`.
    """
    if not hasattr(state_dict, "keys"):
        _fail("state_dict", "a dict returned by GradScaler.state_dict()", state_dict)
    missing = [k for k in TORCH_KEYS if k not in state_dict]
    if missing:
        raise ValueError(
            "`state_dict` must be a GradScaler state dict, with the keys "
            f"{list(TORCH_KEYS)}; {missing} are missing. Received: state_dict with keys "
            f"{sorted(map(str, state_dict.keys()))}"
        )
    scale = state_dict["scale"]
    if not _is_number(scale) or not 0 < scale <= loss_scale.MAX_SCALE:
        _fail(
            "state_dict['scale']",
            f"a finite number > 0 and <= {loss_scale.MAX_SCALE}",
            scale,
        )
    tracker = state_dict["_growth_tracker"]
    if not _is_integer(tracker) or tracker < 0:
        _fail("state_dict['_growth_tracker']", "an integer >= 0", tracker)
    extras = state_dict.get(STATE_KEY, {})
    if not hasattr(extras, "keys"):
        _fail(f"state_dict[{STATE_KEY!r}]", "a dict", extras)
    known = {
        _key(f)
        for f in dataclasses.fields(loss_scale.LossScaleState)
        if f.name not in _NOT_EXTRA and not per_variable(f)
    }
    unknown = sorted(set(map(str, extras)) - known)
    if unknown:
        raise ValueError(
            f"`state_dict[{STATE_KEY!r}]` holds unknown fields {unknown}; known fields are "
            f"{sorted(known)}. Received: state_dict[{STATE_KEY!r}]={dict(extras)!r}"
        )
    values = initial_values(policy)
    for f in extra_fields(policy):
        key = _key(f)
        if key not in extras:
            continue
        value = extras[key]
        name = f"state_dict[{STATE_KEY!r}][{key!r}]"
        if f.metadata["per"] == "history":
            length = policy.history_length
            ok = (
                isinstance(value, (list, tuple))
                and len(value) == length
                and all(_is_number(v) for v in value)
            )
            if not ok:
                _fail(name, f"a list of {length} finite numbers", value)
            cast = float if f.metadata["dtype"] == "float32" else int
            values[f.name] = [cast(v) for v in value]
        else:
            if not _is_integer(value):
                _fail(name, "an integer", value)
            values[f.name] = int(value)
    return values


def _is_number(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _is_integer(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


class ScalerHostMixin:
    """`GradScaler`'s settings, state dicts, pickling and summaries, on the host.

    Nothing here runs inside a training step; whatever reads the device
    (`state_dict`, `summary`, `check`) says so.
    """

    def _extra_values(self):
        if self._extras is None:
            return dict(self._extra_start)
        return read_tensors(self._written_steps(), self._policy)

    # -- settings ------------------------------------------------------------

    def set_growth_factor(self, new_factor: float) -> None:
        """Sets the growth factor (a float > 1)."""
        validation.check_number("new_factor", new_factor, low=1, low_open=True)
        self._policy = dataclasses.replace(self._policy, growth_factor=float(new_factor))
        super().set_growth_factor(new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        """Sets the backoff factor (a float in (0, 1))."""
        validation.check_number(
            "new_factor", new_factor, low=0, high=1, low_open=True, high_open=True
        )
        self._policy = dataclasses.replace(self._policy, backoff_factor=float(new_factor))
        super().set_backoff_factor(new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        """Sets the growth interval (an integer >= 1)."""
        validation.check_number("new_interval", new_interval, low=1, integer=True)
        self._policy = dataclasses.replace(self._policy, dynamic_growth_steps=int(new_interval))
        super().set_growth_interval(new_interval)

    # -- state dicts and pickling ---------------------------------------------

    def _set_scale(self, new_scale):
        if isinstance(new_scale, torch.Tensor):
            if (
                not new_scale.is_floating_point()
                or new_scale.numel() != 1
                or new_scale.requires_grad
                or new_scale.device != self._scale.device
            ):
                raise ValueError(
                    "`new_scale` must be a Python float or a one-element floating-point "
                    f"tensor on the scale's device ({self._scale.device}) that does not "
                    f"require grad. Received: new_scale=tensor of shape "
                    f"{tuple(new_scale.shape)}, dtype {new_scale.dtype}, on "
                    f"{new_scale.device}, requires_grad={new_scale.requires_grad}"
                )
            # Checked as a float is (one host read: `update(new_scale)` is rare).
            value = float(new_scale.detach().reshape(()).to(torch.float32))
            validation.check_number("new_scale", value, low=0, low_open=True, high=MAX_SCALE)
            self._scale.copy_(new_scale.detach().reshape(()))
            self._scale_bound = value
        else:
            validation.check_number("new_scale", new_scale, low=0, low_open=True, high=MAX_SCALE)
            self._scale.fill_(float(new_scale))
            self._scale_bound = float(np.float32(new_scale))
        self._per_optimizer_states.clear()
        self._last_skip = None

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled); reads the device."""
        value = super().get_scale()
        if self._enabled and self._scale is not None:
            self._scale_bound = value
        return value

    def state_dict(self) -> dict[str, Any]:
        """torch's five entries, and the extra state fields under `"lossscale"` if any.

        Empty when disabled. Reads the state on the host; call it after `update()`.
        """
        out = super().state_dict()
        if out and extra_fields(self._policy):
            extras = to_state_dict(self._extra_values(), self._policy)
            out[STATE_KEY] = extras
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of `torch.amp.GradScaler`.

        Works before the first step (the values are used when the scale is
        created). As in torch, the growth factor, backoff factor and growth
        interval come from the dict; the extras' settings stay as
        constructed, and extra fields the dict lacks start afresh. Checks
        everything before writing anything. Does nothing when disabled.
        """
        if not self._enabled:
            return
        if hasattr(state_dict, "keys") and len(state_dict) == 0:
            raise RuntimeError(
                "`state_dict` is empty: it comes from a GradScaler with enabled=False, which "
                "has no state to load. Received: state_dict={}"
            )
        extras = check_state_dict(state_dict, self._policy)
        check = validation.check_number
        check("state_dict['growth_factor']", state_dict["growth_factor"], low=1, low_open=True)
        check(
            "state_dict['backoff_factor']",
            state_dict["backoff_factor"],
            low=0,
            high=1,
            low_open=True,
            high_open=True,
        )
        check("state_dict['growth_interval']", state_dict["growth_interval"], low=1, integer=True)
        policy = dataclasses.replace(
            self._policy,
            growth_factor=float(state_dict["growth_factor"]),
            backoff_factor=float(state_dict["backoff_factor"]),
            dynamic_growth_steps=int(state_dict["growth_interval"]),
        )
        super().load_state_dict(state_dict)
        self._policy = policy
        self._extra_start = extras
        if self._extras is not None:
            self._extras = make_tensors(extras, policy, self._scale.device)
        # The per-parameter records are not in a state dict: they start afresh.
        self._per_variable = {}
        self._ranges = ParameterRanges()
        self._host_steps = self._device_steps = extras.get("steps", 0)
        self._scale_bound = float(np.float32(state_dict["scale"]))

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # torch's: the scale becomes lazy again
        if self._enabled:
            state["_extra_start"] = self._extra_values()
            state["_extras"] = None
        # Observers hold hooks on a live model: a copy has none.
        state["_observers"] = {}
        # The process group is shared by a copy, refused by pickle by name.
        state["_process_group"] = SharedHandle.wrap(
            self._process_group, "process_group", type(self).__name__
        )
        state["_check_units"] = {}  # device constants, made again where it is used
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = {**state, "_process_group": SharedHandle.unwrap(state.get("_process_group"))}
        super().__setstate__(state)
        self.__dict__.setdefault("_check_units", {})  # pickled before it existed
        self.__dict__.setdefault("_device_steps", self._host_steps)
        self.__dict__.setdefault("_ranges", ParameterRanges())

    # -- reading the state ---------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """The loss-scale state as a dict of Python values, for loggers.

        Reads the device: call it when logging, not inside the step.

        Returns:
            `{}` when disabled; otherwise `dynamic_scale` and `step_counter`
            (torch's scale and growth tracker) and, as the settings track
            them, `consecutive_skips`, `steps`, `skipped_steps`,
            `last_overflow_step`, `scale_history`, `nonfinite_variables`
            (parameter names), `error`, `error_step`, `overflows` (the
            window, oldest first: `{"step", "variables", "module",
            "loss_finite"}`), `float16_range` (`{parameter name: {"zero",
            "subnormal", "near_max", "max_abs"}}`, the last measurement) and
            `float16_range_step`: the keys of `LossScaleOptimizer.summary()`.
        """
        if not self._enabled:
            return {}
        names, per_variable = self._per_variable_values()
        values = {
            "scale": self.get_scale(),
            "counter": self._get_growth_tracker(),
            **self._extra_values(),
            **per_variable,
        }
        modules = {}
        if self._observers:
            modules = self._overflow_modules([s for s in values["overflow_steps"] if s >= 0])
        return summarize(values, self._policy, names, modules)

    def check(self) -> None:
        """Raises `LossScaleError` if the state records a crossed fail-fast limit.

        `update()` already does so after every step when `min_scale` or
        `max_consecutive_skips` is set; without them there is nothing to check.
        """
        if not self._enabled or not self._policy.fails_fast:
            return
        if self._extra_values()["error"] != NO_ERROR:
            raise LossScaleError(self._failure_message())

    def _failure_message(self):
        return failure_message(self.summary(), self._policy)
