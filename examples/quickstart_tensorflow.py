import tensorflow as tf
import lossscale as ls

x = tf.random.stateless_normal((256, 16), seed=(0, 0))
y = tf.reduce_sum(x, 1, keepdims=True) / 4
params = [tf.Variable(tf.zeros((16, 1))), tf.Variable(tf.zeros(1))]  # updated in place
opt = ls.LossScaleOptimizer(ls.optimizers.Adam(learning_rate=1e-2))
opt.build(params)  # before the first traced step: its variables are made once

@tf.function(jit_compile=True)
def train_step():
    with tf.GradientTape() as tape:  # float16 compute, float32 loss
        h = tf.cast(x, "float16") @ tf.cast(params[0], "float16") + tf.cast(params[1], "float16")
        loss = tf.reduce_mean((tf.cast(h, "float32") - y) ** 2)
        scaled = opt.scale_loss(loss)  # so small float16 gradients survive
    opt.apply(tape.gradient(scaled, params), params)  # unscale, skip inf/NaN, update
    return loss
for _ in range(200):
    loss = train_step()
print(f"loss {float(loss):.4g}  loss scale {float(opt.dynamic_scale):g}")
