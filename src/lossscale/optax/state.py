"""`DynamicLossScaleState`: the state of `dynamic_loss_scale`, a named pytree.

The policy travels with the state as static structure, so `summary(state)`
and `check(state)` need nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax

from lossscale.mixed_precision.loss_scale import LossScalePolicy, LossScaleState, state_fields
from lossscale.typing import PyTree


class DynamicLossScaleState:
    """The state of a `dynamic_loss_scale` transformation.

    A pytree node: `jax.jit`, `jax.vmap`, `jax.eval_shape`, orbax and
    `jax.tree_util.tree_map` see its arrays as leaves, keyed by name
    (`scale`, `counter`, `inner_state[0].mu['w']`, ...).

    Attributes:
        scale: Float32 scalar, the current loss scale.
        counter: Int32 scalar, finite steps since the last growth or
            overflow.
        consecutive_skips: This and the other `LossScaleState` fields:
            `None` (tuples: empty) unless the policy tracks them.
        last_step_skipped: Boolean scalar: whether the last update was
            skipped. False before the first update.
        inner_state: The inner transformation's state.
        policy: The `LossScalePolicy` (static).
        paths: The parameter paths `nonfinite` refers to (static; empty
            without telemetry).

    Examples:
        >>> import jax, jax.numpy as jnp, optax, lossscale.optax as lso
        >>> state = lso.dynamic_loss_scale(optax.sgd(0.1)).init({"w": jnp.ones(2)})
        >>> float(state.scale), int(state.counter)
        (32768.0, 0)
        >>> [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
        ['.scale', '.counter', '.last_step_skipped']
    """

    __slots__ = ("_loss_scale", "last_step_skipped", "inner_state", "policy", "paths")

    def __init__(
        self,
        loss_scale: LossScaleState,
        last_step_skipped: PyTree,
        inner_state: PyTree,
        policy: LossScalePolicy,
        paths: Sequence[str] = (),
    ) -> None:
        # Unchecked: JAX rebuilds states around tracers, shapes and shardings alike.
        self._loss_scale = loss_scale
        self.last_step_skipped = last_step_skipped
        self.inner_state = inner_state
        self.policy = policy
        self.paths = tuple(paths)

    @property
    def loss_scale_state(self) -> LossScaleState:
        """The loss-scale fields as a `LossScaleState` (for `next_loss_scale`)."""
        return self._loss_scale

    def replace(
        self, loss_scale_state: LossScaleState | None = None, inner_state: PyTree | None = None
    ) -> DynamicLossScaleState:
        """Returns a state with new loss-scale fields and/or a new inner state."""
        return DynamicLossScaleState(
            self._loss_scale if loss_scale_state is None else loss_scale_state,
            self.last_step_skipped,
            self.inner_state if inner_state is None else inner_state,
            self.policy,
            self.paths,
        )

    def __repr__(self):
        fields = ", ".join(
            f"{f.name}={getattr(self._loss_scale, f.name)!r}" for f in state_fields(self.policy)
        )
        return (
            f"DynamicLossScaleState({fields}, last_step_skipped={self.last_step_skipped!r}, "
            f"inner_state={self.inner_state!r})"
        )


def _field_property(field):
    def read(self):
        return getattr(self._loss_scale, field.name)

    # An array (None when untracked), or a tuple of scalars.
    read.__annotations__["return"] = (
        "jax.Array | None"
        if field.metadata["per"] in ("step", "vector")
        else "tuple[jax.Array, ...]"
    )
    return property(
        read, doc=f"The `{field.name}` field of the loss-scale state (see `LossScaleState`)."
    )


# One attribute per LossScaleState field: the dataclass is the one list.
for _field in dataclasses.fields(LossScaleState):
    setattr(DynamicLossScaleState, _field.name, _field_property(_field))
del _field


def _flatten_with_keys(state):
    names = [f.name for f in state_fields(state.policy)]
    children = [(jax.tree_util.GetAttrKey(n), getattr(state._loss_scale, n)) for n in names]
    children.append((jax.tree_util.GetAttrKey("last_step_skipped"), state.last_step_skipped))
    children.append((jax.tree_util.GetAttrKey("inner_state"), state.inner_state))
    return children, (state.policy, state.paths)


def _flatten(state):
    children, aux = _flatten_with_keys(state)
    return [child for _, child in children], aux


def _unflatten(aux, children):
    policy, paths = aux
    *fields, last_step_skipped, inner_state = children
    names = [f.name for f in state_fields(policy)]
    return DynamicLossScaleState(
        LossScaleState(**dict(zip(names, fields))), last_step_skipped, inner_state, policy, paths
    )


jax.tree_util.register_pytree_with_keys(
    DynamicLossScaleState, _flatten_with_keys, _unflatten, flatten_func=_flatten
)


def is_state(x):
    """Whether `x` is a `DynamicLossScaleState` (an `is_leaf` for tree searches)."""
    return isinstance(x, DynamicLossScaleState)


def find(tree, function):
    """The one `DynamicLossScaleState` inside `tree` (an `nnx.split` pair is merged first).

    Raises `ValueError`, naming `function`, where it holds none or several.
    """
    if is_state(tree):
        return tree
    tree = _merged_nnx_pair(tree)
    found = _states_in(tree)
    if len(found) == 1:
        return found[0]
    if not found:
        hint = ""
        if _fields_by_name(tree) is not None:
            hint = (
                " (an nnx.split state holds the arrays but not the settings: pass the "
                "(graphdef, state) pair, or nnx.merge(graphdef, state))"
            )
        raise ValueError(
            f"`{function}` needs a state made by `lossscale.optax.dynamic_loss_scale` (the "
            "state itself, or a tree holding it: an optax.chain state, a Flax TrainState, "
            "nnx.Optimizer.opt_state). Received: a value of type "
            f"{type(tree).__name__} holding no DynamicLossScaleState{hint}"
        )
    raise ValueError(
        f"`{function}` found {len(found)} DynamicLossScaleStates in the tree it was given, "
        "and cannot tell which one is meant. Pass that state itself."
    )


def find_fields(tree):
    """`{field name: leaf}` of the loss-scale state in `tree` (`nnx.split` State too), or None."""
    found = _states_in(_merged_nnx_pair(tree))
    if len(found) == 1:
        fields = {f.name: getattr(found[0], f.name) for f in state_fields(found[0].policy)}
        return {**fields, "last_step_skipped": found[0].last_step_skipped}
    return _fields_by_name(tree)


def _states_in(tree):
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_state) if is_state(x)]


def _fields_by_name(tree):
    """The loss-scale fields of a mapping holding them by name (an `nnx.split` `State`).

    A tuple field comes back as a mapping keyed 0, 1, ...: it is made a tuple again.
    """
    names = {f.name for f in dataclasses.fields(LossScaleState)} | {"last_step_skipped"}
    mappings = [tree]
    while mappings:
        mapping = mappings.pop()
        if not isinstance(mapping, Mapping):
            continue
        keys = set(mapping)
        if {"scale", "counter", "last_step_skipped"} <= keys and keys <= names | {"inner_state"}:
            return {k: _as_tuple(v) for k, v in mapping.items() if k in names}
        mappings.extend(mapping.values())
    return None


def _as_tuple(value):
    if isinstance(value, Mapping):
        return tuple(value[k] for k in sorted(value))
    return value


def _merged_nnx_pair(tree):
    """An `nnx.split` `(graphdef, state)` pair merged back into its object; else `tree`."""
    if (
        isinstance(tree, tuple)
        and len(tree) >= 2
        and type(tree[0]).__module__.startswith("flax.nnx")
        and type(tree[0]).__name__.endswith("GraphDef")
    ):
        from flax import nnx

        return nnx.merge(*tree)
    return tree
