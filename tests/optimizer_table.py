"""The optimizer table: one row per optimizer of `lossscale.optimizers` (not a test module).

Each `Row` holds what the shared scenarios of `optimizer_cases` need to run
on that optimizer: its constructor, the float64 `Rule` of its published
update (written from the papers and Keras's documented behaviour,
independently of `src/`), the option sets and learning rate the rule is
checked with, the arguments of each scenario, the Keras defaults and the
bad arguments with the exact message each raises. `tests/optimizers/
test_rules.py` runs every scenario on every row; what is specific to one
optimizer stays in its own `tests/optimizers/test_<name>.py`.
"""

import dataclasses
import math
from typing import Any

import numpy as np

from lossscale import optimizers
from lossscale.optimizers import (
    SGD,
    Adadelta,
    Adagrad,
    Adam,
    Adamax,
    AdamW,
    Ftrl,
    Lamb,
    Lion,
    Nadam,
    RMSprop,
)
from tests import optimizer_cases as cases

# ---------------------------------------------------------------------------
# The float64 rules.


class SGDRule(cases.Rule):
    """Plain, heavy-ball and Nesterov momentum, in Keras's form (velocity in weight units)."""

    def __init__(self, momentum=0.0, nesterov=False):
        self.momentum, self.nesterov = momentum, nesterov

    def slots(self, w):
        return {"momentum": np.zeros_like(w)} if self.momentum > 0 else {}

    def step(self, g, w, s, lr, t):
        if self.momentum == 0:
            return w - lr * g
        s["momentum"] = self.momentum * s["momentum"] - lr * g
        if self.nesterov:
            return w + self.momentum * s["momentum"] - lr * g
        return w + s["momentum"]


class AdamRule(cases.Rule):
    """Kingma & Ba (2014), with the "epsilon hat" form and optional AMSGrad."""

    def __init__(self, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False):
        self.beta_1, self.beta_2, self.epsilon, self.amsgrad = beta_1, beta_2, epsilon, amsgrad

    def slots(self, w):
        names = ["momentum", "velocity"] + (["velocity_hat"] if self.amsgrad else [])
        return {name: np.zeros_like(w) for name in names}

    def step(self, g, w, s, lr, t):
        b1, b2 = self.beta_1, self.beta_2
        s["momentum"] = b1 * s["momentum"] + (1 - b1) * g
        s["velocity"] = b2 * s["velocity"] + (1 - b2) * g * g
        v = s["velocity"]
        if self.amsgrad:
            s["velocity_hat"] = np.maximum(s["velocity_hat"], v)
            v = s["velocity_hat"]
        alpha = lr * math.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1))
        return w - alpha * s["momentum"] / (np.sqrt(v) + self.epsilon)


class AdamaxRule(cases.Rule):
    """Kingma & Ba (2014), section 7.1, with epsilon added to the norm."""

    def __init__(self, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon

    def slots(self, w):
        return {"momentum": np.zeros_like(w), "norm": np.zeros_like(w)}

    def step(self, g, w, s, lr, t):
        s["momentum"] = self.beta_1 * s["momentum"] + (1 - self.beta_1) * g
        s["norm"] = np.maximum(self.beta_2 * s["norm"], np.abs(g))
        correction = 1 - self.beta_1 ** (t + 1)
        return w - lr * s["momentum"] / (correction * (s["norm"] + self.epsilon))


class AdagradRule(cases.Rule):
    """Duchi, Hazan & Singer (2011), diagonal form, epsilon inside the root."""

    def __init__(self, initial_accumulator_value=0.1, epsilon=1e-7):
        self.initial, self.epsilon = initial_accumulator_value, epsilon

    def slots(self, w):
        return {"accumulator": np.full_like(w, self.initial)}

    def step(self, g, w, s, lr, t):
        s["accumulator"] = s["accumulator"] + g * g
        return w - lr * g / np.sqrt(s["accumulator"] + self.epsilon)


class AdadeltaRule(cases.Rule):
    """Zeiler (2012), Algorithm 1, with Keras's extra learning-rate factor."""

    def __init__(self, rho=0.95, epsilon=1e-7):
        self.rho, self.epsilon = rho, epsilon

    def slots(self, w):
        return {"accumulated_grad": np.zeros_like(w), "accumulated_delta_var": np.zeros_like(w)}

    def step(self, g, w, s, lr, t):
        rho, eps = self.rho, self.epsilon
        s["accumulated_grad"] = rho * s["accumulated_grad"] + (1 - rho) * g * g
        delta = (
            -np.sqrt(s["accumulated_delta_var"] + eps) / np.sqrt(s["accumulated_grad"] + eps) * g
        )
        s["accumulated_delta_var"] = rho * s["accumulated_delta_var"] + (1 - rho) * delta * delta
        return w + lr * delta


class RMSpropRule(cases.Rule):
    """Hinton (2012), lecture 6e; Keras's placement of epsilon inside the root."""

    def __init__(self, rho=0.9, momentum=0.0, epsilon=1e-7, centered=False):
        self.rho, self.momentum, self.epsilon, self.centered = rho, momentum, epsilon, centered

    def slots(self, w):
        names = (
            ["velocity"]
            + (["momentum"] if self.momentum > 0 else [])
            + (["average_gradient"] if self.centered else [])
        )
        return {name: np.zeros_like(w) for name in names}

    def step(self, g, w, s, lr, t):
        s["velocity"] = self.rho * s["velocity"] + (1 - self.rho) * g * g
        denominator = s["velocity"] + self.epsilon
        if self.centered:
            s["average_gradient"] = self.rho * s["average_gradient"] + (1 - self.rho) * g
            denominator = denominator - s["average_gradient"] ** 2
        increment = lr * g / np.sqrt(denominator)
        if self.momentum > 0:
            s["momentum"] = self.momentum * s["momentum"] + increment
            return w - s["momentum"]
        return w - increment


class NadamRule(cases.Rule):
    """Dozat (2016), with the momentum schedule u_t = beta_1 * (1 - 0.5 * 0.96**t)."""

    shared = ("u_product",)

    def __init__(self, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon

    def slots(self, w):
        return {
            "momentum": np.zeros_like(w),
            "velocity": np.zeros_like(w),
            "u_product": np.float64(1.0),
        }

    def step(self, g, w, s, lr, t):
        b1, b2 = self.beta_1, self.beta_2
        u_t = b1 * (1 - 0.5 * 0.96 ** (t + 1))
        u_next = b1 * (1 - 0.5 * 0.96 ** (t + 2))
        s["u_product"] = s["u_product"] * u_t
        s["momentum"] = b1 * s["momentum"] + (1 - b1) * g
        s["velocity"] = b2 * s["velocity"] + (1 - b2) * g * g
        m_hat = u_next * s["momentum"] / (1 - s["u_product"] * u_next) + (1 - u_t) * g / (
            1 - s["u_product"]
        )
        v_hat = s["velocity"] / (1 - b2 ** (t + 1))
        return w - lr * m_hat / (np.sqrt(v_hat) + self.epsilon)


class LionRule(cases.Rule):
    """Chen et al. (2023), "Symbolic Discovery of Optimization Algorithms", Algorithm 2."""

    def __init__(self, beta_1=0.9, beta_2=0.99):
        self.beta_1, self.beta_2 = beta_1, beta_2

    def slots(self, w):
        return {"momentum": np.zeros_like(w)}

    def step(self, g, w, s, lr, t):
        update = np.sign(self.beta_1 * s["momentum"] + (1 - self.beta_1) * g)
        s["momentum"] = self.beta_2 * s["momentum"] + (1 - self.beta_2) * g
        return w - lr * update


class FtrlRule(cases.Rule):
    """McMahan et al. (2013), Algorithm 1, generalised as Keras documents it.

    The learning-rate power replaces the paper's square root, `beta / (2 *
    lr)` joins the L2 term, and the shrinkage penalty's gradient `2 * s * w`
    is added to the gradient used for the linear term.
    """

    def __init__(
        self,
        learning_rate_power=-0.5,
        initial_accumulator_value=0.1,
        l1_regularization_strength=0.0,
        l2_regularization_strength=0.0,
        l2_shrinkage_regularization_strength=0.0,
        beta=0.0,
    ):
        self.power = -learning_rate_power
        self.initial = initial_accumulator_value
        self.l1, self.l2 = l1_regularization_strength, l2_regularization_strength
        self.shrinkage, self.beta = l2_shrinkage_regularization_strength, beta

    def slots(self, w):
        return {"accumulator": np.full_like(w, self.initial), "linear": np.zeros_like(w)}

    def step(self, g, w, s, lr, t):
        n, z = s["accumulator"], s["linear"]
        n_new = n + g * g
        sigma = (n_new**self.power - n**self.power) / lr
        z = z + g + 2 * self.shrinkage * w - sigma * w
        quadratic = n_new**self.power / lr + 2 * (self.l2 + self.beta / (2 * lr))
        s["accumulator"], s["linear"] = n_new, z
        return np.where(np.abs(z) <= self.l1, 0.0, (np.sign(z) * self.l1 - z) / quadratic)


class LambRule(cases.Rule):
    """You et al. (2019), Algorithm 2, with the identity scaling function."""

    def __init__(self, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon

    def slots(self, w):
        return {"momentum": np.zeros_like(w), "velocity": np.zeros_like(w)}

    def step(self, g, w, s, lr, t):
        b1, b2 = self.beta_1, self.beta_2
        s["momentum"] = b1 * s["momentum"] + (1 - b1) * g
        s["velocity"] = b2 * s["velocity"] + (1 - b2) * g * g
        m_hat = s["momentum"] / (1 - b1 ** (t + 1))
        v_hat = s["velocity"] / (1 - b2 ** (t + 1))
        update = m_hat / (np.sqrt(v_hat) + self.epsilon)
        w_norm, u_norm = np.linalg.norm(w), np.linalg.norm(update)
        ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        return w - lr * ratio * update


# ---------------------------------------------------------------------------
# The table.


def _bad(name, value, condition):
    """A bad argument and the exact message `lossscale.validation` raises for it."""
    return {name: value}, f"`{name}` must be {condition}. Received: {name}={value!r}"


def _range(low, high, low_op=">=", high_op="<"):
    return f"a finite number {low_op} {low} and {high_op} {high}"


UNIT = _range(0, 1)  # [0, 1)
UNIT_CLOSED = _range(0, 1, high_op="<=")  # [0, 1]
POSITIVE = "a finite number > 0"
NON_NEGATIVE = "a finite number >= 0"
BOOLEAN = "a boolean"


@dataclasses.dataclass(frozen=True)
class Row:
    """One optimizer: what every shared scenario runs it with.

    `variants` (id -> constructor options, passed to the rule as well) and
    `cases` (id -> (weight_decay, clipping options)) make the grid of the
    float64 reference test, at `learning_rate`. `loss_scale`, `stateless`,
    `jit`, `config` and `resume` are the keyword arguments of
    `optimizer_cases.check_<scenario>`. `defaults` are the attributes of
    `cls()` (`learning_rate` compared after float32 rounding), `bad` the
    `(kwargs, message)` pairs that raise `ValueError` with that message.
    """

    name: str
    cls: type
    rule: type
    learning_rate: float
    variants: dict[str, dict[str, Any]]
    cases: dict[str, tuple[float | None, dict[str, float]]]
    loss_scale: dict[str, Any]
    stateless: dict[str, Any]
    jit: dict[str, Any]
    config: dict[str, Any]
    resume: dict[str, Any]
    defaults: dict[str, Any]
    bad: list[tuple[dict[str, Any], str]]

    @property
    def module(self):
        return getattr(optimizers, self.cls.__module__.rsplit(".", 1)[-1])


FTRL_REGULARIZED = {
    "learning_rate_power": -0.7,
    "initial_accumulator_value": 0.5,
    "l1_regularization_strength": 0.05,
    "l2_regularization_strength": 0.1,
    "l2_shrinkage_regularization_strength": 0.02,
    "beta": 0.3,
}

ROWS = [
    Row(
        name="sgd",
        cls=SGD,
        rule=SGDRule,
        learning_rate=0.1,
        variants={
            "plain": {},
            "momentum": {"momentum": 0.9},
            "nesterov": {"momentum": 0.9, "nesterov": True},
        },
        cases={"no_decay": (None, {}), "decay_clipnorm": (0.05, {"clipnorm": 0.5})},
        loss_scale={"learning_rate": 0.1, "momentum": 0.9, "weight_decay": 0.05, "clipvalue": 0.5},
        stateless={"learning_rate": 0.1, "momentum": 0.9, "nesterov": True},
        jit={"learning_rate": 0.1, "momentum": 0.9, "global_clipnorm": 1.0},
        config={"learning_rate": 0.2, "momentum": 0.5, "nesterov": True, "clipvalue": 1.0},
        resume={"learning_rate": 0.1, "momentum": 0.9},
        defaults={"name": "sgd", "learning_rate": 0.01, "momentum": 0.0, "nesterov": False},
        bad=[
            _bad("momentum", -0.1, UNIT_CLOSED),
            _bad("momentum", 2, UNIT_CLOSED),
            _bad("nesterov", "yes", BOOLEAN),
        ],
    ),
    Row(
        name="adam",
        cls=Adam,
        rule=AdamRule,
        learning_rate=0.01,
        variants={"default": {}, "amsgrad": {"beta_1": 0.8, "beta_2": 0.99, "amsgrad": True}},
        cases={"no_decay": (None, {}), "decay_clipvalue": (0.05, {"clipvalue": 0.5})},
        loss_scale={"learning_rate": 0.01, "weight_decay": 0.05, "clipnorm": 0.5, "amsgrad": True},
        stateless={"learning_rate": 0.01, "amsgrad": True},
        jit={"learning_rate": 0.01, "global_clipnorm": 1.0},
        config={"learning_rate": 0.5, "beta_1": 0.8, "amsgrad": True, "weight_decay": 0.1},
        resume={"learning_rate": 0.01, "amsgrad": True},
        defaults={
            "name": "adam",
            "learning_rate": 0.001,
            "beta_1": 0.9,
            "beta_2": 0.999,
            "epsilon": 1e-7,
            "amsgrad": False,
        },
        bad=[
            _bad("beta_1", 1.0, UNIT),
            _bad("beta_2", -0.5, UNIT),
            _bad("epsilon", 0, POSITIVE),
            _bad("amsgrad", None, BOOLEAN),
        ],
    ),
    Row(
        name="adamw",
        cls=AdamW,
        rule=AdamRule,
        learning_rate=0.01,
        variants={"default": {}, "amsgrad": {"beta_1": 0.8, "beta_2": 0.99, "amsgrad": True}},
        cases={"no_decay": (0.0, {}), "decay_clipnorm": (0.05, {"clipnorm": 0.5})},
        loss_scale={
            "learning_rate": 0.01,
            "weight_decay": 0.05,
            "global_clipnorm": 1.0,
            "amsgrad": True,
        },
        stateless={"learning_rate": 0.01, "amsgrad": True},
        jit={"learning_rate": 0.01, "weight_decay": 0.05, "clipvalue": 0.5},
        config={
            "learning_rate": 0.02,
            "weight_decay": 0.1,
            "beta_1": 0.8,
            "amsgrad": True,
            "clipnorm": 1.0,
            "name": "my_adamw",
        },
        resume={"learning_rate": 0.01, "weight_decay": 0.05, "amsgrad": True},
        defaults={
            "name": "adam_w",
            "learning_rate": 0.001,
            "weight_decay": 0.004,
            "beta_1": 0.9,
            "beta_2": 0.999,
            "epsilon": 1e-7,
            "amsgrad": False,
        },
        bad=[
            _bad("weight_decay", None, NON_NEGATIVE),
            _bad("weight_decay", -0.1, NON_NEGATIVE),
            _bad("beta_1", 1.0, UNIT),
            _bad("beta_2", -0.5, UNIT),
            _bad("epsilon", 0.0, POSITIVE),
            _bad("learning_rate", -1.0, NON_NEGATIVE),
        ],
    ),
    Row(
        name="adamax",
        cls=Adamax,
        rule=AdamaxRule,
        learning_rate=0.01,
        variants={"default": {}, "custom_betas": {"beta_1": 0.5, "beta_2": 0.9, "epsilon": 1e-4}},
        cases={"no_decay": (None, {}), "decay_global_clipnorm": (0.05, {"global_clipnorm": 1.5})},
        loss_scale={"learning_rate": 0.01, "weight_decay": 0.05, "clipvalue": 0.5},
        stateless={"learning_rate": 0.01},
        jit={"learning_rate": 0.01, "clipnorm": 0.5},
        config={
            "learning_rate": 0.02,
            "beta_1": 0.5,
            "beta_2": 0.9,
            "epsilon": 1e-4,
            "global_clipnorm": 3.0,
        },
        resume={"learning_rate": 0.01, "weight_decay": 0.1},
        defaults={
            "name": "adamax",
            "learning_rate": 0.001,
            "beta_1": 0.9,
            "beta_2": 0.999,
            "epsilon": 1e-7,
        },
        bad=[
            _bad("beta_1", -0.1, UNIT),
            _bad("beta_2", 1, UNIT),
            _bad("epsilon", float("inf"), POSITIVE),
        ],
    ),
    Row(
        name="adagrad",
        cls=Adagrad,
        rule=AdagradRule,
        learning_rate=0.1,
        variants={
            "default": {},
            "zero_accumulator": {"initial_accumulator_value": 0.0, "epsilon": 1e-3},
        },
        cases={"no_decay": (None, {}), "decay_global_clipnorm": (0.05, {"global_clipnorm": 1.5})},
        loss_scale={"learning_rate": 0.1, "weight_decay": 0.05, "clipvalue": 0.5},
        stateless={"learning_rate": 0.1},
        jit={"learning_rate": 0.1, "weight_decay": 0.05},
        config={
            "learning_rate": 0.5,
            "initial_accumulator_value": 0.5,
            "epsilon": 1e-5,
            "clipvalue": 2.0,
        },
        resume={"learning_rate": 0.1, "initial_accumulator_value": 0.2},
        defaults={
            "name": "adagrad",
            "learning_rate": 0.001,
            "initial_accumulator_value": 0.1,
            "epsilon": 1e-7,
        },
        bad=[
            _bad("initial_accumulator_value", -0.1, NON_NEGATIVE),
            _bad("epsilon", 0, POSITIVE),
            _bad("learning_rate", "fast", NON_NEGATIVE),
        ],
    ),
    Row(
        name="adadelta",
        cls=Adadelta,
        rule=AdadeltaRule,
        # A large learning rate: Adadelta's raw steps are of order sqrt(epsilon).
        learning_rate=1.0,
        variants={"rho_default": {"epsilon": 1e-3}, "rho_half": {"rho": 0.5, "epsilon": 1e-2}},
        cases={"no_decay": (None, {}), "decay_clipnorm": (0.05, {"clipnorm": 0.7})},
        loss_scale={
            "learning_rate": 1.0,
            "epsilon": 1e-3,
            "weight_decay": 0.05,
            "global_clipnorm": 1.0,
        },
        stateless={"learning_rate": 1.0, "epsilon": 1e-3},
        jit={"learning_rate": 1.0, "epsilon": 1e-3, "clipvalue": 0.5},
        config={"learning_rate": 1.0, "rho": 0.9, "epsilon": 1e-6, "weight_decay": 0.01},
        resume={"learning_rate": 1.0, "epsilon": 1e-3},
        defaults={"name": "adadelta", "learning_rate": 0.001, "rho": 0.95, "epsilon": 1e-7},
        bad=[
            _bad("rho", 1.5, UNIT),
            _bad("epsilon", 0.0, POSITIVE),
            _bad("rho", True, UNIT),
        ],
    ),
    Row(
        name="rmsprop",
        cls=RMSprop,
        rule=RMSpropRule,
        learning_rate=0.01,
        variants={
            "default": {},
            "centered_momentum": {"rho": 0.8, "momentum": 0.9, "centered": True},
        },
        cases={"no_decay": (None, {}), "decay_clipvalue": (0.05, {"clipvalue": 0.5})},
        loss_scale={
            "learning_rate": 0.01,
            "weight_decay": 0.05,
            "clipnorm": 0.5,
            "momentum": 0.5,
            "centered": True,
        },
        stateless={"learning_rate": 0.01, "momentum": 0.5, "centered": True},
        jit={"learning_rate": 0.01, "momentum": 0.5, "centered": True, "global_clipnorm": 1.0},
        config={
            "learning_rate": 0.02,
            "rho": 0.8,
            "momentum": 0.5,
            "epsilon": 1e-6,
            "centered": True,
            "weight_decay": 0.01,
        },
        resume={"learning_rate": 0.01, "momentum": 0.5, "centered": True},
        defaults={
            "name": "rm_sprop",
            "learning_rate": 0.001,
            "rho": 0.9,
            "momentum": 0.0,
            "epsilon": 1e-7,
            "centered": False,
        },
        bad=[
            _bad("rho", 1.0, UNIT),
            _bad("rho", -0.1, UNIT),
            _bad("momentum", -0.5, UNIT_CLOSED),
            _bad("epsilon", -1e-7, POSITIVE),
            _bad("centered", 1, BOOLEAN),
            _bad("learning_rate", float("nan"), NON_NEGATIVE),
        ],
    ),
    Row(
        name="nadam",
        cls=Nadam,
        rule=NadamRule,
        learning_rate=0.01,
        variants={"default": {}, "custom_betas": {"beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-5}},
        cases={"no_decay": (None, {}), "decay_clipvalue": (0.05, {"clipvalue": 0.5})},
        # The skipped step must not advance `u_product` either: the comparison
        # covers every inner variable, `u_product` included.
        loss_scale={"learning_rate": 0.01, "weight_decay": 0.05, "clipnorm": 0.5},
        stateless={"learning_rate": 0.01},
        jit={"learning_rate": 0.01, "global_clipnorm": 1.0},
        config={
            "learning_rate": 0.02,
            "beta_1": 0.8,
            "beta_2": 0.99,
            "epsilon": 1e-5,
            "clipvalue": 1.0,
        },
        # Keras 3 loses `u_product` here; ours is saved and restored with the rest.
        resume={"learning_rate": 0.01},
        defaults={
            "name": "nadam",
            "learning_rate": 0.001,
            "beta_1": 0.9,
            "beta_2": 0.999,
            "epsilon": 1e-7,
        },
        bad=[
            _bad("beta_1", 1.2, UNIT),
            _bad("beta_2", None, UNIT),
            _bad("epsilon", -1.0, POSITIVE),
        ],
    ),
    Row(
        name="lion",
        cls=Lion,
        rule=LionRule,
        learning_rate=0.01,
        variants={"default": {}, "custom_betas": {"beta_1": 0.5, "beta_2": 0.9}},
        cases={"no_decay": (None, {}), "decay_clipnorm": (0.5, {"clipnorm": 0.5})},
        loss_scale={"learning_rate": 0.01, "weight_decay": 0.5, "global_clipnorm": 1.0},
        stateless={"learning_rate": 0.01},
        jit={"learning_rate": 0.01, "weight_decay": 0.5},
        config={"learning_rate": 0.0003, "beta_1": 0.95, "beta_2": 0.98, "weight_decay": 1.0},
        resume={"learning_rate": 0.01, "clipvalue": 0.5},
        defaults={"name": "lion", "learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.99},
        bad=[
            # As in Keras, beta_1's range is (0, 1].
            _bad("beta_1", 0.0, _range(0, 1, low_op=">", high_op="<=")),
            _bad("beta_1", 1.1, _range(0, 1, low_op=">", high_op="<=")),
            _bad("beta_2", 1.0, UNIT),
        ],
    ),
    Row(
        name="ftrl",
        cls=Ftrl,
        rule=FtrlRule,
        learning_rate=0.1,
        variants={"default": {}, "regularized": FTRL_REGULARIZED},
        cases={"no_decay": (None, {}), "decay_global_clipnorm": (0.05, {"global_clipnorm": 1.5})},
        loss_scale={
            "learning_rate": 0.1,
            "weight_decay": 0.05,
            "clipnorm": 0.5,
            **FTRL_REGULARIZED,
        },
        stateless={"learning_rate": 0.1, **FTRL_REGULARIZED},
        jit={"learning_rate": 0.1, "clipvalue": 0.5, **FTRL_REGULARIZED},
        config={"learning_rate": 0.1, "weight_decay": 0.01, **FTRL_REGULARIZED},
        resume={"learning_rate": 0.1, **FTRL_REGULARIZED},
        defaults={
            "name": "ftrl",
            "learning_rate": 0.001,
            "learning_rate_power": -0.5,
            "initial_accumulator_value": 0.1,
            "l1_regularization_strength": 0.0,
            "l2_regularization_strength": 0.0,
            "l2_shrinkage_regularization_strength": 0.0,
            "beta": 0.0,
        },
        bad=[
            _bad("learning_rate_power", 0.5, "a finite number <= 0"),
            _bad("initial_accumulator_value", -1.0, NON_NEGATIVE),
            _bad("l1_regularization_strength", -0.1, NON_NEGATIVE),
            _bad("l2_regularization_strength", -0.1, NON_NEGATIVE),
            _bad("l2_shrinkage_regularization_strength", -0.1, NON_NEGATIVE),
            _bad("beta", -1.0, NON_NEGATIVE),
        ],
    ),
    Row(
        name="lamb",
        cls=Lamb,
        rule=LambRule,
        learning_rate=0.01,
        variants={"default": {}, "custom_betas": {"beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-5}},
        cases={"no_decay": (None, {}), "decay_clipvalue": (0.05, {"clipvalue": 0.5})},
        loss_scale={"learning_rate": 0.01, "weight_decay": 0.05, "clipnorm": 0.5},
        stateless={"learning_rate": 0.01},
        jit={"learning_rate": 0.01, "weight_decay": 0.05},
        config={
            "learning_rate": 0.02,
            "beta_1": 0.8,
            "beta_2": 0.99,
            "epsilon": 1e-5,
            "clipnorm": 2.0,
        },
        resume={"learning_rate": 0.01, "global_clipnorm": 1.0},
        defaults={
            "name": "lamb",
            "learning_rate": 0.001,
            "beta_1": 0.9,
            "beta_2": 0.999,
            "epsilon": 1e-7,
        },
        bad=[
            _bad("beta_1", 1.0, UNIT),
            _bad("beta_2", -0.1, UNIT),
            _bad("epsilon", 0, POSITIVE),
        ],
    ),
]

BY_NAME = {row.name: row for row in ROWS}
