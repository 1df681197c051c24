"""bench/impl_keras.py: Keras 3's LossScaleOptimizer(Adam) rows step as Keras's Adam rule says.

`keras-torch` runs here (the suite's Keras is on torch, conftest.py);
`keras-jax` needs `KERAS_BACKEND=jax`, so it runs in a subprocess
(`workers/bench_row_worker.py`), as `lossscale bench` runs it. Three steps
on a `quick` workload, compared with a float64 NumPy reference of Keras's
rule on the unscaled gradients; torch's Adam rule is 1.4e-5 away.
"""

import numpy as np

from lossscale.bench import registry, workloads
from tests.workers.bench_row_worker import final_params, keras_adam, launch

STEPS = 3
ATOL = 5e-7


def _assert_as_keras_adam(params, workload):
    assert [p.shape for p in params] == list(workload.shapes)
    for got, want in zip(params, keras_adam(workload, STEPS), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def test_the_registry_rows():
    rows = {
        name: (impl.kind, impl.requires, impl.devices, impl.env)
        for name, impl in registry.load().items()
        if impl.setup.__module__ == "lossscale.bench.impl_keras"
    }
    assert rows == {
        "keras-torch": ("peer", ("keras", "torch"), ("cpu", "cuda"), {"KERAS_BACKEND": "torch"}),
        "keras-jax": ("peer", ("keras", "jax"), ("cpu", "cuda"), {"KERAS_BACKEND": "jax"}),
    }


def test_keras_torch_steps_as_keras_adam():
    workload = workloads.get("tiny", quick=True)
    _assert_as_keras_adam(final_params("keras-torch", workload, STEPS), workload)


def test_keras_jax_steps_as_keras_adam_in_its_own_process():
    # Two tensors: the subprocess's time is JAX's import and compilation.
    workload = workloads.get("large", quick=True)
    params = launch("jax", "large", STEPS, ["keras-jax"])["keras-jax"]
    _assert_as_keras_adam(params, workload)
