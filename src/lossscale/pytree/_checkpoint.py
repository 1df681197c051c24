"""Checkpoints of pytree states: what `lossscale.saving` does for pure optimizers.

Arrays are named by a transform's state names (the file records the optimizer
classes) or by an optax state's key paths. Restoring checks every name, shape
and kind first, then makes each array like the target's leaf (which may be a
`jax.ShapeDtypeStruct`).
"""

import sys

import numpy as np

from lossscale.backends import backend_of, get_ops
from lossscale.mixed_precision import restored
from lossscale.pytree._state import OptimizerState

TRANSFORM = "lossscale.pytree"
OPTAX = "optax"


def describe(tx):
    """`(kind, structure)` of a pure optimizer; raises for anything else."""
    from lossscale.pytree._transform import Transform

    if isinstance(tx, Transform):
        return TRANSFORM, _classes(tx._blueprint)
    optax = sys.modules.get("optax")
    if optax is not None and isinstance(tx, optax.GradientTransformation):
        return OPTAX, "optax.GradientTransformation"
    raise ValueError(
        "`optimizer` must be a lossscale.optimizers.Optimizer, or a lossscale.pytree "
        "transform or an optax transformation passed with its `state=`. "
        f"Received: optimizer={tx!r}"
    )


def payload(tx, state):
    """`(config, names, arrays)` to write for `state`, read to NumPy."""
    kind, structure = describe(tx)
    if state is None:
        raise ValueError(
            "A transform keeps no state of its own: pass the state to save, the one `init`, "
            "`apply` or `update` returned: lossscale.saving.save(tx, path, state=state). "
            "Received: state=None"
        )
    names, leaves, _ = _named_leaves(kind, state, "state")
    return (
        {"kind": kind, "structure": structure},
        names,
        [_to_numpy(x, n) for n, x in zip(names, leaves)],
    )


def restore(tx, checkpoint, target, fail, kind_of):
    """A state shaped like `target` holding `checkpoint`'s arrays.

    `fail(path, problem)` raises; `kind_of(dtype name)` is the kind values cast within.
    """
    kind, structure = describe(tx)
    if target is None:
        raise ValueError(
            "`state` is required to restore a transform's state: the target whose structure, "
            "shapes, dtypes and placement the restored state takes, such as tx.init(params) "
            "or jax.eval_shape(tx.init, params). Received: state=None"
        )
    path, config = checkpoint.path, checkpoint.config
    if config["kind"] != kind or config.get("structure") != structure:
        theirs = _what(config["kind"], config.get("structure"))
        fail(path, f"it holds the state of a {theirs}, not of this {_what(kind, structure)}")
    names, leaves, rebuild = _named_leaves(kind, target, "state")
    saved = {
        entry["path"]: (entry, array) for entry, array in zip(checkpoint.entries, checkpoint.arrays)
    }
    missing = [n for n in names if n not in saved]
    extra = [n for n in saved if n not in set(names)]
    if missing or extra:
        fail(
            path,
            f"its arrays do not match the target state's (saved for another model or other "
            f"settings). Missing: {missing}. Unexpected: {extra}",
        )
    for name, leaf in zip(names, leaves):
        array = saved[name][1]
        shape, dtype = _shape_and_dtype(leaf)
        if tuple(array.shape) != shape:
            fail(
                path, f"{name!r} has shape {tuple(array.shape)} but the target's has shape {shape}"
            )
        if kind_of(array.dtype.name) != kind_of(dtype):
            fail(path, f"{name!r} holds {array.dtype.name} values but the target's is {dtype}")
    for name, (field, policy) in _loss_scale_fields(kind, tx, target, names).items():
        found = restored.problem(field, name, saved[name][1], policy)
        if found:
            fail(path, found)
    return rebuild([_like(saved[name][1], leaf) for name, leaf in zip(names, leaves)])


def _loss_scale_fields(kind, tx, target, names):
    """`{name: (LossScaleState field, its policy)}` for the loss-scale arrays among `names`."""
    if kind == TRANSFORM:
        fields, optimizer = {}, tx._blueprint
        while optimizer is not None:
            inner = getattr(optimizer, "inner_optimizer", None)
            if inner is not None:  # a LossScaleOptimizer: its own variables are named by it
                prefix = f"{optimizer.name}/"
                own = {n.removeprefix(prefix): n for n in names if n.startswith(prefix)}
                found = restored.variable_fields(own).items()
                fields.update({own[v]: (f, optimizer.policy) for v, f in found})
            optimizer = inner
        return fields
    from lossscale.optax.state import DynamicLossScaleState

    tree_util = sys.modules["jax"].tree_util
    nodes, _ = tree_util.tree_flatten_with_path(
        target, is_leaf=lambda x: isinstance(x, DynamicLossScaleState)
    )
    fields = {}
    for key_path, node in nodes:
        if isinstance(node, DynamicLossScaleState):
            prefix = tree_util.keystr(key_path)
            for name in names:
                suffix = name[len(prefix) :]
                if name.startswith(prefix) and not suffix.startswith(".inner_state"):
                    field = restored.key_path_field(suffix)
                    if field is not None:
                        fields[name] = (field, node.policy)
    return fields


def _what(kind, structure):
    return f"transform of {structure}" if kind == TRANSFORM else f"{kind} transformation"


def _classes(optimizer):
    inner = getattr(optimizer, "inner_optimizer", None)
    name = type(optimizer).__name__
    return f"{name}({_classes(inner)})" if inner is not None else name


def _named_leaves(kind, state, argname):
    """`(names, leaves, rebuild)`: `rebuild(new leaves)` makes a state of `state`'s structure."""
    if kind == TRANSFORM:
        if not isinstance(state, OptimizerState):
            raise TypeError(
                f"`{argname}` must be the OptimizerState of the transform. "
                f"Received: {argname} of type {type(state).__name__}"
            )
        names = sorted(state)
        return names, [state[n] for n in names], lambda new: OptimizerState(dict(zip(names, new)))
    tree_util = sys.modules["jax"].tree_util
    with_paths, treedef = tree_util.tree_flatten_with_path(state)
    names = [tree_util.keystr(p) for p, _ in with_paths]
    if len(set(names)) != len(names):
        raise ValueError(
            f"`{argname}` has leaves with the same key path; it cannot be saved by name."
        )
    return names, [x for _, x in with_paths], lambda new: tree_util.tree_unflatten(treedef, new)


def _to_numpy(x, name):
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        if isinstance(x, jax.core.Tracer):
            raise ValueError(
                "`state` is traced (inside jax.jit or another transformation): save the "
                "state a jitted step returned, between steps."
            )
        if x.is_deleted():
            raise ValueError(
                f"`state` holds arrays that were donated to a jitted step and no longer exist "
                f"({name!r}): save the state that step returned."
            )
    return np.asarray(get_ops(backend_of(x)).to_numpy(x), order="C")


def _shape_and_dtype(leaf):
    if _is_abstract(leaf):
        return tuple(leaf.shape), np.dtype(leaf.dtype).name
    ops = get_ops(backend_of(leaf))
    return ops.shape(leaf), ops.dtype_name(leaf)


def _is_abstract(leaf):
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(leaf, jax.ShapeDtypeStruct)


def _like(array, leaf):
    """`array` made like the target `leaf`: backend, dtype, placement, weak type."""
    if _is_abstract(leaf):
        jax = sys.modules["jax"]
        value = np.asarray(array, dtype=leaf.dtype)
        if leaf.weak_type and value.ndim == 0:
            # A weakly typed scalar must come back weak, or a jitted step would retrace.
            return jax.numpy.asarray(value.item())
        sharding = getattr(leaf, "sharding", None)
        return jax.device_put(value, sharding) if sharding is not None else jax.numpy.asarray(value)
    ops = get_ops(backend_of(leaf))
    value = ops.asarray(array, dtype=ops.dtype_name(leaf), like=leaf)
    if getattr(leaf, "weak_type", False) and ops.shape(value) == ():
        return sys.modules["jax"].numpy.asarray(np.asarray(value).item())
    return value
