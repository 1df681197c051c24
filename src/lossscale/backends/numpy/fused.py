"""Fused, in-place NumPy kernels for `Adam` and `SGD`.

An optimizer step is memory-bound, and every NumPy expression of
`update_step` makes a pass over main memory. These kernels walk each variable
in cache-sized blocks, run the whole rule on a block with `out=` into scratch
buffers (kept in the optimizer's kernel `cache`), and share the blocks among
a few threads (`parallel`). They perform `update_step`'s float operations in
its order and dtype, so the results are identical bit for bit; a variable
whose arrays are not C-contiguous floats takes `update_step` instead.
"""

import numpy as np

from lossscale.backends._common import unwrap
from lossscale.backends.numpy import ops, parallel

# Elements per block: an Adam block's seven arrays (7 MiB in float32) stay in
# L3 cache through the dozen NumPy calls of the rule, each costing Python time.
BLOCK = 1 << 18
# Variables smaller than this are gathered into one block of at most
# PACK_CAPACITY elements, updated there and copied back.
PACK_BELOW = 1 << 14
PACK_CAPACITY = 1 << 16
# The most arrays a rule touches besides the gradient (Adam with amsgrad).
MAX_ARRAYS = 4


def adam(params, grads, slots, hyper, *, iterations, lr, update_step, cache, grad_scale=None):
    """Fused `Adam.update_step` over every variable (amsgrad included; `grad_scale`: `_job`)."""
    lists = [slots["momentums"], slots["velocities"]]
    if "velocity_hats" in slots:
        lists.append(slots["velocity_hats"])

    def constants(dtype):
        return _adam_constants(hyper, iterations, lr, dtype.name)

    _fuse(params, grads, lists, constants, _adam_block, lr, update_step, cache, grad_scale)


def _fuse(params, grads, slot_lists, make_constants, block_fn, lr, update_step, cache, grad_scale):
    """Runs `block_fn` over every fusable variable and its slots, `update_step` on the others."""
    constants, unscalers, jobs = {}, {}, []
    for i, (grad, variable) in enumerate(zip(grads, params)):
        arrays = _fusable([variable.value] + [s[i].value for s in slot_lists])
        if arrays is None:
            update_step(_unscaled(grad, grad_scale), variable, lr)
            continue
        dtype = arrays[0].dtype
        if dtype not in constants:
            constants[dtype] = make_constants(dtype)
        jobs.append(_job(grad, arrays, constants[dtype], grad_scale, unscalers))
    _run(cache, jobs, block_fn)


def _adam_constants(hyper, iterations, learning_rate, dtype):
    # `Adam.update_step`'s scalars, once per dtype; its Python numbers as 0-d
    # arrays of the dtype: the same values, and faster ufunc calls.
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
# scratch `t` and `u`. `u` may be `g`'s own buffer (the unscaled copy), so
# `g` is read for the last time before `u` is first written. `out` is
# positional: a keyword costs more per ufunc call.
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
    """Fused `SGD.update_step` over every variable (plain, momentum, Nesterov; see `_job`)."""
    del iterations  # SGD's rule does not read it
    lists = [slots["momentums"]] if hyper.momentum != 0 else []

    def constants(dtype):
        return ops.cast(lr, dtype.name), ops.cast(hyper.momentum, dtype.name), hyper.nesterov

    _fuse(params, grads, lists, constants, _sgd_block, lr, update_step, cache, grad_scale)


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

    With `grad_scale`, blocks are unscaled in cache by the dtype's shared
    `unscalers` entry, exactly as `ops.unscale` would; a gradient of another
    dtype, or narrower than float32, is unscaled up front.
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
    # Cast to the variable's dtype, as `update_step` does.
    if g.dtype != dtype:
        g = g.astype(dtype)
    return np.ascontiguousarray(g).reshape(-1), arrays, constants, unscaler


def _unscaler(grad_scale, dtype):
    """`(ufunc, operand)`: `ufunc(g, operand)` is `g / scale`, by an exact reciprocal if any."""
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


# Scratch buffers per (worker, dtype), in the optimizer's kernel cache: two for
# the rule, one for an unscaled gradient block, and a pack's gradient and arrays.
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
    """Blocks of <= BLOCK elements, `(job, start, stop)`; small jobs alike packed `(jobs, 0, n)`."""
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
    # errstate is per thread: carry the caller's into the workers.
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

    # Last block first: the finite check just read the gradients first to last.
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
