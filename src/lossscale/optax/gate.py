"""Skip an inner optax update with selects XLA can run in place.

A skipped step returns `-0.0` updates and the inner state as it was.
`lax.cond` costs a full-size scratch buffer per update on XLA's CPU backend
(a 16.8M-parameter Adam step ran 3x plain optax's), and selecting at the
outputs keeps both the new and the selected moments alive. So `gated_update`
evaluates the inner update's jaxpr one top-level equation at a time (each
bound with its own source information), selecting every state value as soon
as it is computed: everything downstream reads the selected value, and XLA
fuses one select into each state write.

This uses JAX internals, checked at import; on another JAX, and for a jaxpr
holding anything not recognised, the update is evaluated as traced and
selected at its outputs: the same values, at the cost of the copies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The oldest JAX release whose jaxpr internals the evaluation is tested on.
_TESTED_JAX = (0, 10)


def _load_internals():
    """The internals the evaluation needs, or `None` where JAX lacks any of them."""
    version = tuple(getattr(jax, "__version_info__", (0, 0, 0))[:2])
    if version < _TESTED_JAX:
        return None
    try:
        from jax._src import source_info_util
        from jax.extend import core

        internals = {
            "Literal": core.Literal,
            "Primitive": core.Primitive,
            "ShapedArray": jax.core.ShapedArray,
            "known": frozenset(
                p for p in vars(core.primitives).values() if isinstance(p, core.Primitive)
            ),
            "user_context": source_info_util.user_context,
            "current_name_stack": source_info_util.current_name_stack,
        }
    except (ImportError, AttributeError):
        return None
    if not hasattr(core.JaxprEqn, "ctx") or not hasattr(core.Primitive, "get_bind_params"):
        return None
    return internals


_INTERNALS = _load_internals()


def gated_update(update, applied, grads, state, params, extra_args, check=None):
    """Returns `update(grads, state, params, **extra_args)`, gated by `applied`.

    Args:
        update: The inner transformation's `update` function (pure).
        applied: A boolean scalar: `False` skips the step.
        grads: The gradients, finite (so loops inside the update end).
        state: The inner state.
        params: The parameters, or `None`.
        extra_args: Dict of extra keyword arguments for `update`, as given.
        check: Optional callable given the `(updates, new_state)` shapes
            before anything is evaluated; it raises to refuse them.

    Returns:
        `(updates, new_state)`: the inner update's outputs where `applied`,
        else `-0.0` updates (`p + (-0.0)` is `p` for every `p`) and `state`.
    """
    flat, in_tree = jax.tree_util.tree_flatten((grads, state, params))

    def flat_update(*leaves):
        g, s, p = jax.tree_util.tree_unflatten(in_tree, leaves)
        return update(g, s, p, **extra_args)

    old = jax.tree_util.tree_leaves(state)
    if _INTERNALS is None:
        outputs = flat_update(*flat)  # traced once, here
        if check is not None:
            check(outputs)
        return _select_outputs(applied, outputs, old)
    closed, out_shapes = jax.make_jaxpr(flat_update, return_shape=True)(*flat)
    if check is not None:
        check(out_shapes)
    out_tree = jax.tree_util.tree_structure(out_shapes)
    if unsupported(closed) is not None:
        outputs = jax.tree_util.tree_unflatten(out_tree, _evaluate(closed, flat, {}))
        return _select_outputs(applied, outputs, old)
    n_updates = len(jax.tree_util.tree_leaves(out_shapes[0]))
    jaxpr = closed.jaxpr
    state_vars = jaxpr.outvars[n_updates:]
    reroute = _reroutes(jaxpr, state_vars, old)
    outputs = _evaluate(closed, flat, {v: (applied, o) for v, o in reroute.items()})
    updates = [_skipped_to_negative_zero(applied, u) for u in outputs[:n_updates]]
    rerouted = {id(var) for var in reroute}  # literals are not hashable
    new_state = [
        value if id(var) in rerouted else jnp.where(applied, value, o)
        for var, value, o in zip(state_vars, outputs[n_updates:], old)
    ]
    return jax.tree_util.tree_unflatten(out_tree, updates + new_state)


def unsupported(closed):
    """Why `closed` is evaluated as traced, or `None`.

    The first thing not recognised: `"jax"`, `"effects"`, `"references"`,
    `"primitive <name>"` or `"constant <type>"`.
    """
    if _INTERNALS is None:
        return "jax"
    jaxpr = closed.jaxpr
    shaped = _INTERNALS["ShapedArray"]
    variables = [*jaxpr.constvars, *jaxpr.invars]
    variables += [v for eqn in jaxpr.eqns for v in eqn.outvars]
    if any(type(v.aval) is not shaped for v in variables):
        return "references"
    if closed.effects or any(eqn.effects for eqn in jaxpr.eqns):
        return "effects"
    for eqn in jaxpr.eqns:
        if eqn.primitive not in _INTERNALS["known"]:
            return f"primitive {eqn.primitive.name}"
    for const in closed.consts:
        if not isinstance(const, (np.ndarray, np.generic, jax.Array)):
            return f"constant {type(const).__name__}"
    return None


def _skipped_to_negative_zero(applied, update):
    return jnp.where(applied, update, jnp.asarray(-0.0, update.dtype))


def _select_outputs(applied, outputs, old):
    """`(updates, state)` selected leaf by leaf: `-0.0` updates and `old` where skipped."""
    updates, new_state = outputs
    treedef = jax.tree_util.tree_structure(new_state)
    return (
        jax.tree_util.tree_map(lambda u: _skipped_to_negative_zero(applied, u), updates),
        jax.tree_util.tree_unflatten(
            treedef,
            [jnp.where(applied, v, o) for v, o in zip(jax.tree_util.tree_leaves(new_state), old)],
        ),
    )


def _is_literal(var):
    return isinstance(var, _INTERNALS["Literal"])


def _reroutes(jaxpr, state_vars, old):
    """`{var: old leaf}` for each state output an equation computes, returned once (no literals)."""
    produced = {v for eqn in jaxpr.eqns for v in eqn.outvars}
    variables = [v for v in state_vars if not _is_literal(v)]
    seen = {}
    for var in variables:
        seen[var] = seen.get(var, 0) + 1
    return {
        var: leaf
        for var, leaf in zip(state_vars, old)
        if not _is_literal(var) and var in produced and seen[var] == 1
    }


def _evaluate(closed, args, reroute):
    """Evaluates `closed` on `args` as JAX's evaluator does, rerouting `reroute`'s vars."""
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, args))
    user_context = _INTERNALS["user_context"]
    current_name_stack = _INTERNALS["current_name_stack"]

    def read(var):
        return var.val if _is_literal(var) else env[var]

    for eqn in jaxpr.eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        name_stack = current_name_stack() + eqn.source_info.name_stack
        with user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            result = eqn.primitive.bind(*map(read, eqn.invars), **params)
        results = result if eqn.primitive.multiple_results else [result]
        for var, value in zip(eqn.outvars, results):
            if var in reroute:
                applied, leaf = reroute[var]
                value = jnp.where(applied, value, leaf)
            env[var] = value  # a dropped output's var too: nothing reads it
    return [read(var) for var in jaxpr.outvars]
