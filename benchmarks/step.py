"""The optimizer-step benchmark: the same as `lossscale bench`, arguments passed through.

    python benchmarks/step.py                       # every installed implementation, CPU workloads
    python benchmarks/step.py --workload large --impl lossscale-numpy --impl torch-gradscaler-fused

Works from a checkout without installing lossscale (its `src/` goes on the
path, for this process and for the worker subprocesses).
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

from lossscale.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
