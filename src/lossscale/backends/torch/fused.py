"""Adam, AdamW and SGD on torch's fused optimizer kernels.

`torch._fused_adam_` and `torch._fused_sgd_` update every parameter and slot
of a group in one pass and accept a `found_inf` flag that turns the whole
update into a no-op on the device, which is exactly what a skipped
loss-scale step needs: no select afterwards and no host round trip. They
implement torch's formulas; these kernels feed them arguments under which
the formulas become Keras's:

Adam. torch divides the step size by `1 - beta_1**step` and the root of the
second moment by `sqrt(1 - beta_2**step)`. Each slot's `step` is given as
`+inf`, so both corrections are exactly 1, and the learning rate given is
Keras's own step size `alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)`,
computed as `Adam.update_step` computes it: on the device, or for float32
parameters on the CPU on the host, bit for bit the same (`host`). The
moments are the optimizer's own slot tensors; amsgrad's running maximum is
`velocity_hat`. AdamW's decoupled decay (any Adam's `weight_decay`) is
given to this kernel (`Kernel.folds_weight_decay`): with `alpha` on the
host it goes into `torch._fused_adamw_` where that rounds as Keras-on-torch
(`adamw.folded_rate`), else it is `adamw`'s own multi-tensor product
before the update.

Gradients still multiplied by a loss scale (`grad_scale`) are divided inside the
kernel, bit for bit as `torch._foreach_div_`, with no pass of its own over them.

SGD. Keras keeps `m = momentum * m - lr * g` and adds `m` to the weights;
torch keeps `buf = momentum * buf + (1 - dampening) * g` and subtracts
`lr * buf`. With a learning rate of -1 torch's buffer is Keras's `m`, also
when the learning rate changes between steps, given either the dampening
`1 + lr` (on CPU, without Nesterov: Keras-on-torch's rounding, one pass) or
the gradient `-lr * g` (Nesterov, a rate on a GPU: Keras's `update_step`
rounding, a pass more). `is_first_step` stays False: Keras's momentum
starts at zero, and `momentum * 0 + g` is `g`.

The fused kernels compute in float32 (or float64) internally, so they round
a little differently from the step-by-step generic path (about 1e-7
relative per step, tested at 1e-5 over many steps). For float16 and
bfloat16 parameters that difference would be large, since the generic path
rounds every intermediate to half precision: such groups take the
`foreach` rules, which reproduce `update_step` in the parameters'
dtype. Under `torch.compile` on the CPU, Adam is one opaque operation,
`lossscale::fused_adam_`, that runs the eager step (`_opaque`).
"""

import collections

import torch

from lossscale.backends.torch import adamw, dtensors, foreach, host, multi, ops, plans

_FUSED_DTYPES = (torch.float32, torch.float64)
_INFINITE_STEPS = {}


def _fusable(group):
    """Whether `group` takes torch's fused kernel (else the `foreach` rule).

    Not in half precision (see the module doc), not under `torch.compile` (no
    fake implementation; see `_opaque`), not for parameters that are not one
    block each (`Group.dense`): the kernels walk memory as if they were.
    """
    return group.dtype in _FUSED_DTYPES and group.dense and not torch.compiler.is_compiling()


def _opaque(group, iterations):
    """Whether a traced Adam step on `group` calls `lossscale::fused_adam_` (`_traced_adam`).

    While `torch.compile` traces, on a `HOST_READABLE` device, for float32
    and float64 (not DTensors, not a step count given as a number). Elsewhere
    the compiler fuses the `foreach` rule itself: on a GPU that is its
    strength; on the CPU its loops recomputed the step size's two powers
    and root for every eight elements, and opened a loop per tensor.
    """
    return (
        torch.compiler.is_compiling()
        and group.dtype in _FUSED_DTYPES
        and group.dense
        and group.device.type in multi.HOST_READABLE
        and isinstance(ops.unwrap(iterations), torch.Tensor)
        and not dtensors.is_dtensor(group.params[0])
    )


def _infinite_steps(group):
    # One read-only `+inf` per parameter; the kernels only read `state_steps`.
    key = (group.device, len(group.params))
    steps = _INFINITE_STEPS.get(key)
    if steps is None:
        steps = _INFINITE_STEPS[key] = [torch.tensor(float("inf"), device=group.device)] * key[1]
    return steps


def adam(
    params,
    grads,
    slots,
    hyper,
    *,
    iterations,
    lr,
    cache,
    update_step=None,
    keep=None,
    grad_scale=None,
    found_inf=None,
    weight_decay=None,
):
    """`Adam.update_step` (and `AdamW`'s, which is the same) on every variable.

    Under `keep` the kernel itself skips the update where it is False. `grad_scale`:
    None, or a scale still in `grads`. `found_inf`: None, or `keep` in torch's AMP
    form, used as it is. `weight_decay`: None, or the rate every parameter decays
    by first (see the module doc).
    """
    del update_step  # every variable takes a kernel
    purpose = "update" if weight_decay is None else "decayed update"
    factor = None  # the decay's factor, made for the first group that needs it
    with torch.no_grad():
        for group in plans.plan(params, slots, cache, purpose).groups:
            group_lr = foreach.scalar(lr, group)
            write = plans.Writer(keep, group.device, found_inf)
            fusable = _fusable(group)
            alpha = fold = None
            if fusable:
                alpha = host.adam_step_size(
                    hyper.beta_1, hyper.beta_2, iterations, group_lr, group, cache
                )
            if weight_decay is not None:
                fold = adamw.folded_rate(weight_decay, lr, alpha, cache)
                if fold is None:
                    if factor is None:
                        factor = adamw.step_factor(weight_decay, lr, cache, keep)
                    adamw.decay(group, factor)
            slots = [group.slots[n] for n in ("momentums", "velocities")]
            slots.append(group.slots.get("velocity_hats", []))
            if _opaque(group, iterations):  # traced: one opaque call, run as eager
                _traced_adam(
                    group.params,
                    group.grads(grads),
                    *slots,
                    group_lr,
                    ops.unwrap(iterations),
                    hyper.beta_1,
                    hyper.beta_2,
                    hyper.epsilon,
                    hyper.amsgrad,
                    write.found_inf(),
                    _kernel_scale(grad_scale, group),
                )
                continue
            if not fusable:
                group_grads = _unscaled(group, grads, grad_scale)
                foreach.adam(hyper, group, group_grads, group_lr, write, iterations)
                continue
            if alpha is None:
                alpha = _adam_step_size(hyper, group, group_lr, iterations)
            _fused_adam(
                group,
                (group.grads(grads), *slots),
                alpha,
                hyper,
                fold=fold,
                grad_scale=_kernel_scale(grad_scale, group),
                found_inf=write.found_inf(),
            )


def _fused_adam(group, tensors, alpha, hyper, fold=None, grad_scale=None, found_inf=None):
    """`torch._fused_adam_` (`_fused_adamw_` given a `fold`) on `group`, at step size `alpha`.

    `tensors`: the gradients, momentums, velocities and (amsgrad) velocity maxima.
    """
    kernel = torch._fused_adam_ if fold is None else torch._fused_adamw_
    kernel(
        group.params,
        *tensors,
        _infinite_steps(group),
        lr=alpha,
        beta1=hyper.beta_1,
        beta2=hyper.beta_2,
        weight_decay=0.0 if fold is None else fold,
        eps=hyper.epsilon,
        amsgrad=hyper.amsgrad,
        maximize=False,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )


# `lossscale::fused_adam_`: a traced Adam step on the CPU as one call the compiler leaves
# alone, run as the eager step, so a compiled step equals the eager one bit for bit. Its
# schema names what it writes; Inductor calls it on the tensors themselves (no copies).
_LIBRARY = torch.library.Library("lossscale", "FRAGMENT")
_LIBRARY.define(
    "fused_adam_(Tensor(a!)[] params, Tensor(e!)[] grads, Tensor(b!)[] momentums, "
    "Tensor(c!)[] velocities, Tensor(d!)[] velocity_hats, Tensor lr, Tensor iterations, "
    "float beta_1, float beta_2, float epsilon, bool amsgrad, Tensor? found_inf, "
    "Tensor? grad_scale) -> ()"
)
# The host's step size by beta_2 (`host._root`'s block of roots), kept
# between calls. The rate itself is read on every call: the tensor the
# compiled code passes may be written without a version bump.
_OPAQUE_CACHE = {}


def _opaque_adam(params, grads, momentums, velocities, velocity_hats, lr, iterations, *rest):
    hyper, found_inf, grad_scale = _AdamHyper(*rest[:4]), rest[4], rest[5]
    group = plans.Group(params[0].device, params[0].dtype, None, params, {}, True)
    _OPAQUE_CACHE.pop(("torch host lr", group.device, group.dtype), None)
    with torch.no_grad():
        alpha = host.adam_step_size(*hyper[:2], iterations, lr, group, _OPAQUE_CACHE)
        if alpha is None:
            alpha = _adam_step_size(hyper, group, lr, iterations)
        tensors = (grads, momentums, velocities, velocity_hats)
        _fused_adam(group, tensors, alpha, hyper, grad_scale=grad_scale, found_inf=found_inf)


_AdamHyper = collections.namedtuple("_AdamHyper", "beta_1 beta_2 epsilon amsgrad")
_LIBRARY.impl("fused_adam_", _opaque_adam, "CPU")
torch.library.register_fake("lossscale::fused_adam_", lambda *args: None, lib=_LIBRARY)
_traced_adam = torch.ops.lossscale.fused_adam_.default


def _unscaled(group, grads, grad_scale):
    """The group's gradients as `update_step` gets them: divided by `grad_scale` (if any).

    Divided in place as `ops.unscale` divides them, then cast to the group's dtype.
    """
    if grad_scale is None:
        return group.grads(grads)
    own = [ops.unwrap(grads[i]) for i in group.indices]
    unscaled = list(grads)
    for i, g in zip(group.indices, multi.unscale(own, grad_scale, in_place=True)):
        unscaled[i] = g
    return group.grads(unscaled)


def _kernel_scale(grad_scale, group):
    """`grad_scale` as a fused kernel reads it: a float32 0-d tensor on the group's device."""
    if grad_scale is None:
        return None
    scale = ops.unwrap(grad_scale).to(device=group.device, dtype=torch.float32)
    return scale.reshape(()) if scale.ndim else scale  # a `view` is a dispatch too


def _adam_step_size(hyper, group, lr, iterations):
    """Keras's `alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)`, in few kernels.

    Both powers in one `pow` of the pair `(beta_1, beta_2)`, each bit for bit as a 0-d
    one. Eager, `1 - powers` goes into the group's pair buffer, whose two elements
    are views made once: no `unbind` per step.
    """
    betas = ops.constant((hyper.beta_1, hyper.beta_2), group.dtype, group.device)
    powers = torch.pow(betas, foreach.step_count(iterations, group))
    if torch.compiler.is_compiling():
        bias_1, bias_2 = torch.unbind(1 - powers)
    else:
        pair, (bias_1, bias_2) = group.pair_buffer()
        torch.sub(ops.constant((1.0, 1.0), group.dtype, group.device), powers, out=pair)
    return lr * torch.sqrt(bias_2) / bias_1


def sgd(
    params,
    grads,
    slots,
    hyper,
    *,
    iterations,
    lr,
    cache,
    update_step=None,
    keep=None,
    grad_scale=None,
    found_inf=None,
):
    """`SGD.update_step` (plain, momentum, Nesterov) on every variable.

    `grad_scale`: None, or a scale still multiplied into `grads`: plain SGD,
    and momentum on a host-readable rate (`_lr_as_dampening`), divide it out
    in the kernel; otherwise the gradients are divided first, since Keras's
    `lr * g` must be formed from the unscaled `g`.
    `found_inf`: as for `adam`.
    """
    del update_step  # every variable takes a kernel
    with torch.no_grad():
        for group in plans.plan(params, slots, cache).groups:
            group_lr = foreach.scalar(lr, group)
            write = plans.Writer(keep, group.device, found_inf)
            # DTensor registers no sharding strategy for `_fused_sgd_` (it
            # does for `_fused_adam_`): FSDP2's shards take the foreach rule.
            if not _fusable(group) or dtensors.is_dtensor(group.params[0]):
                group_grads = _unscaled(group, grads, grad_scale)
                foreach.sgd(hyper, group, group_grads, group_lr, write, iterations)
                continue
            if hyper.momentum == 0:
                torch._fused_sgd_(
                    group.params,
                    group.grads(grads),
                    [],
                    weight_decay=0.0,
                    momentum=0.0,
                    lr=group_lr,
                    dampening=0.0,
                    nesterov=False,
                    maximize=False,
                    is_first_step=False,
                    grad_scale=_kernel_scale(grad_scale, group),
                    found_inf=write.found_inf(),
                )
                continue
            dampening = _lr_as_dampening(hyper, group, group_lr, cache)
            if dampening is not None:
                step_grads, kernel_scale = group.grads(grads), _kernel_scale(grad_scale, group)
            else:
                # `g * (-lr)` is `-(g * lr)` exactly, the term Keras subtracts;
                # `-lr` is kept while the learning rate does not change.
                key = ("torch negated lr", group.device, group.dtype)
                negated = plans.derived(cache, key, group_lr, torch.neg)
                step_grads = torch._foreach_mul(_unscaled(group, grads, grad_scale), negated)
                dampening, kernel_scale = 0.0, None
            torch._fused_sgd_(
                group.params,
                step_grads,
                group.slots["momentums"],
                weight_decay=0.0,
                momentum=float(hyper.momentum),
                lr=-1.0,
                dampening=dampening,
                nesterov=hyper.nesterov,
                maximize=False,
                is_first_step=False,
                grad_scale=kernel_scale,
                found_inf=write.found_inf(),
            )


def _lr_as_dampening(hyper, group, lr, cache):
    """`1 + lr`, read on the host, where torch's `1 - dampening` is then exactly `-lr`; else None.

    Keras-on-torch's momentum update in the kernel's one pass, with no `-lr * g`
    tensors. Only without Nesterov (torch's Nesterov term adds the raw gradient),
    for a rate on a `HOST_READABLE` device (no wait), and where `1 + lr` is exact
    in double precision: a float32 rate from 2**-29 up.
    """
    if hyper.nesterov or group.device.type not in multi.HOST_READABLE:
        return None
    value = host.learning_rate(lr, group, cache)
    dampening = 1.0 + value
    return dampening if dampening - 1.0 == value else None
