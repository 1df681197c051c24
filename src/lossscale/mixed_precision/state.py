"""`LossScaleState`: the loss-scale state, its fields' metadata, and where front ends keep it.

Each field's metadata says when it exists (its group), its dtype, initial
value, variable name and shape (`per`); field lists are derived from them.
"""

import dataclasses
import operator

# Entries kept in each history field (`LossScaleState.scale_history`, the
# overflow window) unless `LossScalePolicy.history_length` says otherwise.
HISTORY_LENGTH = 8
# The longest window: `overflow_bits` keeps one bit per overflow in an int32.
MAX_HISTORY_LENGTH = 30

# Values of `LossScaleState.error`.
NO_ERROR = 0
BELOW_MIN_SCALE = 1
TOO_MANY_SKIPS = 2

# Why a step was skipped (`LossScaleState.overflow_cause`): gradients
# overflowed; the loss itself was NaN or inf; the same variables stayed
# non-finite through back-offs (backing off cannot help).
OVERFLOW = 0
NONFINITE_LOSS = 1
PERSISTENT = 2
CAUSES = {OVERFLOW: "overflow", NONFINITE_LOSS: "nonfinite_loss", PERSISTENT: "persistent"}
# A skip is persistent once back-offs lowered the scale by this factor since its streak
# began (or the scale is at most 1) and the same variables are still non-finite.
PERSISTENT_DROP = 2.0**8


def _state(group, dtype, initial, variable=None, per="step"):
    """Describes a state field.

    Args:
        group: When the field exists (see `LossScalePolicy.tracks`).
        dtype: Its dtype (integers are int32 on every backend, as in Keras 3).
        initial: Its initial value; `None` means `initial_scale`.
        variable: The optimizer variable's name (defaults to the field's).
        per: `"step"` (a scalar), `"history"` (`history_length` scalars),
            `"variable"` (a scalar per model variable) or `"vector"` (one
            array with an entry per model variable).
    """
    return dataclasses.field(
        default=None if per in ("step", "vector") else (),
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
        steps: Int. Steps taken, skipped or not (kept with telemetry and
            with diagnostics).
        skipped: Int. Skipped steps in total.
        last_overflow_step: Int. Index (from 0) of the last skipped step, or -1.
        error: Int. `NO_ERROR`, `BELOW_MIN_SCALE` or `TOO_MANY_SKIPS`. Once
            set, the state no longer changes and no step is applied.
        error_step: Int. Index of the step that set `error`, or -1.
        streak_scale: Float32. The scale at the first skip of the current
            streak of skipped steps (0 between streaks).
        persistent_step: Int. The first step found persistent (see
            `PERSISTENT_DROP`), or -1.
        scale_history: The scales used by the last `history_length` steps,
            oldest first (entries before the first step are 0).
        nonfinite: One boolean per model variable (in build order): whether
            its gradient was non-finite at the last overflow.
        loss_finite: Int. Whether this step's loss was finite: 1, 0, or -1
            when no `scale_loss` recorded it. Reset to -1 by every step.
        overflow_steps: The steps of the last `history_length` overflows,
            oldest first (-1: no overflow there yet).
        overflow_loss: For each of those overflows, `loss_finite` then.
        overflow_cause: For each of those overflows, its cause: `OVERFLOW`,
            `NONFINITE_LOSS` or `PERSISTENT` (-1: no overflow there yet).
        overflow_bits: One int per model variable: bit k is set when its
            gradient was non-finite at the k-th most recent overflow of the
            window (bit 0: the last one).
        range_zero: A float32 vector, one entry per model variable: the
            share of its scaled gradient's elements that were 0 at the last
            measurement (`GradScaler` lends the `range_*` fields as tuples
            of scalars instead).
        range_subnormal: The share that was a float16 subnormal
            (0 < |g| < 2^-14): precision already lost.
        range_near_max: The share at or above `FLOAT16_MAX / growth_factor`:
            the next growth would overflow them.
        range_max_abs: The largest magnitude.
        range_step: Int. The step of the last measurement, or -1.
    """

    scale: object = _state("keras", "float32", None, "dynamic_scale")
    counter: object = _state("keras", "int32", 0, "step_counter")
    consecutive_skips: object = _state("streak", "int32", 0)
    steps: object = _state("steps", "int32", 0)
    skipped: object = _state("telemetry", "int32", 0, "skipped_steps")
    last_overflow_step: object = _state("telemetry", "int32", -1)
    scale_history: tuple = _state("telemetry", "float32", 0.0, per="history")
    nonfinite: tuple = _state("telemetry", "bool", False, per="variable")
    error: object = _state("fail_fast", "int32", NO_ERROR)
    error_step: object = _state("fail_fast", "int32", -1)
    streak_scale: object = _state("telemetry", "float32", 0.0)
    persistent_step: object = _state("telemetry", "int32", -1)
    loss_finite: object = _state("telemetry", "int32", -1)
    overflow_steps: tuple = _state("telemetry", "int32", -1, per="history")
    overflow_loss: tuple = _state("telemetry", "int32", -1, per="history")
    overflow_cause: tuple = _state("telemetry", "int32", -1, per="history")
    overflow_bits: tuple = _state("telemetry", "int32", 0, per="variable")
    range_zero: object = _state("diagnostics", "float32", 0.0, per="vector")
    range_subnormal: object = _state("diagnostics", "float32", 0.0, per="vector")
    range_near_max: object = _state("diagnostics", "float32", 0.0, per="vector")
    range_max_abs: object = _state("diagnostics", "float32", 0.0, per="vector")
    range_step: object = _state("diagnostics", "int32", -1)


_STATE_FIELDS = dataclasses.fields(LossScaleState)
_FIELDS = {f.name: f for f in _STATE_FIELDS}
STATE_FIELD_NAMES = tuple(_FIELDS)


def per_variable(field) -> bool:
    """Whether `field` (a `dataclasses.Field` of `LossScaleState`) has an entry per variable."""
    return field.metadata["per"] in ("variable", "vector")


def replaced(state, **changes):
    """`state` with some fields changed (`dataclasses.replace`, traceable by torch.compile).

    Raises:
        TypeError: a name in `changes` is not a field (as `dataclasses.replace`).
    """
    unknown = sorted(set(changes) - set(STATE_FIELD_NAMES))
    if unknown:
        raise TypeError(
            f"`replaced` got unknown `LossScaleState` fields: {unknown}. "
            f"Expected names among: {list(STATE_FIELD_NAMES)}."
        )
    return LossScaleState(**{n: changes.get(n, getattr(state, n)) for n in STATE_FIELD_NAMES})


# --- the layout: a front end holds `{field name: holder, or a tuple of them}`


def variable_specs(policy, variable_paths=(), kinds=("step", "history", "variable", "vector")):
    """`(field, variable name, dtype, initial, shape, index)` of each holder `policy` needs.

    Args:
        policy: The `LossScalePolicy` (its tracked fields).
        variable_paths: The model variables' paths, in build order.
        kinds: Which fields' holders to list, by their `per`.

    Yields:
        One tuple per holder, in field order; `initial` is None for
        `initial_scale`, `index` the place in a tuple field (else None).
    """
    for name in policy._field_names:
        meta = _FIELDS[name].metadata
        per = meta["per"]
        if per not in kinds:
            continue
        variable = meta["variable"] or name
        dtype, initial = meta["dtype"], meta["initial"]
        if per == "step":
            yield name, variable, dtype, initial, (), None
        elif per == "vector":
            yield name, variable, dtype, initial, (len(variable_paths),), None
        elif per == "history":
            for i in range(policy.history_length):
                yield name, f"{variable}_{i}", dtype, initial, (), i
        else:
            for i, path in enumerate(variable_paths):
                yield name, f"{path.replace('/', '_')}_{variable}", dtype, initial, (), i


def holders_of(specs, make):
    """`{field: holder or tuple of holders}`: `make(spec)` for each of `variable_specs`."""
    holders = {}
    for spec in specs:
        name, index = spec[0], spec[5]
        made = make(spec)
        if index is None:
            holders[name] = made
        else:
            holders[name] = (*holders.get(name, ()), made)
    return holders


def flatten(state):
    """`((field, index or None), value)` of a `LossScaleState` or `{field: holder(s)}`; no Nones."""
    items = (
        state.items()
        if isinstance(state, dict)
        else ((name, getattr(state, name)) for name in STATE_FIELD_NAMES)
    )
    for name, value in items:
        if isinstance(value, tuple):
            yield from (((name, i), x) for i, x in enumerate(value))
        elif value is not None:
            yield (name, None), value


def read(holders, value_of):
    """The `LossScaleState` of `{field: holder or tuple of holders}`, each read by `value_of`."""
    return LossScaleState(
        **{
            name: tuple(map(value_of, held)) if isinstance(held, tuple) else value_of(held)
            for name, held in holders.items()
        }
    )


def value_of(holder):
    return holder.value


def reader(variables, values=None):
    """`variable -> value`: its own, or, given `values` (one per of `variables`), its entry."""
    if values is None:
        return value_of
    values = list(values)
    if len(values) != len(variables):
        raise ValueError(
            "`optimizer_variables` must hold one value per optimizer variable "
            f"({len(variables)}). Received: {len(values)} values"
        )
    by_id = {id(v): x for v, x in zip(variables, values)}
    return lambda v: by_id[id(v)]


def changed(old, new):
    """`{field: new value}` of the fields of `new` that are not `old`'s, object for object."""
    out = {}
    for name in STATE_FIELD_NAMES:
        value, before = getattr(new, name), getattr(old, name)
        # Element by element: torch.compile traces no identity test of tuples.
        if isinstance(value, tuple):
            same = (
                isinstance(before, tuple)
                and len(value) == len(before)
                and all(map(operator.is_, value, before))
            )
        else:
            same = value is before
        if not same:
            out[name] = value
    return out


def write_back(ops, holders, old, new, storage_of):
    """Writes the fields of `new` that changed from `old` into their holders (`assign`).

    A value that is its holder's own storage (`storage_of(holder)`, updated
    in place) is not written again; on a mutable backend a value that is
    another field's old array (the scale entering the history) is copied
    before any write changes it.
    """
    fresh = changed(old, new)
    targets = dict(flatten({name: holders[name] for name in fresh if name in holders}))
    before = {id(x) for _, x in flatten({name: getattr(old, name) for name in fresh})}
    writes = []
    for key, value in flatten(fresh):
        holder = targets.get(key)
        if holder is None or value is storage_of(holder):
            continue
        if ops.MUTABLE and id(value) in before:
            value = ops.copy(value)
        writes.append((holder, value))
    for holder, value in writes:
        holder.assign(value)
