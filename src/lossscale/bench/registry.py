"""The registry of benchmarked implementations.

Each implementation is a function of an `impl_*` module, decorated with
`@implementation(...)`, that builds a `timing.Stepper` for a workload and
imports its frameworks itself (in its worker subprocess). Kinds: `"ours"`,
`"peer"` (another library's loss-scaled step) and `"baseline"` (unscaled).
"""

import dataclasses
import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable

KINDS = ("ours", "peer", "baseline")
# `implementation`'s options for a torch implementation that runs on either device.
TORCH = {"requires": ("torch",), "devices": ("cpu", "cuda")}
# Modules whose `@implementation` functions fill the registry, in table order.
MODULES = (
    "impl_lossscale",
    "impl_torch",
    "impl_keras",
    "impl_jax",
    "impl_tensorflow",
    "impl_diagnostics",
    "impl_torch_diagnostics",
)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One benchmarked implementation.

    `requires`: distributions it needs (checked without importing them);
    `devices`: `"cpu"`, `"cuda"`; `env`: extra environment variables for its
    subprocess; `setup(workload) -> Stepper`.
    """

    name: str
    kind: str
    description: str
    requires: tuple
    devices: tuple
    env: dict
    setup: Callable

    def missing(self):
        """The required distributions that are not installed."""
        return [r for r in self.requires if importlib.util.find_spec(r) is None]

    def versions(self):
        """`{module: version}` of its distribution, for what it requires (and lossscale, numpy)."""
        names = dict.fromkeys(("lossscale", "numpy") + tuple(self.requires))
        return {n: importlib.metadata.version(_distribution(n)) for n in names}


REGISTRY = {}


def _distribution(module):
    """The installed distribution that provides `module` (itself when it is one)."""
    try:
        importlib.metadata.distribution(module)
        return module
    except importlib.metadata.PackageNotFoundError:
        return importlib.metadata.packages_distributions().get(module, [module])[0]


def implementation(name, kind, description, requires=(), devices=("cpu",), env=None):
    """Registers the decorated `setup(workload) -> Stepper` function under `name`."""
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {KINDS}. Received: kind={kind!r}")

    def register(setup):
        if name in REGISTRY:
            raise ValueError(f"Implementation {name!r} is registered twice.")
        REGISTRY[name] = Implementation(
            name, kind, description, tuple(requires), tuple(devices), dict(env or {}), setup
        )
        return setup

    return register


def load():
    """Imports the implementation modules; returns the filled `REGISTRY`."""
    for module in MODULES:
        importlib.import_module(f"lossscale.bench.{module}")
    return REGISTRY
