"""What `GradScaler` records per parameter and per step, for `summary()` and its errors.

With telemetry (or a fail-fast limit) a scaler records, on the device:
whether the scaled loss was finite (`scale`), which parameters' gradients
were non-finite (one multi-tensor norm per device and dtype in the check
stage) and so, per overflow of the window, their names; with
`diagnostics_every` the float16 range of each parameter's scaled gradient
(`diagnostics.measure_all`: all of them at once, on the steps a Python
count of updates makes due: no host read). `LossScaleState` keeps
per-variable fields for a model's variables; a scaler has parameters
instead, so it keeps the telemetry's here, keyed by parameter name, on the
scale's device, and lends them to `next_loss_scale` as tuples of scalars;
the float16 ranges it keeps as the measurement's vectors
(`scaler_ranges`), which `next_loss_scale` reads as they are.

Names come from `watch(model, scaler)` (`model.named_parameters()`), else
from the param group's `"param_names"` (torch fills them when the
optimizer is built from `model.named_parameters()`), else
`"group{g}.param{i}"`, by the parameter's place in its optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lossscale.backends import get_ops
from lossscale.mixed_precision import diagnostics, loss_scale
from lossscale.mixed_precision.loss_scale import next_loss_scale
from lossscale.mixed_precision.state import per_variable
from lossscale.torch import gradients

_OPS = get_ops("torch")


def telemetry_fields(policy):
    """The per-variable `LossScaleState` fields of the telemetry, kept by parameter name.

    (The `range_*` ones are kept as vectors: `scaler_ranges`.)
    """
    return [
        f
        for f in loss_scale.state_fields(policy)
        if per_variable(f) and f.name not in diagnostics.FIELDS
    ]


def _flatten(outputs):
    """The tensors of `outputs` (a tensor or nested iterables of them, as `scale` takes)."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, Iterable):
        return [t for o in outputs for t in _flatten(o)]
    return []


class _Registration:
    """What `register_step_observer` returns: `remove()` unregisters the observer."""

    def __init__(self, observers, observer):
        self._observers = observers
        self._observer = observer

    def remove(self) -> None:
        """Unregisters the observer (and its parameter names). Idempotent."""
        self._observers.pop(id(self._observer), None)


class ScalerDiagnosticsMixin:
    """`register_step_observer` and the per-parameter records behind `summary()`."""

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

    # -- inside the step: device operations only ------------------------------

    def scale(self, outputs: torch.Tensor | Iterable[Any]) -> torch.Tensor | Iterable[Any]:
        """Multiplies `outputs` (a tensor or nested iterables of them) by the scale, as torch's.

        With telemetry it also records, on the device, whether they were all
        finite: an overflow of this step is then told apart from a NaN/inf
        loss (`summary()["overflows"]`, `LossScaleError`).
        """
        scaled = super().scale(outputs)
        if self._enabled and self._policy.records_details:
            self._record_loss(outputs)
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

    def _measures_now(self):
        """Whether this step measures the float16 range (a count kept on the host)."""
        policy = self._policy
        return policy.diagnoses and self._host_steps % policy.diagnostics_every == 0

    def _measure(self, optimizer):
        """`(names, columns)`: the float16 range of the optimizer's scaled gradients, or None.

        None off a due step. `columns` are `diagnostics.measure_all`'s four
        vectors, entry i the gradient of `names[i]`.
        """
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
        """`(name, gradient)` of the optimizer's dense local gradients.

        With `sparse_values`, a sparse gradient's stored values too.
        """
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

    # -- the update ------------------------------------------------------------

    def _telemetry_state(self, states):
        """The telemetry's per-parameter fields for `next_loss_scale`.

        Returns:
            `(names, fields, variable_finite)`: the parameter names (every
            one checked so far), `{field: tuple}` in that order, and
            `variable_finite` (None where a parameter had no gradient).
        """
        fields = telemetry_fields(self._policy)
        finite = {}
        for state in states.values():
            finite.update(state.get("finite_per_parameter", {}))
        device = self._scale.device
        for name in finite:
            if name not in self._per_variable:
                self._per_variable[name] = {
                    f.name: torch.full(
                        (), f.metadata["initial"], dtype=_DTYPES[f.metadata["dtype"]], device=device
                    )
                    for f in fields
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

    def _advance(self, states, finite, peak, skip, measuring):
        """`next_loss_scale` of this update, with the per-parameter fields lent and kept back.

        `skip` is `finite` as torch's float flag (1.0: skipped). The scale
        and the growth tracker may be updated in place (a plain policy's
        fused kernel does). Also tells the observers, and counts the update
        on the host. On a `measuring` update the ranges are recorded
        already: the statistics policy decides on them.
        """
        names, per_variable, variable_finite = (), {}, ()
        if self._policy.records_details:
            names, per_variable, variable_finite = self._telemetry_state(states)
        if measuring:
            columns = self._ranges.columns
            per_variable.update({f: columns.get(f, ()) for f in diagnostics.FIELDS})
        state = self._state(per_variable)
        new = next_loss_scale(
            _OPS,
            state,
            finite,
            self._policy,
            peak=peak,
            variable_finite=variable_finite,
            measured=True if measuring else None,
            skip=skip.to(torch.float32),
            in_place=True,
        )
        for f in telemetry_fields(self._policy) if names else ():
            for name, value in zip(names, getattr(new, f.name)):
                self._per_variable[name][f.name] = value
        if self._observers:
            for observer, _ in list(self._observers.values()):
                observer.on_step(finite, state.steps)
        self._host_steps += 1
        self._device_steps = self._host_steps  # `next_loss_scale` counted it there too
        return new

    # -- on the host -----------------------------------------------------------

    def _per_variable_values(self):
        """`(names, {field: list of Python values})`, read in one transfer.

        The names are the telemetry's (every parameter checked), then any
        only measured; a field a parameter has no value of reads as its
        initial value.
        """
        policy = self._policy
        fields = telemetry_fields(policy)
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
            for step, module in observer.modules_at(steps).items():
                if out.get(step) is None:
                    out[step] = module
        return out


_DTYPES = {"int32": torch.int32, "float32": torch.float32, "bool": torch.bool}
