"""The demo's picture: the four loss curves, and the loss scales with skipped steps marked.

Drawn on a bare Agg canvas, so no pyplot state or global backend is touched.
"""

import numpy as np

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
# float32 is drawn dashed and on top: the loss-scaled float16 curves follow
# it so closely that a solid line would hide it.
STYLES = ({"linestyle": "--", "zorder": 3}, {}, {}, {})
MARKERS = ("x", "+")
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
    """Writes the PNG of the `RunResult`s of `training.RUNS` to `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Fixed margins: a constrained layout cost as much as the drawing itself.
    fig = Figure(figsize=(9, 6.5))
    FigureCanvasAgg(fig)
    margins = dict(left=0.12, right=0.98, top=0.94, bottom=0.08, hspace=0.06)
    loss_ax, scale_ax = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2), gridspec_kw=margins)
    for result, color, style in zip(results, COLORS, STYLES):
        steps = np.arange(len(result.losses))
        loss_ax.plot(steps, result.losses, color=color, alpha=0.2, linewidth=0.7)
        smooth = _centered_mean(result.losses, SMOOTHING)
        loss_ax.plot(steps, smooth, color=color, linewidth=1.8, label=result.spec.label, **style)
    loss_ax.set_yscale("log")
    loss_ax.set_ylabel(f"minibatch loss\n(faint: per step; bold: centred mean of {SMOOTHING})")
    loss_ax.legend(loc="upper right")
    loss_ax.grid(True, which="both", alpha=0.3)

    scaled = [(r, c) for r, c in zip(results, COLORS) if r.spec.loss_scaling]
    for (result, color), marker in zip(scaled, MARKERS):
        steps = np.arange(len(result.scales))
        policy = result.spec.growth_policy
        scale_ax.step(
            steps, result.scales, where="post", color=color, label=f"{policy}: scale used"
        )
        skipped = result.skipped_steps
        label = f"{policy}: skipped step (gradient overflow): {len(skipped)}"
        at = [result.scales[s] for s in skipped]
        scale_ax.plot(
            skipped, at, marker, linestyle="none", color="black", markersize=8, label=label
        )
        for step in skipped:
            loss_ax.axvline(step, color=color, alpha=0.3, linewidth=0.8)
    scale_ax.set_yscale("log", base=2)
    scale_ax.set_ylabel("LossScaleOptimizer\nloss scale\n(growth policy)")
    scale_ax.set_xlabel("step")
    scale_ax.legend(loc="lower right")
    scale_ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
