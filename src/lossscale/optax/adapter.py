"""`OptaxAdapter`: an `optax.GradientTransformation` used as a lossscale optimizer.

Every leaf of the optax state is an optimizer variable, so saving, loading,
`stateless_apply` and skipped steps carry it like any optimizer's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from lossscale import adapters, validation
from lossscale.optax import placement
from lossscale.optimizers.base import Optimizer
from lossscale.schedules.base import LearningRateSchedule
from lossscale.typing import Array, Config
from lossscale.variables import Variable


class OptaxAdapter(Optimizer):
    """Wraps an `optax.GradientTransformation` so lossscale (and `LossScaleOptimizer`) can drive it.

    The transformation sees the list of variables the adapter is built with
    (JAX arrays), so a mask or label tree is a list too. Each `apply` does:

    ```
    updates, state = transformation.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    iterations += 1
    ```

    The state leaves are variables named after their pytree path (for
    `optax.adam`: `0/count`, `0/mu/0`, ...). Clipping, weight decay,
    schedules and accumulation belong in the transformation; the adapter
    takes none of the base optimizer's settings. `learning_rate` reads and
    sets a learning rate injected with `optax.inject_hyperparams`, and
    raises `AttributeError` otherwise.

    Every variable needs a gradient on every step; transformations whose
    `update` needs extra arguments cannot be driven; `get_config` raises.

    Args:
        transformation: The `optax.GradientTransformation` to drive, such as
            `optax.adam(1e-3)`.
        name: String. The name used for the adapter's variables. Defaults
            to `"optax_optimizer"`.

    Examples:
        >>> import jax.numpy as jnp, optax, lossscale as ls
        >>> from lossscale.optax import OptaxAdapter
        >>> w = ls.Variable(jnp.ones(2), name="w")
        >>> opt = ls.LossScaleOptimizer(OptaxAdapter(optax.sgd(0.5)), initial_scale=4.0)
        >>> loss_scale = opt.scale_loss(1.0)  # multiply the loss before differentiating
        >>> opt.apply([jnp.array([4.0, -4.0])], [w])
        >>> w.numpy()
        array([0.5, 1.5], dtype=float32)
        >>> opt.apply([jnp.array([jnp.inf, 0.0])], [w])  # overflow: skipped
        >>> w.numpy(), float(opt.dynamic_scale)
        (array([0.5, 1.5], dtype=float32), 2.0)
    """

    def __init__(
        self, transformation: optax.GradientTransformation, name: str | None = None, **kwargs: Any
    ) -> None:
        if kwargs:
            raise ValueError(
                f"Argument(s) not recognized by OptaxAdapter: {sorted(kwargs)}. Accepted: "
                "transformation, name. Build clipping, weight decay and accumulation into the "
                "transformation (optax.chain, optax.MultiSteps)."
            )
        if not isinstance(transformation, optax.GradientTransformation):
            raise ValueError(
                "`transformation` must be an optax.GradientTransformation, such as "
                f"optax.adam(1e-3). Received: transformation={transformation!r}"
            )
        super().__init__(learning_rate=self._learning_rate_value, name=name or "optax_optimizer")
        self.transformation = transformation
        self._treedef = None
        self._state_leaves = []
        self._learning_rate_variable = None

    # --- learning rate ------------------------------------------------------
    def _learning_rate_value(self):
        return self._injected_learning_rate().value

    def _injected_learning_rate(self):
        if not self.built:
            raise AttributeError(
                "OptaxAdapter reads its learning rate from the transformation's state, which "
                "is created when the optimizer is built. Call "
                "`optimizer.build(trainable_variables)` (or take one step) first."
            )
        if self._learning_rate_variable is None:
            raise AttributeError(
                "This optax transformation keeps its learning rate inside a closure, so "
                "OptaxAdapter can neither read nor set it. Build the transformation with "
                "optax.inject_hyperparams, e.g. "
                "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), to make the learning "
                "rate part of its state."
            )
        return self._learning_rate_variable

    @property
    def learning_rate(self) -> jax.Array:
        """The `learning_rate` injected with `optax.inject_hyperparams` (a JAX scalar).

        Setting it writes the state leaf. Without one (or before `build`), raises
        `AttributeError`.
        """
        return self._learning_rate_value()

    @learning_rate.setter
    def learning_rate(self, learning_rate: float) -> None:
        variable = self._injected_learning_rate()
        if isinstance(learning_rate, LearningRateSchedule) or callable(learning_rate):
            raise TypeError(
                "OptaxAdapter's learning rate can only be set to a number; give a schedule to "
                "optax.inject_hyperparams when making the transformation instead. Received: "
                f"learning_rate={learning_rate!r}"
            )
        validation.check_number("learning_rate", learning_rate, low=0)
        variable.assign(float(learning_rate))

    # --- building -----------------------------------------------------------
    def build(self, var_list: Sequence[Variable | Array]) -> None:
        """Runs `transformation.init` on `var_list` and keeps each state leaf as a variable."""
        if self.built:
            return
        variables = self._as_variables(var_list, "var_list")
        if variables and variables[0].backend != "jax":
            raise ValueError(
                "OptaxAdapter works on JAX arrays. Received: var_list of "
                f"{variables[0].backend} arrays"
            )
        overwrite = [v.path for v in variables if v.overwrite_with_gradient]
        if overwrite:
            raise ValueError(
                "OptaxAdapter cannot hold overwrite-with-gradient variables: the optax "
                f"transformation would update them like any parameter. Received: {overwrite}"
            )
        params = [v.value for v in variables]
        try:
            state = self.transformation.init(params)
        except Exception as error:
            # optax's own message names a tree it never saw (the user's).
            error.add_note(
                "OptaxAdapter gives the transformation the parameters as the list it is "
                f"built with ({len(params)} arrays; from lossscale.pytree.transform, the "
                "tree's leaves in jax.tree_util order): a mask or label tree (optax.masked, "
                "optax.multi_transform, a weight-decay mask) must be that list or a function "
                "of it. For masks over your own tree, use lossscale.optax.dynamic_loss_scale, "
                "which runs the transformation on the tree itself."
            )
            raise
        state = placement.replicate_uncommitted(state, placement.anchor(params))
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        paths = [path for path, _ in leaves]
        learning_rate = _injected_learning_rate_index(state, paths)
        super().build(variables)
        self._treedef = treedef
        for name, (_, leaf) in zip(_leaf_names(paths), leaves):
            leaf = jnp.asarray(leaf)
            self._state_leaves.append(
                self.add_variable(leaf.shape, initializer=leaf, dtype=leaf.dtype.name, name=name)
            )
        if learning_rate is not None:
            self._learning_rate_variable = self._state_leaves[learning_rate]

    # --- one step -----------------------------------------------------------
    def _run_step(self, grads, variables, plan, grad_scale=None, keep=None, found_inf=None):
        given = {id(v) for g, v in zip(grads, variables) if g is not None}
        absent = [v.path for v in self._trainable_variables if id(v) not in given]
        if absent:
            raise ValueError(
                "OptaxAdapter needs a gradient for every variable it was built with: an optax "
                "transformation updates the whole parameter tree at once. Pass zeros for a "
                "variable without a gradient, or freeze it inside the transformation "
                f"(optax.masked, optax.set_to_zero). Received: no gradient for {absent}"
            )
        super()._run_step(grads, variables, plan, grad_scale, keep, found_inf)

    def _update(self, ops, grads, variables, plan, grad_scale=None, keep=None, found_inf=None):
        params = [v.value for v in self._trainable_variables]
        ordered = [None] * len(params)
        for g, v in zip(grads, variables):
            ordered[self._get_variable_index(v)] = g
        state = self._treedef.unflatten([v.value for v in self._state_leaves])
        updates, state = self.transformation.update(ordered, state, params)
        params = optax.apply_updates(params, updates)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        if treedef != self._treedef:
            raise ValueError(
                "The optax transformation returned a state of another structure than its "
                "`init` made, which OptaxAdapter cannot store. Received: "
                f"{treedef}, expected {self._treedef}"
            )
        for variable, value in zip(self._trainable_variables, params):
            self.assign(variable, value)
        for variable, value in zip(self._state_leaves, leaves):
            self.assign(variable, value)

    # --- what is not supported ------------------------------------------------
    def get_config(self) -> Config:
        """Not supported: raises `NotImplementedError` (no config describes a transformation)."""
        raise NotImplementedError(
            "OptaxAdapter cannot be serialized: an optax.GradientTransformation is a pair of "
            "functions closing over its hyperparameters, which no config can describe. "
            "Recreate it in code; its state (all in `variables`) saves and loads with "
            "`save_own_variables` / `load_own_variables` or `state_dict()`."
        )

    def exclude_from_weight_decay(
        self,
        var_list: Sequence[Variable | Array] | None = None,
        var_names: Sequence[str] | None = None,
    ) -> None:
        """Not supported: raises `NotImplementedError`; mask the decay inside the transformation."""
        raise NotImplementedError(
            "OptaxAdapter applies no weight decay of its own: the transformation does. Pass "
            "a `mask` to optax.add_decayed_weights (or optax.adamw) instead."
        )


def _leaf_names(paths):
    """Variable names for state leaves: `/`-separated paths, or full key strings if those clash."""
    names = [jax.tree_util.keystr(path, simple=True, separator="/") or "state" for path in paths]
    if len(set(names)) < len(names):
        names = [jax.tree_util.keystr(path) for path in paths]
    return names


def _injected_learning_rate_index(state, paths):
    """Index in `paths` of the leaf an `optax.inject_hyperparams` learning rate is, or None."""
    injected = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
    nodes, _ = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, injected)
    )
    keys = [jax.tree_util.keystr(path) for path in paths]
    found = [
        jax.tree_util.keystr(
            path + (jax.tree_util.GetAttrKey("hyperparams"), jax.tree_util.DictKey("learning_rate"))
        )
        for path, node in nodes
        if isinstance(node, injected) and "learning_rate" in node.hyperparams
    ]
    if len(found) > 1:
        raise ValueError(
            f"The optax transformation injects several learning rates ({found}), so "
            "OptaxAdapter cannot tell which one `learning_rate` means. Inject the learning "
            "rate once (e.g. around the whole chain)."
        )
    return keys.index(found[0]) if found else None


def _is_transformation(optimizer):
    return isinstance(optimizer, optax.GradientTransformation)


adapters.register(_is_transformation, OptaxAdapter)
