"""Placing optimizer state next to sharded parameters.

optax creates a transformation's per-parameter state with `zeros_like`,
which keeps each parameter's sharding, but its scalars (`count`, say) on
the default device, uncommitted. A jitted step then returns those scalars
replicated over the parameters' mesh, their sharding changes between the
first and the second call, and the step compiles twice. Placing every
uncommitted leaf replicated over the parameters' devices up front, as
lossscale's own scalars are placed, makes the first call's inputs look like
every later call's.

Traced parameters (under `jax.jit`, `jax.eval_shape`, `jax.vmap`) carry no
placement, so nothing is placed and the functions here stay pure.
"""

import jax

from lossscale.backends import get_ops

_ops = get_ops("jax")


def anchor(params):
    """A float32 scalar replicated over the devices of the first committed
    parameter of `params`, or `None` (no committed concrete parameter).

    `ops.place(x, like=anchor)` then puts a scalar `x` replicated over the
    parameters' mesh, and any other array replicated over the same devices.
    """
    for leaf in jax.tree_util.tree_leaves(params):
        if _committed(leaf):
            return _ops.full((), 0.0, "float32", like=leaf)
    return None


def replicate_uncommitted(tree, like):
    """`tree` with every uncommitted concrete array replicated like `like`.

    Committed leaves (optax's per-parameter state, which follows its
    parameter) keep their placement.

    Args:
        tree: A pytree, such as an optax state.
        like: An `anchor(params)`, or `None` to place nothing.

    Returns:
        A pytree of the structure of `tree`.
    """
    if like is None:
        return tree
    return jax.tree_util.tree_map(
        lambda x: _ops.place(x, like) if _uncommitted(x) else x,
        tree,
    )


def _concrete(x):
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def _committed(x):
    return _concrete(x) and x.committed


def _uncommitted(x):
    return _concrete(x) and not x.committed
