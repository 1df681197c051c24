"""Reading a `dynamic_loss_scale` state: `loss_scale`, `scale_loss`, `summary`, `check`.

Each finds the loss-scale state wherever it sits in the tree it is given
(the state itself, an `optax.chain` state, a Flax `TrainState`,
`nnx.Optimizer.opt_state`). `loss_scale` and `scale_loss` run inside a
jitted step; `summary` and `check` read values back to the host (a device
synchronisation on an accelerator) and belong between steps, like
`LossScaleOptimizer.summary()` / `check()`, whose messages they share.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from lossscale.mixed_precision.loss_scale import NO_ERROR, state_fields
from lossscale.mixed_precision.telemetry import LossScaleError, failure_message, summarize
from lossscale.optax.state import find
from lossscale.typing import PyTree


def loss_scale(state: PyTree) -> jax.Array:
    """The current loss scale held in `state` (a float32 scalar).

    Args:
        state: A `DynamicLossScaleState`, or any pytree holding one.

    Returns:
        The scale, as a JAX array (traced inside `jax.jit`).
    """
    return _array(find(state, "loss_scale").scale)


def scale_loss(loss: PyTree, state: PyTree) -> PyTree:
    """Multiplies `loss` by the loss scale in `state`; differentiate the result.

    Args:
        loss: The loss (a scalar array or a pytree of arrays).
        state: A `DynamicLossScaleState`, or any pytree holding one.

    Returns:
        `loss * scale`, with JAX's type promotion (a float16 loss becomes
        float32, as jmp's `scale` makes it).
    """
    scale = loss_scale(state)
    return jax.tree_util.tree_map(lambda x: x * scale, loss)


def summary(state: PyTree) -> dict[str, Any]:
    """The loss-scale state as Python values, for loggers.

    Reads the values back to the host: call it between steps, not inside
    `jax.jit`.

    Args:
        state: A `DynamicLossScaleState`, or any pytree holding one.

    Returns:
        The dict `LossScaleOptimizer.summary()` returns: `dynamic_scale`,
        `step_counter` and, as the settings track them, `consecutive_skips`,
        `steps`, `skipped_steps`, `last_overflow_step`, `scale_history`,
        `nonfinite_variables` (parameter paths), `error`, `error_step`.
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
    return summarize(values, found.policy, list(found.paths))


def check(state: PyTree) -> None:
    """Raises `LossScaleError` if `state` records a crossed limit.

    A jitted step cannot raise: with `min_scale` or `max_consecutive_skips`
    set, a crossed limit freezes the state (every later step is skipped)
    until this is called, between steps. It reads one scalar; without those
    limits there is nothing to check and nothing is read.

    Args:
        state: A `DynamicLossScaleState`, or any pytree holding one.

    Raises:
        LossScaleError: With the step, the last scales and the parameters
            whose gradients were non-finite.
    """
    found = find(state, "check")
    if not found.policy.fails_fast:
        return
    if int(_host(found.error, "check")) != NO_ERROR:
        raise LossScaleError(failure_message(summary(found), found.policy))


def _array(x):
    """The array behind a state leaf (a Flax NNX optimizer holds it in a Variable)."""
    if isinstance(x, jax.Array):
        return x
    (leaf,) = jax.tree_util.tree_leaves(x)
    return leaf


def _host(x, function):
    x = _array(x)
    if isinstance(x, jax.core.Tracer):
        raise ValueError(
            f"`{function}` reads the state on the host, between steps; it cannot run inside "
            "jax.jit or another JAX transformation. Call it on the state the jitted step "
            "returned. Received: a traced state"
        )
    return np.asarray(x)
