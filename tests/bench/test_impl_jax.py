"""The JAX rows of `lossscale bench`: each runs the step it names.

`lossscale-optax` must do plain `optax.adam`'s arithmetic on the unscaled
gradients (the workload's scale is a power of two, so unscaling is exact),
which is what makes `optax-adam-unscaled` its reference: equal to float32
rounding (XLA fuses the two programs differently, 1 ulp here and there).
"""

import numpy as np

from lossscale.bench import registry, workloads


def run(name, workload, steps=3):
    # Through the registry: importing an implementation module directly
    # would register its rows out of the table's order.
    stepper = registry.load()[name].setup(workload)
    for _ in range(steps):
        result = stepper.step()
    stepper.sync(result)
    return [np.asarray(x) for x in result]


def test_lossscale_optax_equals_plain_optax_adam():
    workload = workloads.get("many_small", quick=True)
    ours = run("lossscale-optax", workload)
    reference = run("optax-adam-unscaled", workload)
    peer = run("optax-jmp", workload)
    initial, _ = workloads.arrays(workload)
    for a, b, c, p in zip(ours, reference, peer, initial):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-7)
        assert not np.array_equal(a, p)  # three applied steps
