"""`watch(model, target)`: which module an overflow started in, recorded on the device.

Hooks on every module keep two device flags for the step in progress:

- the **forward origin**: the first module to finish its forward with
  finite floating-point inputs and a non-finite floating-point output;
- the **backward origin**: the first module, in backward order, that got a
  finite gradient of its outputs and made a non-finite gradient of an input
  or of its own parameters (a module whose forward did not run is not
  reported: its caller is).

A step reports the forward origin, else the backward origin, else `None`
(the gradient reaching the model's outputs was already non-finite: a NaN or
inf loss computed after the model, or a scale so high the loss's own
gradient overflows). After each step the target calls `on_step(finite,
step)`, which pushes an overflowing step's module into a ring, with device
operations only; `modules_at(steps)` reads the ring in one transfer.

The hooks are tensor hooks registered in a forward hook, so in-place
operations on outputs (`ReLU(inplace=True)`) work, and each call of a
module gets its own. Forwards without gradients record nothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lossscale.backends import get_ops
from lossscale.torch.gradients import stored_values

_OPS = get_ops("torch")

HISTORY_LENGTH = 8


class Watch:
    """The hooks `watch` attached, and the device flags they write.

    Use `watch(model, target)` to make one. It is the step observer of its
    target: `on_step` and `modules_at` are called by the target, `remove`
    by you.

    Args:
        model: The `torch.nn.Module` whose modules are watched.
        history_length: Int in 1..30. Overflowing steps kept in the ring.
    """

    def __init__(self, model: torch.nn.Module, history_length: int = HISTORY_LENGTH) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(
                f"`model` must be a torch.nn.Module. Received: model={type(model).__name__}"
            )
        if (
            not isinstance(history_length, int)
            or isinstance(history_length, bool)
            or not 1 <= history_length <= 30
        ):
            raise ValueError(
                "`history_length` must be an integer in 1..30. Received: "
                f"history_length={history_length!r}"
            )
        modules = list(model.named_modules())
        self._names = [name for name, _ in modules]
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        self._device = device
        # Per step: module indices (-1: none), whether each module's output
        # gradients were all finite, and whether any came (its forward ran).
        self._forward_origin = torch.full((), -1, dtype=torch.int32, device=device)
        self._backward_origin = torch.full((), -1, dtype=torch.int32, device=device)
        self._outputs_finite = torch.ones(len(modules), dtype=torch.bool, device=device)
        self._outputs_seen = torch.zeros(len(modules), dtype=torch.bool, device=device)
        # The ring of overflowing steps, oldest first: step, module index.
        self._ring_steps = torch.full((history_length,), -1, dtype=torch.int32, device=device)
        self._ring_modules = torch.full((history_length,), -1, dtype=torch.int32, device=device)
        self._handles = []
        self._active = True
        seen = set()
        for index, (_, module) in enumerate(modules):
            self._handles.append(
                module.register_forward_hook(self._forward_hook(index), with_kwargs=True)
            )
            for param in module.parameters(recurse=False):
                # A shared parameter belongs to the first module holding it.
                if id(param) in seen or not param.requires_grad:
                    continue
                seen.add(id(param))
                self._handles.append(param.register_hook(self._parameter_hook(index)))
        self._parameter_names = [(p, name) for name, p in model.named_parameters()]
        self._target_handle = None

    @property
    def module_names(self) -> list[str]:
        """The watched modules' names, in `model.named_modules()` order (the model is `""`)."""
        return list(self._names)

    @property
    def parameter_names(self) -> list[tuple[torch.Tensor, str]]:
        """`(parameter, name)` pairs from `model.named_parameters()`."""
        return list(self._parameter_names)

    # -- the hooks (inside the step: device operations only) ------------------
    def _forward_hook(self, index):
        def hook(module, args, kwargs, output):
            if not self._active or not torch.is_grad_enabled():
                return None
            inputs = _tensors((args, kwargs))
            outputs = _tensors(output)
            floating = [t for t in outputs if t.is_floating_point()]
            if floating:
                hit = ~self._all_finite(floating)
                floating_inputs = [t for t in inputs if t.is_floating_point()]
                if floating_inputs:
                    hit = hit & self._all_finite(floating_inputs)
                self._first(self._forward_origin, hit, index)
            for t in outputs:
                if t.requires_grad:
                    t.register_hook(self._output_hook(index))
            for t in inputs:  # not leaves: they would keep the hook past this step
                if t.requires_grad and t.grad_fn is not None:
                    t.register_hook(self._input_hook(index))
            return None

        return hook

    def _output_hook(self, index):
        def hook(grad):
            if self._active:
                finite = self._all_finite([grad])
                self._outputs_finite[index : index + 1].logical_and_(finite)
                self._outputs_seen[index : index + 1].fill_(True)

        return hook

    def _input_hook(self, index):
        def hook(grad):
            if self._active:
                started = ~self._all_finite([grad]) & self._outputs_finite[index]
                self._first(self._backward_origin, started, index)

        return hook

    def _all_finite(self, tensors):
        """Whether every value of `tensors` is finite, a boolean on the flags' device."""
        # One pass per tensor (its peak), where `isfinite(t).all()` makes four;
        # `peak < inf` is False for inf and NaN, in one operation.
        peaks = [
            n.to(self._device, non_blocking=True)
            for n in _OPS.peaks([stored_values(t.detach()) for t in tensors])
        ]
        peak = peaks[0] if len(peaks) == 1 else torch.stack(peaks).amax()
        return peak < math.inf

    def _parameter_hook(self, index):
        def hook(grad):
            if self._active:
                ran = self._outputs_finite[index] & self._outputs_seen[index]
                started = ~self._all_finite([grad]) & ran
                self._first(self._backward_origin, started, index)

        return hook

    @staticmethod
    def _first(origin, hit, index):
        """Sets `origin` to `index` where `hit` and no module was recorded yet."""
        origin.masked_fill_(hit & (origin < 0), index)

    # -- the observer protocol -------------------------------------------------
    def on_step(self, finite: torch.Tensor, step: torch.Tensor | int) -> None:
        """Records this step's module if it overflowed, then resets the flags (on the device).

        Args:
            finite: Boolean tensor. Whether the step's gradients were finite.
            step: Int32 tensor (or int). The step's index, from 0.
        """
        device = self._device
        overflowed = ~finite.to(device, non_blocking=True).reshape(())
        step = torch.as_tensor(step, dtype=torch.int32, device=device).reshape(1)
        module = torch.where(
            self._forward_origin >= 0, self._forward_origin, self._backward_origin
        ).reshape(1)
        for ring, value in ((self._ring_steps, step), (self._ring_modules, module)):
            shifted = torch.cat([ring[1:], value])
            ring.copy_(torch.where(overflowed, shifted, ring))
        self._forward_origin.fill_(-1)
        self._backward_origin.fill_(-1)
        self._outputs_finite.fill_(True)
        self._outputs_seen.fill_(False)

    def modules_at(self, steps: list[int]) -> dict[int, str | None]:
        """`{step: name of the module the overflow started in, or None}`; one host read."""
        ring = torch.stack([self._ring_steps, self._ring_modules]).tolist()
        known = {s: m for s, m in zip(*ring) if s >= 0}
        return {
            s: self._names[known[s]] if known.get(s, -1) >= 0 else None for s in map(int, steps)
        }

    def remove(self) -> None:
        """Removes every hook and unregisters from the target. Idempotent."""
        self._active = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._target_handle is not None:
            self._target_handle.remove()
            self._target_handle = None

    def _attached(self, handle: Any) -> None:
        self._target_handle = handle


def watch(model: torch.nn.Module, scaler_or_optimizer: Any) -> Watch:
    """Records, on the device, the module each overflow started in.

    The forward origin (the first module whose output went non-finite from
    finite inputs), else the backward origin (the first whose gradients
    did), else `None`. The names show in the target's
    `summary()["overflows"]` and `LossScaleError`, which also name
    parameters after `model.named_parameters()` while the watch is on.

    Args:
        model: The `torch.nn.Module` trained.
        scaler_or_optimizer: A `lossscale.torch.GradScaler` or a
            `lossscale.LossScaleOptimizer`, with telemetry on.

    Returns:
        A `Watch`; `remove()` takes every hook off again.

    Examples:

        >>> import torch, lossscale.torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> scaler = lossscale.torch.GradScaler("cpu", telemetry=True)
        >>> handle = lossscale.torch.watch(model, scaler)
        >>> handle.module_names
        ['', '0', '1']
        >>> handle.remove()
    """
    register = getattr(scaler_or_optimizer, "register_step_observer", None)
    policy = getattr(scaler_or_optimizer, "policy", None)
    if register is None or policy is None:
        raise ValueError(
            "`scaler_or_optimizer` must be a lossscale.torch.GradScaler or a "
            "LossScaleOptimizer (objects with `register_step_observer` and `policy`). "
            f"Received: scaler_or_optimizer={type(scaler_or_optimizer).__name__}"
        )
    if not policy.records_details:
        raise ValueError(
            "`watch` reports into the overflow window, which needs telemetry: construct "
            "`scaler_or_optimizer` with `telemetry=True` (or a fail-fast limit). Received: "
            f"{type(scaler_or_optimizer).__name__} with telemetry=False"
        )
    handle = Watch(model, history_length=policy.history_length)
    registration = register(handle, parameter_names=handle.parameter_names)
    handle._attached(registration)
    return handle


def _tensors(value):
    """The tensors in a (nested) module input or output."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
