import numpy as np
import lossscale as ls

rng = np.random.default_rng(0)
x = rng.standard_normal((256, 16)).astype(np.float32)
y = x.sum(1, keepdims=True) / 4
w = ls.Variable(np.zeros((16, 1), np.float32), name="w")  # float32 master weights
opt = ls.LossScaleOptimizer(ls.optimizers.Adam(learning_rate=1e-2))
for _ in range(200):
    err = (x.astype(np.float16) @ w.numpy().astype(np.float16)).astype(np.float32) - y
    loss = float((err**2).mean())
    # The gradient of the scaled loss, by hand in float16: scaled, small values survive.
    scaled_grad = x.T.astype(np.float16) @ (opt.scale_loss(2 * err / len(x))).astype(np.float16)
    opt.apply([scaled_grad], [w])  # unscale, skip inf/NaN, update w in place
print(f"loss {loss:.4g}  loss scale {float(opt.dynamic_scale):g}")
