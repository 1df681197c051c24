"""The pieces of an optimizer step that call the update rule, as functions of what they read.

`Optimizer._run_step` composes the step in this order:

```
overwrite-with-gradient variables take their gradient   overwrite.py
None gradients dropped (a warning names them)           gradients.py
/ loss_scale_factor
accumulation: every `gradient_accumulation_steps` calls, the mean of the
              accumulated gradients (ops.cond); other calls only accumulate
clip -> weight decay -> the rule                        clipping.py, weight_decay.py, here
constraints
EMA (+ overwrite every ema_overwrite_frequency steps, ops.cond)   ema.py
iterations += 1 (+= keep where the step is gated)
```

The rule is the backend's kernel for the class (`backends/kernel.py`), or its
`update_step` per variable.
"""

import collections

from lossscale.optimizers.weight_decay import partition_by_decay

# Optimizer class -> the named tuple type of its hyperparameters.
_HYPER_TYPES = {}


def hyper_type(cls, base_keys):
    """The named tuple of `cls`'s own constructor arguments and `kernel_hyperparameters`."""
    made = _HYPER_TYPES.get(cls)
    if made is None:
        names = [k for k in cls._config_keys() if k not in base_keys]
        names += [k for k in cls.kernel_hyperparameters if k not in names]
        made = _HYPER_TYPES[cls] = collections.namedtuple(f"{cls.__name__}Hyper", names)
    return made


def run_rule(
    kernel,
    update_step,
    grads,
    variables,
    slots,
    hyper,
    *,
    iterations,
    learning_rate,
    cache,
    grad_scale=None,
    keep=None,
    found_inf=None,
    weight_decay=None,
):
    """Runs the update rule on every variable: the kernel, or `update_step` one by one.

    `grad_scale`, `keep` and `found_inf` come only where the plan lets them;
    `weight_decay` only for a kernel that decays every one of `variables`.
    """
    if kernel is None:  # then `grad_scale` and `keep` are None (see the plan)
        for grad, variable in zip(grads, variables):
            update_step(grad, variable, learning_rate)
        return
    options = {}
    if keep is not None:
        options["keep"] = keep
        if found_inf is not None and kernel.takes_found_inf:
            options["found_inf"] = found_inf
    if grad_scale is not None:
        options["grad_scale"] = grad_scale
    if weight_decay is not None:
        options["weight_decay"] = weight_decay
    kernel(
        variables,
        grads,
        slots,
        hyper,
        iterations=iterations,
        lr=learning_rate,
        update_step=update_step,
        cache=cache,
        **options,
    )


def decayed_groups(variables, weight_decay, exclusions):
    """`[(positions, rate)]` for a decaying kernel: decayed, then excluded (rate None).

    A group holding every variable has `None` positions (no list to gather).
    """
    decayed, excluded = partition_by_decay(variables, exclusions)
    groups = []
    for positions, rate in ((decayed, weight_decay), (excluded, None)):
        if len(positions) == len(variables):
            groups.append((None, rate))
        elif positions:
            groups.append((positions, rate))
    return groups
