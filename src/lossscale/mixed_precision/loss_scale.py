"""The dynamic loss-scale state machine: one pure function, every backend.

`next_loss_scale(ops, state, finite, policy)` returns the new
`LossScaleState`. It uses selects, never Python branches on array values, so
the stateful wrapper, `stateless_apply` and `jax.jit` share it unchanged.
Python branches here look only at the `LossScalePolicy`, which is static.

Which state fields exist depends on the policy (see `LossScalePolicy.tracks`):
the Keras defaults keep exactly Keras's two (`scale`, `counter`); hysteresis,
telemetry and fail-fast limits add the fields they need.
"""

import dataclasses

import numpy as np

from lossscale import validation

# Below this a float32 scale is subnormal and `grad / scale` overflows for
# ordinary gradients; backoff stops here instead of reaching 0.
MIN_SCALE = float(np.finfo(np.float32).tiny)
MAX_SCALE = float(np.finfo(np.float32).max)
FLOAT16_MAX = float(np.finfo(np.float16).max)
# `growth_policy="headroom"` grows only while the largest scaled gradient,
# times `growth_factor`, stays below FLOAT16_MAX / HEADROOM_MARGIN. The
# gradients the optimizer sees are not the largest values of the backward
# pass (activation gradients and partial sums run larger), and they vary
# from step to step; docs/reliability.md shows how this margin was chosen.
HEADROOM_MARGIN = 8.0
# Scales kept in `LossScaleState.scale_history` (used by the error message).
HISTORY_LENGTH = 8
GROWTH_POLICIES = ("fixed", "headroom")

# Values of `LossScaleState.error`.
NO_ERROR = 0
BELOW_MIN_SCALE = 1
TOO_MANY_SKIPS = 2


def _setting(default, keras=False):
    # `keras`: the setting is in Keras's own config, so it is always written.
    return dataclasses.field(default=default, metadata={"keras": keras})


@dataclasses.dataclass(frozen=True)
class LossScalePolicy:
    """Settings of the dynamic loss scale.

    The defaults reproduce Keras 3's `LossScaleOptimizer` exactly.

    Args:
        initial_scale: Float. The starting loss scale.
        dynamic_growth_steps: Int. After this many consecutive steps with
            finite gradients, the scale grows by `growth_factor`.
        growth_factor: Float > 1. Multiplier applied on growth.
        backoff_factor: Float in (0, 1). Multiplier applied on backoff.
        hysteresis: Int >= 1. Consecutive overflowing steps before the scale
            backs off: 1 backs off at every overflow; N skips N-1 overflowing
            steps in a row at the same scale, then backs off at every further
            one until a finite step resets the count.
        min_scale: Float or `None`. When a backoff would take the scale below
            it, the step is recorded as failed and `LossScaleError` is raised
            (see `LossScaleOptimizer`). `None`: the scale stops at the
            smallest normal float32 instead, without an error.
        max_scale: Float or `None`. Growth stops at this scale.
        max_consecutive_skips: Int >= 0 or `None`. When more steps than this
            are skipped in a row, `LossScaleError` is raised.
        growth_policy: `"fixed"` grows every `dynamic_growth_steps` finite
            steps; `"headroom"` grows then only if the largest scaled
            gradient times `growth_factor` stays below
            `FLOAT16_MAX / HEADROOM_MARGIN`, so a growth rarely costs an
            overflowing (skipped) step.
        telemetry: Boolean. Whether to record the skipped-step counters, the
            last scales and which variables had non-finite gradients at the
            last overflow (one extra reduction per gradient). Always on when
            `min_scale` or `max_consecutive_skips` is set.
    """

    initial_scale: float = _setting(2.0**15, keras=True)
    dynamic_growth_steps: int = _setting(2000, keras=True)
    growth_factor: float = _setting(2.0)
    backoff_factor: float = _setting(0.5)
    hysteresis: int = _setting(1)
    min_scale: float | None = _setting(None)
    max_scale: float | None = _setting(None)
    max_consecutive_skips: int | None = _setting(None)
    growth_policy: str = _setting("fixed")
    telemetry: bool = _setting(False)

    def __post_init__(self):
        check = validation.check_number
        check("initial_scale", self.initial_scale, low=0, low_open=True, high=MAX_SCALE)
        check("dynamic_growth_steps", self.dynamic_growth_steps, low=1, integer=True)
        check("growth_factor", self.growth_factor, low=1, low_open=True)
        check("backoff_factor", self.backoff_factor, low=0, high=1, low_open=True, high_open=True)
        check("hysteresis", self.hysteresis, low=1, integer=True)
        check("min_scale", self.min_scale, low=MIN_SCALE, high=MAX_SCALE, allow_none=True)
        check("max_scale", self.max_scale, low=0, low_open=True, high=MAX_SCALE, allow_none=True)
        check(
            "max_consecutive_skips",
            self.max_consecutive_skips,
            low=0,
            integer=True,
            allow_none=True,
        )
        validation.check_choice("growth_policy", self.growth_policy, GROWTH_POLICIES)
        validation.check_bool("telemetry", self.telemetry)
        low = self.min_scale if self.min_scale is not None else 0.0
        high = self.max_scale if self.max_scale is not None else MAX_SCALE
        if not low <= self.initial_scale <= high or low >= high:
            raise ValueError(
                "The scales must satisfy `min_scale` <= `initial_scale` <= `max_scale` and "
                f"`min_scale` < `max_scale`. Received: min_scale={self.min_scale}, "
                f"initial_scale={self.initial_scale}, max_scale={self.max_scale}"
            )
        # Derived once: a step asks for them every time, and `torch.compile`
        # traces attribute reads where it cannot trace `dataclasses.fields`.
        object.__setattr__(self, "_plain", self._compute_is_plain())
        fields = tuple(f for f in _STATE_FIELDS if self.tracks(f.name))
        object.__setattr__(self, "_field_names", tuple(f.name for f in fields))
        # (name, per, initial) of each: plain values, which a compiled step
        # reads where it cannot read a field's metadata mapping.
        starts = tuple((f.name, f.metadata["per"], f.metadata["initial"]) for f in fields)
        object.__setattr__(self, "_starts", starts)

    @property
    def fails_fast(self):
        """Whether `min_scale` or `max_consecutive_skips` can end training with an error."""
        return self.min_scale is not None or self.max_consecutive_skips is not None

    @property
    def records_details(self):
        """Whether the telemetry fields (counters, history, variable flags) are kept."""
        return self.telemetry or self.fails_fast

    @property
    def is_plain(self):
        """Whether the update is Keras's own, with other factors at most.

        See `_compute_is_plain`.
        """
        return self._plain

    def _compute_is_plain(self):
        """Whether the update is Keras's own, with other factors at most.

        No hysteresis, limits, headroom or telemetry, and factors that are
        float32 numbers (so every kernel multiplies by the same value): the
        state is the scale and the counter, and a backend may update them
        in one kernel (`fused_scale_update`).
        """
        return (
            self.hysteresis == 1
            and not self.records_details
            and self.max_scale is None
            and self.growth_policy == "fixed"
            and all(float(np.float32(f)) == f for f in (self.growth_factor, self.backoff_factor))
        )

    def tracks(self, field_name):
        """Whether `LossScaleState.<field_name>` exists under this policy."""
        group = _FIELDS[field_name].metadata["group"]
        return {
            "keras": True,
            "streak": self.hysteresis > 1 or self.records_details,
            "telemetry": self.records_details,
            "fail_fast": self.fails_fast,
        }[group]

    def non_default_settings(self):
        """The settings to write in a config: Keras's, then any changed one."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata["keras"] or getattr(self, f.name) != f.default
        }


def _state(group, dtype, initial, variable=None, per="step"):
    """Describes a state field.

    Args:
        group: When the field exists (see `LossScalePolicy.tracks`).
        dtype: Its dtype (integers are int32 on every backend, as in Keras 3).
        initial: Its initial value; `None` means `initial_scale`.
        variable: The optimizer variable's name (defaults to the field's).
        per: `"step"` for a scalar, `"history"` for `HISTORY_LENGTH`
            scalars, `"variable"` for one scalar per model variable.
    """
    return dataclasses.field(
        default=None if per == "step" else (),
        metadata=dict(group=group, dtype=dtype, initial=initial, variable=variable, per=per),
    )


@dataclasses.dataclass(frozen=True)
class LossScaleState:
    """The loss-scale state: backend scalars, or tuples of them.

    Fields a policy does not track are `None` (tuples: empty).

    Attributes:
        scale: Float32. The current loss scale.
        counter: Int. Consecutive finite steps since the last growth or
            overflow.
        consecutive_skips: Int. Overflowing (skipped) steps in a row.
        steps: Int. Steps taken, skipped or not.
        skipped: Int. Skipped steps in total.
        last_overflow_step: Int. Index (from 0) of the last skipped step, or -1.
        error: Int. `NO_ERROR`, `BELOW_MIN_SCALE` or `TOO_MANY_SKIPS`. Once
            set, the state no longer changes and no step is applied.
        error_step: Int. Index of the step that set `error`, or -1.
        scale_history: The scales used by the last `HISTORY_LENGTH` steps,
            oldest first (entries before the first step are 0).
        nonfinite: One boolean per model variable (in build order): whether
            its gradient was non-finite at the last overflow.
    """

    scale: object = _state("keras", "float32", None, "dynamic_scale")
    counter: object = _state("keras", "int32", 0, "step_counter")
    consecutive_skips: object = _state("streak", "int32", 0)
    steps: object = _state("telemetry", "int32", 0)
    skipped: object = _state("telemetry", "int32", 0, "skipped_steps")
    last_overflow_step: object = _state("telemetry", "int32", -1)
    scale_history: tuple = _state("telemetry", "float32", 0.0, per="history")
    nonfinite: tuple = _state("telemetry", "bool", False, per="variable")
    error: object = _state("fail_fast", "int32", NO_ERROR)
    error_step: object = _state("fail_fast", "int32", -1)


_STATE_FIELDS = dataclasses.fields(LossScaleState)
_FIELDS = {f.name: f for f in _STATE_FIELDS}
# Every field's name, in declaration order.
STATE_FIELD_NAMES = tuple(_FIELDS)


def state_fields(policy):
    """The `LossScaleState` fields `policy` tracks, in declaration order."""
    return tuple(_FIELDS[name] for name in policy._field_names)


def replaced(state, **changes):
    """`state` with some fields changed (`dataclasses.replace`, traceable by torch.compile)."""
    return LossScaleState(**{n: changes.get(n, getattr(state, n)) for n in STATE_FIELD_NAMES})


def may_apply(ops, state, finite, policy):
    """Whether this step's gradients are applied: finite, and no error recorded."""
    if not policy.fails_fast:
        return finite
    return ops.logical_and(finite, state.error == NO_ERROR)


def _zero(x):
    # A zero of `x`'s dtype and device, made on the device: converting a
    # Python number would cost a host-to-device copy on an accelerator.
    return x * 0


def _constant(ops, value, dtype, like):
    return ops.full((), value, dtype, like=like)


def next_loss_scale(
    ops, state, finite, policy, peak=None, variable_finite=(), skip=None, in_place=False
):
    """Advances the loss-scale state by one step.

    With finite gradients the counter increments; on the
    `dynamic_growth_steps`-th consecutive finite step the scale grows by
    `growth_factor` and the counter resets (a growth that would leave
    float32's finite range is not taken; `max_scale` caps it; with
    `growth_policy="headroom"` it is not taken when `peak * growth_factor`
    would reach `FLOAT16_MAX / HEADROOM_MARGIN`). With non-finite gradients
    the counter resets and, once `hysteresis` steps in a row have
    overflowed, the scale backs off by `backoff_factor`, never below
    `MIN_SCALE`; a backoff below `min_scale`, or more than
    `max_consecutive_skips` skips in a row, records an error instead, after
    which the state stays as it is.

    Fields of `state` that are `None` but tracked by `policy` start from
    their initial values, so a two-field state works with any policy.

    Args:
        ops: The backend module of the state's arrays.
        state: The current `LossScaleState`.
        finite: Backend boolean scalar, whether every gradient was finite.
        policy: The `LossScalePolicy`.
        peak: Float32 scalar, the largest magnitude of the (scaled)
            gradients; required with `growth_policy="headroom"`.
        variable_finite: For each entry of `state.nonfinite`, a boolean
            scalar (whether that variable's gradient was finite) or `None`
            (it had no gradient this step).
        skip: Optional float32 scalar, 1.0 where `finite` is False: the same
            flag in torch's AMP form, when the caller has it (a backend
            kernel reads it instead of converting `finite`).
        in_place: Whether the arrays of `state` may be overwritten with the
            new state (a mutable backend's kernel then updates them where
            they are; the returned state holds them). Defaults to False:
            `state` is left as it was.

    Returns:
        The next `LossScaleState`.
    """
    if policy.growth_policy == "headroom" and peak is None:
        raise ValueError('`peak` is required with growth_policy="headroom". Received: peak=None')
    if len(variable_finite) != len(state.nonfinite):
        raise ValueError(
            "`variable_finite` must hold one entry per entry of `state.nonfinite` "
            f"({len(state.nonfinite)}). Received: {len(variable_finite)} entries"
        )
    state = _complete(ops, state, policy)
    kernel = ops.fused_scale_update() if policy.is_plain else None
    if kernel is not None:
        scale, counter = kernel(
            state.scale,
            state.counter,
            finite,
            policy.dynamic_growth_steps,
            policy.growth_factor,
            policy.backoff_factor,
            MIN_SCALE,
            skip=skip,
            in_place=in_place,
        )
        return replaced(state, scale=scale, counter=counter)
    scale, counter = state.scale, state.counter
    overflow = ops.logical_not(finite)
    new = {}

    grow = ops.logical_and(finite, counter == policy.dynamic_growth_steps - 1)
    with ops.quiet():  # an overflowing candidate is computed on purpose
        grown = scale * policy.growth_factor
        if policy.max_scale is not None:
            grown = ops.minimum(grown, _constant(ops, policy.max_scale, "float32", scale))
        else:
            grown = ops.where(ops.isfinite(grown), grown, scale)
        if policy.growth_policy == "headroom":
            room = peak * policy.growth_factor < FLOAT16_MAX / HEADROOM_MARGIN
            grown = ops.where(room, grown, scale)
        backed_off = scale * policy.backoff_factor
    if policy.min_scale is None:
        backed_off = ops.maximum(backed_off, _constant(ops, MIN_SCALE, "float32", scale))
    else:  # not taken: the step is recorded as failed below
        below = backed_off < policy.min_scale
        backed_off = ops.where(below, scale, backed_off)

    if policy.tracks("consecutive_skips"):
        streak = ops.where(finite, _zero(counter), state.consecutive_skips + 1)
        new["consecutive_skips"] = streak
        back_off = ops.logical_and(overflow, streak >= policy.hysteresis)
    else:
        back_off = overflow
    new["scale"] = ops.cast(
        ops.where(grow, grown, ops.where(back_off, backed_off, scale)), "float32"
    )
    new["counter"] = ops.where(
        ops.logical_and(finite, ops.logical_not(grow)), counter + 1, _zero(counter)
    )

    if policy.records_details:
        step = state.steps
        new["steps"] = step + 1
        new["skipped"] = ops.where(finite, state.skipped, state.skipped + 1)
        new["last_overflow_step"] = ops.where(finite, state.last_overflow_step, step)
        new["scale_history"] = state.scale_history[1:] + (scale,)
        new["nonfinite"] = tuple(
            ops.logical_and(old, finite)
            if ok is None
            else ops.where(finite, old, ops.logical_not(ok))
            for old, ok in zip(state.nonfinite, variable_finite)
        )

    if policy.fails_fast:
        failed = ops.logical_and(back_off, below) if policy.min_scale is not None else None
        too_many = (
            streak > policy.max_consecutive_skips
            if policy.max_consecutive_skips is not None
            else None
        )
        code = _zero(state.error)
        if too_many is not None:
            code = ops.where(too_many, code + TOO_MANY_SKIPS, code)
        if failed is not None:
            code = ops.where(failed, _zero(code) + BELOW_MIN_SCALE, code)
        new["error"] = code
        new["error_step"] = ops.where(code != NO_ERROR, step, state.error_step)
        # Once an error is recorded, nothing moves: the state keeps
        # describing the failure until the host reads it.
        frozen = state.error != NO_ERROR
        new = {
            name: _select(ops, frozen, getattr(state, name), value) for name, value in new.items()
        }
    return replaced(state, **new)


def _select(ops, pred, old, new):
    if isinstance(new, tuple):
        return tuple(ops.where(pred, o, n) for o, n in zip(old, new))
    return ops.where(pred, old, new)


def _complete(ops, state, policy):
    """`state` with every tracked scalar field present (missing ones at their start)."""
    missing = {}
    for name, per, initial in policy._starts:
        if per == "variable":
            continue  # sized by the caller, who knows the model
        if per == "history":
            if not state.scale_history:
                missing[name] = (_zero(state.scale),) * HISTORY_LENGTH
        elif getattr(state, name) is None:
            missing[name] = _zero(state.counter) + initial
    return replaced(state, **missing) if missing else state
