"""Scalars of a step computed on the host, where their tensors live in host memory.

On a `multi.HOST_READABLE` device (the CPU) reading a 0-d tensor waits for
nothing, and a few float operations in Python cost less than dispatching a
kernel for each. torch's own CPU fused optimizers read their `state_step`
and `found_inf` on the host for the same reason. On any other device, and
while `torch.compile` traces (the compiler folds the arithmetic into the
step; a host read would break the graph), nothing here applies and the
callers keep their device arithmetic.

Adam's step size. Keras computes `alpha = lr * sqrt(1 - beta_2**t) / (1 -
beta_1**t)` as float32 tensor operations, each rounded to float32:
`t = float32(iterations + 1)`, both powers in one `pow` of the pair
`(beta_1, beta_2)` (see `fused._adam_step_size`), `1 - ...`, `sqrt`, `*`,
`/`. `adam_step_size` repeats them in Python with the same roundings. The
conversions, `+`, `-`, `*` and `/` are correctly rounded in IEEE float32,
and computing one of them in double and rounding the result to float32 gives
that same correctly rounded value (double has more than twice float32's
precision plus two bits). torch's two others are not correctly rounded, and
are taken from torch itself:

- `pow`: torch's CPU `pow` on a two-element float32 tensor runs its scalar
  loop, `std::pow(float, float)`, which is the C library's `powf`; that
  function is called here (through ctypes). Before the first use with a
  pair of betas, `_powf_agrees` compares the two on a table of steps.
- `sqrt`: torch's CPU float32 `sqrt` is not correctly rounded (torch
  2.13's CPU build: one unit in the last place off for about one value in
  seven). Its argument `1 - beta_2**t` depends on the step alone, so torch computes it
  for `ROOT_BLOCK` steps at once, kept in the kernel cache: three
  operations every `ROOT_BLOCK` steps, none once `1 - beta_2**t` has
  reached 1. `_sqrt_agrees` checks once that torch's root of each value
  does not depend on the length of the tensor holding it, and that the
  root of 1 is 1.

Where a check fails, or no C library `powf` can be loaded, the step size
stays on the device. tests/backends/torch/test_host.py compares the host's
step size with the device's over steps up to 10**7 and several betas.
"""

import ctypes
import ctypes.util
import functools
import math
import struct

import torch

from lossscale.backends.torch import multi, ops, plans

_FLOAT32 = struct.Struct("f")

# Steps at which `_powf_agrees` compares the C library's `powf` with torch's:
# the first ones, round numbers, both sides of 2**24 (where float32 steps
# start to round), and long runs.
CHECKED_STEPS = (1, 2, 3, 4, 7, 10, 100, 1000, 4097, 65537, 10**6, 2**24, 2**24 + 2, 10**7)
# Steps whose `sqrt(1 - beta_2**t)` torch computes at once (see the module doc).
ROOT_BLOCK = 256


def float32(value):
    """`value` rounded to the nearest float32 (beyond its range: an infinity), as a Python float."""
    return _FLOAT32.unpack(_FLOAT32.pack(value))[0]


def readable(tensor):
    """Whether a step may read `tensor` on the host: on a `HOST_READABLE` device, eager."""
    return tensor.device.type in multi.HOST_READABLE and not torch.compiler.is_compiling()


def learning_rate(lr, group, cache):
    """The group's learning rate (`foreach.scalar`'s 0-d tensor) as a Python float.

    Read on the host once per tensor and kept while it is unwritten
    (`plans.derived`): a rate a schedule hands as a new tensor each step
    costs one read per step, a rate held in a variable none.
    """
    return plans.derived(cache, ("torch host lr", group.device, group.dtype), lr, float)


def adam_step_size(beta_1, beta_2, iterations, lr, group, cache):
    """Keras's `alpha` for `group` computed on the host, bit for bit; None where it cannot be.

    Args:
        beta_1, beta_2: Python floats, the optimizer's.
        iterations: The steps taken before this one (an integer tensor or a
            Python int).
        lr: The group's learning rate, a 0-d tensor of its dtype and device.
        group: A float32 `plans.Group` on a `HOST_READABLE` device (else None
            is returned).
        cache: The optimizer's kernel cache (the rate read on the host).

    Returns:
        A Python float (a float32 value), or None: on another device or
        dtype, under `torch.compile`, where a check of `powf` or `sqrt`
        failed, where `1 - beta_1**t` is 0 or the result is not finite.
    """
    steps = ops.unwrap(iterations)
    if (
        group.dtype != torch.float32
        or not readable(lr)
        or (isinstance(steps, torch.Tensor) and not readable(steps))
        or group.device.type not in multi.HOST_READABLE
        or not _powf_agrees(beta_1, beta_2)
        or not _sqrt_agrees()
    ):
        return None
    step = int(steps)
    bias_1, root = _biases(beta_1, beta_2, step, cache)
    if bias_1 == 0.0:
        return None
    alpha = float32(float32(learning_rate(lr, group, cache) * root) / bias_1)
    return alpha if math.isfinite(alpha) else None  # an infinite rate: left to the device


def _bias(beta, step):
    """`1 - beta**t` in float32 (`t = float32(step + 1)`), as the device rounds it."""
    return float32(1.0 - _powf(beta, float32(float(step + 1))))


def _biases(beta_1, beta_2, step, cache):
    """`(1 - beta_1**t, torch's float32 sqrt(1 - beta_2**t))` at `step` (see the module doc)."""
    key = ("torch host biases", beta_1, beta_2)
    block = cache.get(key)
    if block is None or not 0 <= step - block[0] < len(block[1]):
        span = range(step, step + ROOT_BLOCK)
        squares = [_bias(beta_2, s) for s in span]
        roots = (
            [1.0] * ROOT_BLOCK  # `_sqrt_agrees`: torch's root of 1 is 1
            if all(x == 1.0 for x in squares)
            else torch.sqrt(torch.tensor(squares, dtype=torch.float32)).tolist()
        )
        block = cache[key] = (step, [_bias(beta_1, s) for s in span], roots)
    start, bias_1, roots = block
    return bias_1[step - start], roots[step - start]


def _load_powf():
    name = ctypes.util.find_library("m")
    try:
        function = ctypes.CDLL(name).powf
    except (OSError, AttributeError, TypeError):
        return None
    function.restype = ctypes.c_float
    function.argtypes = (ctypes.c_float, ctypes.c_float)
    return function


_POWF = _load_powf()


def _powf(base, exponent):
    # ctypes converts the Python floats to C floats (rounding `base` to
    # float32, as `ops.constant` does) and the result back exactly.
    return _POWF(base, exponent)


@functools.cache
def _powf_agrees(beta_1, beta_2):
    """Whether `powf` equals torch's CPU `pow` of the pair `(beta_1, beta_2)` at `CHECKED_STEPS`."""
    if _POWF is None:
        return False
    betas = torch.tensor((beta_1, beta_2), dtype=torch.float32)
    for step in CHECKED_STEPS:
        t = float32(float(step))
        powers = torch.pow(betas, torch.tensor(t, dtype=torch.float32)).tolist()
        if powers != [_powf(beta_1, t), _powf(beta_2, t)]:
            return False
    return True


@functools.cache
def _sqrt_agrees():
    """Whether torch's float32 `sqrt` of a value is the same alone as in a tensor, and 1 of 1."""
    values = torch.linspace(0.0, 1.0, 4 * ROOT_BLOCK + 3, dtype=torch.float32)
    together = torch.sqrt(values).tolist()
    alone = [torch.sqrt(v).item() for v in values]
    return together == alone and torch.sqrt(torch.tensor(1.0)).item() == 1.0
