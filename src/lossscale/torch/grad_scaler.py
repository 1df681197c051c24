"""`GradScaler`: `torch.amp.GradScaler`'s API and defaults on lossscale's state machine.

A subclass of torch's class. It keeps torch's machinery where that machinery
is the behaviour users rely on: `scale` (tensors and nested outputs), the
per-optimizer stages of `unscale_` and `step` with their errors, the fused
optimizers' `grad_scale` / `found_inf` protocol, and torch's check-and-unscale
kernel, which multiplies each gradient by the float32 reciprocal of the scale
and so gives the same unscaled gradients and the same skip decisions. It
replaces the scale update with `next_loss_scale` (on a plain policy that is
torch's own `_amp_update_scale_` kernel) and adds what torch's lacks: the
extras of `LossScalePolicy`, agreement over a process group, and a guard
against gradients that overflow only once unscaled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from lossscale import validation
from lossscale.backends import get_ops
from lossscale.mixed_precision.loss_scale import (
    MAX_SCALE,
    MIN_SCALE,
    NO_ERROR,
    LossScalePolicy,
    LossScaleState,
)
from lossscale.mixed_precision.telemetry import LossScaleError
from lossscale.torch import (
    scale_bound,
    scaler_arguments,
    scaler_checks,
    scaler_diagnostics,
    scaler_host,
    scaler_step,
)
from lossscale.torch.scaler_ranges import ParameterRanges

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_OPS = get_ops("torch")
# The plain update's kernel (torch's `_amp_update_scale_` and the floor),
# looked up once: `update()` runs it every step.
_SCALE_UPDATE = _OPS.fused_scale_update()


class GradScaler(
    scaler_host.ScalerHostMixin,
    scaler_diagnostics.ScalerDiagnosticsMixin,
    scaler_checks.ScalerChecksMixin,
    scaler_step.ScalerStepMixin,
    torch.amp.GradScaler,
):
    """`torch.amp.GradScaler` with lossscale's dynamic loss scale.

    A drop-in replacement: the same arguments, defaults, methods, state dict
    and errors for misused stages (misuse torch answers with an
    `AssertionError` gets a message naming the argument instead), so it fits
    wherever a `torch.amp.GradScaler` is taken (Lightning's
    `MixedPrecision(scaler=...)`, Accelerate's `accelerator.scaler`). With
    the keyword-only extras at their defaults a training loop is bit for bit
    the one torch's scaler runs: the same unscaled gradients, skipped steps,
    scales and weights. docs/torch.md lists where the guards differ. Each
    step:

    ```
    grads = grads * float32(1 / scale)        # torch's kernel, in place
    found_inf = any(not isfinite(grads))      # before unscaling; after it too
                                              # while the scale is below 1
    found_inf = max over process_group        # with `process_group`
    if not found_inf:
        optimizer.step()                      # fused optimizers: found_inf
                                              # makes their kernel a no-op
    update(): state = next_loss_scale(state, not found_inf, policy)
    ```

    `next_loss_scale` is lossscale's one loss-scale state machine: with
    finite gradients the growth tracker counts up and, on the
    `growth_interval`-th step in a row, the scale grows by `growth_factor`
    (not past float32's range); on an overflow the tracker resets and the
    scale backs off by `backoff_factor`, never below the smallest normal
    float32 (torch's would go on down to 0).

    Args:
        device: String. The device type of the scaled outputs, as in torch
            (`"cuda"`, `"cpu"`, ...). A `"cuda"` scaler on a machine without
            CUDA disables itself with a warning, as torch's does.
        init_scale: Float. The initial scale.
        growth_factor: Float > 1. Multiplier applied on growth.
        backoff_factor: Float in (0, 1). Multiplier applied on backoff.
        growth_interval: Int >= 1. Consecutive finite steps before a growth.
        enabled: Boolean. `False` makes `scale` return its input,
            `step` call `optimizer.step()` and the other methods do nothing.
        hysteresis: Int >= 1. Overflowing steps in a row before the scale
            backs off (the steps are skipped either way).
        min_scale: Float or `None`. A backoff below it raises
            `LossScaleError` from `update()` instead.
        max_scale: Float or `None`. Growth stops at this scale.
        max_consecutive_skips: Int >= 0 or `None`. More skipped steps in a
            row than this raise `LossScaleError` from `update()`.
        growth_policy: `"fixed"` grows every `growth_interval` finite
            steps; `"headroom"` only when the largest scaled gradient, times
            `growth_factor`, stays well below float16's maximum.
        telemetry: Boolean. Whether to count steps and skipped steps and
            keep the last scales and the overflow window, read by
            `summary()`: for each of the last `history_length` overflows
            its step, whether the scaled loss was finite (checked by
            `scale`), the parameters whose gradients were not (one
            multi-tensor norm per step) and, with `watch(model, scaler)`,
            the module where it started.
        diagnostics_every: Int >= 1 or `None`. Every this many `update()`s
            (from the first), measure the float16 range of each
            parameter's scaled gradient before it is unscaled
            (`summary()["float16_range"]`): four reductions per gradient
            on those steps only, decided on the host without a device
            read. `None` (default): never.
        history_length: Int in [1, 30]. Scales and overflows kept.
        process_group: A `torch.distributed` process group, or `None`.
            Every rank of the group takes the same skip decision (one small
            all-reduce of the overflow flag per optimizer), as FSDP's
            `ShardedGradScaler` does; pass `torch.distributed.group.WORLD`
            for all ranks. Gradients that are DTensors (FSDP2) already agree
            over their mesh without it, as with torch's scaler.
        allow_fp16_gradients: Boolean. `False` (torch's behaviour): unscaling
            float16 gradients (a model whose parameters are float16) raises
            torch's "Attempting to unscale FP16 gradients." `True`: they are
            unscaled in float16 by torch's kernel (each multiplied in
            float32 by the reciprocal of the scale, then rounded) and
            checked, also after unscaling while the scale is below 1, where
            a finite float16 gradient can overflow once unscaled.

    Examples:

        >>> import torch, lossscale.torch
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([p], lr=0.25)
        >>> scaler = lossscale.torch.GradScaler("cpu", init_scale=1024.0, telemetry=True)
        >>> scaler.scale((2 * p).sum()).backward()   # gradients 2 * 1024
        >>> scaler.step(opt)                         # unscaled to 2: finite, applied
        >>> scaler.update()
        >>> p.tolist(), scaler.get_scale()
        ([0.5, 0.5], 1024.0)
        >>> p.grad.fill_(float("inf"))               # an overflow: skipped, backed off
        tensor([inf, inf])
        >>> scaler.step(opt); scaler.update()
        >>> p.tolist(), scaler.get_scale(), scaler.summary()["skipped_steps"]
        ([0.5, 0.5], 512.0, 1)

    In a training loop:

    ```python
    scaler = lossscale.torch.GradScaler("cuda", max_consecutive_skips=50)
    for x, y in data:
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)               # optional: clip unscaled grads
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)                   # skipped if any grad overflowed
        scaler.update()
    ```
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        max_consecutive_skips: int | None = None,
        growth_policy: str = "fixed",
        telemetry: bool = False,
        diagnostics_every: int | None = None,
        history_length: int = 8,
        process_group: ProcessGroup | None = None,
        allow_fp16_gradients: bool = False,
    ) -> None:
        enabled = scaler_arguments.as_enabled(enabled)
        validation.check_bool("allow_fp16_gradients", allow_fp16_gradients)
        init_scale = scaler_arguments.as_number("init_scale", init_scale)
        check = validation.check_number
        check("init_scale", init_scale, low=0, low_open=True, high=MAX_SCALE)
        check("growth_factor", growth_factor, low=1, low_open=True)
        check("backoff_factor", backoff_factor, low=0, high=1, low_open=True, high_open=True)
        check("growth_interval", growth_interval, low=1, integer=True)
        if (scaler_arguments.is_real(min_scale) and min_scale > init_scale) or (
            scaler_arguments.is_real(max_scale) and max_scale < init_scale
        ):
            raise ValueError(
                "`init_scale` must lie between `min_scale` and `max_scale`. Received: "
                f"init_scale={init_scale}, min_scale={min_scale}, max_scale={max_scale}"
            )
        policy = LossScalePolicy(
            initial_scale=float(init_scale),
            dynamic_growth_steps=int(growth_interval),
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            max_consecutive_skips=max_consecutive_skips,
            growth_policy=growth_policy,
            telemetry=telemetry,
            diagnostics_every=diagnostics_every,
            history_length=history_length,
        )
        super().__init__(
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )
        self._policy = policy
        self._process_group = process_group
        self._allow_fp16_gradients = allow_fp16_gradients
        self._last_skip = None  # the last update's overflow flag, on the device (1.0: skipped)
        # The extra state fields: Python values until the scale exists, then
        # 0-d tensors beside it (see `scaler_host`).
        self._extra_start = scaler_host.initial_values(policy)
        self._extras = None
        # A lower bound of the scale known on the host, without reading the
        # device (see `_unscaling_may_overflow`).
        self._scale_bound = 0.0
        # Updates so far, counted on the host (the diagnostics cadence), the
        # telemetry's per-parameter records by name, the last float16 ranges
        # (`scaler_ranges`), and the step observers by id.
        self._host_steps = self._extra_start.get("steps", 0)
        # The count the device's `steps` holds: a plain update counts on the
        # host only (an operation fewer per step), and the device's count is
        # written where it is next read (`_written_steps`).
        self._device_steps = self._host_steps
        self._per_variable = {}
        self._ranges = ParameterRanges()
        self._observers = {}
        # The scale-1 check's constant operands, by device (`_check_only`).
        self._check_units = {}

    @property
    def policy(self) -> LossScalePolicy:
        """The `LossScalePolicy`: torch's settings and the extras."""
        return self._policy

    @property
    def process_group(self) -> ProcessGroup | None:
        """The process group whose ranks take one skip decision, or `None`."""
        return self._process_group

    # -- the scale and its state ---------------------------------------------

    def _lazy_init_scale_growth_tracker(self, dev):
        super()._lazy_init_scale_growth_tracker(dev)
        self._extras = scaler_host.make_tensors(self._extra_start, self._policy, self._scale.device)
        self._scale_bound = float(np.float32(self._init_scale))

    def _check_scale_growth_tracker(self, funcname):
        if self._scale is None or self._growth_tracker is None:
            raise RuntimeError(
                f"`GradScaler.{funcname}()` needs the loss scale, which the first "
                "`scaler.scale(outputs)` creates on the outputs' device: compute the loss, "
                f"call `scaler.scale(loss).backward()`, then `scaler.{funcname}(...)`. "
                "Received: a GradScaler that has scaled nothing yet"
            )
        return self._scale, self._growth_tracker

    def _state(self, per_variable=None):
        scale = self._scale
        if self._policy.records_details:
            # The history keeps this step's scale, which `update` then
            # overwrites in place: it gets a copy.
            scale = scale.clone()
        return LossScaleState(
            scale=scale,
            counter=self._growth_tracker,
            **self._written_steps(),
            **(per_variable or {}),
        )

    def _written_steps(self):
        """The extra state tensors, their `steps` brought up to the host's count of updates."""
        steps = self._extras.get("steps")
        if steps is not None and self._device_steps != self._host_steps:
            steps.fill_(self._host_steps)
            self._device_steps = self._host_steps
        return self._extras

    # -- the update ----------------------------------------------------------

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Updates the scale from this iteration's overflow checks (see the class docstring).

        Args:
            new_scale: Optional. A positive float, or a one-element
                floating-point tensor on the scale's device that does not
                require grad: the new scale, set as is (the growth tracker
                and the other state do not change).

        Raises:
            LossScaleError: A fail-fast limit (`min_scale`,
                `max_consecutive_skips`) was crossed. The failing steps were
                skipped, and every later one is skipped until the state is
                restored (`load_state_dict`).
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("update")
        if new_scale is not None:
            self._set_scale(new_scale)
            return
        states = self._per_optimizer_states
        skip = self._skip_flag(states)
        self._last_skip = skip
        policy = self._policy
        measuring = self._measures_now()
        if measuring:
            self._record_ranges(states)
        if policy.is_plain:  # (no telemetry: nothing else is kept per parameter)
            states.clear()
            if measuring:  # the step of the measurement, as `next_loss_scale` keeps it
                self._extras["range_step"].fill_(self._host_steps)
            self._update_plain(skip, policy)
            return
        finite = skip == 0
        peak = None
        if self._policy.growth_policy == "headroom":
            peak = torch.stack([s["peak"] for s in states.values() if "peak" in s]).amax()
        new = self._advance(states, finite, peak, skip, measuring)
        if new.scale is not self._scale:  # else updated in place by the fused kernel
            self._scale.copy_(new.scale)
        if new.counter is not self._growth_tracker:
            self._growth_tracker.copy_(new.counter)
        self._extras = {name: getattr(new, name) for name in self._extras}
        states.clear()
        self._scale_bound = scale_bound.after_update(self._scale_bound, self._policy)
        if self._policy.fails_fast:
            # The one host read the limits cost per step (as in LossScaleOptimizer).
            code = self._extras["error"].to(torch.float32)
            error, self._scale_bound = torch.stack([code, self._scale]).tolist()
            if error != NO_ERROR:
                raise LossScaleError(self._failure_message())

    def _update_plain(self, skip, policy):
        """`update()` of a plain policy: torch's kernel and the floor.

        `next_loss_scale` would run the same kernel (`fused_scale_update`)
        and, with diagnostics, count the step; called directly, the update
        costs no state to build, and the host's lower bound of the scale
        decides whether the floor needs an operation (see `update_scale`).
        """
        # The count `next_loss_scale` keeps on the device: here on the host
        # only (`_written_steps`).
        self._host_steps += 1
        bound = self._scale_bound
        _SCALE_UPDATE(
            self._scale,
            self._growth_tracker,
            None,
            policy.dynamic_growth_steps,
            policy.growth_factor,
            policy.backoff_factor,
            MIN_SCALE,
            skip=skip if skip.dtype == torch.float32 else skip.to(torch.float32),
            in_place=True,
            scale_at_least=bound,
        )
        self._scale_bound = scale_bound.after_update(bound, policy)

    @property
    def last_step_skipped(self) -> bool | None:
        """Whether the step before the last `update()` was skipped (an overflow), or None.

        None before any `update()` and after `update(new_scale)`. Known for
        every optimizer, fused ones included (their kernel is called and
        skips itself, so wrappers that watch `optimizer.step` calls, such as
        Accelerate's `step_was_skipped`, cannot see it). Reading it waits
        for the device: one host read, when asked.
        """
        if self._last_skip is None:
            return None
        return bool(self._last_skip != 0)
