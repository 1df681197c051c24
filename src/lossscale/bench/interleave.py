"""`lossscale bench --interleave`: the implementations of a workload side by side in one process.

Some machines put a whole process in a faster or slower mode for its
lifetime, so implementations sharing an environment are timed in one worker
process per workload, in rounds of alternating order (A B, B A, ...). With
`--alternate-steps` they take turns step by step instead (XLA programs in one
process slow each other down). The parent side is `run`; the worker's, `steps`.
"""

import statistics
import sys

from lossscale.bench import runner


def run(impls, name, args):
    """Rows for workload `name`: each group of `impls` sharing an environment in one process."""
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
