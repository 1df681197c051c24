"""Built copies of a transform's optimizer, one per parameter-tree signature.

A transform never builds the optimizer it is given (the blueprint): an
optimizer is built for one list of variables, and a transform serves any
tree. It builds copies instead:

- `build(blueprint, leaves, paths)`: a copy built on the given leaves,
  concrete or traced. `init` reads its initial values; under `jax.jit`,
  `jax.vmap` or `jax.eval_shape` they are traced like any other value, so
  `init` is pure.
- `abstract(blueprint, leaves, paths)`: a copy built on the shapes and
  dtypes of JAX leaves only (under `jax.eval_shape`), whose variables then
  hold `jax.ShapeDtypeStruct`s: no memory, no tracer. `apply` runs its
  `stateless_apply`, which binds every variable to the values passed in,
  so a template's own values are never read.

Importing this module imports no backend.
"""

import copy
import sys

from lossscale.backends import backend_of, get_ops
from lossscale.variables import Variable


def clone(optimizer):
    """A deep copy of an unbuilt optimizer that shares only modules.

    A `Variable` refers to its backend's module, which `copy.deepcopy`
    cannot copy and which holds no state of the optimizer.
    """
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
    """A copy of `blueprint` built on the shapes and dtypes of the JAX arrays `leaves`.

    Returns:
        The built copy; each of its variables (and of the model variables it
        was built with) holds a `jax.ShapeDtypeStruct`.
    """
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
    # (`backends._common.bound` rebinds storages the same way, temporarily.)
    for variable, description in zip(variables + optimizer.variables, described):
        variable.rebind(description)
    return optimizer
