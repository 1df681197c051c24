"""The demo's second picture: each layer's float16 range over the steps.

One column of panels per loss-scaled run, one row of panels per quantity
that `summary()["float16_range"]` reports of a scaled gradient: the share
of exact zeros, the share of float16 subnormals, the share near float16's
maximum, and the largest magnitude. In each panel a row is a layer and a
column a measured step (one step in every `diagnostics_every`: a sample,
not an average over the interval).

Zeros are drawn apart from subnormals instead of summed into one
"underflow" share: the zero share also counts values that are zero in
float32 (pixels blank in every image, hidden units that did not fire), so
it does not measure underflow by itself; the table's "grads flushed to 0"
column does, against float32. The subnormal share is precision lost
already, and the near-max share is what the next growth would overflow.

Drawn on a bare Agg canvas, so no pyplot state or global backend is touched.
"""

import numpy as np

from lossscale.mixed_precision.diagnostics import FLOAT16_MAX

# (key in summary()["float16_range"], row label)
SHARES = (
    ("zero", "share exactly 0\n(flushed, or 0\nin float32 too)"),
    ("subnormal", "share subnormal\n(0 < |g| < 2^-14:\nprecision lost)"),
    ("near_max", "share near max\n(|g| >= 65504 / 2:\nthe next growth\noverflows it)"),
)
# Shares below this are drawn in its colour: one value of the demo's largest
# layer (64 x 128) is 1.2e-4.
SHARE_FLOOR = 1e-4
# The largest magnitude in octaves, up to float16's maximum (2^15.99).
MAX_ABS_FLOOR = -12.0


def range_matrix(result, key):
    """One quantity of a run's measurements as a layers-by-steps matrix.

    Args:
        result: A `RunResult` of a loss-scaled run.
        key: `"zero"`, `"subnormal"`, `"near_max"` or `"max_abs"`.

    Returns:
        `(layers, steps, matrix)`: the layer names, the measured steps and a
        float64 array of shape `(len(layers), len(steps))`.

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


def _edges(steps, every):
    # A sample at step s is drawn over [s, s + every): where it was taken,
    # and until the next one.
    return np.array(list(steps) + [steps[-1] + every], dtype=np.float64)


def save_heatmap(results, path, title, every):
    """Writes the float16-range heatmaps of `results` to `path` (PNG).

    Args:
        results: The loss-scaled `RunResult`s, one column of panels each.
        path: Output file name.
        title: Figure title.
        every: The runs' `diagnostics_every` (the width of a column).
    """
    from matplotlib import colormaps, colors
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Fixed margins: a constrained layout of these panels took twice as long
    # to draw as the panels themselves.
    fig = Figure(figsize=(12, 8.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(
        len(SHARES) + 1,
        len(results),
        sharex=True,
        squeeze=False,
        gridspec_kw={
            "left": 0.12,
            "right": 0.93,
            "top": 0.9,
            "bottom": 0.06,
            "hspace": 0.12,
            "wspace": 0.12,
        },
    )
    share_norm = colors.LogNorm(vmin=SHARE_FLOOR, vmax=1.0, clip=True)
    peak_norm = colors.Normalize(vmin=MAX_ABS_FLOOR, vmax=np.log2(FLOAT16_MAX))
    share_map = colormaps["viridis"].with_extremes(bad="white")
    for column, result in enumerate(results):
        for row, (key, label) in enumerate(SHARES):
            layers, steps, matrix = range_matrix(result, key)
            ax = axes[row, column]
            # A share of 0 is drawn white: nothing of that kind at that step.
            shown = np.ma.masked_where(~(matrix > 0), matrix)
            mesh = ax.pcolormesh(
                _edges(steps, every),
                np.arange(len(layers) + 1) - 0.5,
                shown,
                cmap=share_map,
                norm=share_norm,
            )
            _label(ax, layers, label if column == 0 else None)
        if column == 0:
            share_mesh = mesh
        layers, steps, peaks = range_matrix(result, "max_abs")
        with np.errstate(divide="ignore"):
            octaves = np.log2(peaks)  # inf stays inf: drawn at float16's maximum
        ax = axes[len(SHARES), column]
        peak_mesh = ax.pcolormesh(
            _edges(steps, every),
            np.arange(len(layers) + 1) - 0.5,
            np.ma.masked_invalid(np.clip(octaves, MAX_ABS_FLOOR, np.log2(FLOAT16_MAX))),
            cmap="magma",
            norm=peak_norm,
        )
        _label(ax, layers, "log2 of largest |g|\n(float16 max:\n2^16)" if column == 0 else None)
        ax.set_xlabel("step")
        axes[0, column].set_title(result.spec.label)
    bar = {"fraction": 0.03, "pad": 0.015}
    fig.colorbar(share_mesh, ax=axes[: len(SHARES), :], label="share of the layer's values", **bar)
    fig.colorbar(peak_mesh, ax=axes[len(SHARES), :], label="octaves", **bar)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def _label(ax, layers, ylabel):
    ax.set_yticks(range(len(layers)), layers)
    ax.invert_yaxis()
    if ylabel:
        ax.set_ylabel(ylabel)
