"""What `dynamic_loss_scale` accepts, checked at trace time with errors that name the cause."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from lossscale.optax.state import DynamicLossScaleState, is_state


def inner_transformation(inner):
    """`inner` as an `optax.GradientTransformation` (an `optax.MultiSteps` unwrapped)."""
    if isinstance(inner, optax.MultiSteps):
        inner = inner.gradient_transformation()
    if not isinstance(inner, optax.GradientTransformation):
        raise ValueError(
            "`inner` must be an optax.GradientTransformation, such as optax.adam(1e-3), "
            f"or an optax.MultiSteps. Received: inner={inner!r}"
        )
    return inner


def like_gradients(params):
    """The part of `params` the gradients have the structure of (`optax.lookahead`'s fast)."""
    return params.fast if isinstance(params, optax.LookaheadParams) else params


def check_inner_init(inner_state):
    """Refuses an inner state that holds a loss-scale state (a scaler inside a scaler)."""
    nested = [x for x in jax.tree_util.tree_leaves(inner_state, is_leaf=is_state) if is_state(x)]
    if nested:
        raise ValueError(
            "`inner` must not itself hold a `dynamic_loss_scale`: the inner one would unscale "
            "gradients that are no longer scaled and skip steps on its own scale. Wrap the "
            "optimizer once, e.g. dynamic_loss_scale(optax.chain(optax.clip_by_global_norm(1.0), "
            "optax.adamw(1e-3))). Received: an inner transformation whose state holds "
            f"{len(nested)} DynamicLossScaleState"
        )


def check_state(state, policy):
    if not isinstance(state, DynamicLossScaleState):
        raise TypeError(
            "`state` must be the DynamicLossScaleState returned by this transformation's "
            f"`init` or `update`. Received: state of type {type(state).__name__}"
        )
    if state.policy != policy:
        raise ValueError(
            "`state` was made by a dynamic_loss_scale with other settings. "
            f"Expected: {policy}. Received: {state.policy}"
        )


def check_inner_state_matches(inner, inner_state, params):
    """Refuses an inner state `inner.init(params)` would not make (another optimizer or tree)."""
    if params is None:
        return
    expected = jax.eval_shape(inner.init, params)
    expected_leaves, expected_tree = jax.tree_util.tree_flatten(expected)
    leaves, tree = jax.tree_util.tree_flatten(inner_state)
    shapes = [tuple(jnp.shape(x)) for x in leaves]
    if tree == expected_tree and shapes == [tuple(x.shape) for x in expected_leaves]:
        return
    raise ValueError(
        "`state` holds an inner state that this transformation's `inner.init(params)` "
        "would not make: it was made by another inner transformation or for another "
        "parameter tree. Make the state with this transformation's `init` on these "
        f"parameters. Expected: {expected_tree}. Received: {tree}"
    )


def check_updates(updates, params, state):
    """Returns `(leaves, treedef, unscaled dtypes)`; raises on any bad input."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(updates)
    leaves = [leaf for _, leaf in with_paths]
    bad = _not_floating(with_paths)
    if bad:
        raise TypeError(
            "`updates` must be floating-point gradients (float16, bfloat16, float32, "
            f"float64 arrays). Received: {', '.join(bad)}"
        )
    if state.paths and len(leaves) != len(state.paths):
        raise ValueError(
            "`updates` must hold one gradient per parameter the state was made for "
            f"({len(state.paths)}: {list(state.paths)}). Received: {len(leaves)} gradients"
        )
    if params is None:
        return leaves, treedef, [leaf.dtype for leaf in leaves]
    params = like_gradients(params)
    param_with_paths, param_treedef = jax.tree_util.tree_flatten_with_path(params)
    if param_treedef != treedef:
        raise ValueError(
            "`updates` must have the tree structure of `params`. "
            f"Received: updates={treedef}, params={param_treedef}"
        )
    bad = [
        f"{jax.tree_util.keystr(path)}: {jnp.result_type(leaf)}"
        for path, leaf in param_with_paths
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating)
    ]
    if bad:
        raise TypeError(
            "`params` must be floating-point arrays: a loss-scaled step updates them with "
            "unscaled float gradients, and an integer parameter has none. Leave integer "
            "leaves out of the tree given to the optimizer (optax.masked, Flax's "
            f"`wrt=nnx.Param`, Equinox's `eqx.filter`). Received: {', '.join(bad)}"
        )
    dtypes = []
    for (path, leaf), (_, param) in zip(with_paths, param_with_paths):
        shape, param_shape = tuple(leaf.shape), tuple(jnp.shape(param))
        # Per-example gradients (optax.contrib.dpsgd) have leading axes.
        if shape[len(shape) - len(param_shape) :] != param_shape or len(shape) < len(param_shape):
            raise ValueError(
                f"The gradient at {jax.tree_util.keystr(path)} must have its parameter's shape "
                f"{param_shape} (after any leading per-example axes). Received: shape {shape}"
            )
        # Unscaled in the wider dtype, so that small values do not flush to zero.
        param_dtype = jnp.result_type(param)
        wider = jnp.finfo(param_dtype).bits > jnp.finfo(leaf.dtype).bits
        dtypes.append(param_dtype if wider else leaf.dtype)
    return leaves, treedef, dtypes


def inner_output_check(inner_state):
    """A `check` for `gate.gated_update`: the new inner state must fit in the old one's place."""

    def check(shapes):
        new = jax.tree_util.tree_flatten_with_path(shapes[1])
        old = jax.tree_util.tree_flatten_with_path(inner_state)
        changed = [
            f"{jax.tree_util.keystr(path)}: {jnp.result_type(b)}{list(jnp.shape(b))} -> "
            f"{a.dtype}{list(a.shape)}"
            for (path, a), (_, b) in zip(new[0], old[0])
            if (a.dtype, tuple(a.shape)) != (jnp.result_type(b), tuple(jnp.shape(b)))
        ]
        if new[1] != old[1] or changed:
            raise ValueError(
                "The inner transformation's `update` returned a state of another structure, "
                "dtype or shape than it was given, which a skipped step cannot stand in for. "
                "A transformation whose state changes on its first update (optax.monitor) "
                "can follow dynamic_loss_scale in an optax.chain instead; one whose float32 "
                "hyperparameters widen a lower-precision state (optax.inject_hyperparams "
                "over bfloat16 or float16 parameters) takes hyperparam_dtype=<that dtype>. "
                f"Received: {changed or f'{old[1]} -> {new[1]}'}"
            )

    return check


def _not_floating(with_paths):
    return [
        f"{jax.tree_util.keystr(path)}: {getattr(leaf, 'dtype', type(leaf).__name__)}"
        for path, leaf in with_paths
        if not (hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating))
    ]
