"""The implementation registry: ours, the peers and the unscaled baseline."""

import pytest

from lossscale.bench import registry


def test_every_requested_implementation_is_registered():
    impls = registry.load()
    by_kind = {}
    for impl in impls.values():
        by_kind.setdefault(impl.kind, []).append(impl.name)
    assert by_kind == {
        "ours": [
            "lossscale-numpy",
            "lossscale-torch",
            "lossscale-torch-adamw",
            "lossscale-torch-sgd-momentum",
            "lossscale-torch-optimizer-adamw",
            "lossscale-jax",
            "lossscale-torch-compiled",
            "lossscale-torch-compiled-lean",
            "lossscale-gradscaler-adamw-fused",
            "lossscale-optax",
            "lossscale-tensorflow",
            "lossscale-tensorflow-graph",
            "lossscale-tensorflow-xla",
            "diagnostics-on-torch",
            "diagnostics-on-jax",
            "diagnostics-on-optax",
            "lossscale-gradscaler-adamw-fused-diagnostics",
            "lossscale-gradscaler-adamw-fused-diagnostics-every-step",
            "lossscale-gradscaler-adamw-fused-diagnostics-window",
            "lossscale-gpt-train-step",
            "lossscale-gpt-train-step-watch",
        ],
        "peer": [
            "torch-gradscaler-fused",
            "torch-gradscaler-foreach",
            "torch-gradscaler-adamw-fused",
            "torch-gradscaler-sgd-momentum-fused",
            "keras-torch",
            "keras-jax",
            "optax-jmp",
            "keras-tensorflow",
            "keras-tensorflow-graph",
            "keras-tensorflow-xla",
        ],
        "baseline": [
            "torch-adam-fused-unscaled",
            "optax-adam-unscaled",
            "diagnostics-off-torch",
            "diagnostics-off-jax",
            "diagnostics-off-optax",
            "lossscale-gradscaler-adamw-fused-window",
        ],
    }
    assert impls["keras-torch"].env == {"KERAS_BACKEND": "torch"}
    assert impls["keras-jax"].env == {"KERAS_BACKEND": "jax"}
    for suffix in ("", "-graph", "-xla"):
        assert impls[f"keras-tensorflow{suffix}"].env == {"KERAS_BACKEND": "tensorflow"}
        assert impls[f"lossscale-tensorflow{suffix}"].requires == ("tensorflow",)
    assert impls["lossscale-numpy"].devices == ("cpu",)
    assert all("cuda" in impl.devices for name, impl in impls.items() if name != "lossscale-numpy")
    assert impls["optax-jmp"].requires == ("jax", "optax", "jmp")
    assert (
        impls["lossscale-optax"].requires
        == impls["optax-adam-unscaled"].requires
        == (
            "jax",
            "optax",
        )
    )


def test_installed_and_versions():
    impl = registry.load()["optax-jmp"]
    assert impl.missing() == []
    assert set(impl.versions()) == {"lossscale", "numpy", "jax", "optax", "jmp"}


def test_registration_errors(monkeypatch):
    monkeypatch.setattr(registry, "REGISTRY", {})
    registry.implementation("a", "ours", "d")(lambda w: None)
    with pytest.raises(ValueError, match="Implementation 'a' is registered twice."):
        registry.implementation("a", "ours", "d")(lambda w: None)
    with pytest.raises(
        ValueError,
        match=r"`kind` must be one of \('ours', 'peer', 'baseline'\). "
        r"Received: kind='rival'",
    ):
        registry.implementation("b", "rival", "d")
    missing = registry.Implementation(
        "c", "peer", "d", ("no_such_module_xyz",), ("cpu",), {}, lambda w: None
    )
    assert missing.missing() == ["no_such_module_xyz"]
