"""How `GradScaler` unscales and checks the gradients of an optimizer.

torch's own kernel (`_amp_foreach_non_finite_check_and_unscale_`) unscales
and checks, so the unscaled gradients and the skips are torch's. While the
scale may be below 1 (a lower bound kept on the host says when), a finite
gradient can overflow once unscaled: then the unscaled gradients are checked
again. With a `process_group`, every rank takes the same decision.
"""

import math

import torch
from torch.amp.grad_scaler import OptState

from lossscale.backends import get_ops
from lossscale.mixed_precision import inspection
from lossscale.mixed_precision.loss_scale import NO_ERROR
from lossscale.torch import gradients

_OPS = get_ops("torch")


class ScalerChecksMixin:
    """`_unscale_grads_`, `_check_inf_per_device` and the guards behind them."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        # `unscale_` (inherited: its stage checks and errors are torch's)
        # calls this with the float32 reciprocal of the scale. Called
        # directly before any `scale()`, there is no scale to check against.
        self._check_scale_growth_tracker("_unscale_grads_")
        allow_fp16 = allow_fp16 or self._allow_fp16_gradients
        return self._unscale_and_check(
            optimizer, inv_scale, found_inf, allow_fp16, self._unscaling_may_overflow()
        )

    def _unscale_and_check(self, optimizer, inv_scale, found_inf, allow_fp16, recheck):
        self._check_process_group()
        # Both measured on the scaled gradients, before they are unscaled in place.
        peak = self._inspect(optimizer)
        measured = self._measure(optimizer)  # the scaled gradients' float16 range
        found = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if recheck:
            # The same kernel at scale 1 writes every value back unchanged
            # and flags the unscaled gradients that are not finite.
            found = gradients.merge_flags(found, self._check_only(optimizer))
        self._per_optimizer_states[id(optimizer)]["measured"] = measured
        return self._agreed(optimizer, found, peak)

    def _check_inf_per_device(self, optimizer):
        # `step` calls this for an optimizer that unscales inside its own
        # kernel (`_step_supports_amp_scaling`): it divides by the scale as
        # it reads each gradient, so only the scaled values are checked here.
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
            peak = self._inspect(optimizer)
            state["measured"] = self._measure(optimizer)
            found = self._check_only(optimizer)
            state["found_inf_per_device"] = self._agreed(optimizer, found, peak)
        return state["found_inf_per_device"]

    def _check_only(self, optimizer):
        # torch's `_unscale_grads_` only reads `one` and copies `zero` per
        # device: both are made once per device (two allocations a step less).
        device = self._scale.device
        units = self._check_units.get(device)
        if units is None:
            with torch.inference_mode(False):  # usable in and out of inference mode
                units = (torch.ones((), device=device), torch.zeros((), device=device))
            self._check_units[device] = units
        one, zero = units
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
        """Whether a finite scaled gradient may overflow once unscaled.

        Only if the scale is below 1: a reciprocal <= 1 (or a division by a
        scale >= 1) cannot take a finite value out of range. The host keeps
        a lower bound of the scale (exact when the scale was set or read,
        times `backoff_factor` per update since) and reads the scale, once,
        only when that bound falls below 1: with optimizers that torch's
        scaler reads anyway (every step) never while the scale is >= 2, and
        with fused optimizers once per about log2(scale) steps. Every rank
        holds the same bound, so all take the same path.
        """
        if self._scale_bound >= 1.0:
            return False
        self._scale_bound = float(self._scale)
        return not self._scale_bound >= 1.0

    def _inspect(self, optimizer):
        """The policy's statistics of the scaled gradients: `inspection.inspect`.

        Keeps each parameter's finite flag (telemetry) by name in the
        optimizer's state, and returns the largest scaled magnitude
        (`growth_policy="headroom"`), or None. Each gradient's peak is one
        multi-tensor norm per device and dtype; a DTensor's (FSDP2) is its
        shard's, and a parameter is non-finite, and the peak the largest,
        over every rank's shard: every rank reports the same.
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
            norms = torch._foreach_norm([g for _, g in members], math.inf)
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
            state["finite_per_parameter"] = {name: finite[i] for i, name in enumerate(names)}
        peak = found.peak
        if peak is not None:
            for group in mesh_groups:
                peak = _OPS.all_max(peak, group)
        return peak

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
