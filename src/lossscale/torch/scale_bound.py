"""A lower bound of `GradScaler`'s scale, kept on the host: known without reading the device.

The scaler decides on the host whether unscaling could overflow (a scale
under 1) and whether the plain update's floor needs an operation; reading
the scale for that would be a device synchronisation at every step. After
each `update()` the bound is moved down by the most one update can lower
the scale:

```
bound' = bound * backoff_factor * (1 - 2^-20)   # float32 rounding of the product
bound' = min(bound', max_scale)                  # where the policy caps the scale
bound' = max(bound', MIN_SCALE)                  # a plain policy at or above its floor
```
"""

from lossscale.mixed_precision.loss_scale import MIN_SCALE, LossScalePolicy

# After an update the scale is at least `backoff_factor` times what it was,
# up to float32 rounding (of the factor and of the product): the bound
# shrinks by this much more, so that it stays a lower bound.
ROUNDING = 1 - 2.0**-20


def after_update(bound: float, policy: LossScalePolicy) -> float:
    """The lower bound of the scale after one `update()`, from the one before it.

    A backoff multiplies the scale by at least `backoff_factor` (up to
    float32 rounding); `max_scale` caps it; under a plain policy a scale at
    or above `MIN_SCALE` stays there (its kernel floors every backoff).
    """
    new = bound * policy.backoff_factor * ROUNDING
    if policy.max_scale is not None:
        new = min(new, policy.max_scale)
    if policy.is_plain and bound >= MIN_SCALE:
        new = max(new, MIN_SCALE)
    return new
