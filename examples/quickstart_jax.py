import jax
import jax.numpy as jnp
import lossscale as ls

x = jax.random.normal(jax.random.PRNGKey(0), (256, 16))
y = x.sum(axis=1, keepdims=True) / 4
params = [jnp.zeros((16, 1)), jnp.zeros(1)]
opt = ls.LossScaleOptimizer(ls.optimizers.Adam(learning_rate=1e-2))
opt.build(params)
state = [v.value for v in opt.variables]  # [step_counter, dynamic_scale, Adam's state...]

def loss_fn(params, scale):  # float16 compute, float32 loss, times the loss scale
    w, b = (p.astype(jnp.float16) for p in params)
    return jnp.mean(((x.astype(jnp.float16) @ w + b).astype(jnp.float32) - y) ** 2) * scale

@jax.jit
def train_step(params, state):
    grads = jax.grad(loss_fn)(params, state[1])
    return opt.stateless_apply(state, grads, params)  # unscale, skip on inf/NaN, update

for step in range(200):
    params, state = train_step(params, state)
print(f"loss {float(loss_fn(params, 1.0)):.4g}  loss scale {float(state[1]):g}")
