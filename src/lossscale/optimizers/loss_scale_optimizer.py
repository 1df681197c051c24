"""`LossScaleOptimizer`: dynamic loss scaling around any optimizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lossscale import validation
from lossscale.mixed_precision.host_reads import HostReadsMixin
from lossscale.mixed_precision.loss_scale import LossScalePolicy, state_fields
from lossscale.mixed_precision.telemetry import warn_unscaled_loss
from lossscale.optimizers.base import Optimizer
from lossscale.optimizers.loss_scale_delegation import InnerDelegationMixin
from lossscale.optimizers.loss_scale_diagnostics import LossScaleDiagnosticsMixin
from lossscale.optimizers.loss_scale_step import LossScaleStepMixin
from lossscale.optimizers.native import NativeInnerStateMixin, wrap_native
from lossscale.shared_handles import SharedHandle
from lossscale.typing import Array, Config
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


class LossScaleOptimizer(
    LossScaleDiagnosticsMixin,  # first: its loads wrap every other's
    InnerDelegationMixin,
    NativeInnerStateMixin,
    HostReadsMixin,
    LossScaleStepMixin,
    Optimizer,
):
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
        process_group: ProcessGroup | None = None,
        axis_name: str | tuple[str, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        arguments = dict(locals())  # first: holds exactly the named arguments
        settings = {f.name: arguments[f.name] for f in dataclasses.fields(LossScalePolicy)}
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
                f"inner_optimizer, name, {', '.join(settings)}"
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
        self.policy = LossScalePolicy(**settings)
        # A live process group is no setting: it stays out of the config
        # (nor does the axis name, which belongs to the step's mapping).
        self.process_group = process_group
        self.axis_name = axis_name
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self.inner_optimizer.loss_scale_factor = None
        self._loss_scaled = False  # set by `scale_loss`; read by `apply` (no array)
        # Made now on NumPy and moved to the model's backend by `build`, so
        # they can be read (and checkpoints matched) before the first step.
        # Keras's order first: step_counter, then dynamic_scale.
        self._state = {}
        for f in sorted(state_fields(self.policy), key=lambda f: f.name != "counter"):
            if f.metadata["per"] == "step":
                self._state[f.name] = self._add_state_variable(f, f.metadata["variable"] or f.name)
            elif f.metadata["per"] == "history":
                self._state[f.name] = tuple(
                    self._add_state_variable(f, f"{f.name}_{i}")
                    for i in range(self.policy.history_length)
                )
        self.step_counter = self._state["counter"]
        self.dynamic_scale = self._state["scale"]
        # Steps taken by `apply`, counted on the host: where the backend
        # re-runs Python at every step, the diagnostics cadence is decided
        # on it, with no device read.
        self._host_steps = 0
        self._observers = []

    def _add_state_variable(self, field, name):
        initial = field.metadata["initial"]
        return self.add_variable(
            (),
            initializer=self.initial_scale if initial is None else initial,
            dtype=field.metadata["dtype"],
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
        for f in state_fields(self.policy):
            if f.metadata["per"] == "vector":
                self._state[f.name] = self.add_variable(
                    (len(var_list),),
                    initializer="zeros",
                    dtype=f.metadata["dtype"],
                    name=f.name,
                )
            elif f.metadata["per"] == "variable":
                self._state[f.name] = tuple(
                    self.add_variable(
                        (),
                        initializer="zeros",
                        dtype=f.metadata["dtype"],
                        name=f"{v.path.replace('/', '_')}_{f.name}",
                    )
                    for v in var_list
                )
        self.inner_optimizer.build(var_list)

    @property
    def _participants(self) -> Any:
        """Whom each skip is agreed with: the JAX axis names, else the process group."""
        return self.process_group if self.axis_name is None else self.axis_name

    @property
    def variables(self) -> list[Variable]:
        """The wrapper's own variables, then the inner optimizer's."""
        return self._variables + self.inner_optimizer.variables

    # --- copies: the process group is shared, not copied ---------------------
    def __getstate__(self) -> dict[str, Any]:
        """What a copy takes (see `Optimizer.__getstate__`); the process group shared.

        `copy.deepcopy` keeps the same group; `pickle` refuses it with an
        error that says what to save instead (`shared_handles`).
        """
        state = super().__getstate__()
        state["process_group"] = SharedHandle.wrap(
            self.process_group, "process_group", type(self).__name__
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = {**state, "process_group": SharedHandle.unwrap(state.get("process_group"))}
        super().__setstate__(state)

    # --- one step -----------------------------------------------------------
    def apply(
        self,
        grads: Sequence[Array | None],
        trainable_variables: Sequence[Variable | Array] | None = None,
    ) -> None:
        """Applies the unscaled gradients unless they overflow; adapts the scale.

        Warns once (`UnscaledLossWarning`) if `scale_loss` was never called.
        With `min_scale` or `max_consecutive_skips` set, raises
        `LossScaleError` when the state records a failure (see `check`).
        """
        if not self._loss_scaled:
            self._loss_scaled = True  # warn once per optimizer
            warn_unscaled_loss(self.name, self.initial_scale)
        super().apply(grads, trainable_variables)
        self.check()

    def scale_loss(self, loss: Array) -> Array:
        """Multiplies `loss` by the current loss scale.

        That is `initial_scale` until a step (or a loaded checkpoint) changes
        it. Before `build` the scale is read as a Python float: the
        optimizer's scalars live on NumPy until it knows the model's backend.
        """
        self._loss_scaled = True
        if self.built and self.policy.records_details:
            self._record_loss(loss)
        return loss * (self.dynamic_scale.value if self.built else float(self.dynamic_scale))

    # --- configuration ----------------------------------------------------------
    def get_config(self) -> Config:
        """Keras's keys, plus each beyond-Keras setting that differs from its default.

        With the defaults the config equals Keras's, so Keras can read it.
        """
        from lossscale import serialization

        return {
            "name": self.name,
            "inner_optimizer": serialization.serialize(self.inner_optimizer),
            **self.policy.non_default_settings(),
        }

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


def _policy_property(field):
    def read(self):
        return getattr(self.policy, field.name)

    read.__annotations__["return"] = field.type  # the policy field's own type
    return property(read, doc=f"The `{field.name}` setting (read-only; see the class docstring).")


# Each setting reads through to the policy: the dataclass is the one list.
for _field in dataclasses.fields(LossScalePolicy):
    setattr(LossScaleOptimizer, _field.name, _policy_property(_field))
del _field
