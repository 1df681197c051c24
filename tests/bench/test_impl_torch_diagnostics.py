"""bench/impl_torch_diagnostics.py: GradScaler's diagnostics rows and the GPT training step.

The diagnostics rows must step as the row they are compared with
(`lossscale-gradscaler-adamw-fused`), bit for bit: measuring changes no
update. The GPT training step must build a model with exactly the `gpt`
workload's parameters, train on float16 autocast, and give the same
parameters with `watch(model, scaler)` as without: the hooks only observe.
"""

import numpy as np
import pytest
import torch

from lossscale.bench import frameworks, registry, workloads
from tests.workers.bench_row_worker import final_params, torch_adam

# The registry first, in the table's order: importing an implementation
# module first would register its rows first (tests/bench/test_registry.py).
registry.load()
from lossscale.bench import impl_torch, impl_torch_diagnostics  # noqa: E402

STEPS = 3
GPT = workloads.get("gpt", quick=True)


def test_the_registry_rows():
    rows = {
        name: (impl.kind, impl.requires, impl.devices, impl.env)
        for name, impl in registry.load().items()
        if impl.setup.__module__ == "lossscale.bench.impl_torch_diagnostics"
    }
    names = [
        "lossscale-gradscaler-adamw-fused-diagnostics",
        "lossscale-gradscaler-adamw-fused-diagnostics-every-step",
        "lossscale-gradscaler-adamw-fused-window",
        "lossscale-gradscaler-adamw-fused-diagnostics-window",
        "lossscale-gpt-train-step",
        "lossscale-gpt-train-step-watch",
    ]
    assert rows == {
        name: (
            "baseline" if name.endswith("fused-window") else "ours",
            ("torch",),
            ("cpu", "cuda"),
            {},
        )
        for name in names
    }
    assert impl_torch_diagnostics.WINDOW == 100
    assert impl_torch_diagnostics.DIAGNOSTICS_EVERY == 100
    assert registry.REGISTRY[names[0]].description.startswith(
        "lossscale.torch.GradScaler(diagnostics_every=100)"
    )
    assert "watch(model, scaler)" in registry.REGISTRY[names[5]].description
    assert registry.REGISTRY[names[3]].description.startswith(
        "100 steps of lossscale.torch.GradScaler("
    )


@pytest.mark.parametrize("suffix", ["-diagnostics", "-diagnostics-every-step"])
def test_the_diagnostics_rows_step_as_the_row_without(suffix):
    workload = workloads.get("tiny", quick=True)
    plain = final_params("lossscale-gradscaler-adamw-fused", workload, STEPS)
    measured = final_params(f"lossscale-gradscaler-adamw-fused{suffix}", workload, STEPS)
    reference = torch_adam(workload, STEPS, weight_decay=impl_torch.WEIGHT_DECAY)
    for a, b, want in zip(plain, measured, reference, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(b, want, rtol=0, atol=5e-7)


def test_a_window_is_a_hundred_steps_and_diagnostics_change_no_update():
    """One timed step of the `-window` rows: 100 AdamW steps, the same with diagnostics."""
    workload = workloads.get("large", quick=True)
    plain = final_params("lossscale-gradscaler-adamw-fused-window", workload, 1)
    measured = final_params("lossscale-gradscaler-adamw-fused-diagnostics-window", workload, 1)
    reference = torch_adam(
        workload, impl_torch_diagnostics.WINDOW, weight_decay=impl_torch.WEIGHT_DECAY
    )
    assert [p.shape for p in measured] == list(workload.shapes)
    for a, b, want in zip(plain, measured, reference, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(b, want, rtol=0, atol=1e-5)


def _train(monkeypatch, name, steps=2):
    import lossscale.torch

    models, watched = [], []
    build, watch = impl_torch_diagnostics._gpt, lossscale.torch.watch

    def recording(torch, workload):
        out = build(torch, workload)
        models.append(out[0])
        return out

    def recording_watch(model, scaler, **kwargs):
        watched.append((model, scaler))
        return watch(model, scaler, **kwargs)

    monkeypatch.setattr(impl_torch_diagnostics, "_gpt", recording)
    monkeypatch.setattr(lossscale.torch, "watch", recording_watch)
    stepper = registry.load()[name].setup(GPT)
    (model,) = models
    assert [m for m, _ in watched] == ([model] if name.endswith("-watch") else [])
    initial = [p.detach().clone() for p in model.parameters()]
    for _ in range(steps):
        stepper.sync(stepper.step())
    return model, initial


def test_the_gpt_model_has_the_workloads_parameters():
    model, vocab, context = impl_torch_diagnostics._gpt(torch, GPT)
    assert tuple(tuple(p.shape) for p in model.parameters()) == GPT.shapes
    assert (vocab, context) == (256, 64)
    tokens = torch.zeros((2, 8), dtype=torch.long)
    assert model(tokens).shape == (2, 8, vocab)


def test_the_gpt_model_refuses_other_shapes():
    with pytest.raises(ValueError, match="The GPT model's parameter shapes must be the workload's"):
        impl_torch_diagnostics._gpt(torch, workloads.get("tiny", quick=True))


def test_the_training_step_trains_and_watching_changes_nothing(monkeypatch):
    model, initial = _train(monkeypatch, "lossscale-gpt-train-step")
    watched, watched_initial = _train(monkeypatch, "lossscale-gpt-train-step-watch")
    params = list(model.parameters())
    for p, q, p0, q0 in zip(params, watched.parameters(), initial, watched_initial, strict=True):
        assert torch.equal(p0, q0)  # one seed
        assert p.dtype == torch.float32 and torch.isfinite(p).all()
        assert torch.equal(p, q)
    # Every parameter moved: the steps were applied, not skipped.
    assert all(not torch.equal(p, p0) for p, p0 in zip(params, initial))


@pytest.mark.parametrize("name", ["lossscale-gpt-train-step", "lossscale-gpt-train-step-watch"])
def test_the_training_step_runs_on_the_gpt_workloads_only(name):
    with pytest.raises(
        frameworks.Unavailable, match="the training step is built for the gpt workload only"
    ):
        registry.load()[name].setup(workloads.get("tiny", quick=True))
