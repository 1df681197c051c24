"""Adam, AdamW and SGD with the loss-scale skip folded into their arithmetic.

Under `LossScaleOptimizer` the inner step gets the step's finite flag as
its `keep` argument. A select of every new value against the old one (or a
`lax.cond`) would honour it; these kernels instead fold the flag into the
rule's own coefficients, so the compiled step holds neither a `lax.cond`
nor a select of any parameter or slot. With no flag (an optimizer on its
own), or a concrete one (an eager step: a plain `if`), they run
`update_step` itself.

Exactness. An applied step computes each rule with `update_step`'s own
operations in `update_step`'s order: the folded coefficients equal the
rule's where the flag holds, and `x * 1.0` and `x + (-0.0)` are identities
in IEEE arithmetic. The expressions keep `update_step`'s shape, because XLA
contracts a multiply feeding an add into one fused multiply-add (on CPU
too), and only alike shapes contract alike. A skipped step leaves every
buffer bitwise as it was, signed zeros included, by these identities:

- The gradient it reads is sanitised: `where(g <= bound, g, 0.0)`, with
  `bound = +inf` where the step is applied (every gradient is finite then,
  so none is zeroed) and NaN where it is skipped (every comparison with NaN
  is false, so every gradient, inf and NaN included, becomes +0.0). That
  select is of the gradient, fused into the update loop, not of any state;
  the rest of the step sees finite numbers.
- A moving average `s + (a - s) * c` takes `c = -0.0`: with `a = +0.0`, the
  product is a zero signed like `s` (-0.0 when `s` is a zero), and adding it
  returns `s`, -0.0 included. Weight decay `w - (w * wd) * lr` takes
  `lr = -0.0` for the same reason, and SGD's `m * momentum - g * lr` takes
  `momentum = 1.0, lr = +0.0`.
- Any other write `s - x` becomes `s - (x * keep + pad)`, with `keep = 1.0,
  pad = -0.0` where the step is applied and `keep = 0.0, pad = +0.0` where
  it is skipped: a finite `x` then contributes exactly `+0.0` (any zero plus
  `+0.0` is `+0.0`), and `s - 0.0` is `s` for every `s`. `s + x` is written
  `s - (-x)` the same way (`a - b` is `a + (-b)` in IEEE arithmetic).
  AMSGrad's `max(v_hat, v)` takes `v + (-inf)` where skipped.

The flag reaches the update loops only through those scalars, each divided
by an opaque 1.0 (`_opaque_one`): XLA computes a division once and passes
it to the loops, where it would copy a select of two constants into every
loop, and LLVM would then split a loop in two on the flag and move parts of
an expression apart, where they no longer contract as `update_step`'s do.

With `grad_scale` (the loss-scale wrapper's scale: `takes_grad_scale`) the
kernels divide each gradient by it inside the loops that read it, as
`multi.unscale` divides (`_divided`), so the step writes no unscaled copy of
the gradients.

Two limits of arithmetic folding, neither reachable from finite training:

- A skipped step multiplies state by zero, so a slot or a parameter that
  already holds an infinity (or a parameter under weight decay) turns to
  NaN there, where `lax.cond` would have kept it. Adam's next applied step
  turns such a slot to NaN anyway (`inf + -inf`).
- XLA's CPU backend flushes subnormal numbers to zero (of their sign) in
  arithmetic, so a subnormal that came into a buffer from outside XLA
  becomes a zero at the first step, skipped or applied; state that XLA
  computed never holds one.
"""

import jax
import jax.numpy as jnp

from lossscale.backends.jax import multi, ops


class _Gate:
    """One step's flag as the scalars a folded rule is built from, in one dtype.

    Args:
        keep: Boolean scalar, True where the step is applied.
        dtype: The dtype of the variables it updates.
        values: `{name: (where applied, where skipped)}`: the rule's own
            folded scalars (Python numbers or scalars of `dtype`). Each
            becomes an attribute, as do `keep`, `pad` and `bound`.
        scale: The loss scale to divide gradients by, or None.
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

        One comparison feeds both selects, the gradient's and the divisor's
        (see `_divided`), so a read costs a compare, two selects and the
        division on top of the rule's own arithmetic. Not `abs(grad) <=
        bound`: XLA would share that `abs` with the finite check's and write
        it out for both.
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

    The same float32 cast and the same division. The divisor is
    `where(kept, scale, 1 + loop)`: `scale` for every gradient the step
    keeps, and a positive number for the zeros it put in place of the rest
    (their quotient is +0.0 either way). XLA fuses a division into a loop
    only when that loop alone reads it (two equal expressions would be
    merged into one, written out), hence a different filler per loop; and it
    rewrites a division by a plain broadcast scalar, once fused, as a
    multiplication by the reciprocal, which rounds differently, hence a
    divisor that is a select per element.
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


def _unscaled(grad, grad_scale):
    return grad if grad_scale is None else multi.unscale([grad], grad_scale)[0]


def _write(variable, value):
    # The value has the skip folded in already.
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
    """`Adam.update_step` (and `AdamW`'s, the same) on every variable, amsgrad included.

    Under a traced `keep`, the folded rule (see the module doc); else
    `update_step` itself.
    """
    del cache  # nothing kept between steps
    keep = _traced(keep)
    if keep is False:
        return
    if keep is None:
        for grad, variable in zip(grads, params):
            update_step(_unscaled(grad, grad_scale), variable, lr)
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
    """`(gate, alpha)`: Adam's folded scalars for one dtype, and its step size.

    `alpha` is `Adam.update_step`'s, computed as it computes it. The rates
    `1 - beta` are -0.0 where the step is skipped; `floor`, added to the
    second moment before AMSGrad's maximum, is -0.0 where it is applied (an
    identity) and -inf where skipped (the maximum keeps `v_hat`).
    """
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

    Under a traced `keep`, the folded rule (see the module doc); plain SGD
    is then `update_step` itself, run on the sanitised gradient with the
    learning rate folded (`+0.0` where skipped: `w - 0.0 * 0.0` is `w`).
    Else `update_step`.
    """
    del iterations, cache  # SGD's rule does not read the step; nothing kept
    keep = _traced(keep)
    if keep is False:
        return
    if keep is None:
        for grad, variable in zip(grads, params):
            update_step(_unscaled(grad, grad_scale), variable, lr)
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
    """`v -= v * weight_decay * lr` for every variable.

    Under a traced `keep` the learning rate is -0.0 where the step is
    skipped: `(v * wd) * -0.0` is a zero of the opposite sign to `v`, and `v`
    minus it is `v`, bit for bit (-0.0 included).
    """
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
