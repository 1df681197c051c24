"""The apply pipeline of `Optimizer` (`PipelineMixin`), in the order a step runs it.

```
overwrite-with-gradient variables take their gradient
None gradients dropped (a warning names them)
/ loss_scale_factor
accumulation: every `gradient_accumulation_steps` calls, the mean of the
              accumulated gradients (ops.cond); other calls only accumulate
clip -> weight decay -> the backend's fused kernel, or update_step per variable
       (a kernel may decay the variables itself: `folds_weight_decay`)
constraints
EMA (+ overwrite every ema_overwrite_frequency steps, ops.cond)
iterations += 1
```

`Optimizer.apply` validates everything first and then runs
`_apply_validated`. A wrapper that decides on a device value whether the
step is taken (the loss-scale wrapper, the torch optimizer a GradScaler steps) calls
the one contract `_step(grads, variables, keep=..., grad_scale=...)`: a
kernel that folds `keep` gets it as an argument; any other step runs under
the backend's `cond(keep, ...)`. Either way a skipped step writes nothing.
"""

import collections
import operator

from lossscale.optimizers import accumulation, clipping, ema, gradients, overwrite
from lossscale.optimizers.weight_decay import apply_weight_decay, partition_by_decay

# Optimizer class -> the named tuple type of its hyperparameters.
_HYPER_TYPES = {}


def hyper_type(cls, base_keys):
    """The frozen named tuple of `cls`'s hyperparameters.

    Its own constructor arguments (not the base ones), then the attributes
    it names in `kernel_hyperparameters`.
    """
    made = _HYPER_TYPES.get(cls)
    if made is None:
        names = [k for k in cls._config_keys() if k not in base_keys]
        names += [k for k in cls.kernel_hyperparameters if k not in names]
        made = _HYPER_TYPES[cls] = collections.namedtuple(f"{cls.__name__}Hyper", names)
    return made


class PipelineMixin:
    """The step of `Optimizer`: `_apply_validated` and the kernels it picks."""

    # Attribute names of the slot lists `update_kernel` reads, e.g.
    # `("_momentums", "_velocities")`. A kernel gets them as `slots`, keyed by
    # the name without its leading underscore; an empty or missing list is
    # left out (a setting the optimizer was built without).
    kernel_slots: tuple = ()
    # Attributes besides the constructor arguments that the kernel reads
    # as hyperparameters (fixed numbers of the rule).
    kernel_hyperparameters: tuple = ()

    def _step(self, grads, variables, keep=None, grad_scale=None, found_inf=None):
        """One step on validated input: the contract wrappers call.

        Args:
            grads: The gradients, one per variable (`None` for none).
            variables: The `Variable`s they update, all of this optimizer's.
            keep: None (the step is taken), or a boolean scalar of the
                backend: the step takes effect only where it holds, and
                nothing reads it on the host. A step whose kernel folds it
                (`_folds_keep`) gets it as an argument; any other runs under
                the backend's `cond(keep, ...)`.
            grad_scale: None, or a scale still multiplied into `grads`, for
                an optimizer whose `_takes_grad_scale(variables)` is True
                (its kernel divides it out as it reads each gradient).
            found_inf: None, or `keep` in torch's AMP form (float32, 1.0
                where the step is skipped), where the caller's check made
                it: a kernel that takes one (`takes_found_inf`) uses it
                instead of making it again. Ignored without `keep`.
        """
        if keep is not None and not self._folds_keep(variables):
            self._ops.cond(
                keep,
                lambda: self._apply_validated(grads, variables, grad_scale),
                None,
                self._state_variables(),
            )
            return
        self._apply_validated(grads, variables, grad_scale, keep, found_inf)

    def _takes_grad_scale(self, variables):
        """Whether `_apply_validated` can divide a loss scale out inside its kernel.

        True when this exact class has a fused kernel that accepts one and no
        step before the kernel reads the gradients (clipping, accumulation,
        a static loss-scale factor, overwrite-with-gradient variables).
        """
        kernel = self._fused_kernel()
        return (
            kernel is not None
            and kernel.takes_grad_scale
            and self.loss_scale_factor is None
            and not self.gradient_accumulation_steps
            and self.clipnorm is None
            and self.clipvalue is None
            and self.global_clipnorm is None
            and not any(v.overwrite_with_gradient for v in variables)
        )

    def _folds_keep(self, variables):
        """Whether `_step` can pass `keep` down instead of running under `ops.cond`.

        True when this exact class's kernel honours `keep` itself
        (`folds_keep`: in its arithmetic or its writes), weight decay (if
        any) has a kernel too, and nothing else in the pipeline writes (no
        accumulation, EMA, constraints or overwrite-with-gradient
        variables): the step then needs no `cond` (on JAX no `lax.cond`).
        """
        ops = self._ops
        kernel = self._fused_kernel()
        return (
            kernel is not None
            and kernel.folds_keep
            and (self.weight_decay is None or ops.fused_weight_decay() is not None)
            and not self.gradient_accumulation_steps
            and not self.use_ema
            and not any(v.overwrite_with_gradient or v.constraint for v in variables)
        )

    def _apply_validated(self, grads, variables, grad_scale=None, keep=None, found_inf=None):
        """Runs one step on validated input.

        `grad_scale`, `keep`, `found_inf`: see `_step` (`keep` only where
        `_folds_keep`).
        """
        ops = self._ops
        grads, variables = overwrite.take_gradients(self, ops, grads, variables)
        grads, variables = gradients.drop_missing(grads, variables)
        if grads:
            if self.loss_scale_factor is not None:
                grads = [g / self.loss_scale_factor for g in grads]
            if self.gradient_accumulation_steps:
                self._accumulate_or_update(ops, grads, variables)
            else:  # `grad_scale` only where `_takes_grad_scale`, `keep` where `_folds_keep`
                self._update(ops, grads, variables, grad_scale, keep, found_inf)
            for v in variables:
                if v.constraint is not None:
                    v.assign(v.constraint(v.value))
            if self.use_ema:
                self._update_ema(ops)
        # + 1 where the step is taken, + 0 where it is not (a boolean adds as
        # an integer: on torch one kernel).
        self._iterations.assign_add(1 if keep is None else keep)

    def _update(self, ops, grads, variables, grad_scale=None, keep=None, found_inf=None):
        grads = clipping.clip_gradients(
            ops, grads, self.clipnorm, self.clipvalue, self.global_clipnorm
        )
        learning_rate = self.learning_rate
        rest = (learning_rate, grad_scale, keep, found_inf)
        if self.weight_decay is None:
            self._update_variables(grads, variables, *rest)
            return
        kernel = self._fused_kernel()
        if kernel is not None and kernel.folds_weight_decay:
            # The kernel decays the variables it is given as it updates
            # them: the decayed ones in one call, the excluded ones in another.
            decayed, excluded = partition_by_decay(variables, self._exclusions)
            for positions, rate in ((decayed, self.weight_decay), (excluded, None)):
                if len(positions) == len(variables):
                    self._update_variables(grads, variables, *rest, weight_decay=rate)
                elif positions:
                    part_grads = [grads[i] for i in positions]
                    part = [variables[i] for i in positions]
                    self._update_variables(part_grads, part, *rest, weight_decay=rate)
            return
        apply_weight_decay(
            ops,
            variables,
            self.weight_decay,
            learning_rate,
            self._exclusions,
            self._kernel_cache,
            keep,
        )
        self._update_variables(grads, variables, *rest)

    def _update_variables(
        self,
        grads,
        variables,
        learning_rate,
        grad_scale=None,
        keep=None,
        found_inf=None,
        weight_decay=None,
    ):
        """Runs the update rule on every variable.

        A backend may hold a fused (multi-tensor) kernel for this exact
        optimizer class; it must equal the per-variable `update_step`, which
        its tests check. It gets the step's state as arguments
        (`backends/kernel.py`). `weight_decay`: None, or a rate for a kernel
        that `folds_weight_decay`, decaying every one of `variables`.
        """
        kernel = self._fused_kernel()
        if kernel is None:  # then `grad_scale` and `keep` are None (see `_step`)
            for grad, variable in zip(grads, variables):
                self.update_step(grad, variable, learning_rate)
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
            self._kernel_slots(variables),
            self._hyper_type(*(getattr(self, k) for k in self._hyper_type._fields)),
            iterations=self.iterations,
            lr=learning_rate,
            update_step=self.update_step,
            cache=self._kernel_cache,
            **options,
        )

    def _kernel_slot_lists(self):
        """`{slot name: list aligned with the trainable variables}` for the kernel."""
        lists = {}
        for attr in self.kernel_slots:
            slots = getattr(self, attr, None)
            if slots:
                lists[attr.lstrip("_")] = slots
        return lists

    def _kernel_slots(self, variables):
        """The slot lists, aligned with `variables` (all of them, or some in any order)."""
        lists = self._kernel_slot_lists()
        every = self._trainable_variables
        if len(variables) == len(every) and all(map(operator.is_, variables, every)):
            return lists
        positions = [self._get_variable_index(v) for v in variables]
        return {name: [slots[i] for i in positions] for name, slots in lists.items()}

    def _fused_kernel(self):
        """The backend's kernel for this exact class's `update_kernel`, or None."""
        name = self._kernel_name
        return None if name is None else self._ops.fused_update(name)

    def _accumulate_or_update(self, ops, grads, variables):
        steps = self.gradient_accumulation_steps
        accumulators = [self._accumulated_gradients[self._get_variable_index(v)] for v in variables]

        def update():
            self._update(
                ops, accumulation.mean_with_accumulated(grads, accumulators, steps), variables
            )
            # The window is over for every variable, as in Keras: the partial
            # sum of one without a gradient at this step is dropped, not
            # carried into the next window.
            accumulation.reset(ops, self._accumulated_gradients)

        ops.cond(
            accumulation.is_update_step(self._iterations.value, steps),
            update,
            lambda: accumulation.accumulate(grads, accumulators),
            self._state_variables(),
        )

    def _update_ema(self, ops):
        iterations = self._steps_taken()
        ema.update_moving_averages(
            ops,
            self._model_variables_moving_average,
            self._trainable_variables,
            self.ema_momentum,
            iterations == 0,
        )
        if self.ema_overwrite_frequency:
            ops.cond(
                (iterations + 1) % self.ema_overwrite_frequency == 0,
                lambda: ema.overwrite_with_averages(
                    self._trainable_variables, self._model_variables_moving_average
                ),
                lambda: None,
                self._state_variables(),
            )
