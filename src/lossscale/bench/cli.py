"""`lossscale bench`: time one optimizer step for every implementation.

Measures the bandwidth, runs each (implementation, workload) pair in its own
subprocess (or side by side: `interleave`) and prints a Markdown report.
"""

import argparse
import datetime
import os
import platform
import statistics
import sys

from lossscale.bench import floor, interleave, registry, runner, table, workloads

DEFAULT_REPEATS = 30
QUICK_REPEATS = 3
DEFAULT_WARMUP_SECONDS = 0.5


def build_parser():
    names = ", ".join(registry.load())
    parser = argparse.ArgumentParser(
        prog="lossscale bench",
        description="Time one LossScaleOptimizer(Adam) step against its peers; print a "
        "Markdown table of median ms, ratio to the memory floor and ratio to the "
        "best peer.",
    )
    parser.add_argument(
        "--workload",
        default="all",
        choices=workloads.NAMES + ("gpu", "all"),
        help="Which workload to run. 'gpu' runs gpu_tiny, gpu_many_small and gpu_large; "
        "'all' (default) runs tiny, many_small and large, plus the GPU ones "
        "when torch sees a CUDA device.",
    )
    parser.add_argument(
        "--impl",
        action="append",
        metavar="NAME",
        default=None,
        help=f"Run only this implementation (repeatable). One of: {names}. "
        "Default: every installed one.",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"Timed steps per implementation (default {DEFAULT_REPEATS}; "
        f"{QUICK_REPEATS} with --quick). The median is reported.",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="Untimed steps first (default: repeats // 5, at least 2; 1 with --quick).",
    )
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=None,
        help=f"Keep warming up until this many seconds have passed (default "
        f"{DEFAULT_WARMUP_SECONDS}; 0 with --quick): a process's first steps run slow.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Tiny workloads and few steps: checks the harness, not speed.",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1200.0,
        help="Seconds allowed per subprocess (default 1200).",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=0,
        help="On a shared machine: wait for idle CPUs before each run, and rerun "
        "a run that other processes disturbed up to this many times, "
        "keeping the least disturbed (Linux; default 0).",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="Run every implementation this many times, alternating the order "
        "(A B, B A, ...), and report the median of the rounds' medians (default 1).",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="Time the implementations that share an environment side by side in one "
        "process per workload, alternating rounds there (--rounds of them), instead of "
        "one process per implementation and round. Best for torch rows.",
    )
    parser.add_argument(
        "--alternate-steps",
        action="store_true",
        help="With --interleave: alternate the implementations step by step within each "
        "round (A B A B ..., then B A B A ...), not round by round; fair to rows that "
        "slow each other down in one process (XLA programs).",
    )
    return parser


def _machine():
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    memory = ""
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
        memory = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cpus} CPUs{memory}, {platform.system()} {platform.release()}"


def _workload_names(choice, parser):
    if choice == "all":
        return workloads.CPU_NAMES + (workloads.GPU_NAMES if runner.cuda_available() else ())
    names = workloads.GPU_NAMES if choice == "gpu" else (choice,)
    if choice in ("gpu",) + workloads.GPU_NAMES and not runner.cuda_available():
        parser.exit(
            2,
            f"lossscale bench: error: --workload {choice} needs a CUDA device, and "
            "torch sees none (or is not installed).\n",
        )
    return names


def _skip_row(impl, workload, explicit):
    """Why `impl` does not run on `workload`: a row, or None (a device, unless asked by name)."""
    row = {"impl": impl.name, "kind": impl.kind, "workload": workload.name}
    if workload.device not in impl.devices:
        return {**row, "skipped": f"runs on {', '.join(impl.devices)} only"} if explicit else None
    return {**row, "skipped": f"not installed: {', '.join(impl.missing())}"}


def _runs_on(impl, workload):
    return workload.device in impl.devices and not impl.missing()


def _run_interleaved(impls, names, args, explicit):
    rows = []
    for name in names:
        workload = workloads.get(name, quick=args.quick)
        runs = [i for i in impls if _runs_on(i, workload)]
        skipped = (_skip_row(i, workload, explicit) for i in impls if i not in runs)
        rows += [row for row in skipped if row is not None]
        rows += interleave.run(runs, name, args)
    return rows


def _run_rows(impls, names, args, explicit):
    rows = []
    for name in names:
        workload = workloads.get(name, quick=args.quick)
        for impl in impls:
            if not _runs_on(impl, workload):
                rows.append(_skip_row(impl, workload, explicit))
                continue
            print(f"[bench] {impl.name} on {name} ...", file=sys.stderr, flush=True)
            job = {
                "kind": "step",
                "impl": impl.name,
                "workload": name,
                "quick": args.quick,
                "repeats": args.repeats,
                "warmup": args.warmup,
                "warmup_seconds": args.warmup_seconds,
            }
            result = runner.run_job_retrying(
                job, env=impl.env, timeout=args.timeout, retries=args.retries
            )
            rows.append({"impl": impl.name, "kind": impl.kind, "workload": name, **result})
    return [row for row in rows if row is not None]


def _run_rounds(impls, names, args, explicit):
    """`_run_rows` `args.rounds` times, every other round in reverse order, merged."""
    rounds = []
    for number in range(args.rounds):
        if args.rounds > 1:
            print(f"[bench] round {number + 1} of {args.rounds}", file=sys.stderr, flush=True)
        order = impls if number % 2 == 0 else impls[::-1]
        rounds.append(
            {(r["impl"], r["workload"]): r for r in _run_rows(order, names, args, explicit)}
        )
    if args.rounds == 1:
        return list(rounds[0].values())
    merged = []
    for key, row in rounds[0].items():
        runs = [r[key] for r in rounds]
        failed = next((r for r in runs if r.get("median_ms") is None), None)
        if failed is not None:
            merged.append(failed)
            continue
        medians = [r["median_ms"] for r in runs]
        merged.append(
            {
                **row,
                "median_ms": statistics.median(medians),
                "round_medians": medians,
                "others_cores": max(r.get("others_cores", 0) for r in runs),
            }
        )
    return merged


def main(argv=None):
    """Runs `lossscale bench` with `argv` (default `sys.argv[1:]`); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    available = registry.load()
    unknown = [n for n in args.impl or () if n not in available]
    if unknown:
        parser.error(f"unknown --impl {unknown}; choose from {sorted(available)}")
    if args.repeats is None:
        args.repeats = QUICK_REPEATS if args.quick else DEFAULT_REPEATS
    if args.repeats < 1:
        parser.error(f"--repeats must be an integer >= 1. Received: {args.repeats}")
    if args.warmup is None:
        args.warmup = 1 if args.quick else max(2, args.repeats // 5)
    if args.warmup < 0:
        parser.error(f"--warmup must be an integer >= 0. Received: {args.warmup}")
    if args.warmup_seconds is None:
        args.warmup_seconds = 0.0 if args.quick else DEFAULT_WARMUP_SECONDS
    if not args.warmup_seconds >= 0:
        parser.error(f"--warmup-seconds must be a number >= 0. Received: {args.warmup_seconds}")
    if args.retries < 0:
        parser.error(f"--retries must be an integer >= 0. Received: {args.retries}")
    if args.rounds < 1:
        parser.error(f"--rounds must be an integer >= 1. Received: {args.rounds}")
    if args.alternate_steps and not args.interleave:
        parser.error("--alternate-steps needs --interleave (it alternates within one process)")
    names = _workload_names(args.workload, parser)
    impls = (
        [available[n] for n in dict.fromkeys(args.impl)] if args.impl else list(available.values())
    )

    bandwidths = {}
    for device in dict.fromkeys(workloads.get(n).device for n in names):
        print(f"[bench] measuring {device} memory bandwidth ...", file=sys.stderr, flush=True)
        bandwidths[device] = runner.run_job_retrying(
            {"kind": "floor", "device": device, "quick": args.quick},
            timeout=args.timeout,
            retries=args.retries,
        )
    floors, info = {}, {}
    for name in names:
        workload = workloads.get(name, quick=args.quick)
        info[name] = workload.describe()
        bw = bandwidths[workload.device]
        if "gb_per_s" in bw:
            floors[name] = floor.floor_ms(workload.size, bw["gb_per_s"])
    run = _run_interleaved if args.interleave else _run_rounds
    rows = run(impls, names, args, explicit=bool(args.impl))
    print(report(rows, floors, bandwidths, info, args))
    failed = [r for r in rows if "error" in r] + [b for b in bandwidths.values() if "error" in b]
    return 1 if failed else 0


def report(rows, floors, bandwidths, info, args):
    """The whole Markdown report as a string."""
    versions = {}
    for row in rows:
        versions.update(row.get("versions", {}))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# lossscale bench ({date})", ""]
    lines += [f"- {line}" for line in table.header(_machine(), bandwidths, floors, info)]
    lines.append(
        f"- Python {platform.python_version()}; "
        + ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
    )
    lines.append(
        f"- Median of {args.repeats} steps after {args.warmup} warm-up steps"
        + (f" and at least {args.warmup_seconds:g} s of warm-up" if args.warmup_seconds else "")
        + (f"; median of {args.rounds} rounds in alternating order" if args.rounds > 1 else "")
        + ("; interleaved: side by side in one process per workload" if args.interleave else "")
        + (", alternating step by step" if args.alternate_steps else "")
        + (" (--quick: tiny workloads, timings meaningless)" if args.quick else "")
    )
    lines += ["", table.markdown_table(rows, floors), ""]
    per_round = [
        f"{r['impl']} on {r['workload']}: " + " / ".join(f"{m:.3f}" for m in r["round_medians"])
        for r in rows
        if "round_medians" in r
    ]
    if per_round:
        lines += ["Medians of each round (ms):", ""] + [f"- {line}" for line in per_round] + [""]
    disturbed = [
        f"{r['impl']} on {r['workload']} ({r['others_cores']:.2f})"
        for r in rows
        if r.get("others_cores", 0) > runner.DISTURBED_CORES
    ]
    if disturbed:
        lines += [
            f"**Unreliable rows**: other processes kept CPUs busy (mean cores in "
            f"parentheses) while these ran: {', '.join(disturbed)}. Rerun on an idle "
            "machine.",
            "",
        ]
    lines += [
        f"- `{impl.name}` ({impl.kind}): {impl.description}"
        for impl in registry.REGISTRY.values()
        if any(r["impl"] == impl.name for r in rows)
    ]
    return "\n".join(lines)
