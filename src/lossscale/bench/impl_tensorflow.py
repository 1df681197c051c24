"""TensorFlow rows: lossscale and Keras 3's wrapper on `tf.Variable`s, eager and compiled.

Each is timed three ways, as TensorFlow code runs: eagerly (`opt.apply`),
inside a `tf.function`, and inside a `tf.function(jit_compile=True)`.
Keras runs in its own subprocess with `KERAS_BACKEND=tensorflow`. On the
CPU, TensorFlow finishes a step before it returns; on a GPU the step reads
one element back, which waits for the device.
"""

from lossscale.bench import frameworks, workloads
from lossscale.bench.registry import implementation
from lossscale.bench.timing import Stepper

_MODES = {"": None, "-graph": False, "-xla": True}  # row suffix -> jit_compile
_HOW = {"": "opt.apply", "-graph": "tf.function", "-xla": "tf.function(jit_compile=True)"}


def _stepper(tf, opt, variables, grads, jit_compile):
    def step():
        opt.apply(grads, variables)

    if jit_compile is not None:
        step = tf.function(step, jit_compile=jit_compile)
    return Stepper(step=step, sync=lambda result: variables[0][:1].numpy())


def _ours(jit_compile):
    def setup(workload):
        import lossscale as ls

        tf = frameworks.tensorflow_for(workload)
        variables, grads = frameworks.tensorflow_arrays(tf, workload)
        opt = ls.LossScaleOptimizer(
            ls.optimizers.Adam(learning_rate=1e-3),
            initial_scale=workloads.LOSS_SCALE,
            dynamic_growth_steps=workloads.GROWTH_STEPS,
        )
        opt.scale_loss(1.0)  # what a training step does first; the gradients come pre-scaled
        opt.build(variables)
        return _stepper(tf, opt, variables, grads, jit_compile)

    return setup


def _keras(jit_compile):
    def setup(workload):
        keras = frameworks.keras_for("tensorflow", workload)
        tf = frameworks.tensorflow_for(workload)
        variables, grads = frameworks.tensorflow_arrays(tf, workload)
        variables = [keras.Variable(v) for v in variables]
        opt = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(learning_rate=1e-3),
            initial_scale=workloads.LOSS_SCALE,
            dynamic_growth_steps=workloads.GROWTH_STEPS,
        )
        opt.build(variables)
        stepper = _stepper(tf, opt, variables, grads, jit_compile)
        stepper.sync = lambda result: keras.ops.convert_to_numpy(variables[0].value[:1])
        return stepper

    return setup


for _suffix, _jit in _MODES.items():
    implementation(
        f"lossscale-tensorflow{_suffix}",
        "ours",
        f"lossscale LossScaleOptimizer(Adam) on tf.Variables, {_HOW[_suffix]}",
        requires=("tensorflow",),
        devices=("cpu", "cuda"),
    )(_ours(_jit))
for _suffix, _jit in _MODES.items():
    implementation(
        f"keras-tensorflow{_suffix}",
        "peer",
        f"Keras 3 LossScaleOptimizer(Adam), TensorFlow backend, {_HOW[_suffix]}",
        requires=("keras", "tensorflow"),
        devices=("cpu", "cuda"),
        env={"KERAS_BACKEND": "tensorflow"},
    )(_keras(_jit))
del _suffix, _jit
