"""The Markdown report: a header on the machine and floors, then one table.

Ratios are to the workload's floor and to its fastest row of kind `"peer"`.
"""

COLUMNS = ("implementation", "workload", "median ms", "ratio to floor", "ratio to best peer")


def best_peers(rows):
    """`{workload: fastest peer median ms}` over the rows of kind "peer"."""
    best = {}
    for row in rows:
        if row["kind"] == "peer" and row.get("median_ms") is not None:
            w = row["workload"]
            best[w] = min(best.get(w, float("inf")), row["median_ms"])
    return best


def _ratio(value, reference):
    return "-" if value is None or not reference else f"{value / reference:.2f}x"


def _cells(row, floors, best):
    median = row.get("median_ms")
    if median is None:
        reason = row.get("skipped") or row.get("error")
        status = "skipped" if row.get("skipped") else "failed"
        return [row["impl"], row["workload"], f"{status}: {reason}", "-", "-"]
    return [
        row["impl"],
        row["workload"],
        f"{median:.3f}",
        _ratio(median, floors.get(row["workload"])),
        _ratio(median, best.get(row["workload"])),
    ]


def markdown_table(rows, floors):
    """The result `rows` (with `median_ms`, or `skipped` / `error`) as a Markdown table."""
    best = best_peers(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * 3) + "|"]
    lines += ["| " + " | ".join(_cells(row, floors, best)) + " |" for row in rows]
    return "\n".join(lines)


def header(machine, bandwidths, floors, workload_info):
    """Lines describing the machine, the measured bandwidth and each workload's floor."""
    lines = [f"Machine: {machine}"]
    for device, bw in bandwidths.items():
        if "error" in bw:
            lines.append(f"Bandwidth ({device}): not measured ({bw['error']})")
        else:
            lines.append(
                f"Bandwidth ({device}): {bw['gb_per_s']:.1f} GB/s "
                f"({bw['method']}, copy of {bw['bytes'] / 2**20:.0f} MiB, "
                "bytes read + written, best of several)"
            )
    for name, info in workload_info.items():
        floor = floors.get(name)
        floor_text = f"{floor:.3f} ms" if floor is not None else "unknown"
        lines.append(f"Workload {name}: {info}; floor {floor_text} (32 bytes per parameter)")
    return lines
