"""Functional use of any lossscale optimizer on pytrees of parameters.

JAX users keep parameters in nested containers (a Flax `params` dict, lists,
tuples, any registered pytree) and write pure training steps. `transform`
turns an optimizer into a pair of pure functions over such trees:

```
tx = lossscale.pytree.transform(optimizer)
state = tx.init(params)                               # pure: jit, vmap, eval_shape
new_params, new_state = tx.apply(grads, state, params)  # pure; jit-able
```

The math is not written again here: `apply` flattens the trees and calls the
`stateless_apply` of a copy of the optimizer built for that tree (the
optimizer given is a blueprint, never built or written; see `Transform`).
The state is an `OptimizerState`, a read-only mapping from readable names
(`"adam/dense_kernel_momentum"`) to arrays, itself a pytree: it goes through
`jax.jit`, `jax.vmap` and checkpointing libraries like any dict of arrays.

Trees are flattened with `jax.tree_util` when JAX has been imported (so
custom pytree nodes work); otherwise nested dicts, lists and tuples of NumPy
arrays or torch tensors are supported with the same leaf order (dict keys
sorted, `None` an empty subtree). Importing this package imports no backend.

A transform's state is saved with `lossscale.saving.save(tx, path,
state=state)` and restored with `lossscale.saving.restore(tx, path,
state=target)` (`_checkpoint`).
"""

from lossscale.pytree._state import OptimizerState
from lossscale.pytree._transform import Transform, transform

__all__ = ["OptimizerState", "Transform", "transform"]
