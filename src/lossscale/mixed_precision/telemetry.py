"""Reading the loss-scale state for people: `summary` dicts and error messages.

Everything here runs on the host, on NumPy values read from the state, and
only when asked (`LossScaleOptimizer.summary()` / `check()`), never inside a
training step.
"""

import warnings

import numpy as np

from lossscale.mixed_precision import diagnostics, loss_scale

_REASONS = {
    loss_scale.BELOW_MIN_SCALE: "the loss scale would fall below `min_scale`",
    loss_scale.TOO_MANY_SKIPS: "more than `max_consecutive_skips` steps in a row were skipped",
}


class LossScaleError(RuntimeError):
    """Training cannot go on: the loss scale collapsed or steps keep overflowing.

    Raised by `LossScaleOptimizer` when `min_scale` or
    `max_consecutive_skips` is set and crossed. The failing steps were
    skipped, so no model or inner-optimizer variable was changed by them.
    """


class UnscaledLossWarning(UserWarning):
    """`LossScaleOptimizer.apply` ran although `scale_loss` was never called.

    Silence it, when the loss is scaled by other means, with
    `warnings.filterwarnings("ignore", category=UnscaledLossWarning)`.
    """


def state_summary(ops, state, policy, variable_paths, modules_at=None):
    """`summarize` of a `LossScaleState` read on the host (a device synchronisation).

    Args:
        ops: The backend module of the state's arrays.
        state: The `LossScaleState`.
        policy: The `LossScalePolicy`.
        variable_paths: Paths of the model variables, in build order.
        modules_at: Optional `steps -> {step: module name or None}`: where
            each overflow of the window started.
    """
    fields = loss_scale.state_fields(policy)
    values = as_numpy(ops, {f.name: getattr(state, f.name) for f in fields})
    values.setdefault("nonfinite", [])
    modules = {}
    if policy.records_details and modules_at is not None:
        modules = modules_at([int(s) for s in values["overflow_steps"] if int(s) >= 0])
    return summarize(values, policy, variable_paths, modules)


def raise_if_failed(ops, error, policy, summary):
    """Raises `LossScaleError` if `error` (the state's field) records a crossed limit.

    `summary()` is called only then, for the message.
    """
    if policy.fails_fast and int(ops.to_numpy(error)) != loss_scale.NO_ERROR:
        raise LossScaleError(failure_message(summary(), policy))


def summarize(values, policy, variable_paths, modules=None):
    """Turns the state's values into a dict for loggers.

    Args:
        values: `{field name: NumPy value}` for every field `policy` tracks
            (tuple fields as lists of values).
        policy: The `LossScalePolicy`.
        variable_paths: Paths of the model variables, in build order.
        modules: Optional `{step: module name or None}`: where each
            overflow of the window started (`lossscale.torch.watch`).

    Returns:
        A dict keyed by the state variables' names: `dynamic_scale` (float),
        `step_counter` (int) and, when tracked, `consecutive_skips`,
        `steps`, `skipped_steps`, `last_overflow_step` (`None` before the
        first overflow), `scale_history` (the scales of the last steps,
        oldest first), `nonfinite_variables` (paths of the variables whose
        gradients were non-finite at the last overflow), `error` (`None` or
        the reason) and `error_step`. With telemetry also `overflows` (the
        window, oldest first: `{"step", "variables", "module",
        "loss_finite"}` each); with diagnostics `float16_range`
        (`{variable path: {"zero", "subnormal", "near_max", "max_abs"}}`, the
        last measurement) and `float16_range_step` (`None` before one).
    """
    out = {}
    for f in loss_scale.state_fields(policy):
        if f.name in _WINDOW or f.name in diagnostics.FIELDS or f.name == "loss_finite":
            continue  # read together below; `loss_finite` is the step's own
        name, value = f.metadata["variable"] or f.name, values[f.name]
        if f.name == "scale_history":
            taken = min(int(values["steps"]), policy.history_length)
            out[name] = [float(x) for x in value[len(value) - taken :]] if taken else []
        elif f.name == "range_step":
            out["float16_range_step"] = None if int(value) < 0 else int(value)
        elif f.name == "nonfinite":
            out["nonfinite_variables"] = [p for p, bad in zip(variable_paths, value) if bool(bad)]
        elif f.name == "error":
            out[name] = _REASONS.get(int(value))
        elif f.name in ("last_overflow_step", "error_step"):
            out[name] = None if int(value) < 0 else int(value)
        elif f.metadata["dtype"] == "float32":
            out[name] = float(value)
        else:
            out[name] = int(value)
    if policy.records_details:
        out["overflows"] = overflows(values, variable_paths, modules or {})
    if policy.diagnoses:
        out["float16_range"] = diagnostics.float16_range(values, list(variable_paths))
    return out


# The overflow window's fields (see `LossScaleState`).
_WINDOW = ("overflow_steps", "overflow_loss", "overflow_bits")
_LOSS = {1: True, 0: False, -1: None}


def overflows(values, variable_paths, modules):
    """The overflow window, oldest first: `{"step", "variables", "module", "loss_finite"}` each.

    Args:
        values: Host values of the `_WINDOW` fields (`overflow_bits` may be
            an empty list: then `variables` are empty).
        variable_paths: The names `overflow_bits` refers to, in order.
        modules: `{step: module name or None}`.
    """
    steps = [int(s) for s in values["overflow_steps"]]
    losses = [int(x) for x in values["overflow_loss"]]
    bits = [int(b) for b in values.get("overflow_bits", [])]
    out = []
    for at, (step, loss) in enumerate(zip(steps, losses)):
        if step < 0:
            continue  # the window is not full yet
        age = len(steps) - 1 - at  # 0 for the most recent overflow
        names = [p for p, b in zip(variable_paths, bits) if (b >> age) & 1]
        out.append(
            {
                "step": step,
                "variables": names,
                "module": modules.get(step),
                "loss_finite": _LOSS[loss],
            }
        )
    return out


def failure_message(summary, policy):
    """The `LossScaleError` message for a summary whose `error` is set."""
    step = summary["error_step"]
    limits = (
        f"min_scale={policy.min_scale}, max_consecutive_skips="
        f"{policy.max_consecutive_skips}, hysteresis={policy.hysteresis}, "
        f"backoff_factor={policy.backoff_factor}"
    )
    history = ", ".join(f"{s:g}" for s in summary["scale_history"])
    bad = summary["nonfinite_variables"]
    lines = [
        f"Loss scaling failed at step {step}: {summary['error']} ({limits}).",
        f"Steps skipped in a row: {summary['consecutive_skips']}; in total: "
        f"{summary['skipped_steps']} of {summary['steps']}.",
        f"Loss scale of the last steps, oldest first: [{history}]; now "
        f"{summary['dynamic_scale']:g}.",
        "Variables whose gradients were non-finite at that step: "
        + (
            repr(bad)
            if bad
            else "none (the overflow came from gradients of variables not "
            "passed to `apply`, or from the unscaling itself)"
        )
        + ".",
        *describe_overflows(summary.get("overflows", [])),
        "Gradients that stay inf/NaN however small the loss scale gets usually come from "
        "the model or the data (a log or division by zero, a bad input batch, a diverging "
        "learning rate), not from float16 overflow.",
        "The failing steps were skipped: no model or optimizer variable was changed by "
        "them, and every later step is skipped until the state is restored.",
    ]
    return "\n".join(lines)


def describe_overflows(window):
    """One line per overflow of the window: whether the loss or the gradients went non-finite."""
    if not window:
        return []
    lines = ["Overflows of the last steps, oldest first:"]
    for o in window:
        if o["loss_finite"] is False:
            what = "the loss was NaN/inf"
        elif o["loss_finite"] is True:
            what = "gradients overflowed (the loss was finite)"
        else:
            what = "gradients overflowed (the loss was not recorded)"
        where = []
        if o["module"] is not None:
            where.append(f"starting in module {o['module']!r}")
        if o["variables"]:
            where.append(f"non-finite in {o['variables']!r}")
        lines.append(f"  step {o['step']}: {what}" + (", " + ", ".join(where) if where else ""))
    return lines


def warn_unscaled_loss(name, initial_scale):
    """Warns (`UnscaledLossWarning`) that optimizer `name` applies gradients of an unscaled loss.

    Returns True. The torch backend marks this function a constant result
    for `torch.compile` (`torch.compiler.assume_constant_result`): in a
    traced step the compiler runs it once, while tracing, instead of
    breaking the graph at `warnings.warn`, which it cannot trace.
    """
    warnings.warn(unscaled_loss_message(name, initial_scale), UnscaledLossWarning, stacklevel=3)
    return True


def unscaled_loss_message(name, initial_scale):
    """The `UnscaledLossWarning` message for the optimizer `name`."""
    return (
        f"LossScaleOptimizer {name!r} is applying gradients, but its `scale_loss()` was never "
        f"called: the gradients are divided by the loss scale ({initial_scale:g} at the start) "
        "without having been multiplied by it, so every update is that many times too small. "
        "Compute gradients of `optimizer.scale_loss(loss)`. If the loss is scaled by other "
        "means, silence this with warnings.filterwarnings('ignore', "
        "category=lossscale.mixed_precision.UnscaledLossWarning)."
    )


def as_numpy(ops, values):
    """`{name: value}` with every backend value (or tuple of them) read to NumPy."""
    return {
        name: [np.asarray(ops.to_numpy(x)) for x in value]
        if isinstance(value, tuple)
        else np.asarray(ops.to_numpy(value))
        for name, value in values.items()
    }
