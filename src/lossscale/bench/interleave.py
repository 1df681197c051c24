"""`lossscale bench --interleave`: the implementations of a workload side by side in one process.

This VM (and others like it) puts a whole process in a faster or a slower
mode for its lifetime, by tens of percent: rows timed in separate processes
differ by the modes they drew as much as by their code, and alternating the
processes over rounds averages that out only slowly. Interleaved, every
implementation that shares an environment (the torch ones, say) is set up
in one worker process per workload, warmed up, and timed in rounds that
alternate their order (A B, B A, ...) there, so each round compares them in
the same mode. Implementations with an environment of their own (Keras on
JAX) still get a process of their own.

With `--alternate-steps` the implementations take turns step by step
within each round instead. XLA programs sharing a process slow each other
down (plain optax on `many_small` went from 3.2 to 10.4 ms interleaved by
rounds); taking turns step by step, each step of every row sees the same
state, so their ratios still compare.

The parent side is `run`; the worker side, `steps`.
"""

import statistics
import sys

from lossscale.bench import runner


def run(impls, name, args):
    """Rows for workload `name`: each group of `impls` sharing an environment in one process.

    Args:
        impls: The implementations to run (installed, and on the workload's device).
        name: The workload's name.
        args: The parsed `lossscale bench` arguments.
    """
    rows, groups = [], {}
    for impl in impls:
        groups.setdefault(tuple(sorted(impl.env.items())), []).append(impl)
    for env, group in groups.items():
        names = [impl.name for impl in group]
        print(f"[bench] {', '.join(names)} on {name}, interleaved ...", file=sys.stderr, flush=True)
        job = {
            "kind": "interleaved",
            "impls": names,
            "workload": name,
            "quick": args.quick,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "warmup_seconds": args.warmup_seconds,
            "rounds": args.rounds,
            "alternate_steps": args.alternate_steps,
        }
        result = runner.run_job_retrying(
            job, env=dict(env), timeout=args.timeout * len(group), retries=args.retries
        )
        for impl in group:
            row = {"impl": impl.name, "kind": impl.kind, "workload": name}
            if "error" in result:
                rows.append({**row, "error": result["error"]})
                continue
            own = result["rows"][impl.name]
            if "others_cores" in result:
                own = {**own, "others_cores": result["others_cores"]}
            rows.append({**row, **own})
    return rows


def steps(job):
    """The worker side: `{impl name: row}` for one interleaved job."""
    from lossscale.bench import registry, timing, workloads
    from lossscale.bench.frameworks import Unavailable

    available = registry.load()
    workload = workloads.get(job["workload"], quick=job["quick"])
    rows, steppers = {}, {}
    for name in job["impls"]:
        try:
            steppers[name] = available[name].setup(workload)
            timing.time_steps(steppers[name], 1, job["warmup"], job["warmup_seconds"])
        except Unavailable as e:
            steppers.pop(name, None)
            rows[name] = {"skipped": str(e)}
    medians = {name: [] for name in steppers}
    order = list(steppers)
    for number in range(job["rounds"]):
        names = order if number % 2 == 0 else order[::-1]
        if job.get("alternate_steps"):  # A B A B ...: one step each in turn
            times = {name: [] for name in names}
            for _ in range(job["repeats"]):
                for name in names:
                    times[name] += timing.time_steps(steppers[name], 1, 0)
        else:  # A A ... B B ...
            times = {name: timing.time_steps(steppers[name], job["repeats"], 0) for name in names}
        for name in names:
            medians[name].append(timing.summary(times[name])["median_ms"])
    for name, values in medians.items():
        rows[name] = {
            "median_ms": statistics.median(values),
            "round_medians": values,
            "versions": available[name].versions(),
        }
    return {"rows": rows}
