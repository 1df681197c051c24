"""Adam, AdamW and SGD with the loss-scale skip folded into their arithmetic.

Under a traced `keep` flag these kernels fold it into the rule's own
coefficients, so the compiled step holds neither a `lax.cond` nor a select
of any parameter or slot. With no flag or a concrete one they run
`update_step` itself.

An applied step computes each rule with `update_step`'s operations in its
order and shape (XLA contracts a multiply feeding an add into an FMA, and
only alike shapes contract alike); `x * 1.0` and `x + (-0.0)` are
identities. A skipped step leaves every buffer bitwise as it was, signed
zeros included:

- The gradient is sanitised: `where(g <= bound, g, 0.0)`, with `bound =
  +inf` where applied and NaN where skipped (every gradient becomes +0.0).
- A moving average `s + (a - s) * c` takes `c = -0.0`: the product is a
  zero signed like `s`, and adding it returns `s`. Weight decay
  `w - (w * wd) * lr` takes `lr = -0.0`, SGD's `m * momentum - g * lr`
  takes `momentum = 1.0, lr = +0.0`.
- Any other write `s - x` becomes `s - (x * keep + pad)`, with `keep, pad =
  1.0, -0.0` where applied and `0.0, +0.0` where skipped; `s + x` is
  written `s - (-x)`. AMSGrad's `max(v_hat, v)` takes `v + (-inf)`.

Each scalar is divided by an opaque 1.0 (`_opaque_one`) so XLA computes it
once outside the loops; a select of two constants copied into a loop would
let LLVM split it on the flag and contract differently from `update_step`.
With `grad_scale`, each gradient is divided inside the loop that reads it
(`_divided`), so no unscaled copy is written.

Limits, neither reachable from finite training: a skipped step turns a
state that already holds an infinity into NaN, and XLA on CPU flushes
subnormals that came from outside XLA to zero.
"""

import jax
import jax.numpy as jnp

from lossscale.backends.jax import multi, ops


class _Gate:
    """One step's flag as the scalars a folded rule is built from, in one dtype.

    `values`: `{name: (where applied, where skipped)}`, each made an attribute,
    as are `keep`, `pad` and `bound`; `scale`: the loss scale, or None.
    """

    def __init__(self, keep, dtype, values, scale=None):
        values = dict(values, keep=(1.0, 0.0), pad=(-0.0, 0.0), bound=(jnp.inf, jnp.nan))
        one = _opaque_one(keep, dtype)
        for name, (applied, skipped) in values.items():
            picked = jnp.where(keep, _constant(applied, dtype), _constant(skipped, dtype))
            setattr(self, name, picked / one)
        self.scale = scale

    def gradient(self, grad, dtype, loop=0):
        """The gradient as loop `loop` (0 or 1) of a variable reads it: sanitised, unscaled, cast.

        Not `abs(grad) <= bound`: XLA would share that `abs` with the finite
        check's and write it out.
        """
        bound = self.bound.astype(grad.dtype)
        kept = grad <= bound
        grad = jnp.where(kept, grad, 0)
        if self.scale is not None:
            grad = _divided(grad, self.scale, kept, loop)
        return ops.cast(grad, dtype)

    def subtract(self, storage, value):
        """`storage - value` where applied; `storage`, bit for bit, where skipped."""
        return storage - (value * self.keep + self.pad)

    def add(self, storage, value):
        """`storage + value` where applied; `storage`, bit for bit, where skipped."""
        return storage - ((-value) * self.keep + self.pad)


def _opaque_one(keep, dtype):
    """Exactly 1.0, computed from the flag, so that XLA keeps a division by it."""
    flag = keep.astype(dtype)
    return flag + (1 - flag)


def _constant(value, dtype):
    # A Python number rounds to `dtype` once, as a weakly typed operand of
    # the generic rule does (`x * (1 - beta)`); its sign survives (-0.0).
    return jnp.asarray(value, dtype)


def _divided(grad, scale, kept, loop):
    """`multi.unscale([grad], scale)[0]` of a sanitised gradient, inside the loop that reads it.

    The divisor is a select per element (XLA would turn a broadcast scalar
    into a reciprocal, which rounds differently), with a filler per loop
    (equal expressions would be merged and written out).
    """
    if grad.dtype.itemsize < 4:
        grad = grad.astype(jnp.float32)
    scale = scale.astype(grad.dtype)
    return grad / jnp.where(kept, scale, jnp.asarray(1 + loop, grad.dtype))


def _traced(keep):
    """`keep` if it is a traced flag; None for no flag or a concrete True; False to skip."""
    if keep is None or isinstance(keep, jax.core.Tracer):
        return keep
    return None if bool(keep) else False


def _run_eagerly(keep, grads, params, update_step, lr, grad_scale):
    """The traced flag, or None once the step ran (or was skipped) on the host."""
    keep = _traced(keep)
    if keep is None:
        for grad, variable in zip(grads, params):
            if grad_scale is not None:
                grad = multi.unscale([grad], grad_scale)[0]
            update_step(grad, variable, lr)
    return None if keep is False else keep


def _write(variable, value):
    variable.rebind(ops.assign(variable.storage, value))


def _per_dtype(variables, make):
    """`{dtype: make(dtype)}` over the variables' dtypes."""
    made = {}
    for variable in variables:
        if variable.dtype not in made:
            made[variable.dtype] = make(variable.dtype)
    return made


def adam(
    params, grads, slots, hyper, *, iterations, lr, update_step, cache, keep=None, grad_scale=None
):
    """`Adam.update_step` (and `AdamW`'s, the same) on every variable, amsgrad included."""
    del cache  # nothing kept between steps
    keep = _run_eagerly(keep, grads, params, update_step, lr, grad_scale)
    if keep is None:
        return
    gates = _per_dtype(
        params, lambda dtype: _adam_gate(hyper, iterations, lr, keep, dtype, grad_scale)
    )
    velocity_hats = slots.get("velocity_hats")
    for i, (grad, variable) in enumerate(zip(grads, params)):
        gate, alpha = gates[variable.dtype]
        m, v = slots["momentums"][i], slots["velocities"][i]
        g = gate.gradient(grad, variable.dtype)
        _write(m, m.value + (g - m.value) * gate.rate_1)
        g = gate.gradient(grad, variable.dtype, loop=1)
        _write(v, v.value + (ops.square(g) - v.value) * gate.rate_2)
        if hyper.amsgrad:
            v_hat = velocity_hats[i]
            _write(v_hat, ops.maximum(v_hat.value, v.value + gate.floor))
            v = v_hat
        step = (m.value * alpha) / (ops.sqrt(v.value) + hyper.epsilon)
        _write(variable, gate.subtract(variable.value, step))


def _adam_gate(hyper, iterations, learning_rate, keep, dtype, grad_scale):
    """`(gate, alpha)`: Adam's folded scalars for one dtype, and `update_step`'s step size."""
    lr = ops.cast(learning_rate, dtype)
    step = ops.cast(iterations + 1, dtype)
    beta_1_power = ops.power(ops.cast(hyper.beta_1, dtype), step)
    beta_2_power = ops.power(ops.cast(hyper.beta_2, dtype), step)
    alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    values = {
        "rate_1": (1 - hyper.beta_1, -0.0),
        "rate_2": (1 - hyper.beta_2, -0.0),
        "floor": (-0.0, -jnp.inf),
    }
    return _Gate(keep, dtype, values, grad_scale), alpha


def sgd(
    params, grads, slots, hyper, *, iterations, lr, update_step, cache, keep=None, grad_scale=None
):
    """`SGD.update_step` (plain, momentum, Nesterov) on every variable.

    Plain SGD under a traced `keep` is `update_step` on the sanitised
    gradient with the learning rate folded (`w - 0.0 * 0.0` is `w`).
    """
    del iterations, cache  # SGD's rule does not read the step; nothing kept
    keep = _run_eagerly(keep, grads, params, update_step, lr, grad_scale)
    if keep is None:
        return

    def gate(dtype):
        values = {
            "lr": (ops.cast(lr, dtype), 0.0),
            "momentum": (ops.cast(hyper.momentum, dtype), 1.0),
        }
        return _Gate(keep, dtype, values, grad_scale)

    gates = _per_dtype(params, gate)
    for i, (grad, variable) in enumerate(zip(grads, params)):
        gate = gates[variable.dtype]
        g = gate.gradient(grad, variable.dtype)
        if hyper.momentum == 0:
            update_step(g, variable, gate.lr)
            continue
        m = slots["momentums"][i]
        _write(m, m.value * gate.momentum - g * gate.lr)
        if hyper.nesterov:
            momentum = ops.cast(hyper.momentum, variable.dtype)
            g = gate.gradient(grad, variable.dtype, loop=1)
            step = m.value * momentum - g * gate.lr
        else:
            step = m.value
        _write(variable, gate.add(variable.value, step))


def weight_decay(params, weight_decay, lr, *, cache, keep=None):
    """`v -= v * weight_decay * lr` for every variable (under a traced `keep`, lr -0.0 skips)."""
    del cache  # nothing kept between steps
    keep = _traced(keep)
    if keep is False:
        return

    def rate(dtype):
        rate = ops.cast(lr, dtype)
        return rate if keep is None else _Gate(keep, dtype, {"lr": (rate, -0.0)}).lr

    rates = _per_dtype(params, rate)
    for variable in params:
        value = variable.value
        _write(variable, value - value * weight_decay * rates[variable.dtype])
