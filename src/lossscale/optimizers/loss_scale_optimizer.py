"""`LossScaleOptimizer`: dynamic loss scaling around any optimizer.

The wrapper holds the loss-scale state in its own variables and runs the
one loss-scale step (`mixed_precision.step.run`) around its inner
optimizer: the inner step takes the decision as its `keep` argument
(`Optimizer._step`), folded into its kernels or gated by `ops.cond`. The
learning rate, the step count, EMA values and weight-decay exclusions are
the inner optimizer's, read and written through.
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

# Base-optimizer arguments and their defaults: the wrapper accepts only the
# defaults, since these settings belong to the inner optimizer.
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

    A skipped step changes no model variable and no inner optimizer
    variable (not even `iterations`).

    Where the inner optimizer has a fused kernel that takes the scale (Adam
    and AdamW on torch), the division happens inside that kernel, which
    saves a full pass over the gradients; like `torch.amp.GradScaler`, it
    leaves the unscaled values in the gradient tensors passed to `apply`
    (never under `stateless_apply`, and never in a tensor of an autograd
    graph).

    Beyond Keras (all off by default): `growth_factor`, `backoff_factor`,
    `hysteresis`, `max_scale`, `growth_policy="headroom"`; fail-fast limits
    `min_scale` and `max_consecutive_skips`, which raise `LossScaleError`
    (naming the step, the last scales and the variables with non-finite
    gradients) instead of skipping steps forever; and `telemetry`
    (skipped-step counters, last overflow, per-variable non-finite flags),
    read with `summary()`. All of it is optimizer state, so it survives
    `stateless_apply`, `jax.jit` and checkpoints.

    With `min_scale` or `max_consecutive_skips` set, each `apply` reads one
    scalar (the error flag) back to the host: on an accelerator that is one
    device synchronisation per step. `stateless_apply` never raises (it may
    run under `jax.jit`): once a limit is crossed the state freezes and every
    later step is skipped; call `check(optimizer_variables)` on the host to
    raise the error.

    Args:
        inner_optimizer: The `lossscale.optimizers.Optimizer` instance to wrap,
            or a `torch.optim.Optimizer` / `optax.GradientTransformation`
            (wrapped in `TorchAdapter` / `OptaxAdapter`).
        initial_scale: Float. The initial loss scale. It is recommended for
            this to be a very high number, because a loss scale that is too
            high gets lowered far more quickly than a loss scale that is too
            low gets raised.
        dynamic_growth_steps: Int. How often to update the scale upwards.
            After every `dynamic_growth_steps` steps with finite gradients,
            the loss scale is multiplied by `growth_factor`.
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
            `"statistics"` (decide from the measured float16 range; needs
            `diagnostics_every`; see `LossScalePolicy`).
        telemetry: Boolean. Record skip counters, the last scales and, for
            each overflow of the window, its step, whether the loss itself
            was finite (recorded by `scale_loss`) and which variables had
            non-finite gradients (one extra reduction per gradient each
            step). On whenever a fail-fast limit is set.
        diagnostics_every: Int or `None`. Every this many steps, measure
            each variable's scaled gradient against float16's range
            (`summary()["float16_range"]`). The decision costs no device
            read: NumPy and eager torch count steps on the host; JAX,
            TensorFlow and `torch.compile` branch on the device (a compiled
            torch step then measures every step and keeps the due ones).
        history_length: Int in [1, 30]. Scales and overflows kept.
        on_persistent: `"warn"` (default), `"raise"` or a callable: what to
            do the first time a step is skipped for a cause no back-off can
            clear (the same variables non-finite while the scale fell by
            `2**8`, or to 1 or below: `summary()["overflows"][i]["cause"] ==
            "persistent"`). `"warn"` warns once (`PersistentSkipWarning`) at
            the next host read (every step with a fail-fast limit, else
            `summary()` or `check()`); `"raise"` raises `LossScaleError` and a
            callable is called with the `summary()` dict (save the batch and
            a checkpoint, say), both right after that step (one scalar read
            per step). Needs the overflow window: `"raise"` or a callable
            turns `telemetry` on. A callable is not part of the config.
        agreement_every: Int or `None`. torch.distributed only: every this
            many steps, one small all-reduce checks that every rank of
            `process_group` holds the same loss-scale state (scale, counters,
            skip count, the inner step count); where they drifted apart,
            `LossScaleError` is raised on every rank at the same step,
            naming the field, the values and the ranks. Within one JAX
            program the state is one global array and cannot drift.
        process_group: torch only. The `torch.distributed` group whose ranks
            must agree on every skip (their gradients may be sharded); None
            uses the default group when torch.distributed is initialised
            with more than one rank, and does nothing otherwise. Not part of
            the config.
        axis_name: JAX only. Inside `shard_map` or `pmap`, where each
            device holds its own block of the gradients (model
            parallelism), the mapped axis name (or a tuple of them) whose
            devices must agree on every skip: the finite flag is combined
            with `lax.pmin` and the policy's peaks with `lax.pmax` over it,
            so the loss-scale state stays replicated. `None` (default):
            global arrays under `jax.jit` (one decision by construction),
            or gradients already averaged over the axis. Not part of the
            config.
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
        settings["telemetry"] = telemetry or (
            diagnosis.check_on_persistent(on_persistent) != "warn"
        )
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
        # A live process group is no setting: it stays out of the config
        # (nor does the axis name, which belongs to the step's mapping).
        self.process_group = process_group
        self.axis_name = axis_name
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self.inner_optimizer.loss_scale_factor = None
        # What the host diagnoses between steps (`mixed_precision.diagnosis`).
        self._persistent = diagnosis.PersistentWatch(on_persistent)
        self._scale_use = diagnosis.ScaleUse(self.name, self.policy.initial_scale)
        self._agreement = diagnosis.Agreement(agreement_every)
        # Made now on NumPy and moved to the model's backend by `build`, so
        # they can be read (and checkpoints matched) before the first step.
        # Keras's order first: step_counter, then dynamic_scale.
        specs = sorted(
            state_layout.variable_specs(self.policy, kinds=("step", "history")),
            key=lambda spec: spec[0] != "counter",
        )
        self._state = state_layout.holders_of(specs, self._add_state_variable)
        self.step_counter = self._state["counter"]
        self.dynamic_scale = self._state["scale"]
        # Steps taken by `apply`, counted on the host: where the backend
        # re-runs Python at every step, the diagnostics cadence is decided
        # on it, with no device read; and the calls of `apply` (the cadence
        # of `agreement_every`).
        self._host_steps = 0
        self._steps_applied = 0
        # Step observers (`lossscale.torch.watch`), and the last step's
        # decision (`last_step_applied`).
        self._observers = []
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

    # --- what belongs to the inner optimizer ------------------------------
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
        """Not a `torch.optim.Optimizer`: raises an `AttributeError` that says what to use.

        torch's LR schedulers read `optimizer.param_groups`; a lossscale
        optimizer keeps its learning rate as a variable instead.
        """
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
        """Multiplies `loss` by the current loss scale.

        That is `initial_scale` until a step (or a loaded checkpoint) changes
        it. Before `build` the scale is read as a Python float: the
        optimizer's scalars live on NumPy until it knows the model's backend.
        """
        if isinstance(loss, (str, bytes)) or not (
            isinstance(loss, numbers.Real) or self._ops.is_native(loss) or _array_like(loss)
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
        scaled by this scale: `scale_loss` never called
        (`UnscaledLossWarning`), a loss scaled twice, or the scale set in
        between (a load). With `min_scale` or `max_consecutive_skips` set,
        raises `LossScaleError` when the state records a failure (see
        `check`); with `on_persistent`, acts on a persistent skip; with
        `agreement_every`, checks the ranks agree.
        """
        super().apply(grads, trainable_variables)
        self._scale_use.unscaling()
        if self._ops.records_calls():  # a traced call: the host reads nothing
            self._after_step()

    def _after_step(self):
        """The host's reads after a step: the ranks' agreement, a persistent skip, the limits."""
        self._steps_applied += 1
        if self._agreement.due(self._steps_applied - 1):
            self._agreement.check(
                self._ops, self.process_group, self._agreed_fields(), self._steps_applied - 1
            )
        self.check()

    def _agreed_fields(self):
        """What every rank must hold alike: the scalar state fields and the inner step count."""
        fields = {
            name: held.value
            for name, held in self._state.items()
            if not isinstance(held, tuple) and held.shape == ()
        }
        fields["iterations"] = self.inner_optimizer.iterations
        return fields

    def _apply_prepared(self, grads, variables, *, owns_grads):
        ops, policy, inner = self._ops, self.policy, self.inner_optimizer
        state = state_layout.read(self._state, _value)
        in_kernel = self._unscales_in_kernel(variables, owns_grads)
        due, host = self._due(state, owns_grads)
        gradients = step.Gradients(
            grads,
            divided=() if in_kernel else [not v.overwrite_with_gradient for v in variables],
            index_of=lambda i: self._indices[id(variables[i])],
            variable_count=len(self._trainable_variables),
            # Outside `stateless_apply` the gradients are the caller's to
            # hand over: torch divides them in place, as GradScaler does,
            # instead of allocating unscaled copies.
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
        state_layout.write_back(ops, self._state, state, new, _storage)

    def _unscales_in_kernel(self, variables, owns_grads):
        """Whether the inner kernel divides the scale out as it reads each gradient.

        One pass fewer where it can (NumPy's, JAX's, a compiled torch step's
        Adam and SGD): division is monotone, so the largest scaled
        magnitude over the scale is the largest unscaled one, and the check
        still catches a gradient that overflows when unscaled. Not where the
        backend divides and checks in one pass anyway (eager torch), not
        under `stateless_apply` on a backend that writes in place (such a
        kernel may leave the unscaled values in the gradient buffers, which
        belong to the caller there), and not where the policy reads each
        gradient's peak.
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
        """`(due, host)`: whether this step measures the float16 range, and who decided.

        Where Python runs every step (eager NumPy and torch, not under
        `stateless_apply`) the host counts the steps; elsewhere the step's
        count on the device decides.
        """
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
        # Each rank measured its own gradients: the near-maximum share and the
        # peak are agreed (the statistics policy decides on them), over
        # `process_group`, or the default group where torch.distributed runs.
        measurements = "peaks" if host or group is not None else None
        return step.Participants(group, measurements=measurements)

    def _record_loss(self, loss):
        """Stores whether `loss` is finite in the `loss_finite` state variable (no host read).

        A traced loss (inside `jax.grad` or `jax.jit`) cannot be kept in a
        variable: it is not recorded, and the step reports the loss as
        unknown.
        """
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

        False for a skipped (overflowing) step. A device value on torch:
        reading it on the host (`bool(...)`) waits for the step.
        `stateless_apply` does not set it.
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
        self, observer: Any, parameter_names: Sequence[tuple[Any, str]] | None = None
    ) -> ObserverHandle:
        """Calls `observer.on_step(finite, step)` in every `apply`, with device values.

        `finite` is the step's agreed skip decision (True: applied), `step`
        the step's index (`None` unless telemetry or diagnostics count
        steps). `summary()` asks `observer.modules_at(steps)` for the
        module where each overflow of the window started. Used by
        `lossscale.torch.watch`. Not called under `stateless_apply`.

        Args:
            observer: An object with `on_step(finite, step)` and
                `modules_at(steps)`.
            parameter_names: Optional `(array, name)` pairs (a module's
                `named_parameters()`): while the observer is registered,
                a variable holding one of these arrays is named so in
                `summary()` and `LossScaleError` (else by its path).

        Returns:
            A handle whose `remove()` unregisters the observer.
        """
        self._observers.append(observer)
        self._observer_names[id(observer)] = {id(a): n for a, n in (parameter_names or [])}
        return ObserverHandle(self._observers, observer)

    def _variable_names(self) -> list[str]:
        """The model variables' names: a registered observer's where it has one, else paths."""
        names = {}
        for observer in self._observers:
            names.update(self._observer_names.get(id(observer), {}))
        return [names.get(id(v.storage), v.path) for v in self._trainable_variables]

    def _notify_observers(self, finite: Array, step_index: Array | None) -> None:
        if not self._observers:
            return
        if step_index is not None and self._ops.MUTABLE:
            # The state's own buffer is written in place next.
            step_index = self._ops.copy(step_index)
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

        Reads the values back to the host (a device synchronisation on an
        accelerator): call it when logging, not inside the step.

        Args:
            optimizer_variables: Optional values for `optimizer.variables`
                (as passed to and returned by `stateless_apply`). Defaults to
                the optimizer's own variables.

        Returns:
            A dict with `dynamic_scale` and `step_counter`;
            `last_step_skipped` (False before the first step since the
            optimizer was made or loaded; from `optimizer_variables`, only
            with telemetry); and, as the settings track them,
            `consecutive_skips`, `steps`, `skipped_steps`,
            `last_overflow_step`, `scale_history`, `nonfinite_variables`
            (paths), `error`, `error_step`, `persistent_step`, `overflows`
            (the overflow window, oldest first: `{"step", "cause",
            "variables", "module", "loss_finite"}` each) and, with
            `diagnostics_every`, `float16_range` and `float16_range_step`.
        """
        state = state_layout.read(self._state, self._reader(optimizer_variables))
        paths = self._variable_names()
        skipped = None
        if optimizer_variables is None and not self.policy.records_details:
            # Kept by `apply` (telemetry, where kept, tells it from the state).
            applied = self._last_applied
            skipped = False if applied is None else self._ops.logical_not(applied)
        found = telemetry.state_summary(
            self._ops, state, self.policy, paths, self._overflow_modules, skipped
        )
        if self._persistent.on_persistent == "warn":  # where the host reads anyway
            self._persistent.notice(found.get("persistent_step"), lambda: found, len(paths))
        return found

    def snapshot(self) -> dict[str, Any]:
        """The loss-scale state as host values: `summary()`, a copy that later steps leave alone.

        `optimizer.dynamic_scale` is a live variable (a list of it logs the
        final value at every entry); keep snapshots instead.
        """
        return self.summary()

    def check(self, optimizer_variables: Sequence[Array] | None = None) -> None:
        """Raises `LossScaleError` if the state records a crossed limit.

        `apply` calls it after every step when `min_scale` or
        `max_consecutive_skips` is set (reading one scalar); call it
        yourself after `stateless_apply` (for example every few steps of a
        `jax.jit` loop), with the values it returned. Without those limits
        (and without `optimizer_variables`) nothing is read.

        Args:
            optimizer_variables: Optional values for `optimizer.variables`
                (from a jitted loop, or restored by a checkpointer): each
                is checked to be one a step can leave (a normal positive
                scale, whole counters) first. Defaults to the optimizer's
                own variables.

        Raises:
            ValueError: A value of `optimizer_variables` no step could
                have left (naming it, its value and the rule).
            LossScaleError: The state records a crossed limit.
        """
        read = self._reader(optimizer_variables)  # the count checked first
        if optimizer_variables is not None:
            # Values from outside (a jitted loop, a restored pytree): each one a step can leave.
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
        policy, watch = self.policy, self._persistent
        watching = (
            policy.records_details
            and not watch.seen
            and (policy.fails_fast or watch.reads_every_step)
        )
        if not watching and not policy.fails_fast:
            return  # nothing to check, nothing read
        count = len(self._trainable_variables)
        if watching:
            watch.notice(
                self._ops.to_numpy(read(self._state["persistent_step"])),
                lambda: self.summary(optimizer_variables),
                count,
            )
        if policy.fails_fast:
            telemetry.raise_if_failed(
                self._ops,
                read(self._state["error"]),
                policy,
                lambda: self.summary(optimizer_variables),
                count,
            )

    def _reader(self, optimizer_variables):
        """`variable -> value`: its own, or its entry of `optimizer_variables`."""
        if optimizer_variables is None:
            return _value
        optimizer_variables = list(optimizer_variables)
        own = self.variables
        if len(optimizer_variables) != len(own):
            raise ValueError(
                "`optimizer_variables` must hold one value per optimizer variable "
                f"({len(own)}). Received: {len(optimizer_variables)} values"
            )
        values = {id(v): x for v, x in zip(own, optimizer_variables)}
        return lambda v: values[id(v)]

    # --- saving and loading: a native inner optimizer's state, the host count ----
    def _native_inner(self):
        """The inner optimizer, where it keeps its state outside lossscale variables.

        A `TorchAdapter` keeps its state in the torch optimizer (it says so
        with `keeps_native_state = True`): `state_dict()` and
        `load_state_dict()` go through its own, with the wrapper's variables
        carried in `optimizer_variables`.
        """
        inner = self.inner_optimizer
        return inner if getattr(inner, "keeps_native_state", False) else None

    def _build_over_native(self, inner) -> None:
        """Builds the wrapper over `inner.parameters()` if its state needs them.

        Telemetry and diagnostics keep variables per model variable (named
        after it) or per model (sized by it), made by `build`. A torch
        optimizer knows its parameters from the start, so a state dict
        saved or loaded before the first step holds those too, as after
        it: the wrapper builds itself, as its first step would with the
        parameters in param-group order (their Variables are named
        `param_0`, `param_1`, ...). A wrapper without such state stays
        unbuilt.
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
        """Restores the state written by `state_dict()` (checked before writing).

        With a native inner optimizer, a wrapper never stepped whose
        telemetry or diagnostics keep per-variable state builds itself
        first (as `state_dict()` does), so it loads a dict saved before or
        after any step; a dict that does not fit then leaves every
        variable's value as it was.
        """
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
        """What the host keeps follows a load: the scale it set, its count of steps.

        A loss scaled before the load is off by a factor (`ScaleUse`); the
        count of steps (the cadence of `diagnostics_every`) is the restored
        `steps`, one host read: a resumed run measures on the steps the
        uninterrupted one does. No step of this run is the last one any more.
        """
        self._scale_use.changed()
        self._last_applied = None
        steps = self._state.get("steps")
        if self.policy.diagnoses and steps is not None:
            self._host_steps = int(steps.numpy())

    # --- configuration ----------------------------------------------------------
    def get_config(self) -> Config:
        """Keras's keys, plus each beyond-Keras setting that differs from its default.

        With the defaults the config equals Keras's, so Keras can read it.
        """
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

    # --- copies: the process group is shared, observers are not --------------
    def __getstate__(self) -> dict[str, Any]:
        """What a copy takes (see `Optimizer.__getstate__`).

        `copy.deepcopy` keeps the same process group; `pickle` refuses it
        with an error that says what to save instead (`shared_handles`). An
        observer is bound to a model (`lossscale.torch.watch` hooks its
        modules): a copy starts with none, as a copy of a torch optimizer
        starts without its hooks.
        """
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
    """What `register_step_observer` returns: `remove()` unregisters the observer."""

    def __init__(self, observers: list, observer: Any) -> None:
        self._observers, self._observer = observers, observer

    def remove(self) -> None:
        """Unregisters the observer (nothing if it already was)."""
        if self._observer in self._observers:
            self._observers.remove(self._observer)


def _value(variable):
    return variable.value


def _array_like(x):
    """Whether `x` is an array of some framework (refused later if of another backend)."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _storage(variable):
    return variable.storage


def _policy_property(field):
    def read(self):
        return getattr(self.policy, field.name)

    read.__annotations__["return"] = field.type  # the policy field's own type
    return property(read, doc=f"The `{field.name}` setting (read-only; see the class docstring).")


# Each setting reads through to the policy: the dataclass is the one list.
for _field in dataclasses.fields(LossScalePolicy):
    setattr(LossScaleOptimizer, _field.name, _policy_property(_field))
del _field
