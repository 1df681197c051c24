"""bench/frameworks.py: the workloads' arrays in each framework, device checks, Keras's backend."""

import numpy as np
import pytest

from lossscale.bench import frameworks, workloads

WORKLOAD = workloads.get("many_small", quick=True)
GPU_WORKLOAD = workloads.get("gpu_tiny", quick=True)


@pytest.mark.parametrize("scaled", [True, False])
def test_torch_tensors_are_the_workloads_arrays_on_its_device(scaled):
    torch, device, params, grads = frameworks.torch_tensors(WORKLOAD, scaled=scaled)
    assert device == torch.device("cpu")
    expected_params, expected_grads = workloads.arrays(WORKLOAD, loss_scaled=scaled)
    for tensors, arrays in ((params, expected_params), (grads, expected_grads)):
        assert len(tensors) == len(arrays) == len(WORKLOAD.shapes)
        for t, a in zip(tensors, arrays):
            assert t.dtype == torch.float32 and t.device == device
            np.testing.assert_array_equal(t.numpy(), a)
    assert frameworks.torch_sync(torch, device)(None) is None


def test_torch_without_cuda_is_unavailable_on_a_cuda_workload(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(frameworks.Unavailable, match="^torch sees no CUDA device$"):
        frameworks.torch_device(GPU_WORKLOAD)


def test_jax_arrays_are_the_loss_scaled_arrays_on_the_cpu(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "")  # restored after the test
    jax = frameworks.jax_for(WORKLOAD)
    import os

    assert os.environ["JAX_PLATFORMS"] == "cpu"
    params, grads = frameworks.jax_arrays(jax, WORKLOAD)
    expected_params, expected_grads = workloads.arrays(WORKLOAD)
    for arrays, expected in ((params, expected_params), (grads, expected_grads)):
        for a, e in zip(arrays, expected, strict=True):
            assert isinstance(a, jax.Array) and a.dtype == np.float32
            assert a.devices() == {jax.devices("cpu")[0]}
            np.testing.assert_array_equal(np.asarray(a), e)


def test_jax_without_a_gpu_is_unavailable_on_a_cuda_workload(monkeypatch):
    import jax

    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with pytest.raises(
        frameworks.Unavailable, match=r"jax has no GPU here \(default backend 'cpu'\)"
    ):
        frameworks.jax_for(GPU_WORKLOAD)


def test_tensorflow_arrays_are_variables_and_tensors_on_the_cpu():
    tf = frameworks.tensorflow_for(WORKLOAD)
    variables, grads = frameworks.tensorflow_arrays(tf, WORKLOAD)
    expected_params, expected_grads = workloads.arrays(WORKLOAD)
    for v, g, p, e in zip(variables, grads, expected_params, expected_grads, strict=True):
        assert isinstance(v, tf.Variable) and not isinstance(g, tf.Variable)
        assert v.dtype == g.dtype == tf.float32
        assert v.device.endswith("CPU:0") and g.device.endswith("CPU:0")
        np.testing.assert_array_equal(v.numpy(), p)
        np.testing.assert_array_equal(g.numpy(), e)


def test_tensorflow_without_a_gpu_is_unavailable_on_a_cuda_workload(monkeypatch):
    import tensorflow as tf

    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [])
    with pytest.raises(frameworks.Unavailable, match="tensorflow sees no GPU"):
        frameworks.tensorflow_for(GPU_WORKLOAD)


def test_keras_runs_on_the_backend_its_environment_names(monkeypatch):
    monkeypatch.setenv("KERAS_TORCH_DEVICE", "meta")  # restored after the test
    keras = frameworks.keras_for("torch", WORKLOAD)  # conftest: KERAS_BACKEND=torch
    import os

    assert keras.backend.backend() == "torch"
    assert os.environ["KERAS_TORCH_DEVICE"] == "cpu"


@pytest.mark.parametrize("backend", ["jax", "tensorflow"])
def test_keras_on_another_backend_than_the_processs_is_refused(backend):
    with pytest.raises(
        RuntimeError,
        match=rf"The Keras {backend} implementation must run with KERAS_BACKEND={backend}\. "
        r"Received: KERAS_BACKEND='torch'",
    ):
        frameworks.keras_for(backend, WORKLOAD)
