"""Reading a `dynamic_loss_scale` state: `loss_scale`, `scale_loss`, `metrics`, `summary`, `check`.

Each finds the loss-scale state wherever it sits in the tree it is given.
`loss_scale`, `scale_loss` and `metrics` run inside a jitted step; `summary`
and `check` read values back to the host, between steps. On a
`jax.vmap`-stacked state they answer per member.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale.mixed_precision import restored
from lossscale.mixed_precision.loss_scale import NO_ERROR, LossScaleState, state_fields
from lossscale.mixed_precision.telemetry import LossScaleError, failure_message, summarize
from lossscale.optax.state import find, find_fields
from lossscale.typing import PyTree


def loss_scale(state: PyTree) -> jax.Array:
    """The current loss scale held in `state` (a float32 scalar).

    Args:
        state: A `DynamicLossScaleState`, or any pytree holding one.

    Returns:
        The scale, as a JAX array (one per member of a stacked state).
    """
    return _array(_fields(state, "loss_scale")["scale"])


def scale_loss(loss: PyTree, state: PyTree) -> PyTree:
    """Multiplies `loss` by the loss scale in `state`; differentiate the result.

    Args:
        loss: The loss (a number or array, or a pytree of them).
        state: A `DynamicLossScaleState`, or any pytree holding one.

    Returns:
        `loss * scale`, with JAX's type promotion (float16 becomes float32).
    """
    leaves = jax.tree_util.tree_leaves(loss)
    bad = [x for x in leaves if not _numeric(x)]
    if bad or not leaves:
        raise TypeError(
            "`loss` must be a number or a numeric array (or a pytree of them), such as the "
            f"float32 scalar a loss function returns. Received: loss={loss!r}"
        )
    scale = loss_scale(state)
    return jax.tree_util.tree_map(lambda x: x * scale, loss)


def metrics(state: PyTree) -> dict[str, jax.Array]:
    """Every loss-scale field of `state` as JAX arrays: a reader that runs inside `jax.jit`.

    Args:
        state: A `DynamicLossScaleState`, or any pytree holding one.

    Returns:
        A dict keyed as `summary` is, holding the arrays the settings track
        (`dynamic_scale`, `step_counter`, ...; `nonfinite` holds one boolean
        per parameter, `error` 0, 1 below `min_scale` or 2 too many skips)
        and always `last_step_skipped`.
    """
    fields = _fields(state, "metrics")
    out = {}
    for f in dataclasses.fields(LossScaleState):
        if f.name not in fields:
            continue
        value = fields[f.name]
        name = f.metadata["variable"] or f.name
        if isinstance(value, tuple):
            if not value:
                continue
            out[name] = jnp.stack([_array(x) for x in value], axis=-1)
        else:
            out[name] = _array(value)
    out["last_step_skipped"] = _array(fields["last_step_skipped"])
    return out


def summary(state: PyTree) -> dict[str, Any] | list:
    """The loss-scale state as Python values, for loggers (between steps; in `jit`: `metrics`).

    Args:
        state: A `DynamicLossScaleState`, or any pytree holding one.

    Returns:
        The dict `LossScaleOptimizer.summary()` returns; for a
        `jax.vmap`-stacked state, a list of them (nested per stacked axis).
    """
    found = find(state, "summary")
    values = {}
    for f in state_fields(found.policy):
        value = getattr(found, f.name)
        values[f.name] = (
            [_host(x, "summary") for x in value]
            if isinstance(value, tuple)
            else _host(value, "summary")
        )
    values.setdefault("nonfinite", [])
    values["last_step_skipped"] = _host(found.last_step_skipped, "summary")
    return _per_member(values, np.shape(values["scale"]), found)


def _per_member(values, shape, found):
    if not shape:
        return summarize(values, found.policy, list(found.paths))
    return [
        _per_member(
            {k: [x[m] for x in v] if isinstance(v, list) else v[m] for k, v in values.items()},
            shape[1:],
            found,
        )
        for m in range(shape[0])
    ]


def check(state: PyTree) -> None:
    """Raises if `state` holds values no step could have left, or records a crossed limit.

    Call it after restoring a state, and between steps where `min_scale` or
    `max_consecutive_skips` is set: a jitted step cannot raise, so a crossed
    limit freezes the state until this is called.

    Args:
        state: A `DynamicLossScaleState`, or any pytree holding one.

    Raises:
        ValueError: A field holds a value no step could have left.
        LossScaleError: The state records a crossed limit.
    """
    found = find(state, "check")
    held = {}  # `where` -> (field, array), read back in one transfer
    for f in state_fields(found.policy):
        value = getattr(found, f.name)
        for i, x in enumerate(value if isinstance(value, tuple) else (value,)):
            where = f"state.{f.name}" + (f"[{i}]" if isinstance(value, tuple) else "")
            held[where] = (f.name, _array(x))
    values = _host({k: x for k, (_, x) in held.items()}, "check")
    for where, (field, _) in held.items():
        message = restored.refusal(
            field, where, values[where], found.policy, after="Restore a valid state."
        )
        if message is not None:
            raise ValueError(message)
    if not found.policy.fails_fast:
        return
    errors = _host(found.error, "check")
    if not np.any(errors != NO_ERROR):
        return
    summaries = summary(found)
    if not errors.shape:
        raise LossScaleError(failure_message(summaries, found.policy, len(found.paths) or None))
    member = tuple(int(i) for i in np.argwhere(errors != NO_ERROR)[0])
    for i in member:
        summaries = summaries[i]
    raise LossScaleError(
        f"Member {member if len(member) > 1 else member[0]} of the stacked state: "
        + failure_message(summaries, found.policy, len(found.paths) or None)
    )


def _fields(state, function):
    """`{field name: leaf}` of the loss-scale state in `state` (see `state.find_fields`)."""
    fields = find_fields(state)
    if fields is None:
        find(state, function)  # raises, naming what was received
    return fields


def _numeric(x):
    if isinstance(x, (str, bytes)):
        return False
    try:
        dtype = np.result_type(x) if not hasattr(x, "dtype") else np.dtype(x.dtype)
    except TypeError:
        return False
    # JAX's lattice: NumPy's does not count bfloat16 a number.
    return jnp.issubdtype(dtype, jnp.number) and not isinstance(x, (bool, np.bool_))


def _array(x):
    """The array behind a state leaf (a Flax NNX optimizer holds it in a Variable)."""
    if isinstance(x, jax.Array):
        return x
    (leaf,) = jax.tree_util.tree_leaves(x)
    return leaf


def _host(x, function):
    """`x` (an array, or a dict of arrays) read back to the host; refused inside a trace."""
    x = {k: _array(v) for k, v in x.items()} if isinstance(x, dict) else _array(x)
    if any(isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(x)):
        raise ValueError(
            f"`{function}` reads the state on the host, between steps; it cannot run inside "
            "jax.jit or another JAX transformation. Call it on the state the jitted step "
            "returned, or use `metrics` inside the step. Received: a traced state"
        )
    if isinstance(x, dict):
        return {k: np.asarray(v) for k, v in jax.device_get(x).items()}
    return np.asarray(x)
