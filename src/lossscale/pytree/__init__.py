"""Functional use of any lossscale optimizer on pytrees of parameters.

JAX users keep parameters in nested containers (a Flax `params` dict, lists,
tuples, any registered pytree) and write pure training steps. `transform`
turns an optimizer into a pair of pure functions over such trees:

```
tx = lossscale.pytree.transform(optimizer)
state = tx.init(params)                               # pure: jit, vmap, eval_shape
new_params, new_state = tx.apply(grads, state, params)  # pure; jit-able
```

`apply` runs the `stateless_apply` of a copy of the optimizer built for the
tree. The state is an `OptimizerState`, a read-only mapping from names
(`"adam/dense_kernel_momentum"`) to arrays, itself a pytree. Without JAX,
nested dicts, lists and tuples of NumPy arrays or torch tensors work, in the
same leaf order. Save a state with `lossscale.saving.save(tx, path, state=state)`.
"""

from lossscale.pytree._state import OptimizerState
from lossscale.pytree._transform import Transform, transform

__all__ = ["OptimizerState", "Transform", "transform"]
