"""Creating and finding an optimizer's variables (`SlotsMixin`).

The base optimizer inherits these: how state variables are made (on the
model's backend and device, named after the model variable they shadow),
how raw native arrays are wrapped once (and the arrays of the last call
resolved again without a lookup), and the `assign*` hooks update rules
write through.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, overload

from lossscale.backends import common_backend, get_ops
from lossscale.optimizers.weight_decay import WeightDecayExclusions
from lossscale.typing import Array, Initializer, Shape
from lossscale.variables import Variable, is_keras_variable


class SlotsMixin:
    """Variable creation and lookup for `Optimizer`."""

    @property
    def variables(self) -> list[Variable]:
        """Every variable holding this optimizer's state, in creation order."""
        return self._variables[:]

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
        # One backend module per backend: comparing them is the cheap check;
        # `common_backend` names the two found.
        ops = variables[0]._ops if variables else None
        if any(v._ops is not ops for v in variables):
            common_backend(variables, what=f"`{argname}`")
        return variables

    def _resolve_variables(self, grads, trainable_variables):
        """`(variables, known)`: `known` when all are ones the optimizer was built with.

        Those share the backend `build` checked, so only other variables are
        checked here (under `torch.compile` every `_ops` read of that check
        would be a Python-level aliasing guard on each call); `apply` raises
        for variables it was not built with, once the gradients are checked.
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
            # The last call's arrays are remembered where Python runs every
            # step (not while a step is traced: there every read would be a
            # guard), and never a keras.Variable, whose value `_as_variable`
            # takes at every call.
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

    def _check_known(self, variables):
        for v in variables:
            if id(v) not in self._indices:
                raise ValueError(
                    f"Unknown variable: {v.path!r}. This optimizer can only be called for the "
                    "variables it was built with; create a new optimizer for new variables."
                )

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
            initializer: Initializer (`"zeros"`, `"ones"`, a number or a
                callable `(shape, dtype)`). Defaults to `"zeros"`.
            dtype: Dtype of the variable. Defaults to `"float32"`.
            aggregation: One of `None`, `"none"`, `"mean"`, `"sum"` or
                `"only_first_replica"`. Defaults to `"none"`.
            layout: Optional tensor layout; stored for sharding-aware users.
            name: String name of the variable.

        Returns:
            The new `Variable`, on the backend and device of the variables
            the optimizer is built with (NumPy before that).
        """
        # The storage itself (not a read of it): a TensorFlow slot follows a
        # mirrored model variable into its strategy.
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
        """Adds a variable shaped like `reference_variable`.

        Its name is `{reference path with "/" as "_"}_{name}`; `name`
        defaults to `"var"`.

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

    def _get_variable_index(self, variable):
        return self._indices[id(variable)]

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


def _same_objects(xs, ys):
    """Whether the sequences hold the same objects, in order (one identity test each, in C)."""
    return len(xs) == len(ys) and all(map(operator.is_, xs, ys))
