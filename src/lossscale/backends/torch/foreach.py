"""Multi-tensor (`torch._foreach_*`) versions of the optimizers' update rules.

Each rule is its optimizer's `update_step`, operation for operation in the
same order and dtype, on one `plans.Group` at once; writes go through
`plans.Writer`, so a skipped step changes nothing and reads nothing on the
host. A rule is `rule(hyper, group, grads, lr, write, iterations)`.
"""

import torch

from lossscale.backends.torch import dtensors, ops, plans

_add, _sub = torch._foreach_add, torch._foreach_sub


def mul(tensors, other):
    """`torch._foreach_mul(tensors, other)`; a Python number goes through `_operand`."""
    return torch._foreach_mul(tensors, _operand(tensors, other))


def div(tensors, other):
    """`torch._foreach_div(tensors, other)`; a Python number goes through `_operand`."""
    return torch._foreach_div(tensors, _operand(tensors, other))


def _operand(tensors, other):
    """`other` as the factor or divisor of a multi-tensor product or quotient.

    A Python number by float32 tensors becomes a cached 0-d float32 tensor:
    the same result, and torch's CPU kernels take it faster. Half-precision
    tensors (a 0-d half would round it), DTensors and traced steps keep it.
    """
    if (
        type(other) in (float, int)
        and tensors
        and tensors[0].dtype == torch.float32
        and not torch.compiler.is_compiling()
        and not dtensors.is_dtensor(tensors[0])
    ):
        return ops.constant(float(other), torch.float32, tensors[0].device)
    return other


def scalar(value, group):
    """`ops.cast(value, dtype)` as in `update_step`, as a 0-d tensor on the group's device."""
    if not isinstance(value, torch.Tensor):
        return ops.constant(value, group.dtype, group.device)
    if value.dtype != group.dtype:
        value = value.to(group.dtype)
    return value if value.device == group.device else value.to(group.device)


def step_count(iterations, group):
    """`ops.cast(iterations + 1, dtype)`: the step being taken, cast once (exact) in one kernel."""
    steps = ops.unwrap(iterations)
    if not isinstance(steps, torch.Tensor) or torch.compiler.is_compiling():
        return scalar(steps + 1, group)
    return torch.add(steps.to(group.device), 1, out=group.step_buffer())


def make_kernel(rule):
    """Wraps `rule(hyper, group, grads, lr, write, iterations)` into a kernel."""

    def kernel(params, grads, slots, hyper, *, iterations, lr, cache, update_step=None, keep=None):
        del update_step  # every variable takes the rule
        with torch.no_grad():
            for group in plans.plan(params, slots, cache).groups:
                rule(
                    hyper,
                    group,
                    group.grads(grads),
                    scalar(lr, group),
                    plans.Writer(keep, group.device),
                    iterations,
                )

    kernel.rule = rule
    return kernel


def sgd(hp, group, grads, lr, write, iterations):
    if hp.momentum == 0:
        write.sub(group.params, mul(grads, lr))
        return
    momentum = scalar(hp.momentum, group)
    scaled = mul(grads, lr)
    m = write.set(group.slots["momentums"], _sub(mul(group.slots["momentums"], momentum), scaled))
    if hp.nesterov:
        write.add(group.params, _sub(mul(m, momentum), scaled))
    else:
        write.add(group.params, m)


def adam(hp, group, grads, lr, write, iterations):
    step = step_count(iterations, group)
    beta_1_power = ops.power(scalar(hp.beta_1, group), step)
    beta_2_power = ops.power(scalar(hp.beta_2, group), step)
    alpha = lr * torch.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    m = _moment(write, group.slots["momentums"], grads, 1 - hp.beta_1)
    v = _moment(write, group.slots["velocities"], mul(grads, grads), 1 - hp.beta_2)
    if hp.amsgrad:
        v = write.set(
            group.slots["velocity_hats"], torch._foreach_maximum(group.slots["velocity_hats"], v)
        )
    write.sub(group.params, div(mul(m, alpha), _add(torch._foreach_sqrt(v), hp.epsilon)))


def _moment(write, slots, values, rate):
    """`slot += (value - slot) * rate`, the moving averages of Adam and kin."""
    # Out of place: on CPU, `_foreach_mul_` by a number rounds differently in half.
    return write.add(slots, mul(_sub(values, slots), rate))


def _decay_average(slots, values, rho):
    """`slot * rho + value * (1 - rho)`."""
    out = mul(slots, rho)
    torch._foreach_add_(out, mul(values, 1 - rho))
    return out


def rmsprop(hp, group, grads, lr, write, iterations):
    slots = group.slots
    velocity = write.set(
        slots["velocities"], _decay_average(slots["velocities"], mul(grads, grads), hp.rho)
    )
    if hp.centered:
        average = write.set(
            slots["average_gradients"], _decay_average(slots["average_gradients"], grads, hp.rho)
        )
        denominator = _sub(velocity, mul(average, average))
        torch._foreach_add_(denominator, hp.epsilon)
    else:
        denominator = _add(velocity, hp.epsilon)
    increment = div(mul(grads, lr), torch._foreach_sqrt(denominator))
    if hp.momentum > 0:
        momentum = mul(slots["momentums"], hp.momentum)
        torch._foreach_add_(momentum, increment)
        increment = write.set(slots["momentums"], momentum)
    write.sub(group.params, increment)


def adagrad(hp, group, grads, lr, write, iterations):
    accumulator = write.add(group.slots["accumulators"], mul(grads, grads))
    denominator = torch._foreach_sqrt(_add(accumulator, hp.epsilon))
    write.sub(group.params, div(mul(grads, lr), denominator))


def adadelta(hp, group, grads, lr, write, iterations):
    rho, epsilon = hp.rho, hp.epsilon
    grad_acc = write.set(
        group.slots["accumulated_grads"],
        _decay_average(group.slots["accumulated_grads"], mul(grads, grads), rho),
    )
    delta_acc = group.slots["accumulated_delta_vars"]
    delta = mul(torch._foreach_sqrt(_add(delta_acc, epsilon)), grads)
    torch._foreach_div_(delta, torch._foreach_sqrt(_add(grad_acc, epsilon)))
    torch._foreach_neg_(delta)
    write.set(delta_acc, _decay_average(delta_acc, mul(delta, delta), rho))
    write.add(group.params, mul(delta, lr))


def adamax(hp, group, grads, lr, write, iterations):
    beta_1_power = ops.power(scalar(hp.beta_1, group), step_count(iterations, group))
    m = _moment(write, group.slots["m"], grads, 1 - hp.beta_1)
    u = write.set(
        group.slots["u"],
        torch._foreach_maximum(mul(group.slots["u"], hp.beta_2), torch._foreach_abs(grads)),
    )
    denominator = _add(u, hp.epsilon)
    torch._foreach_mul_(denominator, 1 - beta_1_power)
    write.sub(group.params, div(mul(m, lr), denominator))


def nadam(hp, group, grads, lr, write, iterations):
    step = step_count(iterations, group)
    decay = scalar(hp.schedule_decay, group)
    beta_1 = scalar(hp.beta_1, group)
    u_t = beta_1 * (1.0 - 0.5 * ops.power(decay, step))
    u_next = beta_1 * (1.0 - 0.5 * ops.power(decay, step + 1))
    u_product = scalar(group.slots["u_product"][0], group)
    u_product_next = u_product * u_next
    beta_2_power = ops.power(scalar(hp.beta_2, group), step)
    m = _moment(write, group.slots["momentums"], grads, 1 - hp.beta_1)
    v = _moment(write, group.slots["velocities"], mul(grads, grads), 1 - hp.beta_2)
    m_hat = div(mul(m, u_next), 1 - u_product_next)
    torch._foreach_add_(m_hat, div(mul(grads, 1 - u_t), 1 - u_product))
    denominator = torch._foreach_sqrt(div(v, 1 - beta_2_power))
    torch._foreach_add_(denominator, hp.epsilon)
    write.sub(group.params, div(mul(m_hat, lr), denominator))


def lion(hp, group, grads, lr, write, iterations):
    beta_1, beta_2 = scalar(hp.beta_1, group), scalar(hp.beta_2, group)
    momentums = group.slots["momentums"]
    direction = mul(momentums, beta_1)
    torch._foreach_add_(direction, mul(grads, 1.0 - beta_1))
    write.sub(group.params, mul(torch._foreach_sign(direction), lr))
    average = mul(momentums, beta_2)
    torch._foreach_add_(average, mul(grads, 1.0 - beta_2))
    write.set(momentums, average)


def ftrl(hp, group, grads, lr, write, iterations):
    accumulators, linears = group.slots["accumulators"], group.slots["linears"]
    params = group.params
    # `ops.power(x, p)` raises to a 0-d tensor of x's dtype; so do these.
    power = [scalar(-hp.learning_rate_power, group)] * len(params)
    l2 = hp.l2_regularization_strength + hp.beta / (2.0 * lr)
    shrunk = _add(grads, mul(params, 2 * hp.l2_shrinkage_regularization_strength))
    new_accumulator = _add(accumulators, mul(grads, grads))
    new_root = torch._foreach_pow(new_accumulator, power)
    sigma = div(_sub(new_root, torch._foreach_pow(accumulators, power)), lr)
    z = write.add(linears, _sub(shrunk, mul(sigma, params)))
    quadratic = div(new_root, lr)
    torch._foreach_add_(quadratic, 2 * l2)
    l1 = hp.l1_regularization_strength
    clipped = torch._foreach_clamp_max(torch._foreach_clamp_min(z, -l1), l1)
    write.set(params, div(_sub(clipped, z), quadratic))
    write.set(accumulators, new_accumulator)


def lamb(hp, group, grads, lr, write, iterations):
    step = step_count(iterations, group)
    beta_1_power = ops.power(scalar(hp.beta_1, group), step)
    beta_2_power = ops.power(scalar(hp.beta_2, group), step)
    m = _moment(write, group.slots["momentums"], grads, 1 - hp.beta_1)
    v = _moment(write, group.slots["velocities"], mul(grads, grads), 1 - hp.beta_2)
    denominator = torch._foreach_sqrt(div(v, 1.0 - beta_2_power))
    torch._foreach_add_(denominator, hp.epsilon)
    update = div(div(m, 1.0 - beta_1_power), denominator)
    # The trust ratio as in `Lamb.update_step`.
    w_norm, u_norm = _norms(group.params), _norms(update)
    ratio = torch.where(
        (w_norm > 0) & (u_norm > 0), w_norm / torch.where(u_norm > 0, u_norm, 1.0), 1.0
    ).to(group.dtype)
    write.sub(group.params, mul(update, list((ratio * lr).unbind(0))))


def _norms(tensors):
    """`sqrt(sum(square(x)))` of each tensor, as one vector (squares rounded as `ops.square`)."""
    return torch.sqrt(torch.stack(torch._foreach_norm(mul(tensors, tensors), 1)))
