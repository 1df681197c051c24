"""`LearningRateSchedule`: the base class users subclass."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # `lossscale.typing` imports this module (the alias of a schedule)
    from lossscale.typing import Array, Config
_ScheduleT = TypeVar("_ScheduleT", bound="LearningRateSchedule")


class LearningRateSchedule:
    """A learning rate that depends on the optimizer's step.

    Subclasses implement `__call__(step)` with the backend ops of `step`
    (`lossscale.backends.ops_for(step)`), so one schedule serves NumPy,
    torch and JAX (including under `jax.jit`), and `get_config`.

    Examples:
        >>> import lossscale as ls
        >>> class Halving(ls.schedules.LearningRateSchedule):
        ...     def __init__(self, initial):
        ...         self.initial = initial
        ...     def __call__(self, step):
        ...         return self.initial * 0.5 ** (step // 10)
        ...     def get_config(self):
        ...         return {"initial": self.initial}
        >>> float(Halving(1.0)(20))
        0.25
    """

    def __call__(self, step: Array) -> Array:
        raise NotImplementedError(
            f"Learning rate schedule '{type(self).__name__}' must override `__call__(self, step)`."
        )

    def get_config(self) -> Config:
        raise NotImplementedError(
            f"Learning rate schedule '{type(self).__name__}' must override `get_config()` in "
            "order to be serializable."
        )

    @classmethod
    def from_config(cls: type[_ScheduleT], config: Config) -> _ScheduleT:
        """Instantiates a schedule from its config (checked against `__init__`)."""
        from lossscale import validation

        return cls(**validation.check_config(cls, config))
