"""A hand-differentiated NumPy network trained in float16 with LossScaleOptimizer.

Float32 master weights; each step runs the forward and backward passes on
float16 copies, seeded with the loss scale (`opt.scale_loss(1.0)`, the
derivative of the scaled loss with respect to the loss). `apply` takes the
float16 gradients, unscales them in float32 and updates the NumPy arrays in
place, or skips the step if any gradient overflowed.

    python examples/numpy_mlp.py
"""

import numpy as np

import lossscale as ls

rng = np.random.default_rng(0)
x = rng.normal(size=(4096, 32)).astype(np.float32)
y = (x @ rng.normal(size=32) > 0).astype(np.int64)

w1 = (rng.normal(size=(32, 64)) / np.sqrt(32)).astype(np.float32)
b1 = np.zeros(64, np.float32)
w2 = (rng.normal(size=(64, 2)) / np.sqrt(64)).astype(np.float32)
b2 = np.zeros(2, np.float32)
params = [w1, b1, w2, b2]
opt = ls.LossScaleOptimizer(
    ls.optimizers.Adam(learning_rate=3e-3), initial_scale=2.0**15, dynamic_growth_steps=100
)


def forward(xb, dtype):
    a1 = xb.astype(dtype) @ w1.astype(dtype) + b1.astype(dtype)
    h = np.maximum(a1, 0)
    return a1, h, h @ w2.astype(dtype) + b2.astype(dtype)


def loss_and_grads(xb, yb, scale):
    a1, h, logits = forward(xb, np.float16)
    z = logits.astype(np.float32)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    loss = -np.log(p[np.arange(len(yb)), yb]).mean()
    p[np.arange(len(yb)), yb] -= 1  # d loss / d logits, times the batch size
    d_logits = (p * (scale / len(yb))).astype(np.float16)
    d_a1 = (d_logits @ w2.astype(np.float16).T) * (a1 > 0)
    grads = [xb.astype(np.float16).T @ d_a1, d_a1.sum(axis=0), h.T @ d_logits, d_logits.sum(axis=0)]
    return loss, grads


for step in range(300):
    batch = rng.integers(0, len(x), 128)
    loss, grads = loss_and_grads(x[batch], y[batch], np.float32(opt.scale_loss(1.0)))
    opt.apply(grads, params)  # float16 grads, float32 weights, updated in place
    if step % 100 == 0:
        print(f"step {step:3d}  loss {loss:.4f}  scale {float(opt.dynamic_scale):g}")

accuracy = (forward(x, np.float32)[2].argmax(axis=1) == y).mean()
print(
    f"accuracy {accuracy:.3f}  loss scale {float(opt.dynamic_scale):g}  "
    f"steps applied {int(opt.iterations)}"
)
