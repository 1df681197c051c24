"""__main__.py: `python -m lossscale` is the `lossscale` command line."""

import importlib
import subprocess
import sys

import lossscale


def _run(*argv):
    return subprocess.run(
        [sys.executable, "-m", "lossscale", *argv], capture_output=True, text=True, timeout=120
    )


def test_parses_the_command_line_and_exits_with_its_status():
    proc = _run("demo", "--steps", "0")
    assert proc.returncode == 2
    assert "lossscale demo: error: argument --steps" in proc.stderr
    proc = _run("--help")
    assert proc.returncode == 0 and "demo" in proc.stdout
    proc = _run("--version")
    assert proc.returncode == 0 and proc.stdout == f"lossscale {lossscale.__version__}\n"


def test_forwards_bench_and_its_errors():
    proc = _run("bench", "--impl", "nope")
    assert proc.returncode == 2
    assert "lossscale bench: error: unknown --impl ['nope']" in proc.stderr


def test_importing_it_runs_nothing():
    module = importlib.import_module("lossscale.__main__")
    assert module.main is lossscale.cli.main
