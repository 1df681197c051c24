"""The demo's second picture: each layer's float16 range over the steps.

One column of panels per loss-scaled run, one row per quantity of
`summary()["float16_range"]`; in a panel a row is a layer and a column a
measured step. Zeros are drawn apart from subnormals: they also count values
that are zero in float32. Drawn on a bare Agg canvas (no pyplot state).
"""

import numpy as np

from lossscale.mixed_precision.diagnostics import FLOAT16_MAX

# (key in summary()["float16_range"], row label)
SHARES = (
    ("zero", "share exactly 0\n(flushed, or 0\nin float32 too)"),
    ("subnormal", "share subnormal\n(0 < |g| < 2^-14:\nprecision lost)"),
    ("near_max", "share near max\n(|g| >= 65504 / 2:\nthe next growth\noverflows it)"),
)
# Shares below this are drawn in its colour (one value of the largest layer: 1.2e-4).
SHARE_FLOOR = 1e-4
# The largest magnitude in octaves, up to float16's maximum (2^15.99).
MAX_ABS_FLOOR = -12.0


def range_matrix(result, key):
    """`(layers, steps, matrix)`: one quantity (`key`) of a loss-scaled run's measurements.

    Raises:
        ValueError: When `result` has no measurement.
    """
    entries = result.float16_range
    if not entries:
        raise ValueError(
            "`result` must hold float16-range measurements (a loss-scaled run). Received: "
            f"the run {result.spec.label!r} with float16_range=[]"
        )
    layers = list(entries[0]["range"])
    steps = [e["step"] for e in entries]
    matrix = np.array(
        [[e["range"][name][key] for e in entries] for name in layers], dtype=np.float64
    )
    return layers, steps, matrix


def save_heatmap(results, path, title, every):
    """Writes the float16-range heatmaps of `results` (columns `every` steps wide) to `path`."""
    from matplotlib import colormaps, colors
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Fixed margins: a constrained layout is slow to draw.
    fig = Figure(figsize=(12, 8.5))
    FigureCanvasAgg(fig)
    margins = dict(left=0.12, right=0.93, top=0.9, bottom=0.06, hspace=0.12, wspace=0.12)
    axes = fig.subplots(
        len(SHARES) + 1, len(results), sharex=True, squeeze=False, gridspec_kw=margins
    )
    share_norm = colors.LogNorm(vmin=SHARE_FLOOR, vmax=1.0, clip=True)
    peak_norm = colors.Normalize(vmin=MAX_ABS_FLOOR, vmax=np.log2(FLOAT16_MAX))
    share_style = {"cmap": colormaps["viridis"].with_extremes(bad="white"), "norm": share_norm}
    for column, result in enumerate(results):
        for row, (key, label) in enumerate(SHARES):
            layers, steps, matrix = range_matrix(result, key)
            # A share of 0 is drawn white: nothing of that kind at that step.
            shown = np.ma.masked_where(~(matrix > 0), matrix)
            ylabel = label if column == 0 else None
            mesh = _panel(axes[row, column], layers, steps, every, shown, ylabel, **share_style)
        if column == 0:
            share_mesh = mesh
        layers, steps, peaks = range_matrix(result, "max_abs")
        with np.errstate(divide="ignore"):
            octaves = np.log2(peaks)  # inf stays inf: drawn at float16's maximum
        ax = axes[len(SHARES), column]
        shown = np.ma.masked_invalid(np.clip(octaves, MAX_ABS_FLOOR, np.log2(FLOAT16_MAX)))
        ylabel = "log2 of largest |g|\n(float16 max:\n2^16)" if column == 0 else None
        peak_mesh = _panel(ax, layers, steps, every, shown, ylabel, cmap="magma", norm=peak_norm)
        ax.set_xlabel("step")
        axes[0, column].set_title(result.spec.label)
    bar = {"fraction": 0.03, "pad": 0.015}
    fig.colorbar(share_mesh, ax=axes[: len(SHARES), :], label="share of the layer's values", **bar)
    fig.colorbar(peak_mesh, ax=axes[len(SHARES), :], label="octaves", **bar)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def _panel(ax, layers, steps, every, values, ylabel, **style):
    """Draws `values` (layers by steps), a sample at step s over [s, s + every); the mesh."""
    x = np.array(list(steps) + [steps[-1] + every], dtype=np.float64)
    mesh = ax.pcolormesh(x, np.arange(len(layers) + 1) - 0.5, values, **style)
    ax.set_yticks(range(len(layers)), layers)
    ax.invert_yaxis()
    if ylabel:
        ax.set_ylabel(ylabel)
    return mesh
