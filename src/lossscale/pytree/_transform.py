"""`Transform`: an optimizer as pure `init`/`apply` functions of pytrees."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from lossscale import validation
from lossscale.backends import common_backend
from lossscale.optimizers.base import Optimizer
from lossscale.optimizers.loss_scale_optimizer import LossScaleOptimizer
from lossscale.pytree import _templates
from lossscale.pytree._flatten import flatten, jax_in_use, unflatten
from lossscale.pytree._state import OptimizerState
from lossscale.typing import Array, PyTree

# The optimizers given to `transform`, which hold no state (`lossscale.saving` says so).
_BLUEPRINTS = weakref.WeakSet()


def is_blueprint(optimizer: Optimizer) -> bool:
    """Whether `optimizer` was given to `transform` (and so holds no training state)."""
    return optimizer in _BLUEPRINTS


class Transform:
    """An optimizer used as pure functions of parameter and gradient pytrees.

    Create it with `transform(optimizer)`. `init(params)` returns the
    initial `OptimizerState` for any parameter tree; `apply` runs one step
    and returns new parameters and a new state. Both are pure (`jax.jit`,
    `jax.vmap`, `jax.eval_shape`); `tx.jit()` compiles `apply` with `params`
    and `state` donated.

    The optimizer given is a blueprint, never built or written: each
    parameter tree gets a private copy built once, so all of the training
    state is in the `state` pytrees.

    Args:
        optimizer: An unbuilt `lossscale.optimizers.Optimizer`, typically a
            `LossScaleOptimizer`.

    Examples:
        >>> import numpy as np, lossscale as ls, lossscale.pytree
        >>> tx = ls.pytree.transform(ls.optimizers.SGD(0.5))
        >>> params = {"w": np.ones(2, np.float32)}
        >>> state = tx.init(params)
        >>> params, state = tx.apply({"w": np.ones(2, np.float32)}, state, params)
        >>> params["w"], int(state["sgd/iteration"])
        (array([0.5, 0.5], dtype=float32), 1)
    """

    def __init__(self, optimizer: Optimizer) -> None:
        if not isinstance(optimizer, Optimizer):
            raise ValueError(
                "`optimizer` must be a lossscale.optimizers.Optimizer instance. "
                f"Received: optimizer={optimizer!r}"
            )
        if optimizer.built:
            raise ValueError(
                "`optimizer` must not be built: a transform builds its own copy for each "
                "parameter tree, and its state lives in the pytrees `init` and `apply` "
                "return. To carry a stateful optimizer's values over, pass an unbuilt one "
                "and make the state from them: OptimizerState(dict(zip(tx.names(params), "
                f"[v.value for v in optimizer.variables]))). Received: optimizer={optimizer!r}"
            )
        inner = getattr(optimizer, "inner_optimizer", None)
        if any(getattr(o, "keeps_native_state", False) for o in (optimizer, inner)):
            raise ValueError(
                "`optimizer` keeps its state in a native optimizer, which updates tensors in "
                "place and cannot run as pure functions. Use a lossscale optimizer (or an "
                f"optax transformation with lossscale.optax). Received: optimizer={optimizer!r}"
            )
        self._optimizer = optimizer
        self._blueprint = _templates.clone(optimizer)
        self._templates = {}  # signature -> (built copy, state names in variables order)
        self._by_names = {}  # frozenset of state names -> (built copy, names)
        _BLUEPRINTS.add(optimizer)

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer given to `transform` (a blueprint: never built, holds no state)."""
        return self._optimizer

    def names(self, params: PyTree) -> list[str]:
        """The state's names for `params`, in `optimizer.variables` order.

        Args:
            params: A pytree of arrays (or of `jax.ShapeDtypeStruct`s' arrays).

        Returns:
            A list of strings, such as `"adam/dense_kernel_momentum"`.
        """
        leaves, treedef, paths = flatten(params, "params", jax_in_use())
        return list(self._template(leaves, treedef, paths)[1])

    def init(self, params: PyTree) -> OptimizerState:
        """Returns the initial optimizer state for `params` (pure).

        On sharded parameters, each slot takes its parameter's sharding and
        scalars are replicated over the same devices.

        Args:
            params: A pytree of arrays (the trainable parameters).

        Returns:
            An `OptimizerState`.
        """
        leaves, treedef, paths = flatten(params, "params", jax_in_use())
        template, names, fresh = self._template(leaves, treedef, paths)
        built = template if fresh else _templates.build(self._blueprint, leaves, paths)
        return OptimizerState(dict(zip(names, [v.value for v in built.variables])))

    def apply(
        self, grads: PyTree, state: OptimizerState, params: PyTree
    ) -> tuple[PyTree, OptimizerState]:
        """Applies one optimizer step to a parameter pytree (pure).

        To donate buffers, use `tx.jit()` (see there why not
        `jax.jit(tx.apply, donate_argnums=(1, 2))`).

        Args:
            grads: A pytree of gradients with the structure of `params`.
                With a `LossScaleOptimizer` these are the gradients of
                `scale_loss(loss, state)`, still scaled.
            state: The `OptimizerState` from `init` or the previous `apply`.
            params: The current parameters.

        Returns:
            A tuple `(new_params, new_state)`.
        """
        _check_state_type(state)
        use_jax = jax_in_use()
        param_leaves, treedef, paths = flatten(params, "params", use_jax)
        grad_leaves, grad_treedef, _ = flatten(grads, "grads", use_jax)
        if grad_treedef != treedef:
            raise ValueError(
                "`grads` must have the structure of `params`. "
                f"Expected: {treedef}. Received: {grad_treedef}"
            )
        template, names, _ = self._template(param_leaves, treedef, paths)
        missing = [n for n in names if n not in state]
        extra = [n for n in state if n not in names]
        if missing or extra:
            raise ValueError(
                "`state` does not match the optimizer's variables for these `params`. "
                f"Missing: {missing}. Unexpected: {extra}"
            )
        new_leaves, new_values = template.stateless_apply(
            [state[n] for n in names], grad_leaves, param_leaves
        )
        return unflatten(treedef, new_leaves), OptimizerState(dict(zip(names, new_values)))

    def _template(self, leaves, treedef, paths):
        """`(built copy, names, fresh)` for this tree; `fresh`: built on `leaves` just now.

        JAX trees get an abstract copy (it works on traced leaves, holds no memory).
        """
        key = _templates.signature(treedef, leaves)
        known = self._templates.get(key)
        if known is not None:
            return (*known, False)
        if common_backend(leaves, what="`params` leaves") == "jax":
            template, fresh = _templates.abstract(self._blueprint, leaves, paths), False
        else:
            template, fresh = _templates.build(self._blueprint, leaves, paths), True
        names = tuple(_unique_names(template.variables))
        self._templates[key] = (template, names)
        self._by_names.setdefault(frozenset(names), (template, names))
        return template, names, fresh

    def jit(
        self, donate: bool = True
    ) -> Callable[[PyTree, OptimizerState, PyTree], tuple[PyTree, OptimizerState]]:
        """Returns `apply` compiled with `jax.jit`, donating `state` and `params`.

        Same signature and results as `apply`. JAX pairs donated inputs with
        outputs in order, so the compiled version takes `(params, state)`, in
        output order, and updates every buffer in place.

        Args:
            donate: Boolean. Whether to donate `params` and `state` (they are
                invalid after the call). Defaults to `True`.

        Returns:
            A function `(grads, state, params) -> (new_params, new_state)`.
        """
        import jax

        validation.check_bool("donate", donate)
        compiled = jax.jit(
            lambda params, state, grads: self.apply(grads, state, params),
            donate_argnums=(0, 1) if donate else (),
        )

        def step(grads, state, params):
            return compiled(params, state, grads)

        return step

    def scale_loss(self, loss: Array, state: OptimizerState) -> Array:
        """Multiplies `loss` by the dynamic scale in `state` (else any `loss_scale_factor`)."""
        if isinstance(self._blueprint, LossScaleOptimizer):
            return loss * self.loss_scale(state)
        return self._blueprint.scale_loss(loss)

    def loss_scale(self, state: OptimizerState) -> Array:
        """The current dynamic loss scale in `state` (`LossScaleOptimizer` only)."""
        optimizer = self._loss_scale_optimizer("loss_scale")
        _check_state_type(state)
        return state[optimizer.dynamic_scale.path]

    def summary(self, state: OptimizerState) -> dict[str, Any]:
        """The loss-scale state in `state` as Python values (`LossScaleOptimizer.summary`)."""
        template, names = self._known(state, "summary")
        return template.summary([state[n] for n in names])

    def check(self, state: OptimizerState) -> None:
        """Raises if `state` holds values no step could have left, or records a crossed limit.

        Call it after restoring `state`, and between steps where `min_scale`
        or `max_consecutive_skips` is set (`LossScaleOptimizer.check`).
        """
        template, names = self._known(state, "check")
        template.check([state[n] for n in names])

    def _loss_scale_optimizer(self, method):
        if not isinstance(self._blueprint, LossScaleOptimizer):
            raise ValueError(
                f"`{method}` needs a transform of a LossScaleOptimizer. "
                f"Received: optimizer={self._optimizer!r}"
            )
        return self._blueprint

    def _known(self, state, method):
        """The built copy and names for a state of a tree this transform has seen."""
        self._loss_scale_optimizer(method)
        _check_state_type(state)
        known = self._by_names.get(frozenset(state))
        if known is None:
            raise ValueError(
                f"`{method}` needs a state of a parameter tree this transform has seen: call "
                "`tx.init(params)` (or `jax.eval_shape(tx.init, params)`) for that tree first. "
                f"Received: a state with names {sorted(state)}"
            )
        return known

    def __repr__(self):
        return f"<Transform optimizer={self._optimizer!r}>"


def transform(optimizer: Optimizer) -> Transform:
    """Wraps `optimizer` for pure, pytree-in/pytree-out use (see `Transform`).

    Args:
        optimizer: An unbuilt `lossscale.optimizers.Optimizer`, never changed.

    Returns:
        A `Transform` with `init`, `apply`, `jit`, `names`, `scale_loss`,
        `loss_scale`, `summary` and `check`.

    Examples:
        >>> import jax, jax.numpy as jnp, lossscale as ls, lossscale.pytree
        >>> tx = ls.pytree.transform(ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3)))
        >>> params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.zeros(2)}}
        >>> state = tx.init(params)
        >>> step = tx.jit()  # jax.jit(tx.apply), updating params and state in place
        >>> grads = jax.tree_util.tree_map(jnp.ones_like, params)
        >>> params, state = step(grads, state, params)
    """
    return Transform(optimizer)


def _unique_names(variables):
    """State names: variable paths, with a numeric suffix where two collide."""
    names, seen = [], {}
    for v in variables:
        name = v.path
        count = seen.get(name, 0)
        seen[name] = count + 1
        names.append(name if count == 0 else f"{name}_{count}")
    return names


def _check_state_type(state):
    if not isinstance(state, OptimizerState):
        raise TypeError(
            "`state` must be the OptimizerState returned by `init` or `apply`. "
            f"Received: state of type {type(state).__name__}"
        )
