"""`GradScaler`'s extra state: made, read back, saved and checked when it comes back in.

Beside torch's scale and growth tracker (`scale`, `counter`), the fields a
`LossScalePolicy` adds live as 0-d tensors on the scale's device. In a state
dict they sit under one key, `STATE_KEY`, beside torch's five entries, so
torch's `GradScaler` loads our dicts and we load torch's.
"""

from __future__ import annotations

import dataclasses

import torch

from lossscale.mixed_precision import diagnostics, loss_scale, restored
from lossscale.mixed_precision.state import per_variable
from lossscale.torch.scaler_arguments import is_real as _is_real

# torch's keys, which its `GradScaler.load_state_dict` reads.
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
STATE_KEY = "lossscale"
# `LossScaleState` fields kept as torch's two tensors.
_NOT_EXTRA = ("scale", "counter")
_DTYPES = {"int32": torch.int32, "float32": torch.float32, "bool": torch.bool}


def telemetry_fields(policy):
    """The telemetry's per-variable fields, kept by parameter name (`range_*`: `scaler_ranges`)."""
    return [
        f
        for f in loss_scale.state_fields(policy)
        if per_variable(f) and f.name not in diagnostics.FIELDS
    ]


def initial_tensor(field, device):
    """A per-variable field's initial value, a 0-d tensor on `device`."""
    return torch.full(
        (), field.metadata["initial"], dtype=_DTYPES[field.metadata["dtype"]], device=device
    )


def extra_fields(policy):
    """The `LossScaleState` fields `policy` tracks beyond torch's scale and tracker."""
    return [
        f
        for f in loss_scale.state_fields(policy)
        if f.name not in _NOT_EXTRA and not per_variable(f)
    ]


def _key(field):
    """The name users see (`summary()`): `skipped_steps`, not `skipped`."""
    return field.metadata["variable"] or field.name


def initial_values(policy):
    """`{field name: Python value}` for a scaler that has taken no step."""
    return {
        f.name: [start] * policy.history_length if f.metadata["per"] == "history" else start
        for f in extra_fields(policy)
        for start in [f.metadata["initial"]]
    }


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
    # One copy to the host; float64 holds every int32 and float32 exactly.
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

    Tracked fields the dict lacks start from their initial values; fields it
    holds that `policy` does not track are ignored. Anything else that does
    not fit raises `ValueError`.
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
    for key, field in (("scale", "scale"), ("_growth_tracker", "counter")):
        value = state_dict[key]
        if not _is_real(value):
            _fail(f"state_dict[{key!r}]", "a number", value)
        _refuse(field, f"state_dict[{key!r}]", value, policy)
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
        cast = float if f.metadata["dtype"] == "float32" else int
        if f.metadata["per"] == "history":
            length = policy.history_length
            if not (
                isinstance(value, (list, tuple))
                and len(value) == length
                and all(_is_real(v) for v in value)
            ):
                _fail(name, f"a list of {length} numbers", value)
            _refuse(f.name, name, list(value), policy)
            values[f.name] = [cast(v) for v in value]
        else:
            if not _is_real(value):
                _fail(name, "a number", value)
            _refuse(f.name, name, value, policy)
            values[f.name] = cast(value)
    return values


def _refuse(field, where, value, policy):
    """Raises `ValueError` where `value` breaks `field`'s rule (`mixed_precision.restored`)."""
    found = restored.refusal(field, where, value, policy)
    if found:
        raise ValueError(found)
