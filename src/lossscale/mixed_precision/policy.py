"""`LossScalePolicy`: the settings of the dynamic loss scale, checked once.

The defaults reproduce Keras 3's `LossScaleOptimizer` exactly. What a step
asks of a policy (which state fields it tracks, whether the plain update
applies) is derived once, at construction, into plain attributes.
"""

import dataclasses
import math
from typing import Any

import numpy as np

from lossscale import validation
from lossscale.mixed_precision.state import (
    _FIELDS,
    _STATE_FIELDS,
    HISTORY_LENGTH,
    MAX_HISTORY_LENGTH,
)

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
GROWTH_POLICIES = ("fixed", "headroom", "statistics")


def check_scale(name: str, value: Any) -> None:
    """Checks a loss scale given as a setting: a normal float32 number > 0.

    Below float32's smallest normal number (2**-126) a scale is subnormal,
    and dividing an ordinary gradient by it overflows.
    """
    validation.check_number(name, value, low=0, low_open=True, high=MAX_SCALE)
    if value < MIN_SCALE:
        raise ValueError(
            f"`{name}` must be at least 2**-126 ({MIN_SCALE:g}), float32's smallest normal "
            "number: a subnormal scale overflows every gradient divided by it. Received: "
            f"{name}={value!r}"
        )


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
            overflowing (skipped) step; `"statistics"` decides at each
            measured step (`diagnostics_every`): it backs off, without
            skipping, when any scaled gradient value sits at or above
            `FLOAT16_MAX / growth_factor`, and grows (at most once per
            measurement, whatever `dynamic_growth_steps` says) when the
            largest one times `growth_factor` stays below
            `FLOAT16_MAX / HEADROOM_MARGIN`. An overflow still skips the
            step and backs off.
        telemetry: Boolean. Whether to record the skipped-step counters, the
            last scales and which variables had non-finite gradients at the
            last overflow (one extra reduction per gradient). Always on when
            `min_scale` or `max_consecutive_skips` is set.
        diagnostics_every: Int >= 1 or `None`. Every this many steps
            (starting with the first), measure each variable's scaled
            gradient against float16's range: the shares of zeros, of
            float16 subnormals and of values near float16's maximum, and
            the largest magnitude (four reductions per gradient on those
            steps only). `None` (default): never.
        history_length: Int in [1, 30]. Scales kept in the scale history
            and overflows kept in the overflow window. Defaults to 8.
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
    diagnostics_every: int | None = _setting(None)
    history_length: int = _setting(HISTORY_LENGTH)

    def __post_init__(self):
        check = validation.check_number
        check_scale("initial_scale", self.initial_scale)
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
        check("diagnostics_every", self.diagnostics_every, low=1, integer=True, allow_none=True)
        check("history_length", self.history_length, low=1, high=MAX_HISTORY_LENGTH, integer=True)
        if self.growth_policy == "statistics" and self.diagnostics_every is None:
            raise ValueError(
                '`growth_policy="statistics"` decides from the measured float16 range: set '
                "`diagnostics_every` (for example 100) as well. Received: "
                'growth_policy="statistics", diagnostics_every=None'
            )
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
        object.__setattr__(self, "_powers_of_two", self._compute_scales_are_powers_of_two())
        fields = tuple(f for f in _STATE_FIELDS if self._tracks_group(f.metadata["group"]))
        object.__setattr__(self, "_field_names", tuple(f.name for f in fields))
        # Asked in every step (`tracks`): a set lookup, not the groups' rules again.
        object.__setattr__(self, "_tracked", frozenset(self._field_names))
        # (name, per, initial) of each: plain values, which a compiled step
        # reads where it cannot read a field's metadata mapping.
        starts = tuple((f.name, f.metadata["per"], f.metadata["initial"]) for f in fields)
        object.__setattr__(self, "_starts", starts)

    @property
    def fails_fast(self) -> bool:
        """Whether `min_scale` or `max_consecutive_skips` can end training with an error."""
        return self.min_scale is not None or self.max_consecutive_skips is not None

    @property
    def records_details(self) -> bool:
        """Whether the telemetry fields (counters, history, variable flags) are kept."""
        return self.telemetry or self.fails_fast

    @property
    def diagnoses(self) -> bool:
        """Whether the float16 range of the gradients is measured (`diagnostics_every`)."""
        return self.diagnostics_every is not None

    @property
    def is_plain(self) -> bool:
        """Whether the update is Keras's own, with other factors at most.

        See `_compute_is_plain`.
        """
        return self._plain

    def _compute_is_plain(self):
        """Whether the update is Keras's own, with other factors at most.

        No hysteresis, limits, headroom or telemetry, and factors that are
        float32 numbers (so every kernel multiplies by the same value): the
        scale and the counter follow Keras's rule, and a backend may update
        them in one kernel (`fused_scale_update`). Diagnostics (with the
        fixed growth policy) only add the step count beside them.
        """
        return (
            self.hysteresis == 1
            and not self.records_details
            and self.max_scale is None
            and self.growth_policy == "fixed"
            and all(float(np.float32(f)) == f for f in (self.growth_factor, self.backoff_factor))
        )

    @property
    def scales_are_powers_of_two(self) -> bool:
        """Whether every scale the update can reach is a normal float32 power of two.

        See `_compute_scales_are_powers_of_two`.
        """
        return self._powers_of_two

    def _compute_scales_are_powers_of_two(self):
        """Whether every scale the update can reach is a normal float32 power of two.

        Then `x * (1 / scale)` is `x / scale`, bit for bit, and `1 / scale`
        is finite. Scales are the initial one times growth and backoff
        factors, capped at `max_scale` and floored at `MIN_SCALE` (2^-126,
        itself a power of two); an initial scale below that floor is
        subnormal in float32, and its reciprocal overflows.
        """
        factors = [self.initial_scale, self.growth_factor, self.backoff_factor]
        if self.max_scale is not None:
            factors.append(self.max_scale)
        return self.initial_scale >= MIN_SCALE and all(math.frexp(f)[0] == 0.5 for f in factors)

    def tracks(self, field_name: str) -> bool:
        """Whether `LossScaleState.<field_name>` exists under this policy.

        Raises:
            KeyError: `field_name` is no field of `LossScaleState`.
        """
        if field_name not in _FIELDS:
            raise KeyError(field_name)
        return field_name in self._tracked

    def _tracks_group(self, group: str) -> bool:
        """Whether the fields of `group` (a field's metadata) exist under this policy."""
        return {
            "keras": True,
            "streak": self.hysteresis > 1 or self.records_details,
            "telemetry": self.records_details,
            "fail_fast": self.fails_fast,
            "steps": self.records_details or self.diagnoses,
            "diagnostics": self.diagnoses,
        }[group]

    def non_default_settings(self) -> dict[str, Any]:
        """The settings to write in a config: Keras's, then any changed one."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata["keras"] or getattr(self, f.name) != f.default
        }


def state_fields(policy: LossScalePolicy) -> tuple[dataclasses.Field, ...]:
    """The `LossScaleState` fields `policy` tracks, in declaration order."""
    return tuple(_FIELDS[name] for name in policy._field_names)
