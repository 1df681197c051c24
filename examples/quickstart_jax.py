import jax
import optax
import lossscale.optax as lso

x = jax.random.normal(jax.random.PRNGKey(0), (256, 16))
params = {"w": jax.numpy.zeros((16, 1)), "b": jax.numpy.zeros(1)}
tx = lso.dynamic_loss_scale(optax.adam(learning_rate=1e-2))  # around any optax transformation
state = tx.init(params)

def loss_fn(params):  # float16 compute, float32 loss
    h = x.astype("float16") @ params["w"].astype("float16") + params["b"].astype("float16")
    return ((h.astype("float32") - x.sum(1, keepdims=True) / 4) ** 2).mean()

@jax.jit
def train_step(params, state):  # gradients of the scaled loss; unscale, skip inf/NaN, update
    updates, state = tx.update(jax.grad(lambda p: lso.scale_loss(loss_fn(p), state))(params), state)
    return optax.apply_updates(params, updates), state
for _ in range(200):
    params, state = train_step(params, state)
print(f"loss {float(loss_fn(params)):.4g}  loss scale {float(lso.loss_scale(state)):g}")
