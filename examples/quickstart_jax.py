import jax
import jax.numpy as jnp
import lossscale as ls

x = jax.random.normal(jax.random.PRNGKey(0), (256, 16))
params = {"w": jnp.zeros((16, 1)), "b": jnp.zeros(1)}
tx = ls.pytree.transform(ls.LossScaleOptimizer(ls.optimizers.Adam(learning_rate=1e-2)))
state = tx.init(params)

def loss_fn(params):  # float16 compute, float32 loss
    h = x.astype(jnp.float16) @ params["w"].astype(jnp.float16) + params["b"].astype(jnp.float16)
    return jnp.mean((h.astype(jnp.float32) - x.sum(1, keepdims=True) / 4) ** 2)

@jax.jit
def train_step(params, state):  # gradients of the scaled loss; unscale, skip inf/NaN, update
    return tx.apply(jax.grad(lambda p: tx.scale_loss(loss_fn(p), state))(params), state, params)

for _ in range(200):
    params, state = train_step(params, state)
print(f"loss {float(loss_fn(params)):.4g}  loss scale {tx.summary(state)['dynamic_scale']:g}")
