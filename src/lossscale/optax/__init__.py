"""What JAX users plug in: dynamic loss scaling for optax, Flax, NNX and Equinox.

```
tx = lso.dynamic_loss_scale(optax.adam(1e-3))   # any optax transformation inside
state = tx.init(params)
grads = jax.grad(lambda p: lso.scale_loss(loss_fn(p), state))(params)
updates, state = tx.update(grads, state, params)  # unscale, check, update or skip
params = optax.apply_updates(params, updates)
```

`OptaxAdapter` goes the other way: an optax transformation as a lossscale
optimizer. Importing this package imports JAX and optax; `import lossscale`
imports neither.
"""

try:
    import jax  # noqa: F401 - fails early, with the fix, if JAX is missing
    import optax  # noqa: F401
except ImportError as error:
    raise ImportError(
        f"lossscale.optax needs JAX and optax ({error}): pip install jax optax"
    ) from error

from lossscale.optax.adapter import OptaxAdapter
from lossscale.optax.host import check, loss_scale, metrics, scale_loss, summary
from lossscale.optax.state import DynamicLossScaleState
from lossscale.optax.transform import dynamic_loss_scale

__all__ = [
    "DynamicLossScaleState",
    "OptaxAdapter",
    "OptaxOptimizer",
    "check",
    "dynamic_loss_scale",
    "loss_scale",
    "metrics",
    "scale_loss",
    "summary",
]

OptaxOptimizer = OptaxAdapter  # its earlier name
