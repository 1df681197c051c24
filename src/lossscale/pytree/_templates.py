"""Built copies of a transform's optimizer (the blueprint), one per parameter-tree signature."""

import copy
import sys

from lossscale.backends import backend_of, get_ops
from lossscale.variables import Variable


def clone(optimizer):
    """A deep copy of an unbuilt optimizer sharing the modules (`Variable`s refer to them)."""
    shared = {id(m): m for m in list(sys.modules.values()) if m is not None}
    return copy.deepcopy(optimizer, shared)


def signature(treedef, leaves):
    """What a template depends on: the tree structure, each leaf's backend, shape and dtype."""
    described = []
    for leaf in leaves:
        backend = backend_of(leaf)
        ops = get_ops(backend)
        described.append((backend, ops.shape(leaf), ops.dtype_name(leaf)))
    return treedef, tuple(described)


def build(blueprint, leaves, paths):
    """A copy of `blueprint` built on `leaves`, its variables named after `paths`."""
    optimizer = clone(blueprint)
    optimizer.build([Variable(leaf, name=path or "param") for leaf, path in zip(leaves, paths)])
    return optimizer


def abstract(blueprint, leaves, paths):
    """A copy of `blueprint` built on the shapes and dtypes of `leaves`: it holds no memory."""
    import jax

    optimizer = clone(blueprint)
    variables = []

    def build_values(*arrays):
        variables.extend(Variable(x, name=p or "param") for x, p in zip(arrays, paths))
        optimizer.build(variables)
        return [v.value for v in variables + optimizer.variables]

    ops = get_ops("jax")
    described = jax.eval_shape(
        build_values, *[jax.ShapeDtypeStruct(ops.shape(x), ops.dtype_name(x)) for x in leaves]
    )
    # The build ran on tracers of a finished trace; keep what they describe.
    for variable, description in zip(variables + optimizer.variables, described):
        variable.rebind(description)
    return optimizer
