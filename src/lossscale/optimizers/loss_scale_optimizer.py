"""`LossScaleOptimizer`: dynamic loss scaling around any optimizer.

The wrapper keeps the loss-scale state in its own variables and runs
`mixed_precision.step.run` around the inner optimizer, whose step takes the
decision as `keep`; learning rate, step count and EMA are the inner one's.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from lossscale import validation
from lossscale.mixed_precision import diagnosis, diagnostics, step, telemetry
from lossscale.mixed_precision import state as state_layout
from lossscale.mixed_precision.loss_scale import LossScalePolicy, state_fields
from lossscale.optimizers import checkpoint
from lossscale.optimizers.base import Optimizer
from lossscale.optimizers.native import wrap_native
from lossscale.shared_handles import SharedHandle
from lossscale.typing import Array, Config, LearningRate
from lossscale.variables import Variable

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# Base-optimizer arguments the wrapper accepts only at these defaults: they are the inner one's.
_INNER_ONLY = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


class LossScaleOptimizer(Optimizer):
    """An optimizer that dynamically scales the loss to prevent underflow.

    Loss scaling multiplies the loss by a large factor, the "loss scale", so
    that small float16 gradients do not flush to zero; the gradients are
    divided by the same factor before the inner optimizer applies them. The
    scale adapts (with the default settings, exactly as Keras 3's wrapper):

    ```
    grads = grads / scale            # overwrite-with-gradient ones untouched
    if all(isfinite(grads)):
        inner_optimizer.apply(grads)
        if counter == dynamic_growth_steps - 1:
            scale, counter = scale * growth_factor, 0
            # not taken if it overflows float32; capped at max_scale; with
            # growth_policy="headroom", not taken unless
            # max|scaled grads| * growth_factor < 65504 / HEADROOM_MARGIN
        else:
            counter += 1
    else:                            # the step is skipped entirely
        counter = 0
        if this is the hysteresis-th overflow in a row or later:
            scale = max(scale * backoff_factor, float32 tiny)
            # below min_scale: LossScaleError instead
        # more than max_consecutive_skips in a row: LossScaleError
    ```

    A skipped step changes no model or inner optimizer variable (not even
    `iterations`). Where the inner optimizer has a fused kernel that takes
    the scale (Adam and AdamW on torch), the division happens inside it,
    leaving the unscaled values in the gradients passed to `apply`, as
    `torch.amp.GradScaler` does (never under `stateless_apply`).

    The settings beyond Keras are all off by default and kept as optimizer
    state, so they survive `stateless_apply`, `jax.jit` and checkpoints.
    With a fail-fast limit (`min_scale`, `max_consecutive_skips`) each
    `apply` reads one scalar back to the host (one device synchronisation
    per step). `stateless_apply` never raises (it may run under
    `jax.jit`): past a limit the state freezes and every later step is
    skipped; call `check(optimizer_variables)` on the host to raise.

    Args:
        inner_optimizer: The `lossscale.optimizers.Optimizer` instance to wrap,
            or a `torch.optim.Optimizer` / `optax.GradientTransformation`
            (wrapped in `TorchAdapter` / `OptaxAdapter`).
        initial_scale: Float. The initial loss scale; best high, since a
            scale too high falls far faster than one too low rises.
        dynamic_growth_steps: Int. After this many steps in a row with
            finite gradients, the scale is multiplied by `growth_factor`.
        name: String. The name to use for the wrapper's variables.
        growth_factor: Float > 1. Defaults to 2.
        backoff_factor: Float in (0, 1). Defaults to 0.5.
        hysteresis: Int >= 1. Overflowing steps in a row, each skipped,
            before the scale backs off. Defaults to 1 (back off at once).
        min_scale: Float or `None`. A backoff below it raises
            `LossScaleError`.
        max_scale: Float or `None`. Growth stops here.
        max_consecutive_skips: Int or `None`. More skipped steps in a row
            raise `LossScaleError`.
        growth_policy: `"fixed"` (default), `"headroom"` or
            `"statistics"` (needs `diagnostics_every`; see `LossScalePolicy`).
        telemetry: Boolean. Record skip counters, the last scales and, per
            overflow of the window, its step, whether the loss was finite
            and which variables had non-finite gradients (one extra
            reduction per gradient). On whenever a fail-fast limit is set.
        diagnostics_every: Int or `None`. Every this many steps, measure
            each scaled gradient against float16's range
            (`summary()["float16_range"]`), decided without a device read.
        history_length: Int in [1, 30]. Scales and overflows kept.
        on_persistent: `"warn"` (default), `"raise"` or a callable: what to
            do the first time a step is skipped for a cause no back-off can
            clear (cause `"persistent"` in `summary()["overflows"]`).
            `"warn"` warns once (`PersistentSkipWarning`) at the next host
            read; `"raise"` raises `LossScaleError` and a callable is called
            with the `summary()` dict, right after that step (one scalar
            read per step; turns `telemetry` on). A callable is not part of
            the config.
        agreement_every: Int or `None`. torch.distributed only: every this
            many steps, one small all-reduce checks that every rank of
            `process_group` holds the same loss-scale state, and raises
            `LossScaleError` on every rank where they drifted apart.
        process_group: torch only. The `torch.distributed` group whose ranks
            must agree on every skip; None: the default group where
            torch.distributed runs with several ranks. Not part of the
            config.
        axis_name: JAX only. Inside `shard_map` or `pmap`, the mapped axis
            name (or names) whose devices, each holding a block of the
            gradients, must agree on every skip, so the state stays
            replicated. `None` (default): global arrays under `jax.jit`.
            Not part of the config.
        **kwargs: Base optimizer arguments are accepted only at their
            defaults; set them on the `inner_optimizer` instead.

    Examples:
        >>> import numpy as np, lossscale as ls
        >>> w = ls.Variable(np.ones(2, np.float32), name="w")
        >>> opt = ls.LossScaleOptimizer(ls.optimizers.SGD(0.1), initial_scale=1024.0)
        >>> loss_scale = opt.scale_loss(1.0)  # multiply the loss before differentiating
        >>> opt.apply([np.full(2, 1024.0, np.float32)], [w])
        >>> w.numpy()
        array([0.9, 0.9], dtype=float32)
        >>> opt.apply([np.array([np.inf, 0], np.float32)], [w])  # overflow: skipped
        >>> float(opt.dynamic_scale), w.numpy()
        (512.0, array([0.9, 0.9], dtype=float32))
    """

    _owns_step_state = False

    def __init__(
        self,
        inner_optimizer: Optimizer | Any,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        name: str | None = None,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
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
        axis_name: str | tuple[str, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        arguments = dict(locals())  # first: holds exactly the named arguments
        settings = {f.name: arguments[f.name] for f in dataclasses.fields(LossScalePolicy)}
        # What a persistent skip triggers reads the overflow window.
        settings["telemetry"] = telemetry or diagnosis.check_on_persistent(on_persistent) != "warn"
        if not kwargs.pop("dynamic", True):
            raise ValueError(
                "LossScaleOptimizer no longer supports `dynamic=False`. Instead, set "
                "`loss_scale_factor` directly on the `inner_optimizer`. Received: dynamic=False"
            )
        for key, default in _INNER_ONLY.items():
            if key in kwargs and kwargs.pop(key) != default:
                raise ValueError(
                    f"LossScaleOptimizer does not support `{key}`. Instead, set `{key}` on the "
                    "`inner_optimizer`."
                )
        if kwargs:
            raise ValueError(
                f"LossScaleOptimizer does not support arguments: {sorted(kwargs)}. Accepted: "
                f"inner_optimizer, name, {', '.join(settings)}, on_persistent, agreement_every, "
                "process_group, axis_name"
            )
        if isinstance(inner_optimizer, LossScaleOptimizer):
            raise ValueError(
                "`inner_optimizer` is already a LossScaleOptimizer: wrapping it again would "
                "scale the loss twice. Pass its inner optimizer, or use it as it is. Received: "
                f"inner_optimizer={inner_optimizer!r}"
            )
        inner_optimizer = wrap_native(inner_optimizer)
        if not isinstance(inner_optimizer, Optimizer):
            raise ValueError(
                "`inner_optimizer` must be a lossscale.optimizers.Optimizer, a "
                "torch.optim.Optimizer or an optax.GradientTransformation instance. "
                f"Received: inner_optimizer={inner_optimizer!r}"
            )
        validation.check_axis_name(axis_name, process_group)
        if agreement_every is not None and axis_name is not None:
            raise ValueError(
                "`agreement_every` checks that torch.distributed ranks hold the same state; "
                "inside one JAX program (`axis_name`) the state is one global array and "
                f"cannot drift. Received: agreement_every={agreement_every!r}, "
                f"axis_name={axis_name!r}"
            )
        self.policy = LossScalePolicy(**settings)
        self.process_group = process_group  # neither this nor axis_name is in the config
        self.axis_name = axis_name
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self.inner_optimizer.loss_scale_factor = None
        self._persistent = diagnosis.PersistentWatch(on_persistent)
        self._scale_use = diagnosis.ScaleUse(self.name, self.policy.initial_scale)
        self._agreement = diagnosis.Agreement(agreement_every)
        # Made now on NumPy (readable before the first step), moved by
        # `build`; Keras's order first: step_counter, then dynamic_scale.
        specs = sorted(
            state_layout.variable_specs(self.policy, kinds=("step", "history")),
            key=lambda spec: spec[0] != "counter",
        )
        self._state = state_layout.holders_of(specs, self._add_state_variable)
        self.step_counter = self._state["counter"]
        self.dynamic_scale = self._state["scale"]
        # Counted on the host, no device read: the diagnostics cadence where
        # Python runs every step, and the `agreement_every` cadence.
        self._host_steps = 0
        self._steps_applied = 0
        self._observers = []  # `lossscale.torch.watch`
        self._observer_names = {}  # id(observer) -> {id(array): name}
        self._last_applied = None

    def _add_state_variable(self, spec):
        _, name, dtype, initial, shape, _ = spec
        if initial is None:
            initial = self.initial_scale
        return self.add_variable(
            shape,
            initializer="zeros" if initial == 0 else initial,  # (a boolean field's False too)
            dtype=dtype,
            name=name,
        )

    def build(self, var_list: Sequence[Variable | Array]) -> None:
        """Moves the wrapper's state to the model's backend and builds the inner optimizer."""
        if self.built:
            return
        var_list = self._as_variables(var_list, "var_list")
        if self.axis_name is not None and var_list and var_list[0].backend != "jax":
            raise ValueError(
                "`axis_name` names `shard_map` / `pmap` axes and applies to JAX only; on "
                f"{var_list[0].backend} leave it None (torch.distributed: `process_group`). "
                f"Received: axis_name={self.axis_name!r}"
            )
        super().build(var_list)
        specs = state_layout.variable_specs(
            self.policy, [v.path for v in var_list], kinds=("variable", "vector")
        )
        self._state.update(state_layout.holders_of(specs, self._add_state_variable))
        self.inner_optimizer.build(var_list)

    @property
    def variables(self) -> list[Variable]:
        """The wrapper's own variables, then the inner optimizer's."""
        return self._variables + self.inner_optimizer.variables

    # --- the inner optimizer's -------------------------------------------
    @property
    def learning_rate(self) -> Array:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: LearningRate) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self) -> Variable | Array:
        return self.inner_optimizer.iterations

    @iterations.setter
    def iterations(self, value: int) -> None:
        self.inner_optimizer.iterations = value

    @property
    def param_groups(self) -> NoReturn:
        """Not a `torch.optim.Optimizer`: raises an `AttributeError` that says what to use."""
        raise AttributeError(
            "'LossScaleOptimizer' object has no attribute 'param_groups': it is not a "
            "torch.optim.Optimizer, so torch's LR schedulers cannot drive it. To use a torch "
            "LR scheduler, wrap the rule as a torch optimizer: "
            "`opt = lossscale.torch.Optimizer(model.parameters(), ls.optimizers.AdamW(...))` "
            "under a `lossscale.torch.GradScaler`, and schedule `opt`; or give the inner "
            "optimizer a `lossscale.schedules` schedule as its `learning_rate`."
        )

    def finalize_variable_values(self, var_list: Sequence[Variable | Array]) -> None:
        """Delegates to the inner optimizer."""
        self.inner_optimizer.finalize_variable_values(var_list)

    def exclude_from_weight_decay(
        self,
        var_list: Sequence[Variable | Array] | None = None,
        var_names: Sequence[str] | None = None,
    ) -> None:
        """Delegates to the inner optimizer, which applies the weight decay."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    # --- one step -----------------------------------------------------------
    def scale_loss(self, loss: Array) -> Array:
        """Multiplies `loss` by the current loss scale (a Python float before `build`)."""
        if isinstance(loss, (str, bytes)) or not (
            isinstance(loss, numbers.Real)
            or self._ops.is_native(loss)
            or (hasattr(loss, "shape") and hasattr(loss, "dtype"))  # else refused later
        ):
            raise TypeError(
                "`loss` must be a number or an array of the optimizer's backend. Received: "
                f"loss of type {type(loss).__name__}"
            )
        if self.built and self.policy.records_details:
            self._record_loss(loss)
        scaled = loss * (self.dynamic_scale.value if self.built else float(self.dynamic_scale))
        self._scale_use.scaled(loss, scaled, identity=self._ops.records_calls())
        return scaled

    def apply(
        self,
        grads: Sequence[Array | None],
        trainable_variables: Sequence[Variable | Array] | None = None,
    ) -> None:
        """Applies the unscaled gradients unless they overflow; adapts the scale.

        Warns once (`ScaleMismatchWarning`) where the gradients' loss was not
        scaled by this scale (`scale_loss` never called, a loss scaled
        twice, a load in between). Then runs the host checks the settings
        ask for: fail-fast limits (see `check`), `on_persistent`,
        `agreement_every`.
        """
        super().apply(grads, trainable_variables)
        self._scale_use.unscaling()
        if not self._ops.records_calls():  # a traced call: the host reads nothing
            return
        self._steps_applied += 1
        if self._agreement.due(self._steps_applied - 1):
            # What every rank must hold alike: the scalar fields, the inner step count.
            fields = {
                name: held.value
                for name, held in self._state.items()
                if not isinstance(held, tuple) and held.shape == ()
            }
            fields["iterations"] = self.inner_optimizer.iterations
            self._agreement.check(self._ops, self.process_group, fields, self._steps_applied - 1)
        self.check()

    def _apply_prepared(self, grads, variables, *, owns_grads):
        ops, policy, inner = self._ops, self.policy, self.inner_optimizer
        state = state_layout.read(self._state, state_layout.value_of)
        in_kernel = self._unscales_in_kernel(variables, owns_grads)
        due, host = self._due(state, owns_grads)
        gradients = step.Gradients(
            grads,
            divided=() if in_kernel else [not v.overwrite_with_gradient for v in variables],
            index_of=lambda i: self._indices[id(variables[i])],
            variable_count=len(self._trainable_variables),
            # Outside `stateless_apply` the gradients are handed over: divided in place.
            unscale="in_kernel" if in_kernel else ("in_place" if owns_grads else "copy"),
        )

        def inner_step(decision):
            inner._step(
                decision.grads,
                variables,
                keep=decision.keep,
                grad_scale=decision.grad_scale,
                found_inf=decision.found_inf,
            )
            if owns_grads:  # never keep a traced value
                self._last_applied = decision.keep
                self._notify_observers(decision.finite, decision.step)

        new, _ = step.run(
            ops,
            policy,
            state,
            gradients,
            inner_step,
            participants=self._participants_of(host),
            due=due,
            in_place=ops.MUTABLE,
        )
        state_layout.write_back(ops, self._state, state, new, lambda v: v.storage)

    def _unscales_in_kernel(self, variables, owns_grads):
        """Whether the inner kernel divides the scale out as it reads each gradient.

        One pass fewer; division is monotone, so checking the scaled peak
        against the scale still catches a gradient that overflows unscaled.
        Not where the backend divides and checks in one pass anyway (eager
        torch), not under `stateless_apply` on a mutable backend (the
        buffers are the caller's), not where the policy reads each peak.
        """
        ops, policy = self._ops, self.policy
        return (
            (owns_grads or not ops.MUTABLE)
            and not policy.records_details
            and policy.growth_policy == "fixed"
            and not ops.checks_while_unscaling()
            and self.inner_optimizer._step_plan(variables).takes_grad_scale
        )

    def _due(self, state, owns_grads):
        """`(due, host)`: whether this step measures, and whether the host's count decided."""
        policy = self.policy
        if not policy.diagnoses:
            return None, False
        if self._ops.host_control() and owns_grads:
            due = self._host_steps % policy.diagnostics_every == 0
            self._host_steps += 1
            return due, True
        return diagnostics.due(policy, state.steps), False

    def _participants_of(self, host):
        """Whom each decision is agreed with: the JAX axis names, else the process group."""
        if self.axis_name is not None:
            return step.Participants(self.axis_name, per_variable=True, measurements="axes")
        group = self.process_group
        # Each rank measured its own gradients: the statistics policy's inputs are agreed.
        measurements = "peaks" if host or group is not None else None
        return step.Participants(group, measurements=measurements)

    def _record_loss(self, loss):
        """Stores whether `loss` is finite in `loss_finite` (no host read; not a traced loss)."""
        ops = self._ops
        is_traced = getattr(ops, "is_traced", None)
        if is_traced is not None and is_traced(loss):
            return
        if ops.is_native(loss):
            flag = ops.cast(ops.isfinite(loss), ops.INT_DTYPE)
            if ops.shape(flag):  # a loss per example: finite only if all are
                flag = ops.cast(ops.sum(1 - flag) == 0, ops.INT_DTYPE)
        else:
            flag = int(math.isfinite(float(loss)))
        self._state["loss_finite"].assign(flag)

    @property
    def last_step_applied(self) -> Array | None:
        """Whether the last `apply` was applied (a backend boolean scalar), or None before one.

        False for a skipped step; on torch a device value (`bool(...)` waits
        for the step). `stateless_apply` does not set it.
        """
        return self._last_applied

    def check_finite(self, grads: Sequence[Array | None]) -> Array:
        """Returns a backend boolean scalar: whether every non-`None` gradient is finite."""
        present = [g for g in grads if g is not None]
        if self.built:
            return self._ops.all_finite(present)
        from lossscale.backends import ops_for

        return ops_for(*present).all_finite(present)

    # --- observers: where an overflow started --------------------------------
    def register_step_observer(
        self, observer: Any, *, parameter_names: Sequence[tuple[Any, str]] | None = None
    ) -> ObserverHandle:
        """Calls `observer.on_step(finite, step)` in every `apply`, with device values.

        `finite` is the agreed decision, `step` the step's index (`None`
        unless steps are counted); `summary()` asks
        `observer.modules_at(steps)` where each overflow started. Used by
        `lossscale.torch.watch`; not called under `stateless_apply`.

        Args:
            observer: An object with `on_step(finite, step)` and
                `modules_at(steps)`.
            parameter_names: Optional `(array, name)` pairs: while the
                observer is registered, a variable holding one of these
                arrays goes by that name in `summary()` and `LossScaleError`.

        Returns:
            A handle whose `remove()` unregisters the observer.
        """
        self._observers.append(observer)
        self._observer_names[id(observer)] = {id(a): n for a, n in (parameter_names or [])}
        return ObserverHandle(self._observers, observer)

    def _variable_names(self) -> list[str]:
        """The model variables' names: a registered observer's where it has one, else paths."""
        names = {k: n for o in self._observers for k, n in self._observer_names[id(o)].items()}
        return [names.get(id(v.storage), v.path) for v in self._trainable_variables]

    def _notify_observers(self, finite: Array, step_index: Array | None) -> None:
        if not self._observers:
            return
        if step_index is not None and self._ops.MUTABLE:
            step_index = self._ops.copy(step_index)  # the state's buffer, written in place next
        for observer in list(self._observers):
            observer.on_step(finite, step_index)

    def _overflow_modules(self, steps: list[int]) -> dict[int, str | None]:
        """`{step: module}` for the overflows at `steps`, from the observers that know it."""
        found = {}
        for observer in self._observers:
            for at, module in observer.modules_at(steps).items():
                if module is not None:
                    found.setdefault(at, module)
        return found

    # --- on the host: summaries and the fail-fast check ----------------------
    def summary(self, optimizer_variables: Sequence[Array] | None = None) -> dict[str, Any]:
        """Returns the loss-scale state as a dict of Python values, for loggers.

        Reads the device (a synchronisation): call it when logging, not inside the step.

        Args:
            optimizer_variables: Optional values for `optimizer.variables`
                (as `stateless_apply` takes and returns them). Defaults to
                the optimizer's own variables.

        Returns:
            A dict with `dynamic_scale`, `step_counter`, `last_step_skipped`
            (with `optimizer_variables`, only with telemetry) and, as the
            settings track them, `consecutive_skips`, `steps`,
            `skipped_steps`, `last_overflow_step`, `scale_history`,
            `nonfinite_variables`, `error`, `error_step`, `persistent_step`,
            `overflows` (oldest first: `{"step", "cause", "variables",
            "module", "loss_finite"}` each), `float16_range` and
            `float16_range_step`.
        """
        state = state_layout.read(
            self._state, state_layout.reader(self.variables, optimizer_variables)
        )
        paths = self._variable_names()
        skipped = None
        if optimizer_variables is None and not self.policy.records_details:
            applied = self._last_applied
            skipped = False if applied is None else self._ops.logical_not(applied)
        found = telemetry.state_summary(
            self._ops, state, self.policy, paths, self._overflow_modules, skipped
        )
        if self._persistent.on_persistent == "warn":  # where the host reads anyway
            self._persistent.notice(found.get("persistent_step"), lambda: found, len(paths))
        return found

    def snapshot(self) -> dict[str, Any]:
        """The loss-scale state as host values (`summary()`), unlike the live `dynamic_scale`."""
        return self.summary()

    def check(self, optimizer_variables: Sequence[Array] | None = None) -> None:
        """Raises `LossScaleError` if the state records a crossed limit.

        `apply` calls it after every step when a fail-fast limit is set;
        call it after `stateless_apply` with the values it returned. Without
        those limits (and without `optimizer_variables`) nothing is read.

        Args:
            optimizer_variables: Optional values for `optimizer.variables`
                (from a jitted loop, or a checkpointer), each checked first
                to be one a step can leave. Defaults to the optimizer's own.

        Raises:
            ValueError: A value of `optimizer_variables` no step could
                have left (naming it, its value and the rule).
            LossScaleError: The state records a crossed limit.
        """
        read = state_layout.reader(self.variables, optimizer_variables)  # the count checked first
        if optimizer_variables is not None:
            optimizer_variables = list(optimizer_variables)
            checkpoint.check_values(
                [
                    (v, x, f"optimizer_variables[{i}] ({v.path})")
                    for i, (v, x) in enumerate(zip(self.variables, optimizer_variables))
                ],
                self._restored_fields(),
                self.policy,
                after="Restore a valid state.",
            )
        diagnosis.check_state(
            self._ops,
            self.policy,
            self._persistent,
            lambda name: read(self._state[name]),
            lambda: self.summary(optimizer_variables),
            len(self._trainable_variables),
        )

    # --- saving and loading -------------------------------------------------
    def _native_inner(self):
        """The inner optimizer where it keeps native state (`TorchAdapter`), else None."""
        inner = self.inner_optimizer
        return inner if getattr(inner, "keeps_native_state", False) else None

    def _build_over_native(self, inner) -> None:
        """Builds over `inner.parameters()` where the state has per-variable fields.

        So a state dict saved or loaded before the first step holds them too.
        """
        if self.built or not any(state_layout.per_variable(f) for f in state_fields(self.policy)):
            return
        self.build(inner.parameters())

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state (see `Optimizer.state_dict`); with a native inner
        optimizer, its `state_dict()` carrying this wrapper's variables in
        `optimizer_variables`."""
        inner = self._native_inner()
        if inner is None:
            return super().state_dict()
        self._build_over_native(inner)
        return inner.state_dict(extra_variables=self._variables)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the state written by `state_dict()` (checked before writing)."""
        inner = self._native_inner()
        if inner is None:
            super().load_state_dict(state_dict)
        else:
            self._build_over_native(inner)
            saved = state_dict.get("optimizer_variables") if isinstance(state_dict, dict) else None
            if isinstance(saved, dict):  # else the inner optimizer's own error
                checkpoint.check_values(
                    [
                        (v, saved[v.path], f"state_dict['optimizer_variables'][{v.path!r}]")
                        for v in self._variables
                        if v.path in saved
                    ],
                    self._restored_fields(),
                    self.policy,
                )
            inner.load_state_dict(state_dict, extra_variables=self._variables)
        self._after_load()

    def save_own_variables(self, store: MutableMapping[str, Array]) -> None:
        """Writes every variable to `store`; raises if the inner optimizer keeps native state."""
        inner = self._native_inner()
        if inner is not None:
            inner.save_own_variables(store)  # raises, naming `state_dict()`
        super().save_own_variables(store)

    def load_own_variables(self, store: Mapping[str, Array]) -> None:
        """Restores the variables from `store`; raises if the inner optimizer keeps native state."""
        inner = self._native_inner()
        if inner is not None:
            inner.load_own_variables(store)  # raises, naming `load_state_dict()`
        super().load_own_variables(store)
        self._after_load()

    def set_weights(self, weights: Sequence[Array]) -> None:
        """Sets every variable from `weights` (see `Optimizer.set_weights`)."""
        super().set_weights(weights)
        self._after_load()

    def _restored_fields(self):
        """The state's fields (`mixed_precision.restored`), and the inner optimizer's."""
        fields = {
            id(held): name
            for name, holders in self._state.items()
            for held in (holders if isinstance(holders, tuple) else (holders,))
        }
        return {**fields, **self.inner_optimizer._restored_fields()}

    def _policy(self):
        return self.policy

    def _after_load(self):
        """The host's copies follow a load: the scale changed, the restored step count."""
        self._scale_use.changed()
        self._last_applied = None
        steps = self._state.get("steps")
        if self.policy.diagnoses and steps is not None:
            self._host_steps = int(steps.numpy())

    # --- configuration ----------------------------------------------------------
    def get_config(self) -> Config:
        """Keras's keys (so Keras reads it), plus each other setting not at its default."""
        from lossscale import serialization

        config = {
            "name": self.name,
            "inner_optimizer": serialization.serialize(self.inner_optimizer),
            **self.policy.non_default_settings(),
        }
        if self._persistent.on_persistent == "raise":  # (a callable is no setting)
            config["on_persistent"] = self._persistent.on_persistent
        if self._agreement.every is not None:
            config["agreement_every"] = self._agreement.every
        return config

    @classmethod
    def from_config(
        cls, config: Config, custom_objects: dict[str, Any] | None = None
    ) -> LossScaleOptimizer:
        from lossscale import serialization

        validation.check_config(cls, config, accepted=cls._config_keys())
        config = dict(config)
        inner = serialization.deserialize(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)

    # --- copies -------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """What a copy takes: the same process group (`shared_handles`), no observers."""
        state = super().__getstate__()
        state["process_group"] = SharedHandle.wrap(
            self.process_group, "process_group", type(self).__name__
        )
        state["_observers"], state["_observer_names"] = [], {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = {**state, "process_group": SharedHandle.unwrap(state.get("process_group"))}
        super().__setstate__(state)


class ObserverHandle:
    """What `register_step_observer` returns."""

    def __init__(self, observers: list, observer: Any) -> None:
        self._observers, self._observer = observers, observer

    def remove(self) -> None:
        """Unregisters the observer (nothing if it already was)."""
        if self._observer in self._observers:
            self._observers.remove(self._observer)


def _policy_property(field):
    def read(self):
        return getattr(self.policy, field.name)

    read.__annotations__["return"] = field.type  # the policy field's own type
    return property(read, doc=f"The `{field.name}` setting (read-only; see the class docstring).")


# Each setting reads through to the policy: the dataclass is the one list.
for _field in dataclasses.fields(LossScalePolicy):
    setattr(LossScaleOptimizer, _field.name, _policy_property(_field))
del _field
