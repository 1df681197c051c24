"""What `GradScaler` records per parameter and per step, for `summary()` and its errors.

With telemetry (or a fail-fast limit) a scaler records, on the device:
whether the scaled loss was finite (`scale`), which parameters' gradients
were non-finite (one multi-tensor norm per device and dtype in the check
stage) and so, per overflow of the window, their names; with
`diagnostics_every` the float16 range of each parameter's scaled gradient
(`diagnostics.measure_all`: all of them at once, on the steps a Python
count of updates makes due: no host read). `LossScaleState` keeps
per-variable fields for a model's variables; a scaler has parameters
instead, so it keeps their values here, keyed by parameter name, on the
scale's device, and lends them to `next_loss_scale` as tuples of scalars
(the `range_*` fields too, which `next_loss_scale` reads as a vector or as
a tuple).

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


def per_variable_fields(policy):
    """The per-variable `LossScaleState` fields `policy` tracks, a scaler keeps them by name."""
    return [f for f in loss_scale.state_fields(policy) if per_variable(f)]


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
        """`{name: measure(grad)}` of the optimizer's scaled gradients, on a due step."""
        if not self._measures_now():
            return {}
        named = self._named_gradients(optimizer)
        named = [(name, grad) for name, grad in named if grad.numel()]
        if not named:
            return {}
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
        return {name: tuple(column[i] for column in columns) for i, (name, _) in enumerate(named)}

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
                    grad = grad.coalesce()._values()
                if type(grad) is not torch.Tensor and hasattr(grad, "to_local"):
                    grad = grad.to_local()  # a DTensor: this rank's shard
                name = known.get(id(param))
                if name is None:
                    name = group_names[i] if group_names else f"group{g}.param{i}"
                out.append((name, grad))
        return out

    # -- the update ------------------------------------------------------------

    def _per_variable_state(self, states):
        """The per-variable fields for `next_loss_scale`, and what this step measured.

        Returns:
            `(names, fields, variable_finite, measured)`: the parameter names
            (every one seen so far), `{field: tuple}` in that order,
            `variable_finite` (None where a parameter had no gradient), and
            `measured` for `next_loss_scale` (None: not a measuring step).
        """
        fields = per_variable_fields(self._policy)
        finite, ranges = {}, {}
        for state in states.values():
            finite.update(state.get("finite_per_parameter", {}))
            ranges.update(state.get("measured", {}))
        device = self._scale.device
        for name in [*finite, *ranges]:
            if name not in self._per_variable:
                self._per_variable[name] = {
                    f.name: torch.full(
                        (),
                        f.metadata["initial"],
                        dtype=_DTYPES[f.metadata["dtype"]],
                        device=device,
                    )
                    for f in fields
                }
        names = list(self._per_variable)
        columns = {f.name: [self._per_variable[n][f.name] for n in names] for f in fields}
        for i, name in enumerate(names):
            for field, value in zip(diagnostics.FIELDS, ranges.get(name, ())):
                columns[field][i] = value.to(device, non_blocking=True)
        measured = True if self._measures_now() and self._policy.diagnoses else None
        variable_finite = ()
        if self._policy.records_details:
            variable_finite = tuple(finite.get(n) for n in names)
        return names, {k: tuple(v) for k, v in columns.items()}, variable_finite, measured

    def _advance(self, states, finite, peak, skip):
        """`next_loss_scale` of this update, with the per-parameter fields lent and kept back.

        `skip` is `finite` as torch's float flag (1.0: skipped). The scale
        and the growth tracker may be updated in place (a plain policy's
        fused kernel does). Also tells the observers, and counts the update
        on the host.
        """
        names, per_variable, variable_finite, measured = (), {}, (), None
        if self._reads_per_variable():
            names, per_variable, variable_finite, measured = self._per_variable_state(states)
        state = self._state(per_variable)
        new = next_loss_scale(
            _OPS,
            state,
            finite,
            self._policy,
            peak=peak,
            variable_finite=variable_finite,
            measured=measured,
            skip=skip.to(torch.float32),
            in_place=True,
        )
        if names:
            self._keep_per_variable(names, new)
        if self._observers:
            for observer, _ in list(self._observers.values()):
                observer.on_step(finite, state.steps)
        self._host_steps += 1
        self._device_steps = self._host_steps  # `next_loss_scale` counted it there too
        return new

    def _reads_per_variable(self):
        """Whether this update reads and writes the per-parameter fields.

        With telemetry, every update (each parameter's overflow flag); with
        diagnostics alone, a measuring update, or every one under the
        statistics policy, which reads the last measurement. Elsewhere the
        fields stay as they are, and building them for a hundred-odd
        parameters would cost more than the update.
        """
        policy = self._policy
        if policy.records_details:
            return True
        return policy.diagnoses and (self._measures_now() or policy.growth_policy == "statistics")

    def _keep_per_variable(self, names, new):
        for f in per_variable_fields(self._policy):
            for name, value in zip(names, getattr(new, f.name)):
                self._per_variable[name][f.name] = value

    # -- on the host -----------------------------------------------------------

    def _per_variable_values(self):
        """`(names, {field: list of Python values})`, read in one transfer."""
        fields = per_variable_fields(self._policy)
        names = list(self._per_variable)
        if not names or not fields:
            return names, {f.name: [] for f in fields}
        flat = torch.stack(
            [self._per_variable[n][f.name].to(torch.float64) for f in fields for n in names]
        ).tolist()
        values = {}
        for k, f in enumerate(fields):
            cast = float if f.metadata["dtype"] == "float32" else int
            values[f.name] = [cast(x) for x in flat[k * len(names) : (k + 1) * len(names)]]
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
