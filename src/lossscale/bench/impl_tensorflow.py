"""TensorFlow rows: lossscale and Keras 3's wrapper on `tf.Variable`s, eager and compiled.

Each is timed eagerly (`opt.apply`), in a `tf.function` and in a
`tf.function(jit_compile=True)`; on a GPU the step reads one element back.
"""

from lossscale.bench import frameworks, impl_keras, impl_lossscale
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
        tf = frameworks.tensorflow_for(workload)
        variables, grads = frameworks.tensorflow_arrays(tf, workload)
        opt = impl_lossscale.optimizer()
        opt.build(variables)
        return _stepper(tf, opt, variables, grads, jit_compile)

    return setup


def _keras(jit_compile):
    def setup(workload):
        keras = frameworks.keras_for("tensorflow", workload)
        tf = frameworks.tensorflow_for(workload)
        variables, grads = frameworks.tensorflow_arrays(tf, workload)
        variables = [keras.Variable(v) for v in variables]
        opt = impl_keras.optimizer(keras)
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
