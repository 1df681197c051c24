"""A JAX pytree model trained in float16 with a jit-compiled LossScaleOptimizer step.

`opt.stateless_apply` mutates nothing, so `jax.jit` compiles it: the loss
scale, its counter and Adam's moments travel as a list of arrays, like the
model's leaves. The loss is computed in float16 and scaled before `jax.grad`.

    python examples/jax_pytree.py
"""

import jax
import jax.numpy as jnp

import lossscale as ls

data_key, label_key, init_key, batch_key = jax.random.split(jax.random.PRNGKey(0), 4)
x = jax.random.normal(data_key, (4096, 32))
y = (x @ jax.random.normal(label_key, (32,)) > 0).astype(jnp.int32)

k1, k2 = jax.random.split(init_key)
params = {
    "hidden": {"w": jax.random.normal(k1, (32, 64)) * 32**-0.5, "b": jnp.zeros(64)},
    "out": {"w": jax.random.normal(k2, (64, 2)) * 64**-0.5, "b": jnp.zeros(2)},
}
leaves, treedef = jax.tree_util.tree_flatten(params)


def predict(leaves, x):
    p = jax.tree_util.tree_unflatten(treedef, [leaf.astype(jnp.float16) for leaf in leaves])
    hidden = jax.nn.relu(x.astype(jnp.float16) @ p["hidden"]["w"] + p["hidden"]["b"])
    return (hidden @ p["out"]["w"] + p["out"]["b"]).astype(jnp.float32)


def scaled_loss(leaves, x, y, scale):
    log_probs = jax.nn.log_softmax(predict(leaves, x))
    loss = -jnp.take_along_axis(log_probs, y[:, None], axis=1).mean()
    return loss * scale, loss


opt = ls.LossScaleOptimizer(
    ls.optimizers.Adam(learning_rate=3e-3), initial_scale=2.0**15, dynamic_growth_steps=100
)
opt.build(leaves)
scale_index = next(i for i, v in enumerate(opt.variables) if v is opt.dynamic_scale)
opt_values = [v.value for v in opt.variables]

gradients = jax.jit(jax.grad(scaled_loss, has_aux=True))
apply_gradients = jax.jit(opt.stateless_apply)

for step in range(300):
    batch = jax.random.randint(jax.random.fold_in(batch_key, step), (128,), 0, len(x))
    grads, loss = gradients(leaves, x[batch], y[batch], opt_values[scale_index])
    leaves, opt_values = apply_gradients(opt_values, grads, leaves)
    if step % 100 == 0:
        print(f"step {step:3d}  loss {float(loss):.4f}  scale {float(opt_values[scale_index]):g}")

params = jax.tree_util.tree_unflatten(treedef, leaves)
accuracy = float((predict(leaves, x).argmax(axis=1) == y).mean())
print(
    f"accuracy {accuracy:.3f}  loss scale {float(opt_values[scale_index]):g}  "
    f"hidden.w dtype {params['hidden']['w'].dtype}"
)
