"""`Optimizer`: the base class every optimizer and the loss-scale wrapper share.

A subclass stores its hyperparameters under their `__init__` argument names,
creates its slots in `build` and writes its rule in `update_step`.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any, TypeVar, overload

from lossscale import validation
from lossscale.backends import _common, common_backend, get_ops
from lossscale.optimizers import (
    accumulation,
    checkpoint,
    clipping,
    config,
    ema,
    gradients,
    overwrite,
    pipeline,
)
from lossscale.optimizers.plan import StepPlan, step_plan
from lossscale.optimizers.weight_decay import WeightDecayExclusions, apply_weight_decay
from lossscale.schedules.base import LearningRateSchedule
from lossscale.typing import Array, Config, Initializer, LearningRate, Shape
from lossscale.variables import Variable, is_keras_variable

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
_OptimizerT = TypeVar("_OptimizerT", bound="Optimizer")


def _snake_case(name):
    """Keras's naming: "LossScaleOptimizer" -> "loss_scale_optimizer", "RMSprop" -> "rm_sprop"."""
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


class Optimizer:
    """Abstract optimizer base class.

    Subclasses create slots in `build` (`add_optimizer_variables`) and write
    the rule in `update_step`. Each `apply`: overwrite-with-gradient variables
    take their gradient, `None` gradients are dropped, `loss_scale_factor` is
    divided out, gradients are accumulated, clipped and decayed, `update_step`
    runs, constraints and the EMA are applied, and `iterations` grows by one.

    Args:
        learning_rate: A float, a `LearningRateSchedule`, or a callable returning it.
        weight_decay: Float. If set, weight decay is applied.
        clipnorm: Float. If set, each gradient is clipped to this norm.
        clipvalue: Float. If set, each gradient is clipped elementwise to this value.
        global_clipnorm: Float. If set, all gradients are clipped to this global norm.
        use_ema: Boolean, defaults to `False`. Whether to keep an EMA of the weights.
        ema_momentum: Float, defaults to 0.99. The EMA's momentum.
        ema_overwrite_frequency: Int or None. With `use_ema`, the model
            variables take their average every this many steps; if None,
            call `finalize_variable_values()` at the end of training.
        loss_scale_factor: Float or `None`. `scale_loss` multiplies the loss
            by it and gradients are divided by it.
        gradient_accumulation_steps: Int (>= 2) or `None`. Update every this
            many steps with the mean of the gradients since the last update.
        name: String. The name used for the optimizer's variables.

    Examples:
        >>> import numpy as np, lossscale as ls
        >>> w = ls.Variable(np.ones(2, np.float32), name="w")
        >>> opt = ls.optimizers.SGD(learning_rate=0.5)
        >>> opt.apply([np.array([1.0, -1.0], np.float32)], [w])
        >>> w.numpy()
        array([0.5, 1.5], dtype=float32)
    """

    # False for the loss-scale wrapper: step count and learning rate are its inner optimizer's.
    _owns_step_state = True
    # The backend kernel equal to `update_step`; not inherited (a subclass may change the rule).
    update_kernel: str | None = None
    # Slot-list attributes the kernel gets as `slots`, keyed without the leading "_".
    kernel_slots: tuple = ()
    # Attributes besides the constructor arguments the kernel reads as hyperparameters.
    kernel_hyperparameters: tuple = ()

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
        arguments = locals()  # first: holds exactly the arguments
        kwargs.pop("decay", None)  # Keras 2 argument, accepted and ignored like Keras 3.
        if kwargs:
            raise ValueError(
                f"Argument(s) not recognized by {type(self).__name__}: {sorted(kwargs)}. "
                f"Accepted: {sorted(self._config_keys())}"
            )
        if name is not None and not isinstance(name, str):
            raise ValueError(f"`name` must be a string or None. Received: name={name!r}")
        settings = {key: arguments[key] for key in _BASE_BOUNDS}
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
        # Read once: a compiled step reads a plain attribute, not the class namespace.
        self._kernel_name = type(self).__dict__.get("update_kernel")
        self._hyper_type = pipeline.hyper_type(type(self), _BASE_KEYS)
        self._kernel_cache = {}  # the kernels' data between steps (tensor lists, buffers)
        self._variables = []
        self._trainable_variables = []
        self._indices = {}
        self._wrappers = {}
        self._last_resolved = None  # `(arrays, variables)` of the last `apply`
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
        """Steps taken: the `Variable`, or `raw steps // gradient_accumulation_steps`."""
        return self._steps_taken() if self.gradient_accumulation_steps else self._iterations

    @iterations.setter
    def iterations(self, value: int) -> None:
        validation.check_number("iterations", int(value), low=0, integer=True)
        self._iterations.assign(int(value) * (self.gradient_accumulation_steps or 1))

    def _steps_taken(self):
        """`iterations` as a backend array."""
        steps, every = self._iterations.value, self.gradient_accumulation_steps
        return steps // every if every else steps

    @property
    def variables(self) -> list[Variable]:
        """Every variable holding this optimizer's state, in creation order."""
        return self._variables[:]

    # --- building: the optimizer's variables -------------------------------
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

    def add_variable(
        self,
        shape: Shape,
        initializer: Initializer = "zeros",
        dtype: str | None = None,
        aggregation: str | None = "none",
        layout: Any = None,
        name: str | None = None,
    ) -> Variable:
        """Adds a (non-trainable) variable to the optimizer.

        Args:
            shape: Shape tuple for the variable.
            initializer: `"zeros"` (default), `"ones"`, a number or a callable.
            dtype: Dtype of the variable. Defaults to `"float32"`.
            aggregation: How replicas combine it (see `Variable`). Defaults to `"none"`.
            layout: Optional tensor layout; stored for sharding-aware users.
            name: String name of the variable.

        Returns:
            The new `Variable`, on the model's backend and device (NumPy before `build`).
        """
        # The storage itself: a TensorFlow slot follows a mirrored variable into its strategy.
        like = self._trainable_variables[0].storage if self._trainable_variables else None
        variable = Variable(
            initializer,
            shape=shape,
            dtype=dtype,
            trainable=False,
            name=name,
            aggregation=aggregation,
            like=like,
        )
        variable.path = f"{self.name}/{variable.name}"
        variable.layout = layout
        self._variables.append(variable)
        return variable

    def add_variable_from_reference(
        self,
        reference_variable: Variable | Array,
        name: str | None = None,
        initializer: Initializer = "zeros",
    ) -> Variable:
        """Adds a variable named `{reference path with "/" as "_"}_{name or "var"}`.

        Returns:
            The new `Variable`, with the reference's shape, dtype and device.
        """
        reference = self._as_variable(reference_variable)
        full_name = f"{reference.path.replace('/', '_')}_{name or 'var'}"
        variable = Variable(
            initializer,
            shape=reference.shape,
            dtype=reference.dtype,
            trainable=False,
            name=full_name,
            like=reference.storage,
        )
        variable.path = f"{self.name}/{full_name}"
        self._variables.append(variable)
        return variable

    @overload
    def add_optimizer_variables(
        self,
        trainable_variables: Sequence[Variable | Array],
        name: str,
        initializer: Initializer = "zeros",
    ) -> list[Variable | None]: ...

    @overload
    def add_optimizer_variables(
        self,
        trainable_variables: Sequence[Variable | Array],
        name: Sequence[str],
        initializer: Initializer | Sequence[Initializer] = "zeros",
    ) -> tuple[list[Variable | None], ...]: ...

    def add_optimizer_variables(
        self,
        trainable_variables: Sequence[Variable | Array],
        name: str | Sequence[str],
        initializer: Initializer | Sequence[Initializer] = "zeros",
    ) -> list[Variable | None] | tuple[list[Variable | None], ...]:
        """Adds one slot variable per trainable variable, for one or several names.

        Overwrite-with-gradient variables get `None` instead of a slot.

        Args:
            trainable_variables: The model variables.
            name: A name prefix, or a list of them (one slot per name).
            initializer: One initializer for all names, or one per name.

        Returns:
            A list of variables for a single name, else a tuple of lists.
        """
        names = [name] if isinstance(name, str) else list(name)
        inits = (
            list(initializer)
            if isinstance(initializer, (list, tuple))
            else [initializer] * len(names)
        )
        if len(names) != len(inits):
            raise ValueError(
                "The number of provided names must match the number of provided "
                f"initializers. Received: name={name!r}, initializer={initializer!r}"
            )
        slots = tuple([] for _ in names)
        for variable in map(self._as_variable, trainable_variables):
            for slot, n, init in zip(slots, names, inits):
                slot.append(
                    None
                    if variable.overwrite_with_gradient
                    else self.add_variable_from_reference(variable, n, init)
                )
        return slots[0] if isinstance(name, str) else slots

    def exclude_from_weight_decay(
        self,
        var_list: Sequence[Variable | Array] | None = None,
        var_names: Sequence[str] | None = None,
    ) -> None:
        """Excludes variables from weight decay (call before `build`).

        Args:
            var_list: A list of variables to exclude.
            var_names: A list of strings; a variable whose name contains any
                of them is excluded (e.g. `["bias"]`).
        """
        if self.built:
            raise ValueError(
                "`exclude_from_weight_decay()` can only be configured before the optimizer "
                "is built."
            )
        self._exclusions = WeightDecayExclusions(
            [self._as_variable(v) for v in var_list or ()], var_names
        )

    def _get_variable_index(self, variable):
        return self._indices[id(variable)]

    def _as_variable(self, x):
        """Wraps a native array once (cached by identity); Variables pass through."""
        if isinstance(x, Variable):
            return x
        wrapped = self._wrappers.get(id(x))
        if wrapped is not None:
            if wrapped.storage is x:  # a raw array wrapped before: every step's case
                return wrapped
            if wrapped.source is x:  # a keras.Variable, maybe assigned since (JAX)
                wrapped.sync_from_source()
                return wrapped
        # A keras.Variable keeps its own name and path; a raw array gets one.
        name = None if is_keras_variable(x) else f"param_{len(self._wrappers)}"
        wrapped = Variable(x, name=name)
        self._wrappers[id(x)] = wrapped
        return wrapped

    def _as_variables(self, xs, argname="trainable_variables"):
        variables = [self._as_variable(x) for x in xs]
        # One module per backend: the cheap check; `common_backend` names the two found.
        ops = variables[0]._ops if variables else None
        if any(v._ops is not ops for v in variables):
            common_backend(variables, what=f"`{argname}`")
        return variables

    # --- one step ------------------------------------------------------------
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
            trainable_variables: The variables (or native arrays). Required on
                the first call, which builds the optimizer.
        """
        grads = list(grads)
        if not grads:
            return
        grads, variables = self._prepare(grads, trainable_variables)
        with self._ops.quiet():
            self._apply_prepared(grads, variables, owns_grads=True)
        if not self._ops.MUTABLE:
            # JAX rebinds: a wrapped keras.Variable takes its new value.
            for v in variables:
                v.sync_to_source()

    def stateless_apply(
        self,
        optimizer_variables: Sequence[Array],
        grads: Sequence[Array | None],
        trainable_variables: Sequence[Array],
    ) -> tuple[list[Array], list[Array]]:
        """Runs `apply` on the given values and returns the new ones, changing no variable.

        Args:
            optimizer_variables: Values for `optimizer.variables`, in order.
            grads: Gradients to apply.
            trainable_variables: Values for the model variables, in order.

        Returns:
            A tuple `(new_trainable_values, new_optimizer_values)`.
        """
        if not self.built:
            raise ValueError(
                f"To call `stateless_apply`, {type(self).__name__} must be built (i.e. its "
                "variables must have been created). Call `optimizer.build(trainable_variables)`."
            )
        own, model = self.variables, self._trainable_variables
        optimizer_variables = list(optimizer_variables)
        trainable_variables = list(trainable_variables)
        gradients.check_values("optimizer_variables", optimizer_variables, own)
        gradients.check_values("trainable_variables", trainable_variables, model)
        grads = list(grads)
        self._resolve_variables(grads, None)
        grads = gradients.validate_gradients(grads, model)
        ops = self._ops
        # Bound to copies where writes happen in place: nothing the caller passed is written.
        values = [
            ops.copy(x) if ops.MUTABLE else x for x in trainable_variables + optimizer_variables
        ]
        with _common.bound(model + own, values), ops.quiet():
            self._apply_prepared(grads, model, owns_grads=False)
            return [v.value for v in model], [v.value for v in own]

    def update_step(self, gradient: Array, variable: Variable, learning_rate: Array) -> None:
        """Applies the update rule to one variable; subclasses implement it."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement `update_step(gradient, variable, "
            "learning_rate)`."
        )

    def _cast_step(self, variable, learning_rate, gradient):
        """`(ops, learning_rate, gradient)` for `update_step`, cast to `variable`'s dtype."""
        ops, dtype = self._ops, variable.dtype
        return ops, ops.cast(learning_rate, dtype), ops.cast(gradient, dtype)

    def _prepare(self, grads, trainable_variables):
        """`apply`'s checks, before any write: `(grads, variables)`, built and checked."""
        variables, known = self._resolve_variables(grads, trainable_variables)
        grads = gradients.validate_gradients(grads, variables)
        if not self.built:
            self.build(variables)
        elif not known:
            for v in variables:
                if id(v) not in self._indices:
                    raise ValueError(
                        f"Unknown variable: {v.path!r}. This optimizer can only be called for "
                        "the variables it was built with; create a new optimizer for new "
                        "variables."
                    )
        return grads, variables

    def _resolve_variables(self, grads, trainable_variables):
        """`(variables, known)`: `known` when all are ones the optimizer was built with.

        Only unknown variables get the backend check: under `torch.compile` each
        `_ops` read would be a guard on every call.
        """
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `trainable_variables`, the optimizer must "
                    "already be built. Call `optimizer.build(trainable_variables)` first or "
                    "pass `trainable_variables`. Received: trainable_variables=None"
                )
            variables, known = self._trainable_variables, True
        elif trainable_variables is self._trainable_variables:  # its own list: nothing to resolve
            variables, known = trainable_variables, True
        else:
            if not isinstance(trainable_variables, (list, tuple)):
                trainable_variables = list(trainable_variables)  # a generator, say
            # Remembered only where Python runs every step (a traced read is a
            # guard), and never for a keras.Variable, which `_as_variable` syncs.
            eager = self.built and self._ops.host_control()
            last = self._last_resolved if eager else None
            if last is not None and _same_objects(trainable_variables, last[0]):
                variables, known = last[1], True  # every step's case
            else:
                variables = [self._as_variable(x) for x in trainable_variables]
                known = self.built and all(id(v) in self._indices for v in variables)
                if not known:
                    variables = self._as_variables(variables)  # Variables pass through
                elif eager and all(v.source is None for v in variables):
                    self._last_resolved = (tuple(trainable_variables), variables)
        if len(grads) != len(variables):
            raise ValueError(
                "`grads` must match the trainable variables one to one. Received: "
                f"{len(grads)} gradients for {len(variables)} variables"
            )
        return variables, known

    def _apply_prepared(self, grads, variables, *, owns_grads):
        """One step on checked input; wrappers override it (`owns_grads`: may write grads)."""
        del owns_grads  # the rules never write the gradients
        self._step(grads, variables)

    def _step(self, grads, variables, keep=None, grad_scale=None, found_inf=None):
        """One step on validated input: the contract wrappers call.

        `keep`: None, or a backend boolean the step takes effect under (passed to
        the kernels where the plan folds it, else `ops.cond`). `grad_scale`: a
        scale still in `grads`, where the plan `takes_grad_scale`. `found_inf`:
        `keep` in torch's AMP form (1.0 where skipped), for kernels that take it.
        """
        plan = self._step_plan(variables)
        if keep is not None and not plan.folds_keep:
            self._ops.cond(
                keep,
                lambda: self._run_step(grads, variables, plan, grad_scale),
                None,
                self._state_variables(),
            )
            return
        self._run_step(grads, variables, plan, grad_scale, keep, found_inf)

    def _step_plan(self, variables: Sequence[Variable]) -> StepPlan:
        """The fast paths this step may take (`plan.step_plan`)."""
        ops = self._ops
        return step_plan(
            self._fused_kernel(),
            variables,
            weight_decay=self.weight_decay,
            weight_decay_kernel=(None if self.weight_decay is None else ops.fused_weight_decay()),
            loss_scale_factor=self.loss_scale_factor,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            clips=(
                self.clipnorm is not None
                or self.clipvalue is not None
                or self.global_clipnorm is not None
            ),
            use_ema=self.use_ema,
        )

    def _fused_kernel(self):
        """The backend's kernel for this exact class's `update_kernel`, or None."""
        return self._ops.fused_update(self._kernel_name)

    def _run_step(self, grads, variables, plan, grad_scale=None, keep=None, found_inf=None):
        """The step, in the order of `pipeline`'s docstring."""
        ops = self._ops
        grads, variables = overwrite.take_gradients(
            ops, grads, variables, self._overwrite_accumulation()
        )
        grads, variables = gradients.drop_missing(grads, variables)
        if grads:
            if self.loss_scale_factor is not None:
                grads = [g / self.loss_scale_factor for g in grads]
            if self.gradient_accumulation_steps:
                self._accumulate_or_update(ops, grads, variables, plan)
            else:
                self._update(ops, grads, variables, plan, grad_scale, keep, found_inf)
            for v in variables:
                if v.constraint is not None:
                    v.assign(v.constraint(v.value))
            if self.use_ema:
                self._update_ema(ops)
        # A boolean adds as 0 or 1 (on torch one kernel).
        self._iterations.assign_add(1 if keep is None else keep)

    def _overwrite_accumulation(self):
        """`(accumulator_of, is_update)` for overwrite-with-gradient variables, or None."""
        steps = self.gradient_accumulation_steps
        if not steps:
            return None
        return (
            lambda v: self._accumulated_gradients[self._get_variable_index(v)],
            lambda: accumulation.is_update_step(self._iterations.value, steps),
        )

    def _update(self, ops, grads, variables, plan, grad_scale=None, keep=None, found_inf=None):
        """Clip, decay, then the rule: the update of one step's gradients."""
        grads = clipping.clip_gradients(
            ops, grads, self.clipnorm, self.clipvalue, self.global_clipnorm
        )
        learning_rate = self.learning_rate
        rest = (learning_rate, grad_scale, keep, found_inf)
        if self.weight_decay is None:
            self._update_variables(grads, variables, *rest)
            return
        if plan.folds_weight_decay:
            # The kernel decays as it updates: decayed and excluded ones in separate calls.
            for positions, rate in pipeline.decayed_groups(
                variables, self.weight_decay, self._exclusions
            ):
                if positions is None:
                    self._update_variables(grads, variables, *rest, weight_decay=rate)
                else:
                    part_grads = [grads[i] for i in positions]
                    part = [variables[i] for i in positions]
                    self._update_variables(part_grads, part, *rest, weight_decay=rate)
            return
        apply_weight_decay(
            ops,
            variables,
            self.weight_decay,
            learning_rate,
            self._exclusions,
            self._kernel_cache,
            keep,
        )
        self._update_variables(grads, variables, *rest)

    def _update_variables(
        self,
        grads,
        variables,
        learning_rate,
        grad_scale=None,
        keep=None,
        found_inf=None,
        weight_decay=None,
    ):
        """Runs the update rule on every one of `variables` (`pipeline.run_rule`)."""
        kernel = self._fused_kernel()
        pipeline.run_rule(
            kernel,
            self.update_step,
            grads,
            variables,
            self._kernel_slots(variables) if kernel is not None else None,
            self._hyper_type(*(getattr(self, k) for k in self._hyper_type._fields)),
            iterations=self.iterations,
            learning_rate=learning_rate,
            cache=self._kernel_cache,
            grad_scale=grad_scale,
            keep=keep,
            found_inf=found_inf,
            weight_decay=weight_decay,
        )

    def _kernel_slot_lists(self):
        """`{slot name: list aligned with the trainable variables}` for the kernel."""
        return {k.lstrip("_"): getattr(self, k) for k in self.kernel_slots if getattr(self, k, 0)}

    def _kernel_slots(self, variables):
        """The slot lists, aligned with `variables` (all of them, or some in any order)."""
        lists = self._kernel_slot_lists()
        if _same_objects(variables, self._trainable_variables):
            return lists
        positions = [self._get_variable_index(v) for v in variables]
        return {name: [slots[i] for i in positions] for name, slots in lists.items()}

    def _accumulate_or_update(self, ops, grads, variables, plan):
        steps = self.gradient_accumulation_steps
        accumulators = [self._accumulated_gradients[self._get_variable_index(v)] for v in variables]

        def update():
            self._update(
                ops, accumulation.mean_with_accumulated(grads, accumulators, steps), variables, plan
            )
            # Every window ends, as in Keras: a partial sum without a gradient now is dropped.
            accumulation.reset(ops, self._accumulated_gradients)

        ops.cond(
            accumulation.is_update_step(self._iterations.value, steps),
            update,
            lambda: accumulation.accumulate(grads, accumulators),
            self._state_variables(),
        )

    def _update_ema(self, ops):
        iterations = self._steps_taken()
        ema.update_moving_averages(
            ops,
            self._model_variables_moving_average,
            self._trainable_variables,
            self.ema_momentum,
            iterations == 0,
        )
        if self.ema_overwrite_frequency:
            ops.cond(
                (iterations + 1) % self.ema_overwrite_frequency == 0,
                lambda: ema.overwrite_with_averages(
                    self._trainable_variables, self._model_variables_moving_average
                ),
                lambda: None,
                self._state_variables(),
            )

    @property
    def _ops(self):
        return self._trainable_variables[0]._ops if self._trainable_variables else get_ops("numpy")

    def _state_variables(self):
        """Everything an update may write: model variables, then optimizer state."""
        return self._trainable_variables + self.variables

    # --- what update rules write through -------------------------------------
    def assign(self, variable: Variable | Array, value: Array) -> None:
        """Assigns `value` to `variable` (a `Variable` or a mutable native array)."""
        self._assign("assign", variable, value)

    def assign_add(self, variable: Variable | Array, value: Array) -> None:
        """Adds `value` to `variable`."""
        self._assign("assign_add", variable, value)

    def assign_sub(self, variable: Variable | Array, value: Array) -> None:
        """Subtracts `value` from `variable`."""
        self._assign("assign_sub", variable, value)

    @staticmethod
    def _assign(method, variable, value):
        if isinstance(variable, Variable):
            getattr(variable, method)(value)
            return
        ops = get_ops(common_backend([variable]))
        if not ops.MUTABLE:
            raise TypeError(
                f"`variable` must be a lossscale.Variable on the {ops.NAME} backend, whose arrays "
                f"are immutable. Received: variable of type {type(variable).__name__}"
            )
        getattr(ops, method)(variable, value)

    # --- around the step -------------------------------------------------------
    def finalize_variable_values(self, var_list: Sequence[Variable | Array]) -> None:
        """Writes the EMA into `var_list` when `use_ema=True`; otherwise does nothing."""
        if self.use_ema:
            ema.overwrite_with_averages(
                [self._as_variable(v) for v in var_list], self._model_variables_moving_average
            )

    def scale_loss(self, loss: Array) -> Array:
        """Multiplies `loss` by `loss_scale_factor` when it is set."""
        return loss if self.loss_scale_factor is None else loss * self.loss_scale_factor

    # --- configuration ---------------------------------------------------------
    @classmethod
    def _config_keys(cls):
        """Every named constructor argument along the class hierarchy."""
        return config.config_keys(cls)

    def get_config(self) -> Config:
        """Returns the optimizer's config: every constructor argument, by name."""
        return config.config_of(self, self._learning_rate)

    @classmethod
    def from_config(
        cls: type[_OptimizerT], config: Config, custom_objects: dict[str, Any] | None = None
    ) -> _OptimizerT:
        """Creates an optimizer from its config (the reverse of `get_config`).

        Args:
            config: A Python dictionary, typically the output of `get_config`.
            custom_objects: Names of user-defined classes or functions it needs.

        Returns:
            An optimizer instance.
        """
        from lossscale.optimizers import config as configs

        return configs.from_config(cls, config, custom_objects)

    # --- saving and loading ------------------------------------------------------
    def save_own_variables(self, store: MutableMapping[str, Array]) -> None:
        """Writes a NumPy copy of every variable to `store["0"]`, `store["1"]`, ..."""
        checkpoint.save(self.variables, store)

    def load_own_variables(self, store: Mapping[str, Array]) -> None:
        """Copies the values of a store written by `save_own_variables` into the variables.

        A store with another number of variables only warns; a shape mismatch
        raises before anything is written.
        """
        checkpoint.load(
            self.name, self.built, self.variables, store, self._restored_fields(), self._policy()
        )

    def set_weights(self, weights: Sequence[Array]) -> None:
        """Sets every optimizer variable from a list of arrays, in `variables` order."""
        if not self.built:
            raise ValueError(
                "You are calling `set_weights()` on an optimizer that has not yet been built. "
                "Call `optimizer.build(trainable_variables)` first."
            )
        checkpoint.set_values(self.variables, weights, self._restored_fields(), self._policy())

    def state_dict(self) -> dict[str, Any]:
        """Returns the optimizer's state in the form torch optimizers use.

        ```
        {
            "state": {0: {"momentum": m0, "velocity": v0}, 1: {...}, ...},
            "param_groups": [{"params": [0, 1, ...], "beta_1": 0.9, ...}],
            "optimizer_variables": {"adam/iteration": t, "adam/learning_rate": lr},
        }
        ```

        `state[i]` holds the slots of the `i`-th variable, by slot name;
        `optimizer_variables` every other variable by `path`; `param_groups`
        lists the parameters and hyperparameters. Values are copies on the
        optimizer's backend and device.

        Returns:
            A dict that `load_state_dict` accepts.
        """
        self._check_built("state_dict()")
        return checkpoint.state_dict(self, self._trainable_variables)

    def state_variables(self) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        """The optimizer's own `Variable`s, laid out as `state_dict()` lays out copies.

        Returns:
            `({parameter index: {slot name: Variable}}, {path: Variable})`.
        """
        self._check_built("state_variables()")
        return checkpoint.layout(self.name, self.variables, self._trainable_variables)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the state written by `state_dict()`, continuing its trajectory.

        The optimizer must be built on variables of the saved number and
        shapes; a mismatch raises `ValueError` before anything is written.
        Arrays may come from another backend or device. Hyperparameters stay
        this optimizer's.

        Args:
            state_dict: A dict returned by `state_dict()`.
        """
        for variable, value in self._state_dict_writes(state_dict):
            variable.assign(value)

    def _state_dict_writes(self, state_dict):
        """Checks `state_dict` whole; returns the `(variable, value)` writes that load it."""
        if not self.built:
            raise ValueError(
                f"`load_state_dict()` writes into the optimizer's variables, which "
                f"{type(self).__name__} creates when it is built. Call "
                "`optimizer.build(trainable_variables)` with the model's variables first."
            )
        return checkpoint.state_dict_writes(
            self.name,
            self.variables,
            self._trainable_variables,
            state_dict,
            self._restored_fields(),
            self._policy(),
        )

    def _restored_fields(self):
        """`{id(variable): field}` of the variables whose restored values are checked."""
        return {id(self._iterations): "iteration"} if self._owns_step_state else {}

    def _policy(self):
        """The `LossScalePolicy` restored values are checked against, or None."""
        return None

    def _check_built(self, method):
        if not self.built:
            raise ValueError(
                f"`{method}` needs the optimizer's variables, which {type(self).__name__} "
                "creates when it is built. Call `optimizer.build(trainable_variables)` (or "
                "take one step) first."
            )

    # --- copies: `copy.deepcopy` and `pickle` ---------------------------
    def __getstate__(self) -> dict[str, Any]:
        """The attributes a copy takes, less the identity lookups and caches it remakes."""
        state = dict(self.__dict__)
        for name in ("_hyper_type", "_kernel_cache", "_indices", "_last_resolved"):
            del state[name]
        state["_wrappers"] = list(self._wrappers.values())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        wrappers = state.pop("_wrappers")
        self.__dict__.update(state)
        self._hyper_type = pipeline.hyper_type(type(self), _BASE_KEYS)
        self._kernel_cache = {}
        self._last_resolved = None
        self._indices = {id(v): i for i, v in enumerate(self._trainable_variables)}
        # Keyed as `_as_variable` keys them: the Keras variable, else the array.
        self._wrappers = {id(w.source if w.source is not None else w.storage): w for w in wrappers}

    def __repr__(self):
        return f"<{type(self).__name__} name={self.name!r} built={self.built}>"


def _same_objects(xs, ys):
    """Whether the sequences hold the same objects, in order (one identity test each, in C)."""
    return len(xs) == len(ys) and all(map(operator.is_, xs, ys))
