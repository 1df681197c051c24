"""A Flax Linen classifier trained in float16, with dynamic loss scaling around optax.adam.

The layers compute in float16 on float32 parameters (`dtype=jnp.float16`).
`lossscale.optax.dynamic_loss_scale` wraps the optax transformation, so
`TrainState.apply_gradients` unscales the gradients of the scaled loss,
skips any step whose gradients overflow and adapts the scale; the loss
scale lives in `state.opt_state` and is checkpointed with it.

    python examples/flax_linen.py
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import lossscale.optax as lso

data_key, label_key, init_key, batch_key = jax.random.split(jax.random.PRNGKey(0), 4)
x = jax.random.normal(data_key, (4096, 32))
y = (x @ jax.random.normal(label_key, (32,)) > 0).astype(jnp.int32)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, dtype=jnp.float16)(x))  # float16 compute, float32 params
        return nn.Dense(2, dtype=jnp.float16)(x).astype(jnp.float32)


model = MLP()
tx = lso.dynamic_loss_scale(optax.adam(3e-3), initial_scale=2.0**15, dynamic_growth_steps=100)
params = model.init(init_key, x[:1])["params"]
state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


@jax.jit
def train_step(state, x, y):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return lso.scale_loss(loss, state.opt_state), loss  # differentiate the scaled loss

    grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss  # unscale, skip inf/NaN, update


for step in range(300):
    batch = jax.random.randint(jax.random.fold_in(batch_key, step), (128,), 0, len(x))
    state, loss = train_step(state, x[batch], y[batch])
    if step % 100 == 0:
        print(f"step {step:3d}  loss {float(loss):.4f}  scale {float(lso.loss_scale(state)):g}")

accuracy = float((state.apply_fn({"params": state.params}, x).argmax(axis=1) == y).mean())
print(f"accuracy {accuracy:.3f}  loss scale {float(lso.loss_scale(state)):g}")
