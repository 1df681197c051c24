"""What JAX users plug in: dynamic loss scaling for optax, Flax, NNX and Equinox.

```
import optax, lossscale.optax as lso

tx = lso.dynamic_loss_scale(optax.adam(1e-3))   # any optax transformation inside
state = tx.init(params)                         # pure: jit, vmap, eval_shape
grads = jax.grad(lambda p: lso.scale_loss(loss_fn(p), state))(params)
updates, state = tx.update(grads, state, params)  # unscale, check, update or skip
params = optax.apply_updates(params, updates)
```

- `dynamic_loss_scale(inner, ...)`: an `optax.GradientTransformationExtraArgs`
  around any optax transformation; it drops into `optax.chain`, Flax's
  `TrainState`, `nnx.Optimizer` and an Equinox loop.
- `loss_scale(state)`, `scale_loss(loss, state)`, `metrics(state)` (inside
  `jit`), `summary(state)`, `check(state)` (between steps): find the
  loss-scale state anywhere in the tree given.
- `DynamicLossScaleState`: the state (a named pytree).
- `OptaxAdapter`: the other direction, an optax transformation adapted into
  a lossscale optimizer (the inner optimizer of a `LossScaleOptimizer`).
  `OptaxOptimizer` is its earlier name, kept as an alias.

Importing this package imports JAX and optax; `import lossscale` imports
neither.
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

# The adapter's name until 0.1.x; kept so that code written for it runs.
OptaxOptimizer = OptaxAdapter
