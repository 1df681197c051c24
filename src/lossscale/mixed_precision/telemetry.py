"""Reading the loss-scale state for people, on the host: `summary` dicts and error messages."""

import warnings

import numpy as np

from lossscale.mixed_precision import diagnostics, loss_scale

_REASONS = {
    loss_scale.BELOW_MIN_SCALE: "the loss scale would fall below `min_scale`",
    loss_scale.TOO_MANY_SKIPS: "more than `max_consecutive_skips` steps in a row were skipped",
}


class LossScaleError(RuntimeError):
    """Training cannot go on: the loss scale collapsed or steps keep overflowing.

    Raised when `min_scale` or `max_consecutive_skips` is crossed. The
    failing steps were skipped: they changed no variable.
    """


class ScaleMismatchWarning(UserWarning):
    """Gradients are unscaled by another factor than the one their loss was scaled by.

    Warned once per optimizer (or scaler) for a loss scaled twice, the
    scale changed in between (a load, `update(new_scale)`), or a loss never
    scaled (`UnscaledLossWarning`): every update is then off by a constant
    factor, which no skip reveals.
    """


class UnscaledLossWarning(ScaleMismatchWarning):
    """`LossScaleOptimizer.apply` ran although `scale_loss` was never called.

    Silence it, when the loss is scaled by other means, with
    `warnings.filterwarnings("ignore", category=UnscaledLossWarning)`.
    """


class PersistentSkipWarning(UserWarning):
    """Steps are skipped for a cause no back-off can clear (see `on_persistent`).

    The same variables stayed non-finite through back-offs: a NaN or inf in
    the weights, the data or a gradient hook, not float16's range.
    """


def state_summary(ops, state, policy, variable_paths, modules_at=None, skipped=None):
    """`summarize` of a `LossScaleState` read on the host (a device synchronisation).

    Args:
        ops: The backend module of the state's arrays.
        state: The `LossScaleState`.
        policy: The `LossScalePolicy`.
        variable_paths: Paths of the model variables, in build order.
        modules_at: Optional `steps -> {step: module name or None}`.
        skipped: Optional (backend) boolean: whether the last step was
            skipped (else told from the telemetry, if kept).
    """
    fields = loss_scale.state_fields(policy)
    values = as_numpy(ops, {f.name: getattr(state, f.name) for f in fields})
    if skipped is not None:
        held = isinstance(skipped, bool)
        values["last_step_skipped"] = skipped if held else ops.to_numpy(skipped)
    values.setdefault("nonfinite", [])
    modules = {}
    if policy.records_details and modules_at is not None:
        modules = modules_at([int(s) for s in values["overflow_steps"] if int(s) >= 0])
    return summarize(values, policy, variable_paths, modules)


def raise_if_failed(ops, error, policy, summary, variable_count=None):
    """Raises `LossScaleError` if `error` (the state's field) records a crossed limit."""
    if policy.fails_fast and int(ops.to_numpy(error)) != loss_scale.NO_ERROR:
        raise LossScaleError(failure_message(summary(), policy, variable_count))


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
        A dict keyed by the state variables' names (see
        `LossScaleOptimizer.summary`); steps not taken yet are `None`.
    """
    out = {}
    for f in loss_scale.state_fields(policy):
        if f.name in _WINDOW or f.name in diagnostics.FIELDS or f.name in _STEP_ONLY:
            continue  # read together below, or the step's own
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
        elif f.name in ("last_overflow_step", "error_step", "persistent_step"):
            out[name] = None if int(value) < 0 else int(value)
        elif f.metadata["dtype"] == "float32":
            out[name] = float(value)
        else:
            out[name] = int(value)
    if "last_step_skipped" in values:
        out["last_step_skipped"] = bool(values["last_step_skipped"])
    elif policy.records_details:
        steps = int(values["steps"])
        out["last_step_skipped"] = steps > 0 and int(values["last_overflow_step"]) == steps - 1
    if policy.records_details:
        out["overflows"] = overflows(values, variable_paths, modules or {})
    if policy.diagnoses:
        out["float16_range"] = diagnostics.float16_range(values, list(variable_paths))
    return out


# The overflow window's fields (see `LossScaleState`), and those only a step reads.
_WINDOW = ("overflow_steps", "overflow_loss", "overflow_cause", "overflow_bits")
_STEP_ONLY = ("loss_finite", "streak_scale")
_LOSS = {1: True, 0: False, -1: None}


def overflows(values, variable_paths, modules):
    """The overflow window, oldest first: `{"step", "cause", "variables", "module", "loss_finite"}`.

    Args:
        values: Host values of the `_WINDOW` fields (`overflow_bits` and
            `overflow_cause` may be missing).
        variable_paths: The names `overflow_bits` refers to, in order.
        modules: `{step: module name or None}`.
    """
    steps = [int(s) for s in values["overflow_steps"]]
    losses = [int(x) for x in values["overflow_loss"]]
    causes = [int(x) for x in values.get("overflow_cause", [-1] * len(steps))]
    bits = [int(b) for b in values.get("overflow_bits", [])]
    out = []
    for at, (step, loss, cause) in enumerate(zip(steps, losses, causes)):
        if step < 0:
            continue  # the window is not full yet
        age = len(steps) - 1 - at  # 0 for the most recent overflow
        names = [p for p, b in zip(variable_paths, bits) if (b >> age) & 1]
        if cause < 0:
            cause = loss_scale.NONFINITE_LOSS if loss == 0 else loss_scale.OVERFLOW
        out.append(
            {
                "step": step,
                "cause": loss_scale.CAUSES[cause],
                "variables": names,
                "module": modules.get(step),
                "loss_finite": _LOSS[loss],
            }
        )
    return out


# How many variable names a message lists before "and N more".
_NAMES_SHOWN = 3


def names_in_short(names):
    """`names` for a message: the first few, then how many more."""
    if len(names) <= _NAMES_SHOWN:
        return ", ".join(names)
    return f"{', '.join(names[:_NAMES_SHOWN])} and {len(names) - _NAMES_SHOWN} more"


def diagnosis(summary, variable_count=None, step=None):
    """What a skipped step says about its cause, in one sentence (None: no overflow).

    Args:
        summary: A `summarize` dict with the overflow window.
        variable_count: How many variables the step had (to tell "every
            variable" apart), or None.
        step: The skipped step to describe (it must be in the window);
            defaults to the last one.
    """
    window = summary.get("overflows") or []
    at = [i for i, o in enumerate(window) if step is None or o["step"] == step]
    if not at:
        return None
    index = at[-1]
    last = window[index]
    names, step = last["variables"], last["step"]
    if last["cause"] == "persistent":
        since = index
        while since > 0 and window[since - 1]["step"] == window[since]["step"] - 1:
            since -= 1
        return (
            f"persistent: the same {_count(names)} ({names_in_short(names)}) stayed non-finite "
            f"through back-offs since step {window[since]['step']}, down to scale "
            f"{_scale_at(summary, step):g}; backing off cannot help: look for a NaN or inf "
            "in the weights, the data or a gradient hook"
        )
    if last["cause"] == "nonfinite_loss":
        return (
            f"nonfinite_loss: the loss itself was NaN or inf at step {step}; look at the data "
            "(an input batch) or the model (a log or a division by zero)"
        )
    if last["loss_finite"] and variable_count and len(names) == variable_count:
        return (
            f"overflow: every variable's gradient was non-finite at step {step} while the loss "
            f"was finite: the scale ({_scale_at(summary, step):g}) is too high for this loss"
        )
    where = f" ({names_in_short(names)})" if names else ""
    loss = "the loss was finite" if last["loss_finite"] else "the loss was not recorded"
    return (
        f"overflow: gradients of {_count(names)}{where} overflowed at step {step} "
        f"({loss}); backing off the scale clears an overflow"
    )


def _count(names):
    return f"{len(names)} variable{'s' if len(names) != 1 else ''}" if names else "variables"


def _scale_at(summary, step):
    history = summary.get("scale_history") or []
    steps = summary.get("steps")
    if steps is not None and history and step >= steps - len(history):
        return history[step - (steps - len(history))]
    return summary["dynamic_scale"]


def failure_message(summary, policy, variable_count=None):
    """The `LossScaleError` message for a summary whose `error` is set: the cause first, short."""
    step = summary["error_step"]
    found = diagnosis(summary, variable_count) or "steps kept being skipped"
    lines = [
        f"Loss scaling failed at step {step}: {found}.",
        f"Stopped because {summary['error']} (min_scale={policy.min_scale}, "
        f"max_consecutive_skips={policy.max_consecutive_skips}, hysteresis={policy.hysteresis}, "
        f"backoff_factor={policy.backoff_factor}). Steps skipped in a row: "
        f"{summary['consecutive_skips']}; in total: {summary['skipped_steps']} of "
        f"{summary['steps']}.",
        "Loss scale of the last steps, oldest first: "
        f"[{', '.join(f'{s:g}' for s in summary['scale_history'])}]; now "
        f"{summary['dynamic_scale']:g}.",
        *describe_overflows(summary.get("overflows", [])),
        "The failing steps were skipped: no model or optimizer variable was changed by "
        "them, and every later step is skipped until the state is restored.",
    ]
    return "\n".join(lines)


def describe_overflows(window):
    """The window's overflows, oldest first: one line per run of alike ones (cause, variables)."""
    if not window:
        return []
    lines = ["Overflows of the last steps, oldest first:"]
    runs = []
    for o in window:
        key = (o["cause"], o["loss_finite"], tuple(o["variables"]), o["module"])
        if runs and runs[-1][0] == key and runs[-1][2] == o["step"] - 1:
            runs[-1][2] = o["step"]
        else:
            runs.append([key, o["step"], o["step"]])
    for (cause, loss, names, module), first, last in runs:
        when = f"step {first}" if first == last else f"steps {first}-{last}"
        what = {True: "loss finite", False: "loss NaN/inf", None: "loss not recorded"}[loss]
        where = []
        if module is not None:
            where.append(f"starting in module {module!r}")
        if names:
            where.append(f"non-finite: {_count(names)} ({names_in_short(list(names))})")
        lines.append(f"  {when}: {cause}, {what}" + ("; " + "; ".join(where) if where else ""))
    return lines


def warn(message, category):
    """Warns `message` as `category`; returns True.

    The torch backend marks it `torch.compiler.assume_constant_result`: a
    traced step runs it once while tracing instead of breaking the graph.
    """
    warnings.warn(message, category, stacklevel=4)
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
