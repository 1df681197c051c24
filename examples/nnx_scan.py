"""A Flax NNX model trained with `nnx.split` and `jax.lax.scan` over steps, in float16.

The optimizer state inside the scanned carry is that of
`lossscale.optax.dynamic_loss_scale`; after the scan, the loss scale is
read from what `nnx.split` returned.

Run: python examples/nnx_scan.py
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
tx = lso.dynamic_loss_scale(optax.adam(3e-3), 2.0**20, 100, telemetry=True)  # 2**20 overflows
optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
graphdef, state = nnx.split((model, optimizer))  # one pytree of arrays: the scan's carry


def train_step(state, step):
    model, optimizer = nnx.merge(graphdef, state)
    idx = jax.random.randint(jax.random.fold_in(batch_key, step), (128,), 0, len(x))

    def loss_fn(model):
        loss = optax.softmax_cross_entropy_with_integer_labels(model(x[idx]), y[idx]).mean()
        return lso.scale_loss(loss, optimizer.opt_state), loss

    grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)  # unscale, skip inf/NaN, update
    return nnx.state((model, optimizer)), (loss, lso.loss_scale(optimizer))


@jax.jit
def train(state, steps):
    return jax.lax.scan(train_step, state, steps)


state, (losses, scales) = train(state, jnp.arange(300))  # 300 steps, one compiled scan
print(f"loss {float(losses[0]):.3f} -> {float(losses[-1]):.3f}, scales {scales[:3].tolist()}")
# After the scan, read the split state: loss_scale and metrics take the bare State,
print("loss scale", float(lso.loss_scale(state)), "steps", int(lso.metrics(state)["steps"]))
info = lso.summary((graphdef, state))  # summary and check take the (graphdef, state) pair
model, optimizer = nnx.merge(graphdef, state)
accuracy = float((model(x).argmax(axis=1) == y).mean())
print(f"accuracy {accuracy:.3f}  skipped {info['skipped_steps']}  scale {info['dynamic_scale']:g}")
