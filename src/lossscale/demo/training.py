"""One training run of the demo, the same loop for every backend and precision.

A float16 run also computes the float32 gradients at the same weights and
batch, to count the values flushed by underflow. The loop reads a few
scalars on the host every step, which costs nothing on the CPU.
"""

import collections
import dataclasses
import time

import numpy as np

from lossscale.backends import get_ops
from lossscale.optimizers import Adam, LossScaleOptimizer

# Adam's default epsilon, before multiplying by the loss weight.
ADAM_EPSILON = 1e-7
# float16's smallest normal number: below it, fewer than 10 significant bits.
FLOAT16_TINY = 2.0**-14

Comparison = collections.namedtuple(
    "Comparison", ["flushed", "nonzero", "subnormal", "received_nonzero", "error"]
)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What distinguishes the four runs.

    Attributes:
        label: The run's name in the table and the pictures.
        precision: `"float32"` or `"float16"`.
        loss_scaling: Whether Adam is wrapped in `LossScaleOptimizer`.
        growth_policy: `LossScaleOptimizer`'s `growth_policy`.
    """

    label: str
    precision: str
    loss_scaling: bool
    growth_policy: str = "fixed"


RUNS = (
    RunSpec("float32", "float32", False),
    RunSpec("float16, no loss scaling", "float16", False),
    RunSpec("float16 + LossScaleOptimizer", "float16", True),
    RunSpec("float16 + LossScaleOptimizer, statistics", "float16", True, "statistics"),
)


@dataclasses.dataclass
class RunResult:
    """What one run measured.

    Attributes:
        spec: The `RunSpec`.
        losses: Minibatch cross-entropy per step (unweighted).
        scales: Loss scale used at each step (`None` without loss scaling).
        skipped_steps: Steps whose update the optimizer skipped.
        flushed: Gradient values, summed over all steps, nonzero in float32
            but zero in the run's float16 gradients (0 for float32).
        nonzero: Gradient values nonzero in float32, summed over all steps
            (0 for float32).
        subnormal: Nonzero float16 gradient values below 2^-14, summed over
            all steps.
        received_nonzero: Nonzero float16 gradient values, summed over all
            steps.
        gradient_errors: Per finite float16 step,
            `||g16 / scale - g32|| / ||g32||` over all weights.
        test_accuracy: Accuracy on the 360 test images after training.
        train_loss: Cross-entropy on the 1,437 training images after training.
        final_scale: The loss scale after the last step, or `None`.
        float16_range: Of a loss-scaled run, one entry per measured step,
            oldest first: `{"step": int, "range": summary()["float16_range"]}`.
        seconds: Wall time of the run.
    """

    spec: RunSpec
    losses: list = dataclasses.field(default_factory=list)
    scales: list = dataclasses.field(default_factory=list)
    skipped_steps: list = dataclasses.field(default_factory=list)
    flushed: int = 0
    nonzero: int = 0
    subnormal: int = 0
    received_nonzero: int = 0
    gradient_errors: list = dataclasses.field(default_factory=list)
    test_accuracy: float = float("nan")
    train_loss: float = float("nan")
    final_scale: float | None = None
    float16_range: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def flush_share(self):
        """Share of nonzero float32 gradient values lost to float16 underflow, or `None`."""
        return self.flushed / self.nonzero if self.nonzero else None

    @property
    def subnormal_share(self):
        """Share of the nonzero float16 gradient values that were subnormal, or `None`."""
        return self.subnormal / self.received_nonzero if self.received_nonzero else None

    @property
    def gradient_error(self):
        """Mean of `gradient_errors`, or `None` when nothing was measured."""
        return float(np.mean(self.gradient_errors)) if self.gradient_errors else None

    def to_dict(self):
        out = dataclasses.asdict(self)
        out["flush_share"] = self.flush_share
        out["subnormal_share"] = self.subnormal_share
        out["gradient_error"] = self.gradient_error
        return out


def _identity(loss):
    return loss


def make_optimizer(spec, config):
    """Adam for every run, wrapped in `LossScaleOptimizer` for the loss-scaled ones.

    `epsilon` is multiplied by `loss_weight` too, so the float32 run equals
    training on the plain loss.
    """
    inner = Adam(learning_rate=config.learning_rate, epsilon=ADAM_EPSILON * config.loss_weight)
    if not spec.loss_scaling:
        return inner
    return LossScaleOptimizer(
        inner,
        initial_scale=config.initial_scale,
        dynamic_growth_steps=config.growth_steps,
        growth_policy=spec.growth_policy,
        diagnostics_every=config.diagnostics_every,
    )


def _compare(reference, grads, scale, ops):
    """`Comparison` of float16 `grads` (at `scale`) and `reference`; `error` None if inf/NaN."""
    reference = [ops.to_numpy(r).astype(np.float64) for r in reference]
    grads = [ops.to_numpy(g).astype(np.float64) for g in grads]
    flushed = sum(int(np.count_nonzero((r != 0) & (g == 0))) for r, g in zip(reference, grads))
    nonzero = sum(int(np.count_nonzero(r)) for r in reference)
    subnormal = sum(int(np.count_nonzero((g != 0) & (np.abs(g) < FLOAT16_TINY))) for g in grads)
    received = sum(int(np.count_nonzero(g)) for g in grads)
    error = None
    if all(np.isfinite(g).all() for g in grads):
        diff = np.sqrt(sum(np.sum((g / scale - r) ** 2) for r, g in zip(reference, grads)))
        error = float(diff / np.sqrt(sum(np.sum(r**2) for r in reference)))
    return Comparison(flushed, nonzero, subnormal, received, error)


def train_run(spec, model, data, batches, config, progress_bar):
    """Trains `model` for one run over `batches` and returns its `RunResult`."""
    ops = get_ops(model.backend)
    optimizer = make_optimizer(spec, config)
    optimizer.build(model.variables)
    scale_loss = optimizer.scale_loss if spec.loss_scaling else _identity
    result = RunResult(spec)
    start = time.perf_counter()
    for step, indices in enumerate(batches):
        x, y = data.x_train[indices], data.y_train[indices]
        scale = float(optimizer.dynamic_scale) if spec.loss_scaling else None
        loss, grads = model.gradients(x, y, spec.precision, config.loss_weight, scale_loss)
        if spec.precision == "float16":
            _, reference = model.gradients(x, y, "float32", config.loss_weight, _identity)
            comparison = _compare(reference, grads, scale or 1.0, ops)
            result.flushed += comparison.flushed
            result.nonzero += comparison.nonzero
            result.subnormal += comparison.subnormal
            result.received_nonzero += comparison.received_nonzero
            if comparison.error is not None:
                result.gradient_errors.append(comparison.error)
            if not spec.loss_scaling:
                # Exact; the wrapper casts so itself when it unscales.
                grads = [ops.cast(g, "float32") for g in grads]
        iterations = int(optimizer.iterations)
        optimizer.apply(grads, model.variables)
        if int(optimizer.iterations) == iterations:
            result.skipped_steps.append(step)
        if spec.loss_scaling and step % config.diagnostics_every == 0:
            summary = optimizer.summary()
            result.float16_range.append(
                {"step": summary["float16_range_step"], "range": summary["float16_range"]}
            )
        result.losses.append(float(loss))
        result.scales.append(scale)
        progress_bar.set_postfix_str(
            f"loss={result.losses[-1]:.4f} scale={'-' if scale is None else f'{scale:g}'}",
            refresh=False,
        )
        progress_bar.update(1)
    progress_bar.close()
    result.seconds = time.perf_counter() - start
    result.train_loss, _ = model.evaluate(data.x_train, data.y_train)
    _, result.test_accuracy = model.evaluate(data.x_test, data.y_test)
    if spec.loss_scaling:
        result.final_scale = float(optimizer.dynamic_scale)
    return result
