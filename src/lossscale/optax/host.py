"""Reading a `dynamic_loss_scale` state: `loss_scale`, `scale_loss`, `metrics`, `summary`, `check`.

Each finds the loss-scale state wherever it sits in the tree it is given
(the state itself, an `optax.chain` state, a Flax `TrainState`, an
`nnx.Optimizer` or its `opt_state`, an `optax.MultiSteps` state, an
`nnx.split` pair). `loss_scale`, `scale_loss` and `metrics` run inside a
jitted step, and on a bare `nnx.split` state; `summary` and `check` read
values back to the host (a device synchronisation on an accelerator) and
belong between steps, like `LossScaleOptimizer.summary()` / `check()`,
whose messages they share. On a `jax.vmap`-stacked state (an ensemble)
they answer per member.
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
        state: A `DynamicLossScaleState`, or any pytree holding one (an
            `nnx.split` state included).

    Returns:
        The scale, as a JAX array (traced inside `jax.jit`; one per member
        for a `jax.vmap`-stacked state).
    """
    return _array(_fields(state, "loss_scale")["scale"])


def scale_loss(loss: PyTree, state: PyTree) -> PyTree:
    """Multiplies `loss` by the loss scale in `state`; differentiate the result.

    Args:
        loss: The loss (a number or array, or a pytree of them).
        state: A `DynamicLossScaleState`, or any pytree holding one.

    Returns:
        `loss * scale`, with JAX's type promotion (a float16 loss becomes
        float32, as jmp's `scale` makes it).
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

    Return it from the jitted step (or log it with `jax.debug.callback`);
    nothing is read back to the host.

    Args:
        state: A `DynamicLossScaleState`, or any pytree holding one (an
            `nnx.split` state included).

    Returns:
        A dict keyed as `summary` is, holding the arrays the settings track:
        `dynamic_scale`, `step_counter`, and as tracked `consecutive_skips`,
        `steps`, `skipped_steps`, `last_overflow_step` (-1 before the first
        overflow), `scale_history` (`history_length` scales, oldest first,
        zeros before the first step), `nonfinite` (one boolean per parameter,
        in `state.paths` order), `error` (0: none, 1: below `min_scale`, 2:
        too many skips), `error_step` (-1 before an error), and always
        `last_step_skipped` (a boolean: whether the last update was
        skipped, False before one). A stacked state gives stacked arrays.
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
    """The loss-scale state as Python values, for loggers.

    Reads the values back to the host: call it between steps, not inside
    `jax.jit` (there, use `metrics`).

    Args:
        state: A `DynamicLossScaleState`, or any pytree holding one.

    Returns:
        The dict `LossScaleOptimizer.summary()` returns: `dynamic_scale`,
        `step_counter` and, as the settings track them, `consecutive_skips`,
        `steps`, `skipped_steps`, `last_overflow_step`, `scale_history`,
        `nonfinite_variables` (parameter paths), `error`, `error_step`. For
        a `jax.vmap`-stacked state (an ensemble), one such dict per member,
        in a list (nested for several stacked axes).
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

    Call it after restoring a state (orbax, any pytree checkpointer): a
    NaN, zero or negative scale, a negative or fractional counter would
    otherwise skip every step or pin the scale, silently. And a jitted step
    cannot raise: with `min_scale` or `max_consecutive_skips` set, a
    crossed limit freezes the state (every later step is skipped) until
    this is called, between steps. It reads the loss-scale fields (a few
    scalars; one per member of a stacked state), never the inner state.

    Args:
        state: A `DynamicLossScaleState`, or any pytree holding one.

    Raises:
        ValueError: A field holds a value no step could have left (the
            field, the value and what it may hold).
        LossScaleError: With the step, the last scales and the parameters
            whose gradients were non-finite (and, for a stacked state, the
            index of the first member in error).
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
    # JAX's lattice: NumPy's alone does not count bfloat16 (an ml_dtypes type) a number.
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
