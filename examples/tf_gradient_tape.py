"""A plain `tf.GradientTape` training loop in float16 with LossScaleOptimizer.

The model is two `tf.Variable` matrices (float32 master weights); each step
runs the forward pass on float16 copies, scales the loss before
`tape.gradient` so that small float16 gradients do not flush to zero, and
`apply` unscales the gradients, updates the variables in place and skips
the step (halving the scale) if any gradient overflowed. The step is a
`tf.function` compiled by XLA; it traces once.

    python examples/tf_gradient_tape.py
"""

import tensorflow as tf

import lossscale as ls

tf.random.set_seed(0)
# A toy task: which side of a random hyperplane a point lies on.
x = tf.random.normal((4096, 32))
y = tf.cast(tf.linalg.matvec(x, tf.random.normal((32,))) > 0, tf.int32)

weights = [
    tf.Variable(tf.random.normal((32, 64)) * 32**-0.5),
    tf.Variable(tf.zeros(64)),
    tf.Variable(tf.random.normal((64, 2)) * 64**-0.5),
    tf.Variable(tf.zeros(2)),
]
opt = ls.LossScaleOptimizer(
    ls.optimizers.Adam(learning_rate=3e-3), initial_scale=2.0**15, dynamic_growth_steps=100
)
opt.build(weights)  # before the first traced step: its variables are made once


def logits(x, weights):
    w1, b1, w2, b2 = (tf.cast(w, tf.float16) for w in weights)
    hidden = tf.nn.relu(tf.cast(x, tf.float16) @ w1 + b1)  # float16 activations
    return tf.cast(hidden @ w2 + b2, tf.float32)


@tf.function(jit_compile=True)
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits(x, weights))
        )
        scaled = opt.scale_loss(loss)
    opt.apply(tape.gradient(scaled, weights), weights)  # unscale, check, update in place
    return loss


for step in range(300):
    batch = tf.random.uniform((128,), 0, len(x), dtype=tf.int32)
    loss = train_step(tf.gather(x, batch), tf.gather(y, batch))
    if step % 100 == 0:
        print(f"step {step:3d}  loss {float(loss):.4f}  scale {float(opt.dynamic_scale):g}")

accuracy = float(tf.reduce_mean(tf.cast(tf.argmax(logits(x, weights), 1, tf.int32) == y, "float")))
print(
    f"accuracy {accuracy:.3f}  loss scale {float(opt.dynamic_scale):g}  "
    f"steps applied {int(opt.iterations)}  traces {train_step.experimental_get_tracing_count()}"
)
