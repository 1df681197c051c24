"""The apply pipeline of `Optimizer` (`PipelineMixin`), in the order a step runs it.

```
overwrite-with-gradient variables take their gradient
None gradients dropped (a warning names them)
/ loss_scale_factor
accumulation: every `gradient_accumulation_steps` calls, the mean of the
              accumulated gradients (ops.cond); other calls only accumulate
clip -> weight decay -> the backend's fused kernel, or update_step per variable
constraints
EMA (+ overwrite every ema_overwrite_frequency steps, ops.cond)
iterations += 1
```

`Optimizer.apply` validates everything first and then runs
`_apply_validated`; a loss-scale wrapper runs it under a device flag with
`_run_gated` (or `_apply_where`), so that a skipped step writes nothing.
"""

from lossscale.optimizers import accumulation, clipping, ema, gradients, overwrite
from lossscale.optimizers.weight_decay import apply_weight_decay


class PipelineMixin:
    """The step of `Optimizer`: `_apply_validated` and the kernels it picks."""

    def _apply_where(self, keep, grads, trainable_variables, skip=None):
        """`apply`, taking effect only where the device flag `keep` holds.

        A step where it does not writes nothing (not even `iterations`) and
        nothing is read on the host: see `_run_gated`. `skip`: the same flag
        in torch's AMP form (float32, 1.0 where `keep` is False), if known.
        """
        grads = list(grads)
        variables, known = self._resolve_variables(grads, trainable_variables)
        gradients.validate_gradients(grads, variables)
        if not self.built:
            self.build(variables)
        elif not known:
            self._check_known(variables)
        with self._ops.quiet():
            self._run_gated(keep, lambda: self._apply_validated(grads, variables), variables, skip)

    def _run_gated(self, keep, update, variables, skip=None):
        """Runs `update`, one step of this optimizer, only where `keep` holds.

        With a kernel that folds the flag into its arithmetic
        (`_folds_gate`), `ops.gated`: no select, no `lax.cond`; otherwise
        `ops.cond`, whose writes select (torch) or branch (JAX).
        """
        ops = self._ops
        targets = self._trainable_variables + self.variables
        if self._folds_gate(variables):
            # Every target was pointed at this optimizer's cell when it was
            # built or created; `masked` trusts the cell while it is intact.
            # (A wrapper's `variables` also holds its inner optimizer's, but
            # the inner optimizer's build takes the model's variables into its
            # own cell, so the wrapper's is never intact once built.)
            ops.gated(keep, update, targets, skip=skip, cell=self._mask_cell)
        else:
            ops.cond(keep, update, None, targets)

    def _takes_grad_scale(self, variables):
        """Whether `_apply_validated` can divide a loss scale out inside its kernel.

        True when this exact class has a fused kernel that accepts one and no
        step before the kernel reads the gradients (clipping, accumulation,
        a static loss-scale factor, overwrite-with-gradient variables).
        """
        kernel = self._fused_kernel()
        return (
            getattr(kernel, "takes_grad_scale", False)
            and self.loss_scale_factor is None
            and not self.gradient_accumulation_steps
            and self.clipnorm is None
            and self.clipvalue is None
            and self.global_clipnorm is None
            and not any(v.overwrite_with_gradient for v in variables)
        )

    def _folds_gate(self, variables):
        """Whether a step gated by a device flag (`ops.gated`) needs no select.

        True when this exact class's kernel folds the flag into its own
        arithmetic (`folds_gate`), weight decay (if any) has such a kernel
        too, and nothing else in the pipeline writes (no accumulation, EMA,
        constraints or overwrite-with-gradient variables). Else a gated step
        is better taken as `ops.cond` (on JAX a `lax.cond`).
        """
        ops = self._ops
        return (
            getattr(self._fused_kernel(), "folds_gate", False)
            and (self.weight_decay is None or ops.fused_weight_decay() is not None)
            and not self.gradient_accumulation_steps
            and not self.use_ema
            and not any(v.overwrite_with_gradient or v.constraint for v in variables)
        )

    def _apply_validated(self, grads, variables, grad_scale=None):
        """Runs one step on validated input.

        `grad_scale`: the loss-scale wrapper's scale, still multiplied into
        `grads`, for an optimizer whose `_takes_grad_scale` is True (the
        fused kernel divides it out as it reads each gradient).
        """
        ops = self._ops
        grads, variables = overwrite.take_gradients(self, ops, grads, variables)
        grads, variables = gradients.drop_missing(grads, variables)
        if grads:
            if self.loss_scale_factor is not None:
                grads = [g / self.loss_scale_factor for g in grads]
            if self.gradient_accumulation_steps:
                self._accumulate_or_update(ops, grads, variables)
            elif grad_scale is None:
                self._update(ops, grads, variables)
            else:  # only optimizers whose `_takes_grad_scale` is True get here
                self._update(ops, grads, variables, grad_scale)
            for v in variables:
                if v.constraint is not None:
                    v.assign(v.constraint(v.value))
            if self.use_ema:
                self._update_ema(ops)
        self._iterations.assign_add(1)

    def _update(self, ops, grads, variables, grad_scale=None):
        grads = clipping.clip_gradients(
            ops, grads, self.clipnorm, self.clipvalue, self.global_clipnorm
        )
        learning_rate = self.learning_rate
        if self.weight_decay is not None:
            apply_weight_decay(
                self, ops, variables, self.weight_decay, learning_rate, self._exclusions
            )
        if grad_scale is None:
            self._update_variables(grads, variables, learning_rate)
        else:
            self._fused_kernel()(self, grads, variables, learning_rate, grad_scale=grad_scale)

    def _update_variables(self, grads, variables, learning_rate):
        """Runs the update rule on every variable.

        A backend may hold a fused (multi-tensor) kernel for this exact
        optimizer class; it must equal the per-variable `update_step`, which
        its tests check.
        """
        kernel = self._fused_kernel()
        if kernel is not None:
            kernel(self, grads, variables, learning_rate)
            return
        for grad, variable in zip(grads, variables):
            self.update_step(grad, variable, learning_rate)

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
