"""The dynamic loss-scale state machine: one pure function, every backend.

`next_loss_scale(ops, state, finite, policy)` returns the new
`LossScaleState`. It uses selects, never Python branches on array values, so
the stateful wrapper, `stateless_apply` and `jax.jit` share it unchanged.
"""

import dataclasses

import numpy as np

from lossscale import validation

# Below this a float32 scale is subnormal and `grad / scale` overflows for
# ordinary gradients; backoff stops here instead of reaching 0.
MIN_SCALE = float(np.finfo(np.float32).tiny)
MAX_SCALE = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class LossScalePolicy:
    """Settings of the dynamic loss scale.

    Args:
        initial_scale: Float. The starting loss scale.
        dynamic_growth_steps: Int. After this many consecutive steps with
            finite gradients, the scale grows by `growth_factor`.
        growth_factor: Float > 1. Multiplier applied on growth.
        backoff_factor: Float in (0, 1). Multiplier applied on overflow.
    """

    initial_scale: float = 2.0 ** 15
    dynamic_growth_steps: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5

    def __post_init__(self):
        validation.check_number("initial_scale", self.initial_scale, low=0, low_open=True,
                                high=MAX_SCALE)
        validation.check_number("dynamic_growth_steps", self.dynamic_growth_steps, low=1,
                                integer=True)
        validation.check_number("growth_factor", self.growth_factor, low=1, low_open=True)
        validation.check_number("backoff_factor", self.backoff_factor, low=0, high=1,
                                low_open=True, high_open=True)


@dataclasses.dataclass(frozen=True)
class LossScaleState:
    """The loss scale (float32 scalar) and the finite-step counter (int scalar)."""

    scale: object
    counter: object


def next_loss_scale(ops, state, finite, policy):
    """Advances the loss-scale state by one step.

    With finite gradients the counter increments; on the
    `dynamic_growth_steps`-th consecutive finite step the scale grows and
    the counter resets (a growth that would leave float32's finite range is
    not taken). With non-finite gradients the scale backs off, never below
    `MIN_SCALE`, and the counter resets.

    Args:
        ops: The backend module of the state's arrays.
        state: The current `LossScaleState`.
        finite: Backend boolean scalar, whether every gradient was finite.
        policy: The `LossScalePolicy`.

    Returns:
        The next `LossScaleState`.
    """
    scale, counter = state.scale, state.counter
    grow = ops.logical_and(finite, counter == policy.dynamic_growth_steps - 1)
    with ops.quiet():  # the overflowing candidate is computed on purpose
        grown = scale * policy.growth_factor
        grown = ops.where(ops.isfinite(grown), grown, scale)
        backed_off = ops.maximum(scale * policy.backoff_factor, MIN_SCALE)
    new_scale = ops.where(finite, ops.where(grow, grown, scale), backed_off)
    new_counter = ops.where(ops.logical_and(finite, ops.logical_not(grow)), counter + 1, counter * 0)
    return LossScaleState(ops.cast(new_scale, "float32"), new_counter)
