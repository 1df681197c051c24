"""The demo's picture: the three loss curves, and the loss scale with skipped steps marked.

Drawn on a bare Agg canvas, so no pyplot state or global backend is touched.
"""

import numpy as np

COLORS = ("#1f77b4", "#d62728", "#2ca02c")
# float32 is drawn dashed and on top: the loss-scaled float16 curve follows
# it so closely that a solid line would hide it.
STYLES = ({"linestyle": "--", "zorder": 3}, {}, {})
SMOOTHING = 25  # odd, so the window is centred


def _centered_mean(values, window):
    """Mean over a centred window, narrowed at both ends (no lag, no padding)."""
    values = np.asarray(values, dtype=np.float64)
    sums = np.concatenate([[0.0], np.cumsum(values)])
    index = np.arange(len(values))
    lo = np.maximum(index - window // 2, 0)
    hi = np.minimum(index + window // 2 + 1, len(values))
    return (sums[hi] - sums[lo]) / (hi - lo)


def save_plot(results, path, title):
    """Writes the PNG to `path`.

    Args:
        results: The three `RunResult`s (float32, float16, float16 scaled).
        path: Output file name.
        title: Figure title.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, scale_ax = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    for result, color, style in zip(results, COLORS, STYLES):
        steps = np.arange(len(result.losses))
        loss_ax.plot(steps, result.losses, color=color, alpha=0.2, linewidth=0.7)
        loss_ax.plot(
            steps,
            _centered_mean(result.losses, SMOOTHING),
            color=color,
            linewidth=1.8,
            label=result.spec.label,
            **style,
        )
    loss_ax.set_yscale("log")
    loss_ax.set_ylabel(f"minibatch loss\n(faint: per step; bold: centred mean of {SMOOTHING})")
    loss_ax.legend(loc="upper right")
    loss_ax.grid(True, which="both", alpha=0.3)

    scaled = results[-1]
    steps = np.arange(len(scaled.scales))
    scale_ax.step(
        steps, scaled.scales, where="post", color=COLORS[-1], label="loss scale used at the step"
    )
    skipped = scaled.skipped_steps
    scale_ax.plot(
        skipped,
        [scaled.scales[s] for s in skipped],
        "x",
        color="black",
        markersize=7,
        label=f"skipped step (gradient overflow): {len(skipped)}",
    )
    for step in skipped:
        loss_ax.axvline(step, color="black", alpha=0.15, linewidth=0.8)
    scale_ax.set_yscale("log", base=2)
    scale_ax.set_ylabel("LossScaleOptimizer\nloss scale")
    scale_ax.set_xlabel("step")
    scale_ax.legend(loc="lower right")
    scale_ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
