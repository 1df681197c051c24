"""The optimizer settings both Keras parity suites run (not a test module).

`test_keras_parity_optimizers.py` runs them against Keras on torch, in
this process; `test_keras_parity_tensorflow.py` against Keras on
TensorFlow, in a worker that reads them as JSON. So a schedule is written
`[schedule class name, its settings]`, and `build` makes it from the
library given.

Per optimizer: its defaults, then its own options with weight decay and a
clipping option (the three clipping options rotate); for four of them a
schedule as learning rate, read from the raw iteration count (no
`learning_rate` variable on either side).
"""

SCENARIOS = {
    "SGD": [
        {"learning_rate": 0.05},
        {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True, "clipnorm": 0.5},
    ],
    "Adam": [
        {"learning_rate": 0.01},
        {"learning_rate": 0.01, "amsgrad": True, "weight_decay": 0.05, "global_clipnorm": 1.5},
    ],
    "AdamW": [
        {"learning_rate": 0.01},
        {"learning_rate": 0.01, "amsgrad": True, "weight_decay": 0.1, "clipnorm": 0.5},
    ],
    "RMSprop": [
        {"learning_rate": 0.01},
        {
            "learning_rate": 0.01,
            "momentum": 0.9,
            "centered": True,
            "rho": 0.8,
            "weight_decay": 0.05,
            "clipvalue": 0.5,
        },
    ],
    "Adagrad": [
        {"learning_rate": 0.1},
        {
            "learning_rate": 0.1,
            "initial_accumulator_value": 0.5,
            "weight_decay": 0.05,
            "global_clipnorm": 1.5,
        },
    ],
    "Adadelta": [
        {"learning_rate": 1.0, "epsilon": 1e-3},
        {"learning_rate": 1.0, "rho": 0.5, "epsilon": 1e-2, "weight_decay": 0.05, "clipnorm": 0.7},
    ],
    "Adamax": [
        {"learning_rate": 0.01},
        {
            "learning_rate": 0.01,
            "beta_1": 0.5,
            "beta_2": 0.9,
            "weight_decay": 0.05,
            "clipvalue": 0.5,
        },
    ],
    "Nadam": [
        {"learning_rate": 0.01},
        {"learning_rate": 0.01, "beta_1": 0.8, "weight_decay": 0.05, "global_clipnorm": 1.5},
    ],
    "Lion": [
        {"learning_rate": 0.01},
        {"learning_rate": 0.01, "beta_1": 0.5, "beta_2": 0.9, "weight_decay": 0.5, "clipnorm": 0.5},
    ],
    "Ftrl": [
        {"learning_rate": 0.1},
        {
            "learning_rate": 0.1,
            "learning_rate_power": -0.7,
            "initial_accumulator_value": 0.5,
            "l1_regularization_strength": 0.05,
            "l2_regularization_strength": 0.1,
            "l2_shrinkage_regularization_strength": 0.02,
            "beta": 0.3,
            "weight_decay": 0.05,
            "clipvalue": 0.5,
        },
    ],
    "Lamb": [
        {"learning_rate": 0.01},
        {"learning_rate": 0.01, "beta_1": 0.8, "weight_decay": 0.05, "global_clipnorm": 1.5},
    ],
}
SCHEDULED = {
    "RMSprop": [
        "ExponentialDecay",
        {"initial_learning_rate": 0.02, "decay_steps": 2, "decay_rate": 0.5, "staircase": True},
    ],
    "Nadam": [
        "CosineDecay",
        {"initial_learning_rate": 0.0, "decay_steps": 4, "warmup_target": 0.02, "warmup_steps": 2},
    ],
    "Ftrl": ["PiecewiseConstantDecay", {"boundaries": [1, 3], "values": [0.3, 0.2, 0.1]}],
    "Lamb": ["CosineDecayRestarts", {"initial_learning_rate": 0.02, "first_decay_steps": 2}],
}
for _name, _schedule in SCHEDULED.items():
    SCENARIOS[_name].append({"learning_rate": _schedule, "weight_decay": 0.05})
KINDS = ["defaults", "options", "schedule"]


def build(library, name, settings):
    """The optimizer `name` with `settings` from `library` (keras or lossscale)."""
    settings = dict(settings)
    schedule = settings.get("learning_rate")
    if isinstance(schedule, list):  # [schedule class name, its settings]
        schedule_name, schedule_settings = schedule
        # keras.optimizers.schedules, lossscale.schedules
        schedules = getattr(library.optimizers, "schedules", None) or library.schedules
        settings["learning_rate"] = getattr(schedules, schedule_name)(**schedule_settings)
    return getattr(library.optimizers, name)(**settings)
