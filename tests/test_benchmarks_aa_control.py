"""benchmarks/aa_control.py: `lossscale bench` rows beside a second copy of their baseline."""

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "aa_control.py"


def test_prints_each_row_with_its_ratio_per_round():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "tiny", "2", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:5]
        for line in proc.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| row")
    }
    assert list(rows) == [
        "torch-gradscaler-adamw-fused",
        "torch-gradscaler-adamw-fused again",
        "lossscale-gradscaler-adamw-fused",
        "lossscale-torch-optimizer-adamw",
    ]
    median, ratio, per_round = rows["torch-gradscaler-adamw-fused"]
    assert float(median) > 0 and float(ratio) == 1.0
    assert per_round.strip() == "1.000 / 1.000"  # one ratio per round
    for median, ratio, per_round in rows.values():
        assert float(median) > 0 and float(ratio) > 0 and len(per_round.split(" / ")) == 2


def test_takes_the_rows_to_compare_by_name():
    proc = subprocess.run(
        # Rows that build in a moment (the NumPy rule, torch's GradScaler step).
        [sys.executable, str(SCRIPT), "tiny", "2", "1", "lossscale-numpy"]
        + ["lossscale-gradscaler-adamw-fused"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line[:2] == "| "]
    assert rows[1:] == [
        "lossscale-numpy",
        "lossscale-numpy again",
        "lossscale-gradscaler-adamw-fused",
    ]


def test_an_unknown_row_is_named():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "tiny", "1", "1", "no-such-row"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "Unknown implementations: ['no-such-row']" in proc.stderr
