"""A float64 NumPy oracle of the published rules, written independently of src/.

`ReferenceOptimizer` reproduces the base-optimizer pipeline (overwrite with
gradient, static loss-scale factor, accumulation, clipping, weight decay, the
update rule, EMA, iterations) and `ReferenceLossScale` the dynamic loss
scale, on plain float64 arrays, so tests compare the library against
arithmetic they can read.
"""

import math

import numpy as np

F32_TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)


def sgd_rule(lr=0.01, momentum=0.0, nesterov=False):
    def init(w):
        return {"m": np.zeros_like(w)}

    def step(g, w, s, lr_t, t):
        if momentum == 0:
            return w - lr_t * g
        s["m"] = momentum * s["m"] - lr_t * g
        return w + (momentum * s["m"] - lr_t * g if nesterov else s["m"])

    return init, step


def adam_rule(beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False):
    def init(w):
        return {"m": np.zeros_like(w), "v": np.zeros_like(w), "vhat": np.zeros_like(w)}

    def step(g, w, s, lr_t, t):
        s["m"] = s["m"] + (g - s["m"]) * (1 - beta_1)
        s["v"] = s["v"] + (g * g - s["v"]) * (1 - beta_2)
        v = s["v"]
        if amsgrad:
            s["vhat"] = np.maximum(s["vhat"], s["v"])
            v = s["vhat"]
        alpha = lr_t * math.sqrt(1 - beta_2 ** (t + 1)) / (1 - beta_1 ** (t + 1))
        return w - s["m"] * alpha / (np.sqrt(v) + epsilon)

    return init, step


class ReferenceOptimizer:
    """Float64 model of `Optimizer.apply` for one list of weights."""

    def __init__(
        self,
        rule,
        weights,
        lr=0.01,
        weight_decay=None,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        exclude=(),
    ):
        init, self.step_fn = rule
        self.w = [np.asarray(w, np.float64).copy() for w in weights]
        self.slots = [init(w) for w in self.w]
        self.lr, self.wd = lr, weight_decay
        self.clipnorm, self.clipvalue, self.global_clipnorm = clipnorm, clipvalue, global_clipnorm
        self.use_ema, self.ema_momentum, self.ema_freq = (
            use_ema,
            ema_momentum,
            ema_overwrite_frequency,
        )
        self.lsf, self.gas = loss_scale_factor, gradient_accumulation_steps
        self.exclude = set(exclude)
        self.raw_iterations = 0
        self.avg = [w.copy() for w in self.w]
        self.acc = [np.zeros_like(w) for w in self.w]

    @property
    def iterations(self):
        return self.raw_iterations // self.gas if self.gas else self.raw_iterations

    def _clip(self, grads):
        if self.clipnorm:
            return [g * self.clipnorm / max(np.linalg.norm(g), self.clipnorm) for g in grads]
        if self.global_clipnorm:
            norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads))
            return [g * min(1.0, self.global_clipnorm / norm) if norm else g for g in grads]
        if self.clipvalue:
            return [np.clip(g, -self.clipvalue, self.clipvalue) for g in grads]
        return grads

    def _update(self, grads):
        grads = self._clip(grads)
        lr_t = self.lr
        for i, g in enumerate(grads):
            if self.wd is not None and i not in self.exclude:
                self.w[i] = self.w[i] - self.w[i] * self.wd * lr_t
            self.w[i] = self.step_fn(g, self.w[i], self.slots[i], lr_t, self.iterations)

    def apply(self, grads):
        grads = [np.asarray(g, np.float64) for g in grads]
        if self.lsf is not None:
            grads = [g / self.lsf for g in grads]
        if self.gas:
            if (self.raw_iterations + 1) % self.gas == 0:
                self._update([(g + a) / self.gas for g, a in zip(grads, self.acc)])
                self.acc = [np.zeros_like(a) for a in self.acc]
            else:
                self.acc = [a + g for a, g in zip(self.acc, grads)]
        else:
            self._update(grads)
        if self.use_ema:
            m = 0.0 if self.iterations == 0 else self.ema_momentum
            self.avg = [m * a + (1 - m) * w for a, w in zip(self.avg, self.w)]
            if self.ema_freq and (self.iterations + 1) % self.ema_freq == 0:
                self.w = [a.copy() for a in self.avg]
        self.raw_iterations += 1


class ReferenceLossScale:
    """Pure-Python model of the dynamic loss scale with the two guards."""

    def __init__(self, initial_scale=2.0**15, growth_steps=2000):
        self.scale, self.counter, self.growth_steps = (
            float(np.float32(initial_scale)),
            0,
            growth_steps,
        )

    def step(self, finite):
        if finite:
            if self.counter == self.growth_steps - 1:
                if self.scale * 2 <= F32_MAX:
                    self.scale = self.scale * 2
                self.counter = 0
            else:
                self.counter += 1
        else:
            self.scale = max(float(np.float32(self.scale / 2)), F32_TINY)
            self.counter = 0
