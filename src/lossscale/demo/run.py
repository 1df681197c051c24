"""`run_demo`: the four runs, the table, the pictures and the saved numbers."""

import dataclasses
import importlib.util
import json
import os
import sys
import time

from lossscale.demo import data as digits
from lossscale.demo import report
from lossscale.demo.models import make_model, single_threaded
from lossscale.demo.training import RUNS, train_run

# Import name -> what to install.
_NEEDS = {
    "sklearn": "scikit-learn",
    "threadpoolctl": "threadpoolctl",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
}
_BACKEND_NEEDS = {
    "torch": {"torch": "torch"},
    "jax": {"jax": "jax"},
    "tensorflow": {"tensorflow": "tensorflow-cpu"},
    "numpy": {},
}
# What `pip install 'lossscale[demo]'` does not bring (it brings torch).
_EXTRA_INSTALL = {"jax": " jax", "tensorflow": " tensorflow-cpu"}


class MissingDependencyError(RuntimeError):
    """Raised when a package the demo needs is not installed."""


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """What `run_demo` produced.

    Attributes:
        runs: The four `RunResult`s: float32, float16 without loss scaling,
            float16 with `LossScaleOptimizer` (growth policy `"fixed"`),
            and with `growth_policy="statistics"`.
        table: The comparison table (Markdown).
        summary: Three sentences reading the table.
        plot_path: The PNG of the loss curves and the loss scales.
        heatmap_path: The PNG of each layer's float16 range over the steps.
        results_path: The JSON file with every measured number.
        seconds: Wall time of the whole demo.
    """

    runs: tuple
    table: str
    summary: str
    plot_path: str
    heatmap_path: str
    results_path: str
    seconds: float


def check_dependencies(backend):
    """Raises `MissingDependencyError` naming every missing package and how to install it."""
    needs = {**_NEEDS, **_BACKEND_NEEDS[backend]}
    missing = [pip for module, pip in needs.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingDependencyError(
            f"`lossscale demo --backend {backend}` needs {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed. Install the demo extra: "
            f"pip install 'lossscale[demo]'" + _EXTRA_INSTALL.get(backend, "")
        )


def _header(config):
    return "\n".join(
        [
            f"lossscale demo: a 64-{config.hidden_units}-10 ReLU network on scikit-learn's 8x8 "
            "digits (1,437 training and 360 test images, shipped inside scikit-learn), trained "
            "four times with the same seed, initial weights and batches.",
            f"backend={config.backend} steps={config.steps} batch={config.batch_size} "
            f"Adam(learning_rate={config.learning_rate:g}) seed={config.seed} "
            f"initial_scale={report.format_number(config.initial_scale)} "
            f"growth_steps={config.growth_steps} diagnostics_every={config.diagnostics_every}",
            "float16 runs keep float32 master weights and run the forward and backward passes on a "
            "float16 copy; the gradients they produce are float16.",
            "Every run multiplies its loss by "
            f"loss_weight={report.format_number(config.loss_weight)} "
            "(--loss-weight): a stand-in for the averaging over 10^5-10^6 loss terms that can put "
            "large models' gradients below float16's normal range (6.1e-05). Adam's epsilon is "
            "multiplied too, so the float32 run trains as on the plain loss (exactly, for a power "
            "of two). With --loss-weight 1 this small network's gradients mostly fit in float16 "
            "and loss scaling has little to fix.",
            "The loss-scaled runs measure each layer's scaled gradient against float16's range "
            f"every {config.diagnostics_every} steps (--diagnostics-every); the last one decides "
            'its scale from that measurement (growth_policy="statistics").',
        ]
    )


def _progress_bar(label, config):
    from tqdm.auto import tqdm

    return tqdm(
        total=config.steps,
        desc=f"{label:<28}",
        unit="step",
        disable=not config.progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )


def run_demo(config, stream=None):
    """Trains the four runs, prints the table and writes the two PNGs and a JSON file.

    Args:
        config: A `DemoConfig`.
        stream: Where to print (defaults to `sys.stdout`); progress bars go
            to `sys.stderr`.

    Returns:
        A `DemoResult`.

    Raises:
        MissingDependencyError: When a package the demo needs is missing.
    """
    stream = stream or sys.stdout
    check_dependencies(config.backend)
    start = time.perf_counter()
    print(_header(config), file=stream, flush=True)
    data = digits.load_digits(config.seed)
    batches = digits.batch_indices(len(data.y_train), config.batch_size, config.steps, config.seed)
    weights = digits.initial_weights(config.seed, config.hidden_units)

    def run(spec):
        model = make_model(config.backend, weights)
        return train_run(spec, model, data, batches, config, _progress_bar(spec.label, config))

    with single_threaded(config.backend):
        runs = tuple(run(spec) for spec in RUNS)
    table, summary = report.table(runs), report.summary(runs)
    os.makedirs(config.out, exist_ok=True)
    plot_path = os.path.join(config.out, "demo.png")
    heatmap_path = os.path.join(config.out, "demo_float16_range.png")
    results_path = os.path.join(config.out, "results.json")
    from lossscale.demo.heatmap import save_heatmap
    from lossscale.demo.plot import save_plot

    setting = f"{config.backend} backend, loss_weight={report.format_number(config.loss_weight)}"
    save_plot(runs, plot_path, f"lossscale demo ({setting})")
    save_heatmap(
        [r for r in runs if r.spec.loss_scaling],
        heatmap_path,
        "Float16 range of each layer's scaled gradient, as LossScaleOptimizer received it, "
        f"measured at one step in {config.diagnostics_every}\n({setting}; white: a share of 0)",
        config.diagnostics_every,
    )
    seconds = time.perf_counter() - start
    results = {"config": dataclasses.asdict(config), "seconds": seconds}
    results.update(runs=[r.to_dict() for r in runs], table=table, summary=summary)
    with open(results_path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    print("\n" + table + "\n\n" + report.LEGEND + "\n\n" + summary, file=stream)
    print(
        f"\nPlot: {plot_path}\nFloat16 range: {heatmap_path}\nNumbers: {results_path}\n"
        f"Total time: {seconds:.1f} s",
        file=stream,
        flush=True,
    )
    return DemoResult(runs, table, summary, plot_path, heatmap_path, results_path, seconds)
