"""benchmarks/jax_compile_time.py: the first call of a jitted step, three ways, in a table."""

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "jax_compile_time.py"


def test_prints_a_row_per_step_with_its_ratio_to_plain_optax():
    proc = subprocess.run(  # a tiny MLP, one round: three fresh processes
        [sys.executable, str(SCRIPT), "--rounds", "1", "--widths", "8,16,4", "--batch", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "MLP 8,16,4, 212 parameters, batch 4, 1 rounds"
    assert lines[1].startswith("| row | first call (s) | x optax |")
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in lines[3:]}
    assert list(rows) == ["optax", "lossscale.optax", "jmp"]
    for row, cells in rows.items():
        first, ratio, cpu, cpu_ratio, trace, compiled, second, per_round = cells
        assert float(first) > 0 and float(cpu) > 0 and float(trace) > 0 and float(compiled) > 0
        assert float(second) > 0 and float(per_round) == float(ratio)  # one round
        if row == "optax":
            assert float(ratio) == float(cpu_ratio) == 1.0
