"""benchmarks/aa_control.py: issue 29's AdamW rows beside a second copy of the baseline."""

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
    assert list(rows) == ["torch", "torch again", "our GradScaler", "our Optimizer"]
    median, ratio, per_round = rows["torch"]
    assert float(median) > 0 and float(ratio) == 1.0
    assert per_round.strip() == "1.000 / 1.000"  # one ratio per round
    for median, ratio, per_round in rows.values():
        assert float(median) > 0 and float(ratio) > 0 and len(per_round.split(" / ")) == 2
