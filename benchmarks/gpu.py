"""The CUDA entry point: `gpu_tiny`, `gpu_many_small` and `gpu_large`.

`gpu_tiny` is a small transformer's 28 tensors (117K parameters),
`gpu_many_small` 400 tensors (~1M), both bound by kernel launches;
`gpu_large` 64 tensors (~256M), bound by memory.

One prepared script for a CUDA machine, sized to finish in about 5 minutes:
the bandwidth floor of the GPU, then every installed implementation that
runs on CUDA (20 timed steps each after 4 warm-up steps), each in its own
subprocess. It fails loudly, with exit status 2, when torch is missing or
sees no CUDA device: there is nothing to fall back to.

    python benchmarks/gpu.py                  # prints the Markdown report
    python benchmarks/gpu.py --repeats 50     # further `lossscale bench` options pass through

JAX rows need a CUDA-enabled jaxlib; with a CPU-only jax they are reported
as skipped, not silently left out.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

# Per subprocess: data generation (2 x 1 GiB), compilation and 24 steps fit
# well inside this; a hung worker cannot eat the whole budget.
DEFAULTS = ["--workload", "gpu", "--repeats", "20", "--warmup", "4", "--timeout", "150"]


def main(argv):
    try:
        import torch
    except ImportError:
        print(
            "benchmarks/gpu.py: error: torch is not installed; this benchmark needs torch "
            "with CUDA.",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        print(
            f"benchmarks/gpu.py: error: CUDA is not available (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda}); run this on a CUDA machine.",
            file=sys.stderr,
        )
        return 2
    from lossscale.bench import main as bench

    return bench(DEFAULTS + list(argv))  # later options override the defaults


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
