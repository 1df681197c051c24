"""`GradScaler`: `torch.amp.GradScaler`'s API and defaults on lossscale's state machine.

A subclass keeping torch's stages, errors, fused-optimizer protocol and
check-and-unscale kernel; its `update` is `mixed_precision.step.advance`.
Its extra state lives in `scaler_state`, the last float16 ranges in `scaler_ranges`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.amp.grad_scaler import OptState

from lossscale import validation
from lossscale.backends import get_ops
from lossscale.mixed_precision import (
    diagnosis,
    diagnostics,
    inspection,
    loss_scale,
    step,
    telemetry,
)
from lossscale.mixed_precision.loss_scale import (
    NO_ERROR,
    LossScalePolicy,
    LossScaleState,
)
from lossscale.mixed_precision.policy import check_scale
from lossscale.mixed_precision.telemetry import LossScaleError
from lossscale.shared_handles import SharedHandle
from lossscale.torch import fused_sgd, gradients, scaler_arguments, scaler_state
from lossscale.torch.scaler_ranges import ParameterRanges

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_OPS = get_ops("torch")


class GradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` with lossscale's dynamic loss scale.

    A drop-in replacement: the same arguments, defaults, methods, state dict
    and errors for misused stages (misuse torch answers with an
    `AssertionError` gets a message naming the argument instead), so it fits
    wherever a `torch.amp.GradScaler` is taken (Lightning's
    `MixedPrecision(scaler=...)`, Accelerate's `accelerator.scaler`). With
    the keyword-only extras at their defaults a training loop is bit for bit
    the one torch's scaler runs: the same unscaled gradients, skipped steps,
    scales and weights. docs/torch_switching.md lists where the guards differ. Each
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
            `scale`), the parameters whose gradients were not (on the CPU
            from torch's own check, one call per gradient; elsewhere one
            multi-tensor norm per step) and, with `watch(model, scaler)`,
            the module where it started.
        diagnostics_every: Int >= 1 or `None`. Every this many `update()`s
            (from the first), measure the float16 range of each
            parameter's scaled gradient before it is unscaled
            (`summary()["float16_range"]`): four reductions per gradient
            on those steps only, decided on the host without a device
            read. `None` (default): never.
        history_length: Int in [1, 30]. Scales and overflows kept.
        on_persistent: `"warn"` (default), `"raise"` or a callable taking
            the `summary()` dict: what to do the first time a step is
            skipped for a cause no back-off can clear (the same parameters
            non-finite while the scale fell by `2**8`, or to 1 or below).
            `"warn"` warns once (`PersistentSkipWarning`) at the next host
            read (every `update()` with a fail-fast limit, else `summary()`
            or `check()`); `"raise"` (`LossScaleError`) and a callable act
            right after that `update()` (one scalar read per update) and
            turn `telemetry` on.
        agreement_every: Int >= 1 or `None`. Every this many `update()`s, one
            small all-reduce checks that every rank of `process_group` (the
            default group if None) holds the same scale, growth tracker and
            counters; where they drifted apart, `LossScaleError` is raised
            on every rank at the same update, naming them.
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

    In a training loop, as torch's: `scaler.scale(loss).backward()`,
    optionally `scaler.unscale_(optimizer)` and clipping, then
    `scaler.step(optimizer)` (skipped if any gradient overflowed) and
    `scaler.update()`.
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
        on_persistent: Any = "warn",
        agreement_every: int | None = None,
        process_group: ProcessGroup | None = None,
        allow_fp16_gradients: bool = False,
    ) -> None:
        enabled = scaler_arguments.as_enabled(enabled)
        validation.check_bool("allow_fp16_gradients", allow_fp16_gradients)
        init_scale = scaler_arguments.as_number("init_scale", init_scale)
        check = validation.check_number
        check_scale("init_scale", init_scale)
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
            # What a persistent skip triggers reads the overflow window.
            telemetry=telemetry or diagnosis.check_on_persistent(on_persistent) != "warn",
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
        # The extra fields: Python values until the scale exists, then 0-d tensors.
        self._extra_start = scaler_state.initial_values(policy)
        self._extras = None
        self._scale_bound = 0.0  # a lower bound of the scale (`_unscaling_may_overflow`)
        # Updates counted on the host, and the count the device's `steps` holds.
        self._host_steps = self._extra_start.get("steps", 0)
        self._device_steps = self._host_steps
        self._per_variable = {}  # the telemetry's per-parameter records by name
        self._ranges = ParameterRanges()
        self._observers = {}
        self._persistent = diagnosis.PersistentWatch(on_persistent)
        self._scale_use = diagnosis.ScaleUse("GradScaler", float(init_scale))
        self._agreement = diagnosis.Agreement(agreement_every)
        self._check_units = {}  # the scale-1 check's constant operands, by device

    @property
    def policy(self) -> LossScalePolicy:
        """The `LossScalePolicy`: torch's settings and the extras."""
        return self._policy

    @property
    def process_group(self) -> ProcessGroup | None:
        """The process group whose ranks take one skip decision, or `None`."""
        return self._process_group

    # -- torch's stages, in its order: scale, unscale_, step, update ------------

    def scale(self, outputs: torch.Tensor | Iterable[Any]) -> torch.Tensor | Iterable[Any]:
        """Multiplies `outputs` (a tensor or nested iterables of them) by the scale, as torch's.

        With telemetry it also records, on the device, whether they were all
        finite: an overflow of this step is then told apart from a NaN/inf
        loss (`summary()["overflows"]`, `LossScaleError`).
        """
        if isinstance(outputs, (str, bytes)):
            raise TypeError(
                "`outputs` must be a tensor or nested iterables of tensors (the loss). "
                f"Received: outputs of type {type(outputs).__name__}"
            )
        scaled = super().scale(outputs)
        if self._enabled:
            if self._policy.records_details:
                self._record_loss(outputs)
            self._scale_use.scaled(outputs, scaled, identity=not torch.compiler.is_compiling())
        return scaled

    def _record_loss(self, outputs):
        """Keeps in `loss_finite` whether every scaled output was finite (0 once one was not)."""
        tensors = [t for t in _flatten(outputs) if t.is_floating_point()]
        if not tensors or self._extras is None:
            return
        device = self._scale.device
        flags = [torch.isfinite(t).all().to(device, non_blocking=True) for t in tensors]
        ok = (flags[0] if len(flags) == 1 else torch.stack(flags).all()).to(torch.int32)
        current = self._extras["loss_finite"]
        self._extras = {**self._extras, "loss_finite": torch.where(current == 0, current, ok)}

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        # Called by the inherited `unscale_` (torch's stage checks and errors).
        allow_fp16 = allow_fp16 or self._allow_fp16_gradients
        if self._scale is None:
            # Called directly before any `scale()` (torch's tests, apex, some
            # trainers): no scale to check against, no state yet.
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        return self._unscale_and_check(
            optimizer, inv_scale, found_inf, allow_fp16, self._unscaling_may_overflow()
        )

    def _unscale_and_check(self, optimizer, inv_scale, found_inf, allow_fp16, recheck):
        self._check_process_group()
        measured = self._measure(optimizer)  # the scaled gradients' float16 range
        found, peak = self._unscale(optimizer, inv_scale, found_inf, allow_fp16, recheck)
        self._per_optimizer_states[id(optimizer)]["measured"] = measured
        return self._agreed(optimizer, found, peak)

    def _unscale(self, optimizer, inv_scale, found_inf, allow_fp16, recheck):
        """torch's `_unscale_grads_` with the policy's statistics (`_inspect`): `(found, peak)`.

        With `recheck`, the same kernel at scale 1 then flags the unscaled
        gradients that are not finite. Telemetry on CPU without a peak calls
        the kernel once per dense gradient, each with its own flag: one more
        reduction per gradient would cost more than the rest of the telemetry.
        """
        policy = self._policy
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not (
            policy.records_details
            and policy.growth_policy != "headroom"
            and inv_scale.device.type == "cpu"
            and all(type(g) is torch.Tensor and g.device.type == "cpu" for g in grads)
            and not any(g.is_sparse for g in grads)
        ):
            peak = self._inspect(optimizer)  # on the scaled gradients, before the unscaling
            found = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            if recheck:
                found = gradients.merge_flags(found, self._check_only(optimizer))
            return found, peak
        if not allow_fp16 and any(g.dtype == torch.float16 for g in grads):
            raise ValueError("Attempting to unscale FP16 gradients.")  # torch's, before any write
        named = [(name, g) for name, g in self._named_gradients(optimizer) if g.numel()]
        flags = torch.zeros(len(named))  # 1.0 where the gradient is not finite
        with torch.no_grad():
            factors = (inv_scale, self._units(inv_scale.device)[0]) if recheck else (inv_scale,)
            for factor in factors:
                for (_, grad), flag in zip(named, flags.unbind()):
                    torch._amp_foreach_non_finite_check_and_unscale_([grad], flag, factor)
        finite = dict(zip([name for name, _ in named], _OPS.unstack(flags == 0)))
        self._per_optimizer_states[id(optimizer)]["finite_per_parameter"] = finite
        # torch's flag: a copy of `found_inf` (shape and dtype), 1.0 if a gradient was not finite.
        found = found_inf.to(inv_scale.device, copy=True)
        if named:
            found.masked_fill_(flags.amax() > 0, 1.0)
        return ({inv_scale.device: found} if grads else {}), None

    def _units(self, device):
        """`(one, zero)` on `device`, made once: the scale-1 check's operands."""
        units = self._check_units.get(device)
        if units is None:
            with torch.inference_mode(False):  # usable in and out of inference mode
                units = (torch.ones((), device=device), torch.zeros((), device=device))
            self._check_units[device] = units
        return units

    def _check_only(self, optimizer):
        # torch's `_unscale_grads_` only reads `one` and copies `zero` per
        # device: both are made once per device (two allocations a step less).
        one, zero = self._units(self._scale.device)
        return super()._unscale_grads_(optimizer, one, zero, True)

    def _check_process_group(self):
        # Before any gradient is touched: the agreement comes after the unscaling.
        dist = torch.distributed
        if self._process_group is not None and not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "`process_group` was given but torch.distributed is not initialised: call "
                "`torch.distributed.init_process_group` before stepping. Received: "
                f"process_group={self._process_group!r}"
            )

    def _unscaling_may_overflow(self):
        """Whether a finite scaled gradient may overflow once unscaled: only with a scale below 1.

        The host keeps a lower bound of the scale (exact when set or read, times
        `backoff_factor` per update since) and reads the scale, once, only when that bound
        falls below 1: for fused optimizers once per about log2(scale) steps. Every rank
        holds the same bound, so all take the same path.
        """
        if self._scale_bound >= 1.0:
            return False
        self._scale_bound = float(self._scale)
        return not self._scale_bound >= 1.0

    def _inspect(self, optimizer):
        """Keeps each parameter's finite flag in the optimizer's state; returns the peak or None.

        A DTensor's (FSDP2) flag and peak are taken over every rank's shard,
        so every rank reports the same.
        """
        policy = self._policy
        state = self._per_optimizer_states[id(optimizer)]
        state["finite_per_parameter"] = {}
        if not policy.records_details and policy.growth_policy != "headroom":
            return None
        named = self._named_gradients(optimizer, sparse_values=True)
        groups = {}
        for name, grad in named:
            if grad.numel():  # an empty one has no peak, as a missing one
                groups.setdefault((grad.device, grad.dtype), []).append((name, grad))
        names, peaks, dtypes = [], [], []
        for (_, dtype), members in groups.items():
            norms = _OPS.peaks([g for _, g in members])
            names.extend(name for name, _ in members)
            peaks.extend(n.float().to(self._scale.device, non_blocking=True) for n in norms)
            dtypes.extend([str(dtype).removeprefix("torch.")] * len(members))
        found = inspection.inspect(_OPS, peaks, dtypes, self._scale, policy)
        mesh_groups = gradients.mesh_groups(optimizer)
        if found.variable_finite:
            bad = (~torch.stack(found.variable_finite)).to(torch.float32)
            for group in mesh_groups:
                bad = _OPS.all_max(bad, group)
            finite = bad == 0
            state["finite_per_parameter"] = dict(zip(names, _OPS.unstack(finite)))
        peak = found.peak
        if peak is not None:
            for group in mesh_groups:
                peak = _OPS.all_max(peak, group)
        return peak

    def _measures_now(self):
        """Whether this step measures the float16 range (a count kept on the host)."""
        policy = self._policy
        return policy.diagnoses and self._host_steps % policy.diagnostics_every == 0

    def _measure(self, optimizer):
        """`(names, `diagnostics.measure_all` columns)` of the scaled gradients, or None."""
        if not self._measures_now():
            return None
        named = self._named_gradients(optimizer)
        named = [(name, grad) for name, grad in named if grad.numel()]
        if not named:
            return None
        columns = list(
            diagnostics.measure_all(_OPS, [grad for _, grad in named], self._policy.growth_factor)
        )
        # Each rank measured its own gradients (an FSDP2 shard, a rank's
        # batch): the statistics policy decides on the near-maximum share and
        # the peak, so every rank takes their largest, and decides alike.
        groups = gradients.mesh_groups(optimizer)
        if self._process_group is not None:
            groups.append(self._process_group)
        for group in groups:
            for k in (2, 3):  # near_max, max_abs
                columns[k] = _OPS.all_max(columns[k], group)
        return [name for name, _ in named], tuple(columns)

    def _named_gradients(self, optimizer, sparse_values=False):
        """`(name, gradient)` of the dense local gradients (`sparse_values`: sparse ones' too)."""
        known = {k: v for _, names in self._observers.values() for k, v in names.items()}
        out = []
        for g, group in enumerate(optimizer.param_groups):
            group_names = group.get("param_names")
            for i, param in enumerate(group["params"]):
                grad = param.grad
                if grad is None or not isinstance(grad, torch.Tensor):
                    continue
                if grad.is_sparse:
                    if not sparse_values:
                        continue
                    grad = gradients.stored_values(grad)
                if type(grad) is not torch.Tensor and hasattr(grad, "to_local"):
                    grad = grad.to_local()  # a DTensor: this rank's shard
                name = known.get(id(param))
                if name is None:
                    name = group_names[i] if group_names else f"group{g}.param{i}"
                out.append((name, grad))
        return out

    def _agreed(self, optimizer, found, peak):
        """The optimizer's overflow flags, agreed over the process group and gated by errors.

        Untouched (torch's own result) without a process group, fail-fast
        limits or several devices; otherwise one flag on the scale's device,
        0 or 1 (fused kernels skip only on exactly 1, so flags are combined
        by their maximum, not their sum as torch's does).
        """
        state = self._per_optimizer_states[id(optimizer)]
        group = self._process_group
        if peak is not None:
            state["peak"] = peak if group is None else _OPS.all_max(peak, group)
        if group is None and not self._policy.fails_fast and len(found) <= 1:
            return found
        device = self._scale.device
        flags = [f.to(device).reshape(()) for f in found.values()]
        flag = torch.stack(flags).amax() if flags else torch.zeros((), device=device)
        if group is not None:
            flag = _OPS.all_max(flag, group)
        if self._policy.fails_fast:
            # Once a limit was crossed every step is skipped, as the state
            # machine leaves the state as it is, until the state is restored.
            flag = torch.maximum(flag, (self._extras["error"] != NO_ERROR).to(flag.dtype))
        return {device: flag}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Steps `optimizer` unless this iteration's gradients overflowed (torch's `step`).

        Unscales the gradients first if `unscale_(optimizer)` was not called
        (an optimizer with a fused kernel divides them itself), and returns
        what `optimizer.step` returns, or `None` where the step is skipped.
        The stages and their errors are torch's.

        Args:
            optimizer: The `torch.optim.Optimizer` to step.
            *args: Passed on to `optimizer.step`.
            **kwargs: Passed on to `optimizer.step` (no `closure`).
        """
        if (
            self._enabled
            and "closure" not in kwargs
            and fused_sgd.makes_momentum_buffers(optimizer)
        ):
            state = self._per_optimizer_states[id(optimizer)]
            if state["stage"] is not OptState.STEPPED:  # else torch's error, below
                if state["stage"] is OptState.READY:
                    # Checked here to decide on the host; torch's `step` checks
                    # again below (this step only) and hands the kernel the scale.
                    self._check_inf_per_device(optimizer)
                if self._found_inf_on_host(state):
                    state["stage"] = OptState.STEPPED
                    return None
        if self._enabled:
            self._scale_use.unscaling()
        return super().step(optimizer, *args, **kwargs)

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        # torch reads the overflow flag on the host here (no fused kernel).
        if self._found_inf_on_host(optimizer_state):
            return None
        return optimizer.step(*args, **kwargs)

    def _found_inf_on_host(self, optimizer_state):
        """Whether the gradients overflowed, read with the scale (keeps `_scale_bound` exact)."""
        device = self._scale.device
        flags = [f.to(device).reshape(()) for f in optimizer_state["found_inf_per_device"].values()]
        found, self._scale_bound = torch.stack([torch.stack(flags).sum(), self._scale]).tolist()
        return bool(found)

    def _check_inf_per_device(self, optimizer):
        # For an optimizer that unscales inside its own kernel
        # (`_step_supports_amp_scaling`): only the scaled values are checked here.
        self._check_scale_growth_tracker("step")
        self._check_process_group()
        state = self._per_optimizer_states[id(optimizer)]
        if self._unscaling_may_overflow():
            # The kernel's quotients cannot be checked: unscale here instead.
            # torch's protocol then hands the optimizer no `grad_scale`.
            inv_scale = self._scale.double().reciprocal().float()
            found_inf = torch.zeros((), device=self._scale.device)
            state["found_inf_per_device"] = self._unscale_and_check(
                optimizer, inv_scale, found_inf, True, recheck=True
            )
            state["stage"] = OptState.UNSCALED
        else:
            state["measured"] = self._measure(optimizer)
            one, zero = self._units(self._scale.device)
            found, peak = self._unscale(optimizer, one, zero, True, recheck=False)
            state["found_inf_per_device"] = self._agreed(optimizer, found, peak)
        return state["found_inf_per_device"]

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
        if skip.dtype != torch.float32:  # (a `to` of the same dtype is a dispatch too)
            skip = skip.to(torch.float32)
        self._last_skip = skip
        policy = self._policy
        measuring = self._measures_now()
        if policy.is_plain:
            # Torch's kernel alone; a count of steps stays on the host (`_written_steps`).
            if measuring:
                self._record_ranges(states)
                self._extras["range_step"].fill_(self._host_steps)
            states.clear()
            self._host_steps += 1
            loss_scale.plain_update(
                _OPS,
                self._scale,
                self._growth_tracker,
                None,
                policy,
                skip=skip,
                in_place=True,
                scale_at_least=self._scale_bound,
            )
            self._scale_bound = loss_scale.scale_lower_bound(self._scale_bound, policy)
            self._after_update()
            return
        names, per_variable, variable_finite, peak = (), {}, (), None
        if measuring:  # the statistics policy decides on them
            self._record_ranges(states)
            columns = self._ranges.columns
            per_variable.update({f: columns.get(f, ()) for f in diagnostics.FIELDS})
        if policy.records_details:
            names, per_variable_fields, variable_finite = self._telemetry_state(states)
            per_variable.update(per_variable_fields)
        if policy.growth_policy == "headroom":
            peak = torch.stack([s["peak"] for s in states.values() if "peak" in s]).amax()
        state = self._state(per_variable)
        finite = skip == 0
        new = step.advance(
            _OPS,
            policy,
            state,
            finite,
            peak=peak,
            variable_finite=variable_finite,
            found_inf=skip,
            in_place=True,
            measured=True if measuring else None,
            scale_at_least=self._scale_bound,
        )
        states.clear()
        if new.scale is not self._scale:  # else updated in place by the fused kernel
            self._scale.copy_(new.scale)
        if new.counter is not self._growth_tracker:
            self._growth_tracker.copy_(new.counter)
        self._extras = {name: getattr(new, name) for name in self._extras}
        for f in scaler_state.telemetry_fields(policy) if names else ():
            for name, value in zip(names, getattr(new, f.name)):
                self._per_variable[name][f.name] = value
        for observer, _ in list(self._observers.values()):
            observer.on_step(finite, state.steps)
        self._host_steps += 1
        self._device_steps = self._host_steps  # `next_loss_scale` counted it there too
        self._scale_bound = loss_scale.scale_lower_bound(self._scale_bound, policy)
        self._after_update()

    def _after_update(self):
        """The host's reads after an update: a persistent skip, the ranks' agreement, the limits.

        One read brings the error, the persistent step and the scale (keeps `_scale_bound` exact).
        """
        policy, watch = self._policy, self._persistent
        reads = [self._extras["error"]] if policy.fails_fast else []
        if (
            policy.records_details
            and not watch.seen
            and (policy.fails_fast or watch.reads_every_step)
        ):
            reads.append(self._extras["persistent_step"])
        if reads:
            values = torch.stack([x.to(torch.float32) for x in [*reads, self._scale]]).tolist()
            self._scale_bound = values[-1]
            if len(reads) > 1 or not policy.fails_fast:
                watch.notice(values[len(reads) - 1], self.summary, len(self._per_variable) or None)
            if policy.fails_fast and values[0] != NO_ERROR:
                raise LossScaleError(self._failure_message())
        if self._agreement.due(self._host_steps - 1):
            fields = {"scale": self._scale, "growth_tracker": self._growth_tracker}
            fields.update(
                {k: v for k, v in self._written_steps().items() if not isinstance(v, tuple)}
            )
            self._agreement.check(_OPS, self._process_group, fields, self._host_steps - 1)

    def _skip_flag(self, states):
        """The steps' overflow flags, one scalar on the scale's device (1.0: skip), for `update`."""
        device = self._scale.device
        flags = []
        for state in states.values():
            for f in state["found_inf_per_device"].values():
                f = f.to(device, non_blocking=True)
                # Reshaped only when not 0-d already (torch's are): a `view` is a dispatch too.
                flags.append(f.reshape(()) if f.ndim else f)
        if not flags:
            raise RuntimeError(
                "`GradScaler.update()` found no overflow check to update the scale from: "
                "no optimizer was stepped (or unscaled) by this scaler since the last update. "
                "Call `scaler.step(optimizer)` first. Received: no `step()` or `unscale_()` "
                "since the last `update()`"
            )
        # Each flag is 0 or 1 (torch's kernel, or `_agreed`): torch's AMP form.
        return flags[0] if len(flags) == 1 else torch.stack(flags).amax()

    def _telemetry_state(self, states):
        """`(names, {field: tuple}, variable_finite)` of every parameter checked so far.

        `variable_finite` is None where a parameter had no gradient.
        """
        fields = scaler_state.telemetry_fields(self._policy)
        finite = {}
        for state in states.values():
            finite.update(state.get("finite_per_parameter", {}))
        device = self._scale.device
        for name in finite:
            if name not in self._per_variable:
                self._per_variable[name] = {
                    f.name: scaler_state.initial_tensor(f, device) for f in fields
                }
        names = list(self._per_variable)
        columns = {f.name: tuple(self._per_variable[n][f.name] for n in names) for f in fields}
        return names, columns, tuple(finite.get(n) for n in names)

    def _record_ranges(self, states):
        """Keeps this update's measurements (`_measure`'s, one per optimizer stepped)."""
        for state in states.values():
            measured = state.get("measured")
            if measured is not None:
                self._ranges.record(*measured, self._scale.device)

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

    # -- the scale and its settings ------------------------------------------------

    def _lazy_init_scale_growth_tracker(self, dev):
        super()._lazy_init_scale_growth_tracker(dev)
        self._extras = scaler_state.make_tensors(
            self._extra_start, self._policy, self._scale.device
        )
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
        """The `LossScaleState` the scaler holds, with `per_variable`'s fields lent to it."""
        scale = self._scale
        if self._policy.records_details:
            # The history keeps this step's scale, which `update` overwrites in place.
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

    def _set_scale(self, new_scale):
        if isinstance(new_scale, torch.Tensor):
            if (
                not new_scale.is_floating_point()
                or new_scale.numel() != 1
                or new_scale.requires_grad
                or new_scale.device != self._scale.device
            ):
                raise ValueError(
                    "`new_scale` must be a Python float or a one-element floating-point "
                    f"tensor on the scale's device ({self._scale.device}) that does not "
                    f"require grad. Received: new_scale=tensor of shape "
                    f"{tuple(new_scale.shape)}, dtype {new_scale.dtype}, on "
                    f"{new_scale.device}, requires_grad={new_scale.requires_grad}"
                )
            # Checked as a float is (one host read: `update(new_scale)` is rare).
            value = float(new_scale.detach().reshape(()).to(torch.float32))
            check_scale("new_scale", value)
            self._scale.copy_(new_scale.detach().reshape(()))
            self._scale_bound = value
        else:
            check_scale("new_scale", new_scale)
            self._scale.fill_(float(new_scale))
            self._scale_bound = float(np.float32(new_scale))
        self._per_optimizer_states.clear()
        self._last_skip = None
        self._scale_use.changed()

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled); reads the device."""
        value = super().get_scale()
        if self._enabled and self._scale is not None:
            self._scale_bound = value
        return value

    def set_growth_factor(self, new_factor: float) -> None:
        """Sets the growth factor (a float > 1)."""
        validation.check_number("new_factor", new_factor, low=1, low_open=True)
        self._policy = dataclasses.replace(self._policy, growth_factor=float(new_factor))
        super().set_growth_factor(new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        """Sets the backoff factor (a float in (0, 1))."""
        validation.check_number(
            "new_factor", new_factor, low=0, high=1, low_open=True, high_open=True
        )
        self._policy = dataclasses.replace(self._policy, backoff_factor=float(new_factor))
        super().set_backoff_factor(new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        """Sets the growth interval (an integer >= 1)."""
        validation.check_number("new_interval", new_interval, low=1, integer=True)
        self._policy = dataclasses.replace(self._policy, dynamic_growth_steps=int(new_interval))
        super().set_growth_interval(new_interval)

    # -- state dicts and copies ------------------------------------------------------

    def _extra_values(self):
        if self._extras is None:
            return dict(self._extra_start)
        return scaler_state.read_tensors(self._written_steps(), self._policy)

    def state_dict(self) -> dict[str, Any]:
        """torch's five entries, and the extra state fields under `"lossscale"` if any.

        Empty when disabled. Reads the state on the host; call it after `update()`.
        """
        out = super().state_dict()
        if out and scaler_state.extra_fields(self._policy):
            out[scaler_state.STATE_KEY] = scaler_state.to_state_dict(
                self._extra_values(), self._policy
            )
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of `torch.amp.GradScaler`.

        Works before the first step (the values are used when the scale is
        created). As in torch, the growth factor, backoff factor and growth
        interval come from the dict; the extras' settings stay as
        constructed, and extra fields the dict lacks start afresh. Checks
        everything before writing anything. Does nothing when disabled.
        """
        if not self._enabled:
            return
        if hasattr(state_dict, "keys") and len(state_dict) == 0:
            raise RuntimeError(
                "`state_dict` is empty: it comes from a GradScaler with enabled=False, which "
                "has no state to load. Received: state_dict={}"
            )
        extras = scaler_state.check_state_dict(state_dict, self._policy)
        check = validation.check_number
        check("state_dict['growth_factor']", state_dict["growth_factor"], low=1, low_open=True)
        check(
            "state_dict['backoff_factor']",
            state_dict["backoff_factor"],
            low=0,
            high=1,
            low_open=True,
            high_open=True,
        )
        check("state_dict['growth_interval']", state_dict["growth_interval"], low=1, integer=True)
        policy = dataclasses.replace(
            self._policy,
            growth_factor=float(state_dict["growth_factor"]),
            backoff_factor=float(state_dict["backoff_factor"]),
            dynamic_growth_steps=int(state_dict["growth_interval"]),
        )
        super().load_state_dict(state_dict)
        self._policy = policy
        self._extra_start = extras
        if self._extras is not None:
            self._extras = scaler_state.make_tensors(extras, policy, self._scale.device)
        # The per-parameter records are not in a state dict: they start afresh.
        self._per_variable = {}
        self._ranges = ParameterRanges()
        self._host_steps = self._device_steps = extras.get("steps", 0)
        self._scale_bound = float(np.float32(state_dict["scale"]))
        self._last_skip = None
        self._scale_use.changed()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # torch's: the scale becomes lazy again
        if self._enabled:
            state["_extra_start"] = self._extra_values()
            state["_extras"] = None
        # Observers hold hooks on a live model: a copy has none.
        state["_observers"] = {}
        # The process group is shared by a copy, refused by pickle by name.
        state["_process_group"] = SharedHandle.wrap(
            self._process_group, "process_group", type(self).__name__
        )
        state["_check_units"] = {}  # device constants, made again where it is used
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = {**state, "_process_group": SharedHandle.unwrap(state.get("_process_group"))}
        super().__setstate__(state)
        self.__dict__.setdefault("_check_units", {})  # pickled before it existed
        self.__dict__.setdefault("_device_steps", self._host_steps)
        self.__dict__.setdefault("_ranges", ParameterRanges())

    # -- on the host: observers, summaries, the fail-fast check -------------------

    def register_step_observer(
        self, observer: Any, *, parameter_names: list[tuple[torch.Tensor, str]] | None = None
    ) -> _Registration:
        """Calls `observer.on_step(finite, step)` after every `update()`.

        `lossscale.torch.watch(model, scaler)` registers itself here; its
        `modules_at(steps)` fills `"module"` of `summary()["overflows"]`.

        Args:
            observer: An object with `on_step(finite, step)` (device values:
                whether the step's gradients were finite, its index) and
                `modules_at(steps) -> {step: module name or None}`.
            parameter_names: Optional `(parameter, name)` pairs: the names
                of the parameters in `summary()` and errors.

        Returns:
            A handle whose `remove()` unregisters the observer.

        Raises:
            ValueError: The scaler keeps no overflow window
                (`telemetry=False` and no fail-fast limit).
        """
        if not self._policy.records_details:
            raise ValueError(
                "`register_step_observer` (and `watch`) needs the overflow window: construct "
                "the GradScaler with `telemetry=True` (or a fail-fast limit). Received: "
                "a GradScaler with telemetry=False"
            )
        for method in ("on_step", "modules_at"):
            if not callable(getattr(observer, method, None)):
                raise ValueError(
                    f"`observer` must have an `{method}` method. Received: "
                    f"observer={type(observer).__name__}"
                )
        names = {id(p): name for p, name in (parameter_names or [])}
        self._observers[id(observer)] = (observer, names)
        return _Registration(self._observers, observer)

    def summary(self) -> dict[str, Any]:
        """The loss-scale state as a dict of Python values, for loggers.

        Reads the device: call it when logging, not inside the step.

        Returns:
            `{}` when disabled; otherwise `dynamic_scale` and `step_counter`
            (torch's scale and growth tracker), `last_step_skipped` (False
            before the first `update()`) and,
            as the settings track them, `consecutive_skips`, `steps`, `skipped_steps`,
            `last_overflow_step`, `scale_history`, `nonfinite_variables`
            (parameter names), `error`, `error_step`, `overflows` (the
            window, oldest first: `{"step", "variables", "module",
            "loss_finite"}`), `float16_range` (`{parameter name: {"zero",
            "subnormal", "near_max", "max_abs"}}`, the last measurement) and
            `float16_range_step`: the keys of `LossScaleOptimizer.summary()`.
        """
        if not self._enabled:
            return {}
        names, per_variable = self._per_variable_values()
        values = {
            "scale": self.get_scale(),
            "counter": self._get_growth_tracker(),
            **self._extra_values(),
            **per_variable,
        }
        if not self._policy.records_details:  # else told from the state's telemetry
            values["last_step_skipped"] = bool(self.last_step_skipped)  # None before an update
        modules = {}
        if self._observers:
            modules = self._overflow_modules([s for s in values["overflow_steps"] if s >= 0])
        found = telemetry.summarize(values, self._policy, names, modules)
        if self._persistent.on_persistent == "warn":  # where the host reads anyway
            self._persistent.notice(found.get("persistent_step"), lambda: found, len(names))
        return found

    def check(self) -> None:
        """Raises `LossScaleError` if the state records a crossed fail-fast limit.

        `update()` already does so after every step when `min_scale` or
        `max_consecutive_skips` is set; without them there is nothing to check.
        """
        if not self._enabled or not self._policy.fails_fast:
            return
        if self._extra_values()["error"] != NO_ERROR:
            raise LossScaleError(self._failure_message())

    def _failure_message(self):
        summary = self.summary()
        count = len(self._per_variable) or None
        return telemetry.failure_message(summary, self._policy, count)

    def _per_variable_values(self):
        """`(names, {field: list of Python values})`, read in one transfer.

        Checked parameters first, then measured ones; a missing value reads as its initial one.
        """
        policy = self._policy
        fields = scaler_state.telemetry_fields(policy)
        checked = list(self._per_variable)
        seen = set(checked)
        names = checked + [n for n in self._ranges.names if n not in seen]
        parts = [
            torch.stack([self._per_variable[n][f.name].to(torch.float64) for n in checked])
            for f in (fields if checked else ())
        ]
        if policy.diagnoses and names:
            parts.extend(self._ranges.values(names).values())
        # One copy to the host (every part on the device of the first).
        flat = torch.cat([p.to(parts[0].device) for p in parts]).tolist() if parts else []
        values, at = {}, 0
        for f in fields:
            cast = float if f.metadata["dtype"] == "float32" else int
            initial = cast(f.metadata["initial"])
            taken = [cast(x) for x in flat[at : at + len(checked)]]
            values[f.name] = taken + [initial] * (len(names) - len(checked))
            at += len(checked)
        for f in diagnostics.FIELDS if policy.diagnoses else ():
            values[f] = flat[at : at + len(names)]
            at += len(names)
        return names, values

    def _overflow_modules(self, steps):
        """`{step: module}` from the observers (the first that knows one)."""
        out = {}
        for observer, _ in list(self._observers.values()):
            for at, module in observer.modules_at(steps).items():
                if out.get(at) is None:
                    out[at] = module
        return out


class _Registration:
    """What `register_step_observer` returns: `remove()` unregisters the observer."""

    def __init__(self, observers, observer):
        self._observers = observers
        self._observer = observer

    def remove(self) -> None:
        """Unregisters the observer (and its parameter names). Idempotent."""
        self._observers.pop(id(self._observer), None)


def _flatten(outputs):
    """The tensors of `outputs` (a tensor or nested iterables of them, as `scale` takes)."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, Iterable):
        return [t for o in outputs for t in _flatten(o)]
    return []
