"""The subprocess side of the runner: one job, one JSON result line.

`python -m lossscale.bench.worker '<job json>'` runs a job of kind `"floor"`,
`"step"` or `"interleaved"`, then prints `runner.RESULT_PREFIX` and the
result as JSON on the last line of stdout.
"""

import json
import sys

from lossscale.bench.runner import RESULT_PREFIX


def run(job):
    """Runs one job in this process; returns its result dict."""
    from lossscale.bench import floor, interleave, registry, timing, workloads
    from lossscale.bench.frameworks import Unavailable

    if job["kind"] == "floor":
        return floor.measure(job["device"], quick=job["quick"])
    if job["kind"] == "interleaved":
        return interleave.steps(job)
    impl = registry.load()[job["impl"]]
    workload = workloads.get(job["workload"], quick=job["quick"])
    try:
        stepper = impl.setup(workload)
        times = timing.time_steps(stepper, job["repeats"], job["warmup"], job["warmup_seconds"])
    except Unavailable as e:
        return {"skipped": str(e)}
    return {**timing.summary(times), "versions": impl.versions()}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    result = run(json.loads(argv[0]))
    sys.stdout.write("\n" + RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
