"""`LossScalePolicy`: the settings of the dynamic loss scale, checked and derived once."""

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
# `growth_policy="headroom"` grows only while the largest scaled gradient
# times `growth_factor` stays below FLOAT16_MAX / HEADROOM_MARGIN: the
# backward pass holds larger values than the gradients (docs/reliability.md).
HEADROOM_MARGIN = 8.0
GROWTH_POLICIES = ("fixed", "headroom", "statistics")


def check_scale(name: str, value: Any) -> None:
    """Checks a loss scale given as a setting: a normal float32 number > 0."""
    validation.check_number(name, value, low=0, low_open=True, high=MAX_SCALE)
    if value < MIN_SCALE:
        raise ValueError(
            f"`{name}` must be at least 2**-126 ({MIN_SCALE:g}), float32's smallest normal "
            "number: a subnormal scale overflows every gradient divided by it. Received: "
            f"{name}={value!r}"
        )


def _setting(default, keras=False):
    # `keras`: in Keras's own config, so always written.
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
        hysteresis: Int >= 1. Overflowing steps in a row before the scale
            backs off (then at every further one, until a finite step).
        min_scale: Float or `None`. A backoff below it records a failure
            (`LossScaleError`). `None`: the scale stops at the smallest
            normal float32 instead.
        max_scale: Float or `None`. Growth stops at this scale.
        max_consecutive_skips: Int >= 0 or `None`. More skipped steps in a
            row record a failure.
        growth_policy: `"fixed"` grows every `dynamic_growth_steps` finite
            steps; `"headroom"` then only if the largest scaled gradient
            times `growth_factor` stays below `FLOAT16_MAX /
            HEADROOM_MARGIN`; `"statistics"` decides at each measured step
            (`diagnostics_every`): it backs off, without skipping, when any
            scaled gradient value is at or above `FLOAT16_MAX /
            growth_factor`, else grows when the largest times
            `growth_factor` stays below `FLOAT16_MAX / HEADROOM_MARGIN`.
            An overflow still skips the step and backs off.
        telemetry: Boolean. Record skip counters, the last scales and the
            variables with non-finite gradients at each overflow (one extra
            reduction per gradient). Always on with a fail-fast limit.
        diagnostics_every: Int >= 1 or `None`. Every this many steps (from
            the first), measure each scaled gradient's shares of zeros,
            float16 subnormals and values near float16's maximum, and its
            largest magnitude. `None` (default): never.
        history_length: Int in [1, 30]. Scales and overflows kept.
            Defaults to 8.
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
        # Derived once into plain values: a step asks for them every time, and
        # `torch.compile` traces attribute reads, not `dataclasses.fields`.
        factors = (self.growth_factor, self.backoff_factor)
        plain = (
            self.hysteresis == 1
            and not self.records_details
            and self.max_scale is None
            and self.growth_policy == "fixed"
            and all(float(np.float32(f)) == f for f in factors)
        )
        object.__setattr__(self, "_plain", plain)
        # Every reachable scale is a product of these, or MIN_SCALE (2^-126).
        powers = [self.initial_scale, *factors] + (
            [] if self.max_scale is None else [self.max_scale]
        )
        two = self.initial_scale >= MIN_SCALE and all(math.frexp(f)[0] == 0.5 for f in powers)
        object.__setattr__(self, "_powers_of_two", two)
        groups = {
            "keras": True,
            "streak": self.hysteresis > 1 or self.records_details,
            "telemetry": self.records_details,
            "fail_fast": self.fails_fast,
            "steps": self.records_details or self.diagnoses,
            "diagnostics": self.diagnoses,
        }
        fields = tuple(f for f in _STATE_FIELDS if groups[f.metadata["group"]])
        object.__setattr__(self, "_field_names", tuple(f.name for f in fields))
        object.__setattr__(self, "_tracked", frozenset(self._field_names))
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
        """Whether the update is Keras's own, with other float32 factors at most.

        No hysteresis, limits, headroom or telemetry: a backend may update
        the scale and the counter in one kernel (`fused_scale_update`).
        """
        return self._plain

    @property
    def scales_are_powers_of_two(self) -> bool:
        """Whether every scale the update can reach is a normal float32 power of two.

        Then `x * (1 / scale)` is `x / scale`, bit for bit, and `1 / scale`
        is finite.
        """
        return self._powers_of_two

    def tracks(self, field_name: str) -> bool:
        """Whether `LossScaleState.<field_name>` exists under this policy.

        Raises:
            KeyError: `field_name` is no field of `LossScaleState`.
        """
        if field_name not in _FIELDS:
            raise KeyError(field_name)
        return field_name in self._tracked

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
