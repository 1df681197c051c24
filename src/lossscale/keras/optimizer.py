"""`lossscale.keras.LossScaleOptimizer`: Keras's wrapper, on lossscale's state machine."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from lossscale.backends import get_ops
from lossscale.keras import gates
from lossscale.mixed_precision import diagnosis, diagnostics, restored, step, telemetry
from lossscale.mixed_precision import state as state_layout
from lossscale.mixed_precision.loss_scale import LossScalePolicy

BACKENDS = ("tensorflow", "jax", "torch")
# The settings Keras's own wrapper has (the others are lossscale's extras).
_KERAS_SETTINGS = ("initial_scale", "dynamic_growth_steps")


@keras.saving.register_keras_serializable(package="lossscale")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """A `keras.optimizers.LossScaleOptimizer` whose scale follows lossscale's state machine.

    Keras takes it wherever it takes its own wrapper (`model.compile`, also
    under `"mixed_float16"`, `keras.optimizers.get` / `serialize` /
    `deserialize`, `.keras` files). With the default settings each step
    gives, bit for bit, Keras's weights, scale and counter, wherever Keras's
    scale stays finite and positive:

    ```
    grads = grads / scale                 # overwrite-with-gradient ones untouched
    if all(isfinite(grads)):              # checked after unscaling
        inner_optimizer.apply(grads)
        counter += 1; every dynamic_growth_steps finite steps:
            scale *= growth_factor        # not taken if it overflows float32
    else:                                 # skipped: no variable changes
        counter = 0
        scale = max(scale * backoff_factor, float32 tiny)  # never 0
    ```

    Where Keras's scale would reach `inf` or `0`, this one keeps training.
    The skip takes no host read on any backend, and under `tf.distribute`
    every replica takes the same decision.

    The other settings are those of `lossscale.LossScaleOptimizer` (all off
    by default). Past a fail-fast limit the state freezes and `check()`
    raises `LossScaleError`: an eager `apply` calls it after each step; in a
    compiled `fit`, `lossscale.keras.LossScaleLogger()` does after each batch.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` instance to wrap.
        initial_scale: Float. The initial loss scale.
        dynamic_growth_steps: Int. After this many consecutive steps with
            finite gradients, the scale grows by `growth_factor`.
        name: String. The name of the optimizer.
        growth_factor: Float > 1. Defaults to 2.
        backoff_factor: Float in (0, 1). Defaults to 0.5.
        hysteresis: Int >= 1. Overflowing steps in a row, each skipped,
            before the scale backs off. Defaults to 1.
        min_scale: Float or `None`. A backoff below it records an error.
        max_scale: Float or `None`. Growth stops here.
        max_consecutive_skips: Int or `None`. More skipped steps in a row
            record an error.
        growth_policy: `"fixed"` (default), `"headroom"` or
            `"statistics"` (with `diagnostics_every`).
        telemetry: Boolean. Record skip counters, the last scales and the
            overflow window (`summary()`).
        diagnostics_every: Int or `None`. Every this many steps, measure
            each scaled gradient against float16's range
            (`summary()["float16_range"]`).
        history_length: Int in [1, 30]. Scales and overflows kept.
        on_persistent: `"warn"` (default), `"raise"` or a callable taking
            the `summary()` dict: what to do the first time a step is
            skipped for a cause no back-off can clear (see
            `lossscale.LossScaleOptimizer`), at `check()` and `summary()`.
            `"raise"` and a callable turn `telemetry` on.
        **kwargs: Base optimizer arguments, accepted only at their defaults
            (as by Keras's wrapper): set them on the `inner_optimizer`.

    Examples:
        >>> import keras, lossscale.keras as lsk
        >>> optimizer = lsk.LossScaleOptimizer(keras.optimizers.SGD(0.1), telemetry=True)
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer=optimizer, loss="mse")
        >>> model.optimizer is optimizer
        True
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
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
        **kwargs: Any,
    ) -> None:
        arguments = dict(locals())  # first: holds exactly the named arguments
        settings = {f.name: arguments[f.name] for f in dataclasses.fields(LossScalePolicy)}
        # What a persistent skip triggers reads the overflow window.
        settings["telemetry"] = telemetry or diagnosis.check_on_persistent(on_persistent) != "warn"
        backend = keras.backend.backend()
        if backend not in BACKENDS:
            raise ValueError(
                f"lossscale.keras runs on Keras's {', '.join(BACKENDS)} backends. "
                f"Received: keras.backend.backend()={backend!r}"
            )
        _check_inner(inner_optimizer)
        # Checked before Keras makes any variable: bad input builds nothing.
        policy = LossScalePolicy(**settings)
        super().__init__(inner_optimizer, initial_scale, dynamic_growth_steps, name=name, **kwargs)
        self.policy = policy
        self._ops = get_ops(backend)
        self._host_steps = 0  # eager torch's diagnostics cadence, with no device read
        self._persistent = diagnosis.PersistentWatch(on_persistent)
        self._scale_use = diagnosis.ScaleUse(self.name, policy.initial_scale)

    # --- state ------------------------------------------------------------
    def build(self, var_list: Sequence[keras.Variable]) -> None:
        """Keras's `step_counter` and `dynamic_scale`, the extras' state, the inner optimizer."""
        if self.built:
            return
        super().build(var_list)
        specs = [
            spec
            for spec in state_layout.variable_specs(self.policy, [v.path for v in var_list])
            if spec[0] not in ("scale", "counter")  # Keras's own two
        ]
        self._state = {
            "scale": self.dynamic_scale,
            "counter": self.step_counter,
            **state_layout.holders_of(specs, self._state_variable),
        }

    def _state_variable(self, spec):
        _, name, dtype, initial, shape, _ = spec
        if dtype.startswith("int"):
            # Keras's "int" (int64 on TensorFlow): combined with the counter.
            dtype = self.step_counter.dtype
        return self.add_variable(
            shape=shape,
            dtype=dtype,
            initializer=keras.initializers.Constant(initial),
            aggregation="none",
            name=name,
        )

    def load_own_variables(self, store: dict) -> None:
        """Keras's load, its values checked first (`mixed_precision.restored`).

        A state no step could have left raises `ValueError` naming the
        entry, and nothing is loaded; the host's step count follows the load.
        """
        if len(store.keys()) == len(self.variables):  # else Keras warns and loads nothing
            fields = {id(self.inner_optimizer.iterations): "iteration"}
            for name, held in getattr(self, "_state", {}).items():
                for holder in held if isinstance(held, tuple) else (held,):
                    fields[id(holder)] = name
            for i, variable in enumerate(self.variables):
                field = fields.get(id(variable))
                found = field and restored.refusal(
                    field, f"store[{str(i)!r}]", np.asarray(store[str(i)]), self.policy
                )
                if found:
                    raise ValueError(found)
        super().load_own_variables(store)
        self._scale_use.changed()
        steps = getattr(self, "_state", {}).get("steps")
        if self.policy.diagnoses and steps is not None:
            self._host_steps = int(keras.ops.convert_to_numpy(steps.value))

    # --- one step -----------------------------------------------------------
    def scale_loss(self, loss: Any) -> Any:
        """Multiplies `loss` by the current scale; with telemetry, records whether it was finite.

        (Keras's JAX `fit` discards what this writes: there the loss is not recorded.)
        """
        if isinstance(loss, (str, bytes)):
            raise TypeError(
                f"`loss` must be a number or a tensor. Received: loss of type {type(loss).__name__}"
            )
        if self.built and self.policy.records_details:
            finite = keras.ops.all(keras.ops.isfinite(loss))
            flag = self._state["loss_finite"]
            flag.assign(keras.ops.cast(finite, flag.dtype))
        scaled = super().scale_loss(loss)
        self._scale_use.scaled(loss, scaled, identity=_executing_eagerly(self._ops.NAME, scaled))
        return scaled

    def apply(
        self,
        grads: Sequence[Any],
        trainable_variables: Sequence[keras.Variable] | None = None,
    ) -> None:
        """Applies the unscaled gradients unless they overflow; adapts the scale.

        With `min_scale` or `max_consecutive_skips` set, an eager call raises
        `LossScaleError` when the state records a failure (see `check`).
        """
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        grads = list(grads)
        variables = list(
            trainable_variables if trainable_variables is not None else self._trainable_variables
        )
        _check_gradients(grads, variables)  # before anything is written
        eager = _executing_eagerly(self._ops.NAME, self.dynamic_scale.value)
        if eager:
            self._scale_use.unscaling()
        if self._ops.NAME == "jax":  # immutable arrays: the stateless step, then writes
            new_trainable, new_optimizer = self.stateless_apply(
                [v.value for v in self.variables], grads, [v.value for v in variables]
            )
            for v, x in zip([*variables, *self.variables], [*new_trainable, *new_optimizer]):
                v.assign(x)
        else:
            self._stateful_step(grads, variables, trainable_variables)
        if eager:
            self.check()

    def _stateful_step(self, grads, variables, trainable_variables):
        ops, inner = self._ops, self.inner_optimizer
        state = state_layout.read(self._state, state_layout.value_of)

        def inner_step(decision):
            gates.run_stateful(
                ops.NAME,
                decision.keep,
                lambda grads: inner.apply(grads, trainable_variables=trainable_variables),
                decision.grads,
                [*inner.variables, *variables],
            )

        new, _ = step.run(
            ops,
            self.policy,
            state,
            self._gradients(grads, variables),
            inner_step,
            due=self._due(state, host=ops.host_control()),
        )
        state_layout.write_back(ops, self._state, state, new, state_layout.value_of)

    def stateless_apply(
        self,
        optimizer_variables: Sequence[Any],
        grads: Sequence[Any],
        trainable_variables: Sequence[Any],
    ) -> tuple[list, list]:
        """The step on values: returns `(new trainable values, new optimizer values)`.

        Mutates nothing and never raises for a crossed limit (see `check`).
        """
        if not self.built:
            raise ValueError(
                f"To call `stateless_apply`, {type(self).__name__} must be built (its "
                "variables created): call `optimizer.build(trainable_variables)` first."
            )
        ops = self._ops
        optimizer_variables = list(optimizer_variables)
        read = state_layout.reader(self.variables, optimizer_variables)
        grads = list(grads)
        _check_gradients(grads, self._trainable_variables)
        state = state_layout.read(self._state, read)
        inner_values = optimizer_variables[len(self._variables) :]
        trainable = list(trainable_variables)

        def inner_step(decision):
            def applied():
                new_trainable, new_inner = self.inner_optimizer.stateless_apply(
                    inner_values, decision.grads, trainable
                )
                return list(new_trainable), list(new_inner)

            return gates.run_stateless(
                ops.NAME, decision.keep, applied, lambda: (trainable, inner_values)
            )

        new, (new_trainable, new_inner) = step.run(
            ops,
            self.policy,
            state,
            self._gradients(list(grads), self._trainable_variables),
            inner_step,
            due=self._due(state, host=False),
        )
        holders = dict(state_layout.flatten(self._state))
        written = {id(holders[key]): value for key, value in state_layout.flatten(new)}
        given = {id(x) for x in optimizer_variables}
        mine = []
        for v in self._variables:
            value = written.get(id(v), read(v))
            if ops.MUTABLE and id(value) in given and value is not read(v):
                value = ops.copy(value)  # another's given value: the caller writes that one
            mine.append(ops.cast(value, v.dtype) if id(v) in written else value)
        return list(new_trainable), mine + list(new_inner)

    def _gradients(self, grads, variables):
        """The step's `step.Gradients`: divided but for overwrite-with-gradient ones, copies."""
        return step.Gradients(
            grads,
            divided=[
                g is not None and not self._overwrite_variable_with_gradient(v)
                for g, v in zip(grads, variables)
            ],
            index_of=lambda i: self._get_variable_index(variables[i]),
            variable_count=len(self._trainable_variables),
            unscale="copy",
        )

    def _due(self, state, host):
        """Whether this step measures (None: no diagnostics), by the host's count or the state's."""
        policy = self.policy
        if not policy.diagnoses:
            return None
        if host:
            due = self._host_steps % policy.diagnostics_every == 0
            self._host_steps += 1
            return due
        return diagnostics.due(policy, state.steps)

    # --- on the host: summaries and the fail-fast check ----------------------
    def summary(self, optimizer_variables: Sequence[Any] | None = None) -> dict[str, Any]:
        """The loss-scale state as a dict of Python values, for loggers (reads the device).

        The keys of `lossscale.LossScaleOptimizer.summary()`.

        Args:
            optimizer_variables: Optional values for `optimizer.variables`
                (as `stateless_apply` takes and returns them). Defaults to
                the optimizer's own variables.
        """
        state = state_layout.read(
            self._state, state_layout.reader(self.variables, optimizer_variables)
        )
        paths = [v.path for v in self._trainable_variables]
        out = telemetry.state_summary(self._ops, state, self.policy, paths)
        if self._persistent.on_persistent == "warn":
            self._persistent.notice(out.get("persistent_step"), lambda: out, len(paths))
        return out

    def check(self, optimizer_variables: Sequence[Any] | None = None) -> None:
        """Raises `LossScaleError` if the state records a crossed limit (see the class docstring).

        Args:
            optimizer_variables: Optional values for `optimizer.variables`.
        """
        read = state_layout.reader(self.variables, optimizer_variables)
        diagnosis.check_state(
            self._ops,
            self.policy,
            self._persistent,
            lambda name: read(self._state[name]),
            lambda: self.summary(optimizer_variables),
            len(self._trainable_variables),
        )

    # --- configuration ----------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """Keras's keys, plus each other setting not at its default."""
        config = super().get_config()
        config.update(self.policy.non_default_settings())
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: dict | None = None):
        """Rebuilds the wrapper and its inner optimizer; leaves `config` as it was."""
        return super().from_config(dict(config), custom_objects=custom_objects)


def _policy_property(field):
    def read(self):
        return getattr(self.policy, field.name)

    def write(self, value):
        if "policy" not in vars(self):
            return  # Keras's constructor, before the policy (holding this value) is set
        self.policy = dataclasses.replace(self.policy, **{field.name: value})

    return property(
        read,
        write if field.name in _KERAS_SETTINGS else None,
        doc=f"The `{field.name}` setting (see the class docstring).",
    )


for _field in dataclasses.fields(LossScalePolicy):
    setattr(LossScaleOptimizer, _field.name, _policy_property(_field))
del _field


def _check_inner(inner):
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` is already a LossScaleOptimizer: wrapping it again would scale "
            "the loss twice. Pass its inner optimizer, or use it as it is. Received: "
            f"inner_optimizer={inner!r}"
        )
    if type(inner).__module__.startswith("lossscale."):
        raise ValueError(
            "`inner_optimizer` must be a Keras optimizer; lossscale's own optimizers run "
            "outside `model.fit` (use keras.optimizers.Adam and the like here). Received: "
            f"inner_optimizer={inner!r}"
        )
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise ValueError(
            "`inner_optimizer` must be a keras.optimizers.Optimizer instance, such as "
            f"keras.optimizers.Adam(). Received: inner_optimizer={inner!r}"
        )


def _check_gradients(grads, variables):
    """Refuses gradients that do not fit the variables (count, shape, float dtype)."""
    if len(grads) != len(variables):
        raise ValueError(
            "`grads` must match the trainable variables one to one. Received: "
            f"{len(grads)} gradients for {len(variables)} variables"
        )
    for g, v in zip(grads, variables):
        if g is None or hasattr(g, "dense_shape"):  # (a sparse one is the variable's by making)
            continue
        shape = tuple(None if d is None else int(d) for d in g.shape)
        wanted = tuple(v.shape)
        if len(shape) != len(wanted) or any(
            d is not None and d != w for d, w in zip(shape, wanted)
        ):
            raise ValueError(
                f"The gradient for variable {v.path!r} must have the variable's shape "
                f"{wanted}. Received: gradient shape {shape}"
            )
        dtype = keras.backend.standardize_dtype(g.dtype)
        if not keras.backend.is_float_dtype(dtype):
            raise ValueError(
                f"The gradient for variable {v.path!r} must have a floating-point dtype. "
                f"Received: gradient dtype {dtype}"
            )


def _executing_eagerly(backend, value):
    """Whether a host read may run here: not in a graph, a compiled region or a trace."""
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly()
    if backend == "torch":
        import torch

        return not torch.compiler.is_compiling()
    import jax

    return not isinstance(value, jax.core.Tracer)
