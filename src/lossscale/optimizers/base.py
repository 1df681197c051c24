"""`Optimizer`: the base class every optimizer and the loss-scale wrapper share.

A subclass declares its hyperparameters as `__init__` arguments stored under
the same attribute names, creates its slots in `build`, and writes its update
rule once in `update_step`. `apply` (validate, build, run the step) lives
here; the step itself (`pipeline.py`), stateless application
(`stateless.py`), variable creation (`slots.py`), config (`config.py`),
saving (`state.py`), gradient checks (`gradients.py`) and the pipeline's
pieces (`clipping.py`, `weight_decay.py`, `ema.py`, `accumulation.py`) live
in the small modules it composes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from lossscale import validation
from lossscale.backends import get_ops
from lossscale.optimizers import ema, gradients
from lossscale.optimizers.checkpoint import CheckpointMixin
from lossscale.optimizers.config import ConfigMixin
from lossscale.optimizers.pipeline import PipelineMixin, hyper_type
from lossscale.optimizers.slots import SlotsMixin
from lossscale.optimizers.stateless import StatelessMixin
from lossscale.optimizers.weight_decay import WeightDecayExclusions
from lossscale.schedules.base import LearningRateSchedule
from lossscale.typing import Array, LearningRate
from lossscale.variables import Variable

# Accepted ranges of the base keyword arguments (all but `ema_momentum` may be None).
_BASE_BOUNDS = {
    "weight_decay": dict(low=0, allow_none=True),
    "clipnorm": dict(low=0, low_open=True, allow_none=True),
    "clipvalue": dict(low=0, low_open=True, allow_none=True),
    "global_clipnorm": dict(low=0, low_open=True, allow_none=True),
    "ema_momentum": dict(low=0, high=1),
    "ema_overwrite_frequency": dict(low=1, integer=True, allow_none=True),
    "loss_scale_factor": dict(low=0, low_open=True, allow_none=True),
    "gradient_accumulation_steps": dict(low=2, integer=True, allow_none=True),
}


# The base keyword arguments (not a rule's hyperparameters).
_BASE_KEYS = frozenset(_BASE_BOUNDS) | {"learning_rate", "use_ema", "name"}


def _snake_case(name):
    # Keras's naming: "LossScaleOptimizer" -> "loss_scale_optimizer",
    # "RMSprop" -> "rm_sprop", "SGD" -> "sgd".
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


class Optimizer(SlotsMixin, PipelineMixin, StatelessMixin, ConfigMixin, CheckpointMixin):
    """Abstract optimizer base class.

    Subclass it and override `build` (create slot variables with
    `add_optimizer_variables`), `update_step` (the update rule, written with
    `self.assign*` and the backend ops) and, only if needed, `get_config`.

    One `apply` runs, in this order: overwrite-with-gradient variables take
    their gradient; `None` gradients are dropped (with a warning); the static
    `loss_scale_factor` is divided out; with gradient accumulation, the mean
    of the accumulated gradients is used every `gradient_accumulation_steps`
    calls and other calls only accumulate; gradients are clipped; weight
    decay is applied; `update_step` runs per variable; variable constraints
    are applied; the EMA is updated (and written to the model every
    `ema_overwrite_frequency` steps); `iterations` increases by one.

    Args:
        learning_rate: A float, a `LearningRateSchedule`, or a callable taking
            no arguments and returning the learning rate.
        weight_decay: Float. If set, weight decay is applied.
        clipnorm: Float. If set, the gradient of each weight is individually
            clipped so that its norm is no higher than this value.
        clipvalue: Float. If set, the gradient of each weight is clipped to be
            no higher than this value.
        global_clipnorm: Float. If set, the gradient of all weights is clipped
            so that their global norm is no higher than this value.
        use_ema: Boolean, defaults to `False`. If `True`, an exponential
            moving average (EMA) of the model's weights is kept.
        ema_momentum: Float, defaults to 0.99. Only used if `use_ema=True`:
            `new_average = ema_momentum * old_average + (1 - ema_momentum) *
            current_variable_value`.
        ema_overwrite_frequency: Int or None. Only used if `use_ema=True`.
            Every `ema_overwrite_frequency` steps of iterations, the model
            variables are overwritten by their moving average. If None, call
            `finalize_variable_values()` at the end of training.
        loss_scale_factor: Float or `None`. If a float, `scale_loss`
            multiplies the loss by it and gradients are divided by it before
            updating variables.
        gradient_accumulation_steps: Int or `None`. If an int (>= 2), model
            and optimizer variables are updated every
            `gradient_accumulation_steps` steps with the average of the
            gradients since the last update.
        name: String. The name used for the optimizer's variables.

    Examples:
        >>> import numpy as np, lossscale as ls
        >>> w = ls.Variable(np.ones(2, np.float32), name="w")
        >>> opt = ls.optimizers.SGD(learning_rate=0.5)
        >>> opt.apply([np.array([1.0, -1.0], np.float32)], [w])
        >>> w.numpy()
        array([0.5, 1.5], dtype=float32)
    """

    # The loss-scale wrapper keeps no step counter or learning rate of its
    # own: both read through to the inner optimizer.
    _owns_step_state = True

    # The name of a backend kernel that reproduces this class's `update_step`
    # for all of its variables at once (multi-tensor or fused), or None. Only
    # the class that declares it gets the kernel: a subclass that changes the
    # rule takes the per-variable `update_step` unless it declares a name too.
    update_kernel: str | None = None

    def __init__(
        self,
        learning_rate: LearningRate,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("decay", None)  # Keras 2 argument, accepted and ignored like Keras 3.
        if kwargs:
            raise ValueError(
                f"Argument(s) not recognized by {type(self).__name__}: {sorted(kwargs)}. "
                f"Accepted: {sorted(self._config_keys())}"
            )
        if name is not None and not isinstance(name, str):
            raise ValueError(f"`name` must be a string or None. Received: name={name!r}")
        settings = dict(
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )
        for key, bounds in _BASE_BOUNDS.items():
            validation.check_number(key, settings[key], **bounds)
        validation.check_bool("use_ema", use_ema)
        if sum(a is not None for a in (clipnorm, clipvalue, global_clipnorm)) > 1:
            raise ValueError(
                "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set. "
                f"Received: clipnorm={clipnorm}, clipvalue={clipvalue}, "
                f"global_clipnorm={global_clipnorm}"
            )
        self.name = name or _snake_case(type(self).__name__)
        self.use_ema = use_ema
        for key, value in settings.items():
            setattr(self, key, value)
        self.built = False
        # The class's own `update_kernel` (not an inherited one), read once:
        # a compiled step reads a plain attribute, not the class namespace.
        self._kernel_name = type(self).__dict__.get("update_kernel")
        # What the kernel reads besides the step's arrays: the class's own
        # hyperparameters, as a frozen named tuple made each step, and a
        # dict the backend's kernels keep derived data in between steps
        # (tensor lists, scratch buffers, traced functions), which lives and
        # dies with this optimizer.
        self._hyper_type = hyper_type(type(self), _BASE_KEYS)
        self._kernel_cache = {}
        self._variables = []
        self._trainable_variables = []
        self._indices = {}
        self._wrappers = {}
        # `(arrays, variables)` of the last `apply` given arrays of its own:
        # the same arrays again resolve to the same variables.
        self._last_resolved = None
        self._exclusions = WeightDecayExclusions()
        if self._owns_step_state:
            self._iterations = self.add_variable(
                (), initializer=0, dtype="int32", aggregation="only_first_replica", name="iteration"
            )
            self._learning_rate = None
            self._set_learning_rate(learning_rate)

    # --- learning rate and iterations ------------------------------------
    def _set_learning_rate(self, learning_rate):
        if isinstance(learning_rate, LearningRateSchedule) or (
            callable(learning_rate) and not isinstance(learning_rate, Variable)
        ):
            if isinstance(self._learning_rate, Variable):
                self._variables.remove(self._learning_rate)
            self._learning_rate = learning_rate
            return
        validation.check_number("learning_rate", learning_rate, low=0)
        if isinstance(self._learning_rate, LearningRateSchedule):
            raise TypeError(
                "This optimizer was created with a `LearningRateSchedule` as its "
                "`learning_rate`, hence its learning rate is not settable. Create the "
                f"optimizer with a float `learning_rate` instead. Received: "
                f"learning_rate={learning_rate!r}"
            )
        if isinstance(self._learning_rate, Variable):
            self._learning_rate.assign(float(learning_rate))
            return
        self._learning_rate = self.add_variable(
            (),
            initializer=float(learning_rate),
            dtype="float32",
            aggregation="only_first_replica",
            name="learning_rate",
        )
        # Made after a callable was replaced: keep `iteration, learning_rate` first.
        self._variables.insert(1, self._variables.pop())

    @property
    def learning_rate(self) -> Array:
        """The current learning rate (a backend scalar)."""
        lr = self._learning_rate
        if isinstance(lr, LearningRateSchedule):
            return lr(self._iterations.value)
        if isinstance(lr, Variable):
            return lr.value
        return lr()

    @learning_rate.setter
    def learning_rate(self, learning_rate: LearningRate) -> None:
        self._set_learning_rate(learning_rate)

    @property
    def iterations(self) -> Variable | Array:
        """Optimizer steps taken (`raw steps // gradient_accumulation_steps`).

        The `Variable` itself without gradient accumulation, else an array.
        """
        if self.gradient_accumulation_steps:
            return self._steps_taken()
        return self._iterations

    def _steps_taken(self):
        """`iterations` as a backend array."""
        steps = self._iterations.value
        return (
            steps // self.gradient_accumulation_steps if self.gradient_accumulation_steps else steps
        )

    @iterations.setter
    def iterations(self, value: int) -> None:
        validation.check_number("iterations", int(value), low=0, integer=True)
        self._iterations.assign(int(value) * (self.gradient_accumulation_steps or 1))

    def build(self, var_list: Sequence[Variable | Array]) -> None:
        """Creates the optimizer's state for `var_list` (called by `apply`)."""
        var_list = self._as_variables(var_list, "var_list")
        if not var_list:
            raise ValueError("`var_list` must contain at least one variable. Received: var_list=[]")
        for v in var_list:
            if validation.dtype_kind(v.dtype) != "float":
                raise ValueError(
                    "`var_list` must hold real floating-point variables: the update rules "
                    "train neither integers, booleans nor complex numbers. Received: variable "
                    f"{v.path!r} of dtype {v.dtype}"
                )
        self._trainable_variables = var_list
        self._indices = {id(v): i for i, v in enumerate(var_list)}
        self._exclusions.decide(var_list)
        # Scalars made before the backend was known follow the model there.
        for v in self._variables:
            v.move_to(var_list[0].storage)
        if self.use_ema:
            self._model_variables_moving_average = self.add_optimizer_variables(var_list, "average")
        if self.gradient_accumulation_steps:
            self._accumulated_gradients = [
                self.add_variable_from_reference(v, "gradient_accumulator") for v in var_list
            ]
        self.built = True

    def update_step(self, gradient: Array, variable: Variable, learning_rate: Array) -> None:
        """Applies the update rule to one variable; subclasses implement it."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement `update_step(gradient, variable, "
            "learning_rate)`."
        )

    # --- applying -----------------------------------------------------------
    def apply_gradients(
        self, grads_and_vars: Iterable[tuple[Array | None, Variable | Array]]
    ) -> Variable | Array:
        """Applies `(gradient, variable)` pairs; returns `iterations`."""
        grads, variables = zip(*grads_and_vars)
        self.apply(list(grads), list(variables))
        return self.iterations

    def apply(
        self,
        grads: Sequence[Array | None],
        trainable_variables: Sequence[Variable | Array] | None = None,
    ) -> None:
        """Updates trainable variables according to the gradients.

        Args:
            grads: Gradients, one per variable (`None` for no gradient).
            trainable_variables: The variables (or native arrays, which are
                wrapped once without copying). Required on the first call,
                which builds the optimizer; afterwards defaults to the
                variables it was built with.
        """
        grads = list(grads)
        if not grads:
            return
        grads, variables = self._prepare(grads, trainable_variables)
        with self._ops.quiet():
            self._apply_validated(grads, variables)
        if not self._ops.MUTABLE:
            # JAX rebinds: a wrapped keras.Variable takes its new value.
            for v in variables:
                v.sync_to_source()

    def _prepare(self, grads, trainable_variables):
        """`apply`'s checks, before any write: `(grads, variables)`, built and checked.

        The gradients are `grads` itself, or a copy with sparse ones made
        dense (see `gradients.validate_gradients`).
        """
        variables, known = self._resolve_variables(grads, trainable_variables)
        grads = gradients.validate_gradients(grads, variables)
        if not self.built:
            self.build(variables)
        elif not known:
            self._check_known(variables)
        return grads, variables

    @property
    def _ops(self):
        if self._trainable_variables:
            return self._trainable_variables[0]._ops
        return get_ops("numpy")

    def _state_variables(self):
        """Everything an update may write: model variables, then optimizer state."""
        return self._trainable_variables + self.variables

    def finalize_variable_values(self, var_list: Sequence[Variable | Array]) -> None:
        """Writes the EMA into `var_list` when `use_ema=True`; otherwise does nothing."""
        if self.use_ema:
            ema.overwrite_with_averages(
                [self._as_variable(v) for v in var_list], self._model_variables_moving_average
            )

    def scale_loss(self, loss: Array) -> Array:
        """Multiplies `loss` by `loss_scale_factor` when it is set."""
        if self.loss_scale_factor is not None:
            return loss * self.loss_scale_factor
        return loss

    # --- copies: `copy.deepcopy` and `pickle` ---------------------------
    def __getstate__(self) -> dict[str, Any]:
        """The attributes a copy takes (`copy.deepcopy`, `pickle`).

        The copy holds copies of every variable (of the model's too, unless
        they are copied along, as torch's optimizers do). Made again by the
        copy instead: the lookups keyed by object identity (its objects are
        new), the kernels' derived data (it refers to this optimizer's
        arrays), the remembered arrays of the last `apply` and the named
        tuple type of the hyperparameters (made at run time).
        """
        state = dict(self.__dict__)
        for name in ("_hyper_type", "_kernel_cache", "_indices", "_last_resolved"):
            del state[name]
        state["_wrappers"] = list(self._wrappers.values())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        wrappers = state.pop("_wrappers")
        self.__dict__.update(state)
        self._hyper_type = hyper_type(type(self), _BASE_KEYS)
        self._kernel_cache = {}
        self._last_resolved = None
        self._indices = {id(v): i for i, v in enumerate(self._trainable_variables)}
        # Keyed as `_as_variable` keys them: the Keras variable, else the array.
        self._wrappers = {id(w.source if w.source is not None else w.storage): w for w in wrappers}

    def __repr__(self):
        return f"<{type(self).__name__} name={self.name!r} built={self.built}>"
