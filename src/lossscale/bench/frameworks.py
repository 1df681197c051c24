"""Framework plumbing shared by the implementations (runs in workers only).

Every function imports its framework lazily, inside a worker subprocess that
benchmarks one implementation, so selecting a device through the
environment before the first import is safe.
"""

import os

from lossscale.bench import workloads
from lossscale.bench.timing import Stepper


class Unavailable(Exception):
    """An installed implementation cannot run this workload here (e.g. no GPU)."""


def torch_device(workload):
    """Returns `(torch, device)` for the workload's device."""
    import torch

    if workload.device == "cuda" and not torch.cuda.is_available():
        raise Unavailable("torch sees no CUDA device")
    return torch, torch.device(workload.device)


def torch_tensors(workload, scaled=True):
    """Returns `(torch, device, params, grads)` for `workload` (grads loss-scaled)."""
    torch, device = torch_device(workload)
    params, grads = workloads.arrays(workload, loss_scaled=scaled)
    return (
        torch,
        device,
        [torch.from_numpy(p).to(device) for p in params],
        [torch.from_numpy(g).to(device) for g in grads],
    )


def torch_sync(torch, device):
    """A `Stepper.sync` for `device`: waits for CUDA work, nothing on the CPU."""
    if device.type == "cuda":
        return lambda result: torch.cuda.synchronize(device)
    return lambda result: None


def jax_for(workload):
    """Imports JAX on the workload's platform and returns the `jax` module."""
    if workload.device == "cpu":
        # On a GPU machine JAX would otherwise put the CPU workloads on the GPU.
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if workload.device == "cuda" and jax.default_backend() != "gpu":
        raise Unavailable(f"jax has no GPU here (default backend {jax.default_backend()!r})")
    return jax


def jax_arrays(jax, workload):
    """Returns `(params, grads)` as JAX arrays (grads loss-scaled)."""
    params, grads = workloads.arrays(workload)
    to_jax = jax.numpy.asarray
    return [to_jax(p) for p in params], [to_jax(g) for g in grads]


def jax_stepper(jax, opt, params, grads, steps=1):
    """`steps` calls of `jax.jit(opt.stateless_apply)` (`opt` built), state donated, as a step."""
    # Donated in the order the outputs come back (params, then optimizer state):
    # XLA pairs each output with the first donated input of its shape (docs/jax.md).
    apply = jax.jit(
        lambda params, values, grads: opt.stateless_apply(values, grads, params),
        donate_argnums=(0, 1),
    )
    state = {"optimizer": [v.value for v in opt.variables], "params": params}

    def step():
        for _ in range(steps):
            state["params"], state["optimizer"] = apply(state["params"], state["optimizer"], grads)
        return state["params"]

    return Stepper(step=step, sync=jax.block_until_ready)


def optax_stepper(jax, tx, params, grads, steps=1):
    """`steps` jitted, donated optax steps (`update`, then `apply_updates`) as a step."""
    import optax

    def apply(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    apply = jax.jit(apply, donate_argnums=(0, 1))
    state = [params, tx.init(params)]

    def step():
        for _ in range(steps):
            state[:] = apply(*state, grads)
        return state[0]

    return Stepper(step=step, sync=jax.block_until_ready)


def tensorflow_for(workload):
    """Imports TensorFlow for the workload's device and returns the `tf` module."""
    import tensorflow as tf

    if workload.device == "cuda" and not tf.config.list_physical_devices("GPU"):
        raise Unavailable("tensorflow sees no GPU (tensorflow-cpu, or no CUDA device)")
    return tf


def tensorflow_arrays(tf, workload):
    """Returns `(variables, grads)`: `tf.Variable` parameters and tensor gradients (loss-scaled)."""
    params, grads = workloads.arrays(workload)
    device = "/GPU:0" if workload.device == "cuda" else "/CPU:0"
    with tf.device(device):
        return [tf.Variable(p) for p in params], [tf.constant(g) for g in grads]


def keras_for(backend, workload):
    """Imports Keras 3 on `backend` ("torch", "jax" or "tensorflow") for the workload's device."""
    if os.environ.get("KERAS_BACKEND") != backend:
        raise RuntimeError(
            f"The Keras {backend} implementation must run with KERAS_BACKEND={backend}. "
            f"Received: KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}"
        )
    if backend == "torch":
        os.environ["KERAS_TORCH_DEVICE"] = workload.device
        torch_device(workload)
    elif backend == "jax":
        jax_for(workload)
    else:
        tensorflow_for(workload)
    import keras

    return keras
