"""Placing optimizer state next to sharded parameters.

optax makes its scalars (`count`) uncommitted on the default device; a jitted
step returns them replicated, and compiles twice. Placing every uncommitted
leaf replicated over the parameters' devices up front avoids that. Traced
parameters carry no placement: nothing is placed.
"""

import jax

from lossscale.backends import get_ops

_ops = get_ops("jax")


def anchor(params):
    """A float32 scalar replicated like the first committed parameter of `params`, or `None`."""
    for leaf in jax.tree_util.tree_leaves(params):
        if _committed(leaf):
            return _ops.full((), 0.0, "float32", like=leaf)
    return None


def replicate_uncommitted(tree, like):
    """`tree` with every uncommitted concrete array replicated like `like` (an `anchor`)."""
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
