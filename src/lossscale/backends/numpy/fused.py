"""Fused, in-place NumPy kernels for `Adam` and `SGD`.

An optimizer step is memory-bound. The generic path runs `update_step` once
per variable, and every NumPy expression in it allocates a full-size
temporary and makes one more pass over main memory (about a dozen for Adam).
These kernels walk each variable in blocks small enough to stay in a core's
L2 cache instead: a block of gradient, parameter and slots comes from memory
once, the whole update rule runs on it with `out=` into two block-sized
scratch buffers, and the results go back once. Blocks are shared among a few
threads (`parallel`), because on many machines one core cannot
saturate the memory bus.

Each kernel performs the same float operations in the same order and dtype
as the optimizer's `update_step`, so the results are identical bit for bit
(`tests/backends/numpy/test_fused.py` checks it). A variable whose arrays are not
C-contiguous floats takes `update_step` instead.

Scratch buffers belong to one optimizer (kept in its kernel `cache`), so
they are allocated on its first step and reused afterwards.
"""

import numpy as np

from lossscale.backends._common import unwrap
from lossscale.backends.numpy import ops, parallel

# Elements per block. An Adam block touches seven arrays of BLOCK values (g,
# p, m, v and three scratch buffers), 7 MiB in float32: beyond L2, but it
# stays in L3 cache through the dozen NumPy calls of the update rule. Each
# call that first reads an array from memory streams it at one core's rate
# (the hardware prefetcher ramps up on each call), and each call costs
# ~0.2 us of Python, so larger blocks win until L3 runs out. Measured on
# 2 vCPUs of an EPYC (16M parameters, 1 MiB L2 and 32 MiB L3; CPU time per
# step against 2**17, block sizes alternating step by step): 2**15 +16%,
# 2**16 +5%, 2**18 -4% to -9%, 2**19 and 2**20 no better than 2**17
# (-2% to +14% from run to run).
BLOCK = 1 << 18
# Variables smaller than this are packed together: their arrays are gathered
# into one block of at most PACK_CAPACITY elements, updated there, and copied
# back, which costs three or four copies per variable instead of a dozen
# NumPy calls.
PACK_BELOW = 1 << 14
PACK_CAPACITY = 1 << 16
# The most arrays an update rule touches besides the gradient (Adam with
# amsgrad: parameter, two moments, maximum second moment).
MAX_ARRAYS = 4

# --- kernels -------------------------------------------------------------


def adam(params, grads, slots, hyper, *, iterations, lr, update_step, cache, grad_scale=None):
    """Fused `Adam.update_step` over every variable (amsgrad included).

    `grad_scale`: see `_job`.
    """
    lists = [slots["momentums"], slots["velocities"]]
    if "velocity_hats" in slots:
        lists.append(slots["velocity_hats"])
    constants, unscalers = {}, {}
    jobs = []
    for i, (grad, variable) in enumerate(zip(grads, params)):
        arrays = _fusable([variable.value] + [s[i].value for s in lists])
        if arrays is None:
            update_step(_unscaled(grad, grad_scale), variable, lr)
            continue
        dtype = arrays[0].dtype
        if dtype not in constants:
            constants[dtype] = _adam_constants(hyper, iterations, lr, dtype.name)
        jobs.append(_job(grad, arrays, constants[dtype], grad_scale, unscalers))
    _run(cache, jobs, _adam_block)


def _adam_constants(hyper, iterations, learning_rate, dtype):
    # The same scalar expressions as `Adam.update_step`, evaluated once per
    # dtype instead of once per variable. The Python numbers `update_step`
    # mixes in (1 - beta, epsilon) become 0-d arrays of the variable's dtype:
    # the same values (NumPy casts a Python float to the array's dtype), and
    # a ufunc call with one takes a third of the time it takes with a float.
    lr = ops.cast(learning_rate, dtype)
    step = ops.cast(iterations + 1, dtype)
    beta_1_power = ops.power(ops.cast(hyper.beta_1, dtype), step)
    beta_2_power = ops.power(ops.cast(hyper.beta_2, dtype), step)
    alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    return (
        alpha,
        np.asarray(1 - hyper.beta_1, dtype),
        np.asarray(1 - hyper.beta_2, dtype),
        np.asarray(hyper.epsilon, dtype),
    )


# A block function `fn(g, arrays, constants, t, u)` updates `arrays` (flat
# blocks of the variable and its slots) from the gradient block `g`, with
# `t` and `u` as scratch. When `g` is the unscaled copy in scratch, `u` is
# that same buffer (one buffer fewer in cache: 2-6% less CPU per step), so
# a block function reads `g` for the last time before it first writes `u`.
# They pass `out` positionally: with a keyword a ufunc call costs about 20%
# more, and calls on ~10^5 elements are short enough for that to show.
_sub, _mul, _add, _div = np.subtract, np.multiply, np.add, np.divide


def _adam_block(g, arrays, constants, t, u):
    alpha, one_minus_beta_1, one_minus_beta_2, epsilon = constants
    p, m, v = arrays[:3]
    _sub(g, m, t)  # m += (g - m) * (1 - beta_1)
    _mul(t, one_minus_beta_1, t)
    _add(m, t, m)
    np.square(g, t)  # v += (g**2 - v) * (1 - beta_2)
    _sub(t, v, t)
    _mul(t, one_minus_beta_2, t)
    _add(v, t, v)
    if len(arrays) == 4:  # amsgrad: v_hat = max(v_hat, v), then use v_hat
        np.maximum(arrays[3], v, out=arrays[3])  # positional out is deprecated here
        v = arrays[3]
    np.sqrt(v, t)  # p -= (m * alpha) / (sqrt(v) + epsilon)
    _add(t, epsilon, t)
    _mul(m, alpha, u)
    _div(u, t, u)
    _sub(p, u, p)


def sgd(params, grads, slots, hyper, *, iterations, lr, update_step, cache, grad_scale=None):
    """Fused `SGD.update_step` over every variable (plain, momentum, Nesterov).

    `grad_scale`: see `_job`.
    """
    del iterations  # SGD's rule does not read it
    momentums = slots.get("momentums")
    constants, unscalers = {}, {}
    jobs = []
    for i, (grad, variable) in enumerate(zip(grads, params)):
        arrays = [variable.value]
        if hyper.momentum != 0:
            arrays.append(momentums[i].value)
        arrays = _fusable(arrays)
        if arrays is None:
            update_step(_unscaled(grad, grad_scale), variable, lr)
            continue
        dtype = arrays[0].dtype
        if dtype not in constants:
            constants[dtype] = (
                ops.cast(lr, dtype.name),
                ops.cast(hyper.momentum, dtype.name),
                hyper.nesterov,
            )
        jobs.append(_job(grad, arrays, constants[dtype], grad_scale, unscalers))
    _run(cache, jobs, _sgd_block)


def _sgd_block(g, arrays, constants, t, u):
    lr, momentum, nesterov = constants
    _mul(g, lr, t)
    if len(arrays) == 1:  # p -= g * lr
        _sub(arrays[0], t, arrays[0])
        return
    p, m = arrays
    _mul(m, momentum, m)  # m = m * momentum - g * lr
    _sub(m, t, m)
    if nesterov:  # p += m * momentum - g * lr
        _mul(m, momentum, u)
        _sub(u, t, u)
        _add(p, u, p)
    else:  # p += m
        _add(p, m, p)


# --- arrays --------------------------------------------------------------


def _fusable(arrays):
    """Flat views of `arrays`, or None unless all are writeable C-contiguous floats of one dtype."""
    dtype = arrays[0].dtype
    if dtype.kind != "f":
        return None
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.dtype != dtype:
            return None
        flags = a.flags
        if not (flags.c_contiguous and flags.writeable):
            return None
    return [a.reshape(-1) for a in arrays]


def _job(grad, arrays, constants, grad_scale, unscalers):
    """One variable's work: `(flat gradient, flat arrays, constants, unscaler)`.

    With `grad_scale` (the loss-scale wrapper's scale, still multiplied into
    the gradients), each gradient block is unscaled in cache by `unscaler`,
    exactly as `ops.unscale` would divide the whole gradient, which saves
    that pass over memory and its full-size result. The gradients
    themselves are never written. Gradients whose dtype is not the
    variable's, or narrower than float32, are unscaled up front instead,
    since `unscale` then divides in another dtype. `unscalers` holds one
    per dtype, shared by the step's jobs (so that small ones can be packed
    together).
    """
    dtype = arrays[0].dtype
    g = np.asarray(unwrap(grad))
    unscaler = None
    if grad_scale is not None:
        if g.dtype == dtype and dtype.itemsize >= 4:
            unscaler = unscalers.get(dtype)
            if unscaler is None:
                unscaler = unscalers[dtype] = _unscaler(grad_scale, dtype)
        else:
            g = _unscaled(g, grad_scale)
    # `update_step` casts the gradient to the variable's dtype; so does this
    # (a copy only when the dtypes differ or the gradient is strided).
    if g.dtype != dtype:
        g = g.astype(dtype)
    return np.ascontiguousarray(g).reshape(-1), arrays, constants, unscaler


def _unscaler(grad_scale, dtype):
    """`(ufunc, operand)` such that `ufunc(g, operand)` equals `g / scale` bit for bit.

    A power-of-two scale (what the dynamic loss scale is with the default
    factors) has an exact reciprocal, and multiplying by it gives the
    correctly rounded `g / scale` too (subnormal results included: both
    round the same real number), at a fraction of a division's cost. Any
    other scale is divided by.
    """
    scale = np.asarray(unwrap(grad_scale)).astype(dtype)
    if np.frexp(scale)[0] == 0.5:  # a power of two (not 0, inf or NaN)
        with np.errstate(over="ignore"):
            reciprocal = np.divide(np.asarray(1, dtype), scale)
        if np.isfinite(reciprocal) and reciprocal * scale == 1:
            return np.multiply, reciprocal
    return np.divide, scale


def _unscaled(grad, grad_scale):
    if grad_scale is None:
        return grad
    return ops.unscale([grad], grad_scale)[0]


# --- scheduling ----------------------------------------------------------

# Block-sized scratch buffers per (worker, dtype), in the optimizer's kernel
# cache under this key: two for the update rule, one for an unscaled
# gradient block, and a packed block's gradient and arrays.
SCRATCH_KEY = "numpy scratch"


def _scratch(cache, workers, dtypes):
    buffers = cache.get(SCRATCH_KEY)
    if buffers is None:
        buffers = cache[SCRATCH_KEY] = {}
    for worker in range(workers):
        for dtype in dtypes:
            if (worker, dtype) not in buffers:
                buffers[worker, dtype] = tuple(np.empty(BLOCK, dtype) for _ in range(3)) + tuple(
                    np.empty(_pack_capacity(), dtype) for _ in range(1 + MAX_ARRAYS)
                )
    return buffers


def _pack_capacity():
    return min(PACK_CAPACITY, BLOCK)  # a pack is updated in block-sized scratch


def _blocks(jobs):
    """Splits the jobs into blocks of <= BLOCK elements: `(job, start, stop)`.

    A large job is cut into several blocks. Consecutive small jobs that
    share their dtype, constants and unscaler form one pack instead,
    `(tuple of jobs, 0, total size)` with at most PACK_CAPACITY elements.
    """
    blocks, pack, packed = [], [], 0

    def close():
        if len(pack) == 1:
            blocks.append((pack[0], 0, packed))
        elif pack:
            blocks.append((tuple(pack), 0, packed))

    for j, (g, arrays, constants, unscaler) in enumerate(jobs):
        n = g.size
        if n >= min(PACK_BELOW, _pack_capacity()) or len(arrays) > MAX_ARRAYS:
            blocks.extend((j, start, min(start + BLOCK, n)) for start in range(0, n, BLOCK))
            continue
        if pack:
            g0, arrays0, constants0, unscaler0 = jobs[pack[0]]
            if (
                packed + n > _pack_capacity()
                or g.dtype != g0.dtype
                or constants is not constants0
                or unscaler is not unscaler0
                or len(arrays) != len(arrays0)
            ):
                close()
                pack, packed = [], 0
        pack.append(j)
        packed += n
    close()
    return blocks


def _run(cache, jobs, block_fn):
    if not jobs:
        return
    blocks = _blocks(jobs)
    count = parallel.workers(blocks)
    scratch = _scratch(cache, count, {job[0].dtype for job in jobs})
    # errstate is per thread: carry the caller's (quiet during a skipped
    # step's arithmetic) into the workers.
    errors = np.geterr()

    def work(worker, take):
        with np.errstate(**errors):
            while (block := take()) is not None:
                j, start, stop = block
                members = j if isinstance(j, tuple) else None
                g, arrays, constants, unscaler = jobs[members[0] if members else j]
                t, u, w, *pack = scratch[worker, g.dtype]
                n = stop - start
                if members:
                    g, arrays = _gather([jobs[i] for i in members], pack, n)
                elif n != g.size:
                    g, arrays = g[start:stop], [a[start:stop] for a in arrays]
                if n != t.size:
                    t, u, w = t[:n], u[:n], w[:n]
                if unscaler is not None:  # `u` may reuse it: see the block functions
                    g = u = unscaler[0](g, unscaler[1], w)
                block_fn(g, arrays, constants, t, u)
                if members:
                    _scatter(arrays, [jobs[i][1] for i in members])

    # Last block first: the loss-scale wrapper's finite check
    # (`parallel.peak_magnitude`) has just read the gradients first to last,
    # so the last ones are still in cache.
    parallel.share(work, blocks[::-1], count)


def _gather(jobs, buffers, n):
    """Concatenates the jobs' gradients and arrays into `buffers` (n elements each)."""
    g = np.concatenate([job[0] for job in jobs], out=buffers[0][:n])
    arrays = [
        np.concatenate([job[1][a] for job in jobs], out=buffers[1 + a][:n])
        for a in range(len(jobs[0][1]))
    ]
    return g, arrays


def _scatter(packed, targets):
    """Copies each packed array back into the variables' own arrays."""
    start = 0
    for arrays in targets:
        stop = start + arrays[0].size
        for source, target in zip(packed, arrays):
            np.copyto(target, source[start:stop])
        start = stop
