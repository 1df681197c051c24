"""bench/impl_lossscale.py: each of our rows steps as its optimizer's published rule says.

Three steps on the `quick` version of a workload, read back and compared
with a float64 NumPy reference of Keras's rule, which ours follows: the
loss-scaled gradients come back unscaled (exactly: the scale is a power of
two) and every step is applied. The tolerance is float32 rounding;
torch's own Adam rule (epsilon after the bias correction) is 1.4e-5 away.
"""

import numpy as np
import pytest

from lossscale.bench import registry, workloads
from tests.workers.bench_row_worker import final_params, keras_adam, sgd_momentum

STEPS = 3
ATOL = 5e-7

ROWS = {
    "lossscale-numpy": ("tiny", keras_adam, {}),
    "lossscale-torch": ("tiny", keras_adam, {}),
    "lossscale-torch-adamw": ("tiny", keras_adam, {"weight_decay": 0.004}),
    "lossscale-torch-sgd-momentum": ("tiny", sgd_momentum, {}),
    "lossscale-torch-optimizer-adamw": ("tiny", keras_adam, {"weight_decay": 0.004}),
    "lossscale-jax": ("tiny", keras_adam, {}),
    # torch.compile's first call compiles for seconds per tensor shape: two tensors.
    "lossscale-torch-compiled": ("large", keras_adam, {}),
    "lossscale-torch-compiled-lean": ("large", keras_adam, {}),
}


def test_the_registry_rows():
    rows = {
        name: (impl.kind, impl.requires, impl.devices, impl.env)
        for name, impl in registry.load().items()
        if impl.setup.__module__ == "lossscale.bench.impl_lossscale"
    }
    assert list(rows) == list(ROWS)
    assert rows == {
        "lossscale-numpy": ("ours", (), ("cpu",), {}),
        **{
            name: ("ours", ("torch",), ("cpu", "cuda"), {})
            for name in ROWS
            if name.startswith("lossscale-torch")
        },
        "lossscale-jax": ("ours", ("jax",), ("cpu", "cuda"), {}),
    }
    describe = {name: registry.REGISTRY[name].description for name in rows}
    assert "LossScaleOptimizer(AdamW)" in describe["lossscale-torch-adamw"]
    assert "SGD(momentum=0.9)" in describe["lossscale-torch-sgd-momentum"]
    assert "lossscale.torch.Optimizer(AdamW)" in describe["lossscale-torch-optimizer-adamw"]
    assert "torch.compile(fullgraph=True)" in describe["lossscale-torch-compiled"]
    assert "tensor guards only" in describe["lossscale-torch-compiled-lean"]


@pytest.mark.parametrize("name", list(ROWS))
def test_a_row_steps_as_its_rule(name):
    workload_name, rule, options = ROWS[name]
    workload = workloads.get(workload_name, quick=True)
    params = final_params(name, workload, STEPS)
    assert [p.shape for p in params] == list(workload.shapes)
    for got, want in zip(params, rule(workload, STEPS, **options), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
