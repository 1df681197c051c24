"""The Markdown table: columns, one row per result, ratios to floor and best peer."""

from lossscale.bench import table


def _rows():
    return [
        {"impl": "ours", "kind": "ours", "workload": "w", "median_ms": 3.0},
        {"impl": "slow-peer", "kind": "peer", "workload": "w", "median_ms": 4.0},
        {"impl": "fast-peer", "kind": "peer", "workload": "w", "median_ms": 2.0},
        {"impl": "unscaled", "kind": "baseline", "workload": "w", "median_ms": 0.5},
        {"impl": "gone", "kind": "peer", "workload": "w", "skipped": "not installed: x"},
        {"impl": "broken", "kind": "ours", "workload": "v", "error": "exit status 1: boom"},
        {"impl": "ours", "kind": "ours", "workload": "v", "median_ms": 1.25},
    ]


def test_columns_and_one_row_per_result():
    lines = table.markdown_table(_rows(), {"w": 1.5}).splitlines()
    assert lines[0] == (
        "| implementation | workload | median ms | ratio to floor | ratio to best peer |"
    )
    assert lines[1] == "|---|---|---:|---:|---:|"
    assert lines[2:] == [
        "| ours | w | 3.000 | 2.00x | 1.50x |",
        "| slow-peer | w | 4.000 | 2.67x | 2.00x |",
        "| fast-peer | w | 2.000 | 1.33x | 1.00x |",
        # The unscaled baseline is faster than every peer but is not one.
        "| unscaled | w | 0.500 | 0.33x | 0.25x |",
        "| gone | w | skipped: not installed: x | - | - |",
        "| broken | v | failed: exit status 1: boom | - | - |",
        # No floor and no peer for workload v.
        "| ours | v | 1.250 | - | - |",
    ]


def test_best_peers_ignores_baselines_and_missing_results():
    assert table.best_peers(_rows()) == {"w": 2.0}
    assert table.best_peers([]) == {}


def test_header_lines():
    lines = table.header(
        "a machine",
        {
            "cpu": {"gb_per_s": 37.25, "method": "torch copy_, 2 threads", "bytes": 2**28},
            "cuda": {"error": "no GPU"},
        },
        {"large": 14.5},
        {"large": "16 tensors", "other": "2 tensors"},
    )
    assert lines == [
        "Machine: a machine",
        "Bandwidth (cpu): 37.2 GB/s (torch copy_, 2 threads, copy of 256 MiB, bytes read + "
        "written, best of several)",
        "Bandwidth (cuda): not measured (no GPU)",
        "Workload large: 16 tensors; floor 14.500 ms (32 bytes per parameter)",
        "Workload other: 2 tensors; floor unknown (32 bytes per parameter)",
    ]
