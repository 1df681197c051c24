"""`LossScaleOptimizer`: dynamic loss scaling around any optimizer."""

from lossscale.mixed_precision.loss_scale import LossScalePolicy, LossScaleState, next_loss_scale
from lossscale.optimizers.base import Optimizer

# Base-optimizer arguments and their defaults: the wrapper accepts only the
# defaults, since these settings belong to the inner optimizer.
_INNER_ONLY = {
    "weight_decay": None, "clipnorm": None, "global_clipnorm": None, "clipvalue": None,
    "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
    "loss_scale_factor": None, "gradient_accumulation_steps": None,
}


class LossScaleOptimizer(Optimizer):
    """An optimizer that dynamically scales the loss to prevent underflow.

    Loss scaling multiplies the loss by a large factor, the "loss scale", so
    that small float16 gradients do not flush to zero; the gradients are
    divided by the same factor before the inner optimizer applies them. The
    scale adapts:

    ```
    grads = grads / scale            # overwrite-with-gradient ones untouched
    if all(isfinite(grads)):
        inner_optimizer.apply(grads)
        if counter == dynamic_growth_steps - 1:
            scale, counter = scale * 2, 0   # skipped if scale * 2 overflows
        else:
            counter += 1
    else:                            # the step is skipped entirely
        scale, counter = max(scale / 2, float32 tiny), 0
    ```

    A skipped step changes no model variable and no inner optimizer
    variable (not even `iterations`).

    Args:
        inner_optimizer: The `lossscale.optimizers.Optimizer` instance to wrap.
        initial_scale: Float. The initial loss scale. It is recommended for
            this to be a very high number, because a loss scale that is too
            high gets lowered far more quickly than a loss scale that is too
            low gets raised.
        dynamic_growth_steps: Int. How often to update the scale upwards.
            After every `dynamic_growth_steps` steps with finite gradients,
            the loss scale is doubled.
        name: String. The name to use for the wrapper's variables.
        **kwargs: Base optimizer arguments are accepted only at their
            defaults; set them on the `inner_optimizer` instead.

    Example:

    >>> import numpy as np, lossscale as ls
    >>> w = ls.Variable(np.ones(2, np.float32), name="w")
    >>> opt = ls.LossScaleOptimizer(ls.optimizers.SGD(0.1), initial_scale=1024.0)
    >>> loss_scale = opt.scale_loss(1.0)  # multiply the loss before differentiating
    >>> opt.apply([np.full(2, 1024.0, np.float32)], [w])
    >>> w.numpy()
    array([0.9, 0.9], dtype=float32)
    >>> opt.apply([np.array([np.inf, 0], np.float32)], [w])  # overflow: skipped
    >>> float(opt.dynamic_scale), w.numpy()
    (512.0, array([0.9, 0.9], dtype=float32))
    """

    _owns_step_state = False

    def __init__(self, inner_optimizer, initial_scale=2.0 ** 15, dynamic_growth_steps=2000,
                 name=None, **kwargs):
        if not kwargs.pop("dynamic", True):
            raise ValueError(
                "LossScaleOptimizer no longer supports `dynamic=False`. Instead, set "
                "`loss_scale_factor` directly on the `inner_optimizer`. Received: dynamic=False")
        for key, default in _INNER_ONLY.items():
            if key in kwargs and kwargs.pop(key) != default:
                raise ValueError(
                    f"LossScaleOptimizer does not support `{key}`. Instead, set `{key}` on the "
                    "`inner_optimizer`.")
        if kwargs:
            raise ValueError(
                f"LossScaleOptimizer does not support arguments: {sorted(kwargs)}. Accepted: "
                "inner_optimizer, initial_scale, dynamic_growth_steps, name")
        if not isinstance(inner_optimizer, Optimizer):
            raise ValueError(
                "`inner_optimizer` must be a lossscale.optimizers.Optimizer instance. "
                f"Received: inner_optimizer={inner_optimizer!r}")
        self.policy = LossScalePolicy(initial_scale, dynamic_growth_steps)
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self.inner_optimizer.loss_scale_factor = None
        # Made now on NumPy and moved to the model's backend by `build`, so
        # they can be read (and checkpoints matched) before the first step.
        self.step_counter = self.add_variable((), initializer=0, dtype="int64",
                                              name="step_counter")
        self.dynamic_scale = self.add_variable((), initializer=self.initial_scale,
                                               dtype="float32", name="dynamic_scale")

    @property
    def initial_scale(self):
        return self.policy.initial_scale

    @property
    def dynamic_growth_steps(self):
        return self.policy.dynamic_growth_steps

    def build(self, var_list):
        """Moves the wrapper's state to the model's backend and builds the inner optimizer."""
        if self.built:
            return
        var_list = self._as_variables(var_list, "var_list")
        super().build(var_list)
        self.inner_optimizer.build(var_list)

    @property
    def variables(self):
        """The wrapper's own variables, then the inner optimizer's."""
        return self._variables + self.inner_optimizer.variables

    def _apply_validated(self, grads, variables):
        ops = self._ops
        scale = self.dynamic_scale.value
        scaled = [i for i, (g, v) in enumerate(zip(grads, variables))
                  if g is not None and not v.overwrite_with_gradient]
        grads = list(grads)
        for i, g in zip(scaled, ops.unscale([grads[i] for i in scaled], scale)):
            grads[i] = g
        # Checking the unscaled gradients also catches a finite gradient that
        # overflows when divided by a tiny scale.
        finite = self.check_finite(grads)
        ops.cond(finite, lambda: self.inner_optimizer.apply(grads, variables), lambda: None,
                 self._trainable_variables + self.inner_optimizer.variables)
        state = next_loss_scale(ops, LossScaleState(scale, self.step_counter.value), finite,
                                self.policy)
        self.dynamic_scale.assign(state.scale)
        self.step_counter.assign(state.counter)

    def check_finite(self, grads):
        """Returns a backend boolean scalar: whether every non-`None` gradient is finite."""
        present = [g for g in grads if g is not None]
        return self._ops_of(present).all_finite(present)

    def _ops_of(self, arrays):
        if self.built:
            return self._ops
        from lossscale.backends import ops_for

        return ops_for(*arrays)

    def scale_loss(self, loss):
        """Multiplies `loss` by the current loss scale (`initial_scale` before build)."""
        return loss * (self.dynamic_scale.value if self.built else self.initial_scale)

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @iterations.setter
    def iterations(self, value):
        self.inner_optimizer.iterations = value

    def finalize_variable_values(self, var_list):
        """Delegates to the inner optimizer."""
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        from lossscale import serialization

        return {
            "name": self.name,
            "inner_optimizer": serialization.serialize(self.inner_optimizer),
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        from lossscale import serialization

        config = dict(config)
        inner = serialization.deserialize(config.pop("inner_optimizer"),
                                          custom_objects=custom_objects)
        return cls(inner, **config)
