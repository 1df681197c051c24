"""The `lossscale` command line.

`lossscale demo` (`lossscale.demo`) and `lossscale bench` (`lossscale.bench`,
which reads its own options). Bad options exit with status 2; a missing
optional package exits with status 1 and says what to install.
"""

import argparse
import importlib
import math
import re
import sys

from lossscale import __version__
from lossscale.demo.config import (
    BACKENDS,
    DEFAULT_LOSS_WEIGHT,
    DEFAULT_STEPS,
    QUICK_STEPS,
    DemoConfig,
)

_POWER_OF_TWO = re.compile(r"^\s*2\s*(?:\*\*|\^)\s*([+-]?\d+)\s*$")


def _integer(low):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}. Received: {text!r}")
        return value

    return parse


def _positive_number(text):
    """A finite float > 0; also accepts powers of two written `2**15` or `2^-16`."""
    match = _POWER_OF_TWO.match(text)
    try:
        value = 2.0 ** int(match.group(1)) if match else float(text)
    except (ValueError, OverflowError):
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a finite number > 0 (such as 32768, 1e-5 or 2**15). Received: {text!r}"
        )
    return value


def build_parser():
    """Returns the `argparse` parser of the `lossscale` command."""
    parser = argparse.ArgumentParser(
        prog="lossscale",
        description="Dynamic loss scaling for mixed-precision training on NumPy, PyTorch and JAX.",
    )
    parser.add_argument("--version", action="version", version=f"lossscale {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    defaults = DemoConfig()
    demo = commands.add_parser(
        "demo",
        help="train in float32, float16 and float16 with LossScaleOptimizer, and compare",
        description="Trains a small network on scikit-learn's 8x8 digits four times with the "
        "same seed and data: float32; float16 without loss scaling; float16 with "
        "LossScaleOptimizer, under the fixed and the statistics growth policy. Prints a "
        "comparison table (accuracy, loss, skipped steps, loss scale, gradients lost to "
        "float16 underflow) and writes a PNG of the loss curves and the loss scales, and "
        "one of each layer's float16 range over the steps.",
    )
    demo.add_argument(
        "--steps",
        type=_integer(1),
        default=None,
        help=f"optimizer steps per run (default: {DEFAULT_STEPS}, or {QUICK_STEPS} with --quick)",
    )
    demo.add_argument(
        "--seed",
        type=_integer(0),
        default=defaults.seed,
        help="seed of the data split, batch order and initial weights (default: %(default)s)",
    )
    demo.add_argument(
        "--out",
        metavar="DIR",
        default=defaults.out,
        help="directory for demo.png, demo_float16_range.png and results.json "
        "(default: %(default)s)",
    )
    demo.add_argument(
        "--initial-scale",
        type=_positive_number,
        default=defaults.initial_scale,
        help="LossScaleOptimizer's initial loss scale (default: 2**15)",
    )
    demo.add_argument(
        "--growth-steps",
        type=_integer(1),
        default=defaults.growth_steps,
        help="LossScaleOptimizer's dynamic_growth_steps: finite steps between "
        "doublings of the scale (default: %(default)s)",
    )
    demo.add_argument(
        "--diagnostics-every",
        type=_integer(1),
        default=defaults.diagnostics_every,
        help="the loss-scaled runs' diagnostics_every: steps between measurements of each "
        "layer's float16 range, which the heatmap shows and the statistics policy decides "
        "from (default: %(default)s)",
    )
    demo.add_argument(
        "--backend",
        choices=BACKENDS,
        default=defaults.backend,
        help="array library for the model and the optimizer (default: %(default)s)",
    )
    demo.add_argument(
        "--loss-weight",
        type=_positive_number,
        default=DEFAULT_LOSS_WEIGHT,
        help="constant every run multiplies its loss by, standing in for the "
        "averaging over many loss terms that makes large models' gradients "
        "small (default: 2**-16; 1 trains on the plain loss)",
    )
    demo.add_argument(
        "--quick",
        action="store_true",
        help=f"a run of a few seconds ({QUICK_STEPS} steps), for tests",
    )
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    demo.set_defaults(subparser=demo)
    commands.add_parser(
        "bench",
        add_help=False,
        help="time one optimizer step against the reference implementations "
        "(options: lossscale bench --help)",
    )
    return parser


def _run_demo(args):
    from lossscale.demo import MissingDependencyError, run_demo

    steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    try:
        config = DemoConfig(
            steps=steps,
            seed=args.seed,
            out=args.out,
            initial_scale=args.initial_scale,
            growth_steps=args.growth_steps,
            diagnostics_every=args.diagnostics_every,
            backend=args.backend,
            loss_weight=args.loss_weight,
            progress=not args.no_progress,
        )
    except ValueError as error:
        args.subparser.error(str(error))
    try:
        run_demo(config)
    except MissingDependencyError as error:
        print(f"lossscale demo: error: {error}", file=sys.stderr)
        return 1
    return 0


def _run_bench(argv):
    # Imported here: `lossscale demo` and `--help` must not need the benchmark.
    try:
        bench = importlib.import_module("lossscale.bench")
    except ModuleNotFoundError as error:
        if error.name not in ("lossscale.bench", None):
            raise
        print(
            "lossscale bench: error: the benchmark module `lossscale.bench` is not "
            "available in this installation.",
            file=sys.stderr,
        )
        return 1
    status = bench.main(list(argv))
    return status if isinstance(status, int) else 0


def main(argv=None):
    """Runs the `lossscale` command; returns its exit status.

    Args:
        argv: Arguments without the program name. Defaults to
            `sys.argv[1:]`.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench":
        return _run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    return _run_demo(args)
