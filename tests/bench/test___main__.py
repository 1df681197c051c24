"""bench/__main__.py: `python -m lossscale.bench` runs `lossscale bench` and exits with its status."""

import subprocess
import sys


def _run(*argv):
    return subprocess.run(
        [sys.executable, "-m", "lossscale.bench", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_quick_run_prints_the_report_and_exits_0():
    proc = _run("--quick", "--workload", "large", "--impl", "lossscale-numpy", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# lossscale bench (")
    assert "| lossscale-numpy | large | " in proc.stdout
    assert "[bench] lossscale-numpy on large ..." in proc.stderr


def test_bad_arguments_exit_2_naming_the_argument():
    proc = _run("--rounds", "0")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("usage: lossscale bench")
    assert "lossscale bench: error: --rounds must be an integer >= 1. Received: 0" in proc.stderr
    proc = _run("--workload", "huge")
    assert proc.returncode == 2
    assert "argument --workload: invalid choice: 'huge'" in proc.stderr


def test_help_lists_the_implementations():
    proc = _run("--help")
    assert proc.returncode == 0
    assert "lossscale-numpy" in proc.stdout and "--interleave" in proc.stdout
