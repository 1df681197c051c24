"""The demo's comparison table and its one-paragraph reading, from measured numbers only."""

import math

COLUMNS = (
    "run",
    "test acc.",
    "train loss",
    "skipped steps",
    "final scale",
    "grads flushed to 0",
    "grad error vs float32",
)

LEGEND = """\
test acc.: accuracy on the 360 test images after the last step.
train loss: cross-entropy on the 1,437 training images after the last step.
skipped steps: steps LossScaleOptimizer skipped because a gradient overflowed.
  The "statistics" run measures each layer's float16 range every
  diagnostics_every steps and decides its scale there: it backs off before
  the values near float16's maximum overflow, and grows only with headroom.
final scale: LossScaleOptimizer's loss scale after the last step.
grads flushed to 0: share of gradient values, over all steps, that were nonzero
  in float32 (computed alongside, at the same weights and batch) but zero in
  the float16 gradients the optimizer received: lost to underflow.
grad error vs float32: ||g16 / scale - g32|| / ||g32||, averaged over the
  steps with finite gradients; it also counts what float16 rounds away
  without flushing to zero."""


def format_number(x):
    """`2^k` for a power of two (loss scales, loss weights), else the shortest float form."""
    exponent = math.log2(x)
    return f"2^{exponent:g}" if exponent.is_integer() else f"{x:g}"


def _scale(scale):
    return "-" if scale is None else format_number(scale)


def _percent(share):
    return "-" if share is None else f"{100 * share:.3g} %"


def rows(results):
    """The table's cells, one list of strings per run."""
    return [
        [
            r.spec.label,
            f"{100 * r.test_accuracy:.1f} %",
            f"{r.train_loss:.4f}",
            str(len(r.skipped_steps)),
            _scale(r.final_scale),
            _percent(r.flush_share),
            _percent(r.gradient_error),
        ]
        for r in results
    ]


def table(results):
    """Returns the comparison as a Markdown table (readable as plain text too)."""
    body = [list(COLUMNS)] + rows(results)
    widths = [max(len(row[i]) for row in body) for i in range(len(COLUMNS))]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(body[0]), rule] + [line(r) for r in body[1:]])


def summary(results):
    """Three sentences that read the table; every number comes from `results`."""
    reference, unscaled, scaled, statistics = results

    return (
        f"Without loss scaling, float16 flushed {_percent(unscaled.flush_share)} of the "
        f"nonzero gradient values to zero, {_percent(unscaled.subnormal_share)} of the values "
        f"left were float16 subnormals (below 2^-14: fewer than 10 significant bits), its "
        f"gradients were off by {_percent(unscaled.gradient_error)} on average, and it reached "
        f"{100 * unscaled.test_accuracy:.1f} % test accuracy. With LossScaleOptimizer, "
        f"float16 flushed {_percent(scaled.flush_share)}, "
        f"{_percent(scaled.subnormal_share)} were subnormal, it was off by "
        f"{_percent(scaled.gradient_error)}, skipped {len(scaled.skipped_steps)} overflowing "
        f"step(s) and reached {100 * scaled.test_accuracy:.1f} % "
        f'(float32: {100 * reference.test_accuracy:.1f} %). With the "statistics" growth '
        f"policy it skipped {len(statistics.skipped_steps)} step(s) instead of "
        f"{len(scaled.skipped_steps)}, ended at scale {_scale(statistics.final_scale)}, "
        f"{_percent(statistics.subnormal_share)} of its values were subnormal, and it reached "
        f"{100 * statistics.test_accuracy:.1f} %."
    )
