"""One float16 MLP trained twice on the same batches: jmp by hand, then lossscale.optax.

Run: python examples/jmp_to_optax.py
"""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

import lossscale.optax as lso

STEPS, SCALE, PERIOD = 300, 2.0**24, 50  # 2**24 overflows float16 at first
kx, kw, k1, k2 = jax.random.split(jax.random.PRNGKey(0), 4)
x = jax.random.normal(kx, (2048, 32))
y = (x @ jax.random.normal(kw, (32,)) > 0).astype(jnp.int32)
params = {
    "hidden": jax.random.normal(k1, (32, 64)) / 32**0.5,
    "out": jax.random.normal(k2, (64, 2)) / 8.0,
}


def loss_fn(params, x, y):  # float32 parameters, float16 compute
    p = jax.tree.map(lambda w: w.astype(jnp.float16), params)
    logits = jax.nn.relu(x.astype(jnp.float16) @ p["hidden"]) @ p["out"]
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def batch(step):
    idx = jax.random.randint(jax.random.fold_in(kx, step), (128,), 0, len(x))
    return x[idx], y[idx]


# --- Before: jmp's DynamicLossScale, the skip written by hand. ---
tx = optax.adam(3e-3)


@jax.jit
def jmp_step(params, opt_state, loss_scale, x, y):
    grads = jax.grad(lambda p: loss_scale.scale(loss_fn(p, x, y)))(params)
    grads = loss_scale.unscale(grads)
    finite = jmp.all_finite(grads)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state), (params, opt_state))
    return params, opt_state, loss_scale.adjust(finite)


p_jmp, opt_state = params, tx.init(params)
loss_scale = jmp.DynamicLossScale(jnp.float32(SCALE), period=PERIOD)
scales_jmp = []
for step in range(STEPS):
    p_jmp, opt_state, loss_scale = jmp_step(p_jmp, opt_state, loss_scale, *batch(step))
    scales_jmp.append(float(loss_scale.loss_scale))

# --- After: one transformation scales, unscales, skips and adapts. ---
tx_ls = lso.dynamic_loss_scale(optax.adam(3e-3), SCALE, PERIOD, telemetry=True)


@jax.jit
def ls_step(params, state, x, y):
    grads = jax.grad(lambda p: lso.scale_loss(loss_fn(p, x, y), state))(params)
    updates, state = tx_ls.update(grads, state, params)
    return optax.apply_updates(params, updates), state, lso.metrics(state)


p_ls, state = params, tx_ls.init(params)
scales_ls = []
for step in range(STEPS):
    p_ls, state, m = ls_step(p_ls, state, *batch(step))
    scales_ls.append(float(lso.loss_scale(state)))

info = lso.summary(state)
pairs = zip(jax.tree.leaves((p_ls, state.inner_state)), jax.tree.leaves((p_jmp, opt_state)))
diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - b))) for a, b in pairs)
accuracy = float((jnp.argmax(jax.nn.relu(x @ p_ls["hidden"]) @ p_ls["out"], 1) == y).mean())
print(f"skipped {info['skipped_steps']} of {STEPS}, scale {float(m['dynamic_scale']):g}")
print(f"accuracy {accuracy:.3f}  same scales {scales_ls == scales_jmp}  max difference {diff:g}")
