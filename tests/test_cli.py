"""`lossscale` command line: parsing, exit codes, messages, `bench` forwarding."""

import subprocess
import sys
import types

import pytest

from lossscale import cli
from lossscale.demo import config as demo_config


def _error(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--steps", "0"], "argument --steps: must be an integer >= 1. Received: '0'"),
        (["demo", "--steps", "ten"], "argument --steps: must be an integer >= 1. Received: 'ten'"),
        (["demo", "--seed", "-1"], "argument --seed: must be an integer >= 0. Received: '-1'"),
        (
            ["demo", "--growth-steps", "0"],
            "argument --growth-steps: must be an integer >= 1. Received: '0'",
        ),
        (
            ["demo", "--diagnostics-every", "0"],
            "argument --diagnostics-every: must be an integer >= 1. Received: '0'",
        ),
        (["demo", "--initial-scale", "0"], "argument --initial-scale: must be a finite number > 0"),
        (["demo", "--initial-scale", "nan"], "Received: 'nan'"),
        (["demo", "--initial-scale", "inf"], "Received: 'inf'"),
        (["demo", "--initial-scale", "2**2000"], "Received: '2**2000'"),
        (["demo", "--loss-weight=-1e-5"], "argument --loss-weight: must be a finite number > 0"),
        (["demo", "--backend", "mxnet"], "argument --backend: invalid choice: 'mxnet'"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["demo", "--steps"], "argument --steps: expected one argument"),
        (["train"], "argument COMMAND: invalid choice: 'train'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_options_exit_2_with_a_message(capsys, argv, message):
    err = _error(capsys, argv)
    assert message in err
    assert err.startswith("usage: lossscale")


def test_demo_option_errors_name_the_subcommand(capsys):
    assert "lossscale demo: error:" in _error(capsys, ["demo", "--steps", "0"])


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            [],
            {
                "steps": None,
                "seed": 0,
                "out": "lossscale-demo",
                "initial_scale": 2.0**15,
                "growth_steps": 50,
                "diagnostics_every": 50,
                "backend": "torch",
                "loss_weight": 2.0**-16,
                "quick": False,
                "no_progress": False,
            },
        ),
        (
            [
                "--steps",
                "7",
                "--seed",
                "3",
                "--out",
                "d",
                "--initial-scale",
                "2**20",
                "--growth-steps",
                "9",
                "--diagnostics-every",
                "4",
                "--backend",
                "jax",
                "--loss-weight",
                "2^-3",
                "--quick",
                "--no-progress",
            ],
            {
                "steps": 7,
                "seed": 3,
                "out": "d",
                "initial_scale": 2.0**20,
                "growth_steps": 9,
                "diagnostics_every": 4,
                "backend": "jax",
                "loss_weight": 0.125,
                "quick": True,
                "no_progress": True,
            },
        ),
        (
            ["--initial-scale", "1e3", "--loss-weight", "0.5"],
            {"initial_scale": 1000.0, "loss_weight": 0.5},
        ),
    ],
)
def test_demo_options_parse(argv, expected):
    args = cli.build_parser().parse_args(["demo", *argv])
    assert {k: getattr(args, k) for k in expected} == expected


def test_defaults_match_the_demo_config():
    args = cli.build_parser().parse_args(["demo"])
    defaults = demo_config.DemoConfig()
    names = ("seed", "out", "initial_scale", "growth_steps", "diagnostics_every", "backend")
    for name in names + ("loss_weight",):
        assert getattr(args, name) == getattr(defaults, name)
    assert defaults.steps == demo_config.DEFAULT_STEPS


def test_help_lists_commands_and_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "demo" in out and "bench" in out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--steps",
        "--seed",
        "--out",
        "--initial-scale",
        "--growth-steps",
        "--diagnostics-every",
        "--backend",
        "--quick",
        "--loss-weight",
    ):
        assert option in out


def test_bench_forwards_its_arguments(monkeypatch):
    received = []

    def fake_main(argv):
        received.append(argv)
        return 3

    monkeypatch.setitem(sys.modules, "lossscale.bench", types.SimpleNamespace(main=fake_main))
    assert cli.main(["bench", "--workload", "large", "--help"]) == 3
    assert received == [["--workload", "large", "--help"]]


def test_bench_returning_none_exits_0(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "lossscale.bench", types.SimpleNamespace(main=lambda argv: None)
    )
    assert cli.main(["bench"]) == 0


def test_missing_bench_module_exits_1(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lossscale.bench", None)
    assert cli.main(["bench"]) == 1
    assert "`lossscale.bench` is not available" in capsys.readouterr().err


def test_missing_demo_dependency_exits_1(monkeypatch, capsys, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tqdm" else real(name, *a)
    )
    assert cli.main(["demo", "--quick", "--backend", "numpy", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "lossscale demo: error: `lossscale demo --backend numpy` needs tqdm" in err
    assert "pip install 'lossscale[demo]'" in err
    assert not list(tmp_path.iterdir())


def test_console_script():
    # `python -m lossscale`: tests/test___main__.py.
    command = [str(__import__("pathlib").Path(sys.executable).parent / "lossscale")]
    proc = subprocess.run(
        command + ["demo", "--steps", "0"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "lossscale demo: error: argument --steps" in proc.stderr
    proc = subprocess.run(command + ["--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "demo" in proc.stdout


def test_the_command_line_imports_neither_torch_nor_jax():
    code = (
        "import sys, lossscale.cli; "
        "print(sorted(m for m in ('torch', 'jax', 'matplotlib', 'sklearn') "
        "if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "[]", proc.stderr


def test_version_prints_the_package_version(capsys):
    import importlib.metadata

    import lossscale

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"lossscale {lossscale.__version__}\n"
    # One version: pyproject.toml reads it from lossscale.__version__.
    assert importlib.metadata.version("lossscale") == lossscale.__version__
