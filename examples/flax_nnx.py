"""A Flax NNX classifier trained in float16 with `nnx.Optimizer` and dynamic loss scaling.

The layers compute in float16 on float32 parameters. The optax
transformation given to `nnx.Optimizer` is wrapped in
`lossscale.optax.dynamic_loss_scale`, so `optimizer.update` unscales the
gradients of the scaled loss, skips any step whose gradients overflow and
adapts the scale, all inside one `nnx.jit` step.

    python examples/flax_nnx.py
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import lossscale.optax as lso

data_key, label_key, batch_key = jax.random.split(jax.random.PRNGKey(0), 3)
x = jax.random.normal(data_key, (4096, 32))
y = (x @ jax.random.normal(label_key, (32,)) > 0).astype(jnp.int32)


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(32, 64, dtype=jnp.float16, rngs=rngs)  # float32 params
        self.out = nnx.Linear(64, 2, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x))).astype(jnp.float32)


model = MLP(nnx.Rngs(0))
tx = lso.dynamic_loss_scale(optax.adam(3e-3), initial_scale=2.0**15, dynamic_growth_steps=100)
optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, x, y):
    def loss_fn(model):
        loss = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
        return lso.scale_loss(loss, optimizer.opt_state), loss  # differentiate the scaled loss

    grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)  # unscale, skip inf/NaN, update
    return loss


for step in range(300):
    batch = jax.random.randint(jax.random.fold_in(batch_key, step), (128,), 0, len(x))
    loss = train_step(model, optimizer, x[batch], y[batch])
    if step % 100 == 0:
        print(f"step {step:3d}  loss {float(loss):.4f}  scale {float(lso.loss_scale(optimizer)):g}")

accuracy = float((model(x).argmax(axis=1) == y).mean())
print(f"accuracy {accuracy:.3f}  loss scale {float(lso.loss_scale(optimizer)):g}")
