"""bench/impl_diagnostics.py: the diagnostics rows, a window of `EVERY` steps with and without.

One timed step of these rows is `EVERY` optimizer steps. On the `quick`
large workload (two tensors) one window must give Keras's Adam rule (ours)
or optax's (`optax.adam`, epsilon after the bias correction) 100 times
over, in float64 NumPy, with the diagnostics-on row bit for bit its
diagnostics-off row: measuring changes no update.
"""

import numpy as np
import pytest

from lossscale.bench import registry, workloads
from tests.workers.bench_row_worker import final_params, keras_adam, torch_adam

# The registry first, in the table's order: importing an implementation
# module first would register its rows first (tests/bench/test_registry.py).
registry.load()
from lossscale.bench import impl_diagnostics  # noqa: E402

WORKLOAD = workloads.get("large", quick=True)
# 100 float32 steps of parameters in [0.5, 1.5); the other epsilon
# placement is 2e-4 away after 100 steps.
ATOL = 1e-5
RULES = {"torch": keras_adam, "jax": keras_adam, "optax": torch_adam}


def test_the_registry_rows():
    rows = {
        name: (impl.kind, impl.requires, impl.devices, impl.env)
        for name, impl in registry.load().items()
        if impl.setup.__module__ == "lossscale.bench.impl_diagnostics"
    }
    requires = {"torch": ("torch",), "jax": ("jax",), "optax": ("jax", "optax")}
    assert rows == {
        f"diagnostics-{on}-{backend}": (kind, requires[backend], ("cpu", "cuda"), {})
        for backend in RULES
        for on, kind in (("off", "baseline"), ("on", "ours"))
    }
    assert impl_diagnostics.EVERY == 100
    assert registry.REGISTRY["diagnostics-on-jax"].description == (
        "100 steps of LossScaleOptimizer(Adam), jax.jit(opt.stateless_apply), diagnostics_every=100"
    )
    assert registry.REGISTRY["diagnostics-off-optax"].description.endswith("no diagnostics")


@pytest.mark.parametrize("backend", list(RULES))
def test_a_window_is_every_steps_and_diagnostics_change_no_update(backend):
    off = final_params(f"diagnostics-off-{backend}", WORKLOAD, 1)
    on = final_params(f"diagnostics-on-{backend}", WORKLOAD, 1)
    reference = RULES[backend](WORKLOAD, impl_diagnostics.EVERY)
    assert [p.shape for p in on] == list(WORKLOAD.shapes)
    for a, b, want in zip(off, on, reference, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("on", [False, True])
def test_the_on_row_measures_once_per_window(monkeypatch, on):
    created = []
    make = impl_diagnostics._optimizer

    def recording(diagnostics):
        created.append(make(diagnostics))
        return created[-1]

    monkeypatch.setattr(impl_diagnostics, "_optimizer", recording)
    name = f"diagnostics-{'on' if on else 'off'}-torch"
    stepper = registry.load()[name].setup(WORKLOAD)
    stepper.step()
    (opt,) = created
    summary = opt.summary()
    assert summary["step_counter"] == impl_diagnostics.EVERY
    assert summary["dynamic_scale"] == workloads.LOSS_SCALE  # every step applied
    if not on:
        assert "float16_range" not in summary
        return
    assert summary["float16_range_step"] == 0  # the window's first step
    _, scaled = workloads.arrays(WORKLOAD)
    peaks = sorted(r["max_abs"] for r in summary["float16_range"].values())
    assert peaks == sorted(float(np.abs(g).max()) for g in scaled)
