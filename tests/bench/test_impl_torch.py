"""bench/impl_torch.py: the GradScaler rows step as torch's optimizers' rules say.

Three steps on the `quick` tiny workload, read back and compared with a
float64 NumPy reference of torch's rule on the unscaled gradients: every
GradScaler row unscales the gradients it is given (the scale is a power of
two, so exactly) and applies every step. The tolerance is float32 rounding;
Keras's Adam rule (epsilon before the bias correction) is 1.4e-5 away.
"""

import numpy as np
import pytest

from lossscale.bench import registry, workloads
from tests.workers.bench_row_worker import final_params, sgd_momentum, torch_adam

# The registry first, in the table's order: importing an implementation
# module first would register its rows first (tests/bench/test_registry.py).
registry.load()
from lossscale.bench import impl_torch  # noqa: E402

STEPS = 3
ATOL = 5e-7
WORKLOAD = workloads.get("tiny", quick=True)

ROWS = {
    "torch-gradscaler-fused": ("peer", torch_adam, {}),
    "torch-gradscaler-foreach": ("peer", torch_adam, {}),
    "torch-gradscaler-adamw-fused": ("peer", torch_adam, {"weight_decay": impl_torch.WEIGHT_DECAY}),
    "torch-gradscaler-sgd-momentum-fused": ("peer", sgd_momentum, {}),
    "lossscale-gradscaler-adamw-fused": (
        "ours",
        torch_adam,
        {"weight_decay": impl_torch.WEIGHT_DECAY},
    ),
    "torch-adam-fused-unscaled": ("baseline", torch_adam, {}),
}


def test_the_registry_rows():
    rows = {
        name: (impl.kind, impl.requires, impl.devices, impl.env)
        for name, impl in registry.load().items()
        if impl.setup.__module__ == "lossscale.bench.impl_torch"
    }
    assert rows == {
        name: (kind, ("torch",), ("cpu", "cuda"), {}) for name, (kind, _, _) in ROWS.items()
    }
    assert list(rows) == list(ROWS)
    assert impl_torch.WEIGHT_DECAY == 0.004  # Keras's AdamW default, as our AdamW rows'
    describe = {name: registry.REGISTRY[name].description for name in rows}
    assert describe["lossscale-gradscaler-adamw-fused"].startswith("lossscale.torch.GradScaler")
    assert all(
        d.startswith("torch.amp.GradScaler")
        for n, d in describe.items()
        if "-gradscaler-" in n and n.startswith("torch")
    )
    assert "no loss scaling" in describe["torch-adam-fused-unscaled"]


@pytest.mark.parametrize("name", list(ROWS))
def test_a_row_steps_as_its_rule(name):
    _, rule, options = ROWS[name]
    params = final_params(name, WORKLOAD, STEPS)
    assert [p.shape for p in params] == list(WORKLOAD.shapes)
    for got, want in zip(params, rule(WORKLOAD, STEPS, **options), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def test_our_grad_scaler_row_is_torchs_bit_for_bit():
    ours = final_params("lossscale-gradscaler-adamw-fused", WORKLOAD, STEPS)
    theirs = final_params("torch-gradscaler-adamw-fused", WORKLOAD, STEPS)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_scaler_stepper_passes_its_options_to_our_scaler(monkeypatch):
    import lossscale.torch

    created = []

    class Recording(lossscale.torch.GradScaler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            created.append(self)

    monkeypatch.setattr(lossscale.torch, "GradScaler", Recording)
    stepper = impl_torch.scaler_stepper(
        WORKLOAD, scaler_kwargs={"diagnostics_every": 1}, adamw=True, fused=True
    )
    (scaler,) = created
    assert scaler.get_scale() == workloads.LOSS_SCALE
    assert scaler.get_growth_interval() == workloads.GROWTH_STEPS
    for _ in range(2):
        stepper.prepare()
        stepper.step()
    summary = scaler.summary()
    assert summary["steps"] == 2 and summary["float16_range_step"] == 1
    _, scaled = workloads.arrays(WORKLOAD)
    peaks = sorted(r["max_abs"] for r in summary["float16_range"].values())
    assert peaks == sorted(float(np.abs(g).max()) for g in scaled)
