"""bench/impl_tensorflow.py: the TensorFlow rows, eager, in a tf.function and compiled by XLA.

Ours run here; Keras's need `KERAS_BACKEND=tensorflow`, so they run in a
subprocess (`workers/bench_row_worker.py`), as `lossscale bench` runs them.
Each steps three times on the `quick` large workload (two tensors: the time
is TensorFlow's tracing and compilation) and must give Keras's Adam rule on
the unscaled gradients, in float64 NumPy; torch's Adam rule is 1.4e-5 away.
"""

import numpy as np
import pytest

from lossscale.bench import registry, workloads
from tests.workers.bench_row_worker import final_params, keras_adam, launch

STEPS = 3
ATOL = 5e-7
WORKLOAD = workloads.get("large", quick=True)
MODES = {"": "opt.apply", "-graph": "tf.function", "-xla": "tf.function(jit_compile=True)"}


def _assert_as_keras_adam(params):
    assert [p.shape for p in params] == list(WORKLOAD.shapes)
    for got, want in zip(params, keras_adam(WORKLOAD, STEPS), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def test_the_registry_rows():
    rows = {
        name: (impl.kind, impl.requires, impl.devices, impl.env, impl.description)
        for name, impl in registry.load().items()
        if impl.setup.__module__ == "lossscale.bench.impl_tensorflow"
    }
    keras = {"KERAS_BACKEND": "tensorflow"}
    assert rows == {
        **{
            f"lossscale-tensorflow{suffix}": (
                "ours",
                ("tensorflow",),
                ("cpu", "cuda"),
                {},
                f"lossscale LossScaleOptimizer(Adam) on tf.Variables, {how}",
            )
            for suffix, how in MODES.items()
        },
        **{
            f"keras-tensorflow{suffix}": (
                "peer",
                ("keras", "tensorflow"),
                ("cpu", "cuda"),
                keras,
                f"Keras 3 LossScaleOptimizer(Adam), TensorFlow backend, {how}",
            )
            for suffix, how in MODES.items()
        },
    }


@pytest.mark.parametrize("suffix", list(MODES))
def test_ours_steps_as_keras_adam(suffix):
    import tensorflow as tf

    step = registry.load()[f"lossscale-tensorflow{suffix}"].setup(WORKLOAD).step
    if suffix:  # compiled: a tf.function, with XLA or without
        assert isinstance(step, tf.types.experimental.PolymorphicFunction)
        assert step.experimental_get_tracing_count() == 0
    else:
        assert not isinstance(step, tf.types.experimental.PolymorphicFunction)
    _assert_as_keras_adam(final_params(f"lossscale-tensorflow{suffix}", WORKLOAD, STEPS))


def test_keras_steps_as_keras_adam_in_its_own_process():
    names = [f"keras-tensorflow{suffix}" for suffix in MODES]
    result = launch("tensorflow", "large", STEPS, names)
    assert list(result) == names
    for name in names:
        _assert_as_keras_adam(result[name])
