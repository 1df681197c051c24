"""What a front end diagnoses on the host, between steps, without a device read inside one.

- `PersistentWatch`: acts (`on_persistent`) on a skip no back-off can clear;
- `ScaleUse`: warns when gradients are unscaled by another factor than
  their loss was scaled by;
- `Agreement`: every `agreement_every` steps, checks that every rank holds
  the same loss-scale state.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lossscale import validation
from lossscale.mixed_precision.telemetry import (
    LossScaleError,
    PersistentSkipWarning,
    ScaleMismatchWarning,
    UnscaledLossWarning,
    diagnosis,
    raise_if_failed,
    unscaled_loss_message,
    warn,
)

# What `on_persistent` accepts besides a callable.
ON_PERSISTENT = ("raise", "warn")


def check_on_persistent(on_persistent: Any) -> Any:
    """Checks the `on_persistent` argument: "raise", "warn" or a callable."""
    if on_persistent not in ON_PERSISTENT and not callable(on_persistent):
        raise ValueError(
            '`on_persistent` must be "raise", "warn" or a callable taking the summary dict. '
            f"Received: on_persistent={on_persistent!r}"
        )
    return on_persistent


class PersistentWatch:
    """What a front end does the first time the state records a persistent skip.

    Acted on where the host reads the state: after every step for `"raise"`
    or a callable, at `summary()` and `check()` for `"warn"`.

    Args:
        on_persistent: `"raise"` (`LossScaleError`), `"warn"`
            (`PersistentSkipWarning`, once) or a callable, called once with
            the `summary()` dict (to save the batch and a checkpoint, say).
    """

    def __init__(self, on_persistent: Any) -> None:
        self.on_persistent = check_on_persistent(on_persistent)
        self.seen = False

    @property
    def reads_every_step(self) -> bool:
        """Whether the host reads the flag after every step (all but "warn")."""
        return self.on_persistent != "warn"

    def notice(
        self, persistent_step: Any, summary: Callable[[], dict], variable_count: int | None = None
    ) -> None:
        """Acts once on the state's `persistent_step` (a host number; -1 or None: none yet).

        `summary()` is called only when acting.
        """
        if self.seen or persistent_step is None or int(persistent_step) < 0:
            return
        self.seen = True
        found = summary()
        message = (
            f"Loss scaling: step {int(persistent_step)} was skipped, "
            f"{diagnosis(found, variable_count, int(persistent_step)) or 'persistent'}."
        )
        if self.on_persistent == "raise":
            raise LossScaleError(message)
        if self.on_persistent == "warn":
            warnings.warn(message, PersistentSkipWarning, stacklevel=3)
        else:
            self.on_persistent(found)


def check_state(ops, policy, watch, read, summary, variable_count=None):
    """A front end's `check()`: the persistent watch, then the fail-fast limits.

    `read(field)` gives a state field's value; `summary()` is called only for
    a message or a hook. Raises `LossScaleError` for a crossed limit, or a
    persistent skip under "raise"; reads nothing where neither applies.
    """
    if policy.records_details and not watch.seen:
        if policy.fails_fast or watch.reads_every_step:
            watch.notice(ops.to_numpy(read("persistent_step")), summary, variable_count)
    if policy.fails_fast:
        raise_if_failed(ops, read("error"), policy, summary, variable_count)


class ScaleUse:
    """The factor a loss was scaled by against the one its gradients are unscaled by, on the host.

    `scaled(loss, output)` when a loss is scaled, `changed()` when the host
    sets the scale, `unscaling()` when gradients are unscaled. Warns once
    per owner: `UnscaledLossWarning` for a loss never scaled,
    `ScaleMismatchWarning` for one scaled twice or a scale changed between.

    Args:
        owner: The optimizer's or scaler's name, for the message.
        initial_scale: The scale at the start, for the unscaled-loss message.
    """

    def __init__(self, owner: str, initial_scale: float) -> None:
        self.owner, self.initial_scale = owner, initial_scale
        self.warned = False
        self._epoch = 0  # host-side changes of the scale so far
        self._scaled_at = None  # the epoch of the last scaled loss, None: never scaled
        self._last = None  # a weak reference to the last scaled output

    def __getstate__(self):
        # A copy (`copy.deepcopy`, `pickle`) keeps no reference to this one's last output.
        return {**self.__dict__, "_last": None}

    def scaled(self, loss: Any, output: Any, identity: bool = True) -> None:
        """Records that `loss` was scaled into `output`; warns if `loss` was such an output.

        `identity`: whether to keep `output`'s identity (not while tracing).
        """
        self._scaled_at = self._epoch
        if not identity:
            return
        last = self._last() if self._last is not None else None
        if last is not None and last is loss:
            self._warn(
                "the loss was scaled twice: `scale_loss` (or `scale()`) was given its own "
                "output, so its gradients are the scale times too large once unscaled"
            )
        try:
            self._last = weakref.ref(output)
        except TypeError:  # a Python or NumPy number: no identity to keep
            self._last = None

    def changed(self) -> None:
        """Records that the host set the scale: a loss scaled before is off by a factor."""
        self._epoch += 1

    def unscaling(self) -> None:
        """Checks that the loss of the gradients now unscaled was scaled, by this scale."""
        if self._scaled_at is None:
            if not self.warned:
                self.warned = True
                warn(unscaled_loss_message(self.owner, self.initial_scale), UnscaledLossWarning)
        elif self._scaled_at != self._epoch:
            self._warn(
                "the scale changed between scaling the loss and unscaling its gradients (a "
                "load_state_dict, set_weights or update(new_scale) in between), so they are "
                "unscaled by another factor than the loss was scaled by"
            )

    def _warn(self, what):
        if not self.warned:
            self.warned = True
            warn(f"{self.owner!r}: {what}.", ScaleMismatchWarning)


class Agreement:
    """Every `every` steps, checks that all participants hold the same loss-scale state.

    One all-reduce (each field's largest and smallest value) and one host
    read; where a field differs, every participant gathers the values (to
    name the ranks) and raises `LossScaleError` at the same step.

    Args:
        every: Int >= 1, or None (never).
    """

    def __init__(self, every: int | None) -> None:
        validation.check_number("agreement_every", every, low=1, integer=True, allow_none=True)
        self.every = every

    def due(self, step: int) -> bool:
        """Whether the step numbered `step` (from 0, counted on the host) is checked."""
        return self.every is not None and (step + 1) % self.every == 0

    def check(
        self,
        ops: Any,
        group: Any,
        fields: Mapping[str, Any],
        step: int,
        what: str = "loss-scale states",
    ) -> None:
        """Raises `LossScaleError` where the participants' `fields` differ.

        Args:
            ops: The backend module of the fields' arrays.
            group: The participants (a torch process group, or None).
            fields: `{name: scalar array}`, the same names everywhere.
            step: The step (for the message).
            what: What the fields are, for the message.
        """
        if not ops.several_participants(group):
            return
        names = list(fields)
        values = ops.stack([ops.cast(fields[n], "float32") for n in names])
        both = ops.all_max(ops.stack([values, -values]), group)
        high, low = np.asarray(ops.to_numpy(both), np.float64) * [[1.0], [-1.0]]
        if np.array_equal(high, low, equal_nan=True):
            return
        every = np.asarray(ops.to_numpy(ops.all_gather(values, group)), np.float64)
        problems = []
        for k, name in enumerate(names):
            if high[k] == low[k]:
                continue
            by_value = {}
            for rank, value in enumerate(every[:, k]):
                by_value.setdefault(float(value), []).append(rank)
            problems.append(
                f"`{name}` is "
                + ", ".join(f"{v:g} on ranks {ranks}" for v, ranks in sorted(by_value.items()))
            )
        raise LossScaleError(
            f"The ranks' {what} drifted apart by step {step}: "
            + "; ".join(problems)
            + ". Every rank must take the same decision: a resume that loaded another rank's "
            "file, a scaler stepped on some ranks only, or a load_state_dict on one rank does "
            "this. Load the same state on every rank (or one rank's, broadcast)."
        )
