"""Saving, loading and setting an optimizer's variables, every check before any write.

Two layouts: Keras's flat store keyed `"0"`, `"1"`, ... in `variables` order, and
torch's `state_dict` keyed by parameter index (docs/torch_optim.md).
"""

from __future__ import annotations

import inspect
import numbers
import warnings
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

from lossscale.backends import backend_of, get_ops
from lossscale.typing import Array

STATE_DICT_KEYS = ("state", "param_groups", "optimizer_variables")


def save(variables: Sequence[Any], store: MutableMapping[str, Array]) -> None:
    """Writes each variable, as a NumPy copy, to `store["0"]`, `store["1"]`, ..."""
    for i, variable in enumerate(variables):
        store[str(i)] = variable.numpy()


def check_values(
    writes: Sequence[tuple],
    fields: Mapping[int, str],
    policy: Any = None,
    after: str = "Nothing was loaded.",
) -> None:
    """Refuses a value no step could have left in its variable (`mixed_precision.restored`).

    `writes`: `(variable, value, where)` triples; `fields`: `{id(variable): field}`
    of the variables with a rule; `after`: the message's last sentence.
    """
    from lossscale.mixed_precision import restored

    for variable, value, where in writes:
        field = fields.get(id(variable))
        if field is None:
            continue
        found = restored.refusal(field, where, _host(value), policy, after)
        if found:
            raise ValueError(found)


def _host(value):
    """`value` (a number or an array of any backend) as a NumPy array."""
    try:
        backend = backend_of(value)
    except TypeError:
        return np.asarray(value)
    return np.asarray(get_ops(backend).to_numpy(value))


def load(
    name: str,
    built: bool,
    variables: Sequence[Any],
    store: Mapping[str, Array],
    fields: Mapping[int, str] = {},  # noqa: B006 - read only
    policy: Any = None,
) -> None:
    """Restores `variables` from a store written by `save` (another count only warns)."""
    if len(store.keys()) != len(variables):
        msg = (
            f"Skipping variable loading for optimizer '{name}', because it has "
            f"{len(variables)} variables whereas the saved optimizer has "
            f"{len(store.keys())} variables."
        )
        if not built:
            msg += " This is likely because the optimizer has not been called/built yet."
        warnings.warn(msg, stacklevel=3)
        return
    values = [store[str(i)] for i in range(len(variables))]
    _write_checked("store", variables, values, lambda i: f"store[{str(i)!r}]", fields, policy)


def set_values(
    variables: Sequence[Any],
    weights: Sequence[Array],
    fields: Mapping[int, str] = {},  # noqa: B006 - read only
    policy: Any = None,
) -> None:
    """Sets each of `variables` from `weights`, in order, after checking them all."""
    weights = list(weights)
    if len(weights) != len(variables):
        raise ValueError(
            f"`weights` must hold one array per optimizer variable ({len(variables)}). "
            f"Received: {len(weights)} arrays"
        )
    _write_checked("weights", variables, weights, lambda i: f"weights[{i}]", fields, policy)


def _write_checked(argname, variables, values, where, fields, policy):
    """Checks the shapes and values, then assigns each of `values` to its variable."""
    for i, (variable, value) in enumerate(zip(variables, values)):
        shape = tuple(getattr(value, "shape", ()))
        if shape != variable.shape:
            raise ValueError(
                f"Optimizer variable {variable.path!r} has shape {variable.shape}, not "
                f"compatible with the provided value's shape. Received: {argname}[{i}].shape="
                f"{shape}"
            )
    writes = [(v, x, where(i)) for i, (v, x) in enumerate(zip(variables, values))]
    check_values(writes, fields, policy)
    for variable, value in zip(variables, values):
        variable.assign(value)


def state_dict(optimizer: Any, params: Sequence[Any]) -> dict[str, Any]:
    """`optimizer`'s state in torch's layout (see `Optimizer.state_dict`), as copies."""
    per_parameter, shared = layout(optimizer.name, optimizer.variables, params)
    return {
        "state": {
            i: {name: v.ops.copy(v.value) for name, v in slots.items()}
            for i, slots in per_parameter.items()
        },
        "param_groups": [{"params": list(range(len(params))), **_hyperparameters(optimizer)}],
        "optimizer_variables": {path: v.ops.copy(v.value) for path, v in shared.items()},
    }


def state_dict_writes(
    name: str,
    variables: Sequence[Any],
    params: Sequence[Any],
    state_dict: dict[str, Any],
    fields: Mapping[int, str] = {},  # noqa: B006 - read only
    policy: Any = None,
) -> list:
    """Checks `state_dict` whole against the layout; returns the `(variable, value)` writes."""
    per_parameter, shared = layout(name, variables, params)
    writes = _match_state_dict(len(params), state_dict, per_parameter, shared)
    check_values(writes, fields, policy)
    return [(variable, value) for variable, value, _ in writes]


def layout(name: str, variables: Sequence[Any], params: Sequence[Any]) -> tuple[dict, dict]:
    """`({parameter index: {slot name: Variable}}, {path: Variable})` of `variables`.

    A slot `{reference path with "/" as "_"}_{name}` belongs to the parameter of the
    longest such prefix and its shape; the k-th of a shared path to the k-th parameter.
    """
    by_prefix = {}
    for i, p in enumerate(params):
        by_prefix.setdefault(p.path.replace("/", "_") + "_", []).append(i)
    taken = {}
    per_parameter, shared = {}, {}
    for variable in variables:
        owner = _owner(variable, params, by_prefix, taken)
        if owner is not None:
            index, slot = owner
            per_parameter.setdefault(index, {})[slot] = variable
            continue
        if variable.path in shared:
            raise ValueError(
                f"Two variables of optimizer '{name}' share the path "
                f"{variable.path!r}, so `state_dict()` cannot key them apart. Give each "
                "optimizer (and the inner optimizer of a LossScaleOptimizer) its own `name`."
            )
        shared[variable.path] = variable
    return dict(sorted(per_parameter.items())), shared


def _owner(variable, params, by_prefix, taken):
    name = variable.name
    cuts = [k + 1 for k, c in enumerate(name) if c == "_"]
    for cut in reversed(cuts):  # longest prefix first
        prefix, slot = name[:cut], name[cut:]
        indices = by_prefix.get(prefix)
        if not indices or not slot:
            continue
        k = taken.get((prefix, slot), 0)
        if k < len(indices) and params[indices[k]].shape == variable.shape:
            taken[(prefix, slot)] = k + 1
            return indices[k], slot
    return None


def _hyperparameters(optimizer):
    """The optimizer's plain-valued constructor arguments (nested for a wrapped one)."""
    from lossscale.optimizers.base import Optimizer
    from lossscale.optimizers.config import config_keys

    keys = config_keys(type(optimizer))
    # A wrapper's base arguments are its inner optimizer's: at their defaults, they mislead.
    wraps = any(isinstance(getattr(optimizer, key, None), Optimizer) for key in keys)
    base = inspect.signature(Optimizer.__init__).parameters
    values = {}
    for key in keys:
        if key == "learning_rate":  # a variable (in `optimizer_variables`) or a schedule
            continue
        value = getattr(optimizer, key, None)
        if wraps and key in base and key != "name" and value == base[key].default:
            continue
        if isinstance(value, Optimizer):
            values[key] = {"class_name": type(value).__name__, **_hyperparameters(value)}
        elif value is None or isinstance(value, (bool, numbers.Number, str)):
            values[key] = value
    return values


def _match_state_dict(count, state_dict, per_parameter, shared):
    """Checks `state_dict` against the layout; returns `[(variable, value), ...]`."""
    if not isinstance(state_dict, dict) or set(state_dict) != set(STATE_DICT_KEYS):
        got = (
            sorted(map(str, state_dict))
            if isinstance(state_dict, dict)
            else type(state_dict).__name__
        )
        raise ValueError(
            f"`state_dict` must be a dict with keys {list(STATE_DICT_KEYS)}, as returned by "
            f"`state_dict()`. Received: {got}"
        )
    groups = state_dict["param_groups"]
    if (
        not isinstance(groups, (list, tuple))
        or len(groups) != 1
        or not isinstance(groups[0], dict)
        or list(groups[0].get("params", ())) != list(range(count))
    ):
        raise ValueError(
            f"`state_dict['param_groups']` must be one group listing the {count} parameters "
            f"this optimizer was built with (params=[0, ..., {count - 1}]). Received: "
            f"{groups!r}"[:400]
        )
    writes = []
    state = state_dict["state"]
    _check_keys("state_dict['state']", state, per_parameter)
    for index, slots in per_parameter.items():
        where = f"state_dict['state'][{index}]"
        _check_keys(where, state[index], slots)
        for name, variable in slots.items():
            at = f"{where}[{name!r}]"
            writes.append((variable, _value(at, state[index][name], variable), at))
    saved = state_dict["optimizer_variables"]
    _check_keys("state_dict['optimizer_variables']", saved, shared)
    for path, variable in shared.items():
        at = f"state_dict['optimizer_variables'][{path!r}]"
        writes.append((variable, _value(at, saved[path], variable), at))
    return writes


def _check_keys(where, got, expected):
    if not isinstance(got, dict) or set(got) != set(expected):
        received = sorted(got, key=str) if isinstance(got, dict) else type(got).__name__
        raise ValueError(
            f"`{where}` must have the keys {list(expected)} of this optimizer. Received: {received}"
        )


def _value(where, value, variable):
    """`value` as an array `variable.assign` takes (converted across backends)."""
    try:
        backend = backend_of(value)
    except TypeError:
        raise ValueError(f"`{where}` must be an array. Received: {type(value).__name__}") from None
    shape = get_ops(backend).shape(value)
    if shape != variable.shape:
        raise ValueError(
            f"`{where}` must have the shape {variable.shape} of optimizer variable "
            f"{variable.path!r}. Received: shape {shape}"
        )
    if backend not in ("numpy", variable.backend):
        value = get_ops(backend).to_numpy(value)
    return value
