"""`Transform`: an optimizer as pure `init`/`apply` functions of pytrees."""

import sys

from lossscale import validation
from lossscale.optimizers.base import Optimizer
from lossscale.optimizers.loss_scale_optimizer import LossScaleOptimizer
from lossscale.pytree._flatten import flatten, jax_in_use, unflatten
from lossscale.pytree._state import OptimizerState
from lossscale.variables import Variable


class Transform:
    """An optimizer used as pure functions of parameter and gradient pytrees.

    Create it with `transform(optimizer)`. `init` builds the optimizer on the
    first parameter tree it sees (slot names follow the tree's paths) and
    returns the initial `OptimizerState`; `apply` runs one step of the
    optimizer's `stateless_apply` and returns new parameters (same tree
    structure, dtypes and, on JAX, sharding) and a new state. The optimizer
    object is never mutated by `apply`, so `jax.jit(tx.apply)` compiles once;
    `tx.jit()` compiles it with `params` and `state` donated, in the order
    that lets XLA update every buffer in place.

    The transform keeps the arrays it was initialised with (the optimizer's
    variables wrap them); on JAX, donating `state` and `params` to the
    jitted step (`tx.jit()`) frees them after the first step.

    Args:
        optimizer: A `lossscale.optimizers.Optimizer`, typically a
            `LossScaleOptimizer`. Unbuilt, or built on variables with the
            shapes of the parameter tree (to continue stateful training).

    Examples:
        >>> import numpy as np, lossscale as ls, lossscale.pytree
        >>> tx = ls.pytree.transform(ls.optimizers.SGD(0.5))
        >>> params = {"w": np.ones(2, np.float32)}
        >>> state = tx.init(params)
        >>> params, state = tx.apply({"w": np.ones(2, np.float32)}, state, params)
        >>> params["w"], int(state["sgd/iteration"])
        (array([0.5, 0.5], dtype=float32), 1)
    """

    def __init__(self, optimizer):
        if not isinstance(optimizer, Optimizer):
            raise ValueError(
                "`optimizer` must be a lossscale.optimizers.Optimizer instance. "
                f"Received: optimizer={optimizer!r}"
            )
        self._optimizer = optimizer
        self._treedef = None
        self._names = None
        self._use_jax = None

    @property
    def optimizer(self):
        """The wrapped optimizer (built by the first `init`)."""
        return self._optimizer

    @property
    def names(self):
        """The state's names, in `optimizer.variables` order (None before `init`)."""
        return list(self._names) if self._names is not None else None

    def init(self, params):
        """Returns the optimizer state for `params`.

        The first call builds the optimizer on `params`' leaves and must run
        eagerly (not under `jax.jit`); later calls need the same tree
        structure and return the optimizer's current (initial) values, and
        may run under `jax.jit` or `jax.vmap`.

        Args:
            params: A pytree of arrays (the trainable parameters).

        Returns:
            An `OptimizerState`.
        """
        use_jax = jax_in_use() if self._use_jax is None else self._use_jax
        leaves, treedef, paths = flatten(params, "params", use_jax)
        if self._treedef is None:
            if not self._optimizer.built:
                _check_concrete(leaves)
                variables = [
                    Variable(leaf, name=path or "param") for leaf, path in zip(leaves, paths)
                ]
                self._optimizer.build(variables)
            self._treedef, self._use_jax = treedef, use_jax
            self._names = _unique_names(self._optimizer.variables)
        else:
            self._check_structure(treedef, "params")
        values = [v.value for v in self._optimizer.variables]
        deleted = [n for n, x in zip(self._names, values) if _is_deleted(x)]
        if deleted:
            raise ValueError(
                "The initial optimizer state was donated to a jitted step and no longer "
                "exists; keep the state returned by `apply`, or create a new optimizer and "
                f"transform. Deleted: {deleted}"
            )
        return OptimizerState(dict(zip(self._names, values)))

    def apply(self, grads, state, params):
        """Applies one optimizer step to a parameter pytree.

        Pure: nothing is mutated, so it may be wrapped in `jax.jit` or
        `jax.vmap`. To donate buffers, use `tx.jit()`, or a training step of
        your own that takes `(params, state, ...)` and returns
        `(params, state)` in that order with `donate_argnums=(0, 1)`:
        `jax.jit(tx.apply, donate_argnums=(1, 2))` pairs the buffers badly
        (see `jit`).

        Args:
            grads: A pytree of gradients with the structure of `params`.
                With a `LossScaleOptimizer` these are the gradients of
                `scale_loss(loss, state)`, still scaled.
            state: The `OptimizerState` from `init` or the previous `apply`.
            params: The current parameters.

        Returns:
            A tuple `(new_params, new_state)`.
        """
        if self._treedef is None:
            raise ValueError(
                "`apply` needs an initialised transform; call `state = tx.init(params)` first."
            )
        if not isinstance(state, OptimizerState):
            raise TypeError(
                "`state` must be the OptimizerState returned by `init` or `apply`. "
                f"Received: state of type {type(state).__name__}"
            )
        param_leaves, treedef, _ = flatten(params, "params", self._use_jax)
        self._check_structure(treedef, "params")
        grad_leaves, grad_treedef, _ = flatten(grads, "grads", self._use_jax)
        if grad_treedef != treedef:
            raise ValueError(
                "`grads` must have the structure of `params`. "
                f"Expected: {treedef}. Received: {grad_treedef}"
            )
        missing = [n for n in self._names if n not in state]
        extra = [n for n in state if n not in self._names]
        if missing or extra:
            raise ValueError(
                "`state` does not match this optimizer's variables. "
                f"Missing: {missing}. Unexpected: {extra}"
            )
        new_leaves, new_values = self._optimizer.stateless_apply(
            [state[n] for n in self._names], grad_leaves, param_leaves
        )
        return unflatten(treedef, new_leaves), OptimizerState(dict(zip(self._names, new_values)))

    def jit(self, donate=True):
        """Returns `apply` compiled with `jax.jit`, donating `state` and `params`.

        Same signature and results as `apply`. JAX pairs donated inputs with
        outputs of the same shape in order, so donating `apply`'s own
        `(state, params)` would pair each optimizer slot with a parameter and
        force XLA to copy buffers; this compiles a version whose inputs come in
        output order `(params, state)`, which updates every buffer in place.

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

    def scale_loss(self, loss, state):
        """Multiplies `loss` by the loss scale held in `state`.

        With a `LossScaleOptimizer` this is the current dynamic scale; with
        another optimizer, its static `loss_scale_factor` (if any).
        """
        if isinstance(self._optimizer, LossScaleOptimizer):
            return loss * self.loss_scale(state)
        return self._optimizer.scale_loss(loss)

    def loss_scale(self, state):
        """The current dynamic loss scale in `state` (`LossScaleOptimizer` only)."""
        scale = self._loss_scale_optimizer("loss_scale").dynamic_scale
        position = next(i for i, v in enumerate(self._optimizer.variables) if v is scale)
        return state[self._names[position]]

    def summary(self, state):
        """The loss-scale state in `state` as Python values, for logging.

        Delegates to `LossScaleOptimizer.summary` (a host read: call it when
        logging, not inside the jitted step).
        """
        return self._loss_scale_optimizer("summary").summary(self._values(state))

    def check(self, state):
        """Raises `LossScaleError` if `state` records a crossed limit.

        The jitted step cannot raise; with `min_scale` or
        `max_consecutive_skips` set, call this between steps (it reads one
        scalar). Delegates to `LossScaleOptimizer.check`.
        """
        self._loss_scale_optimizer("check").check(self._values(state))

    def _loss_scale_optimizer(self, method):
        if not isinstance(self._optimizer, LossScaleOptimizer):
            raise ValueError(
                f"`{method}` needs a transform of a LossScaleOptimizer. "
                f"Received: optimizer={self._optimizer!r}"
            )
        if self._names is None:
            raise ValueError(f"`{method}` needs an initialised transform; call `tx.init` first.")
        return self._optimizer

    def _values(self, state):
        if not isinstance(state, OptimizerState):
            raise TypeError(
                "`state` must be the OptimizerState returned by `init` or `apply`. "
                f"Received: state of type {type(state).__name__}"
            )
        return [state[n] for n in self._names]

    def _check_structure(self, treedef, argname):
        if treedef != self._treedef:
            raise ValueError(
                f"`{argname}` must have the tree structure this transform was initialised "
                f"with. Expected: {self._treedef}. Received: {treedef}"
            )

    def __repr__(self):
        return f"<Transform optimizer={self._optimizer!r}>"


def transform(optimizer):
    """Wraps `optimizer` for pure, pytree-in/pytree-out use (see `Transform`).

    Args:
        optimizer: A `lossscale.optimizers.Optimizer`.

    Returns:
        A `Transform` with `init`, `apply`, `scale_loss` and `loss_scale`.

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


def _check_concrete(leaves):
    jax = sys.modules.get("jax")
    if jax is None:
        return
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        raise ValueError(
            "The first `tx.init(params)` builds the optimizer and must run eagerly, not "
            "under `jax.jit`/`jax.vmap`: call it once on concrete parameters (later calls "
            "may be traced). Received: traced params"
        )


def _is_deleted(x):
    is_deleted = getattr(x, "is_deleted", None)
    return bool(is_deleted()) if callable(is_deleted) else False
