"""Each script in examples/ runs as a user would run it, and learns."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
NAMES = ("torch_autocast.py", "jax_pytree.py", "numpy_mlp.py", "tf_gradient_tape.py")
# The JAX ecosystem's loops: an optax transformation, not the Keras-style wrapper.
OPTAX_NAMES = ("flax_linen.py", "flax_nnx.py")
QUICKSTARTS = (
    "quickstart_torch.py",
    "quickstart_torch_scaler.py",
    "quickstart_jax.py",
    "quickstart_tensorflow.py",
    "quickstart_numpy.py",
)
# The quickstarts are printed in the README, verbatim.
README = ROOT / "README.md"


def _run(name, cwd):
    # One thread: the examples' matrices are tiny, and spinning worker
    # threads on a busy test machine would only slow them down.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("name", NAMES + OPTAX_NAMES)
def test_example_runs_and_learns(name, tmp_path):
    last = _run(name, tmp_path)
    assert float(re.search(r"accuracy (\S+)", last).group(1)) > 0.95
    # 300 steps, no overflow, doubling every 100 finite steps: 2**15 -> 2**18.
    assert float(re.search(r"loss scale (\S+)", last).group(1)) == 2.0**18
    traces = re.search(r"traces (\d+)", last)  # a compiled step, where the example has one
    assert traces is None or traces.group(1) == "1"


@pytest.mark.parametrize("name", NAMES)
def test_example_is_short_and_uses_the_wrapper(name):
    text = (EXAMPLES / name).read_text()
    assert len(text.splitlines()) < 80
    assert "LossScaleOptimizer(" in text and ("scale_loss(" in text or "dynamic_scale" in text)


@pytest.mark.parametrize("name", OPTAX_NAMES)
def test_optax_example_is_short_and_uses_the_transformation(name):
    text = (EXAMPLES / name).read_text()
    assert len(text.splitlines()) < 80
    assert "lso.dynamic_loss_scale(optax." in text and "lso.scale_loss(" in text


@pytest.mark.parametrize("name", QUICKSTARTS)
def test_quickstart_runs_and_fits(name, tmp_path):
    last = _run(name, tmp_path)
    assert float(re.search(r"^loss (\S+)", last).group(1)) < 1e-2
    assert float(re.search(r"loss scale (\S+)", last).group(1)) > 1.0


@pytest.mark.parametrize("name", QUICKSTARTS)
def test_quickstart_is_printed_verbatim_in_the_readme(name):
    code = (EXAMPLES / name).read_text()
    assert len(code.splitlines()) <= 20
    assert f"```python\n{code}```" in README.read_text()


def test_lightning_example_learns_and_skips_its_first_overflows(tmp_path):
    text = (EXAMPLES / "lightning_fp16.py").read_text()
    assert len(text.splitlines()) < 80 and "lossscale.torch.GradScaler(" in text
    last = _run("lightning_fp16.py", tmp_path)
    assert float(re.search(r"accuracy (\S+)", last).group(1)) > 0.95
    # 2**24 overflows five times (down to 2**19); 91 finite steps grow it once.
    assert "skipped 5 of 96 steps" in last
    assert float(re.search(r"loss scale (\S+)", last).group(1)) == pytest.approx(2.0**20, 1e-5)


# Two ranks the way torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR and
# MASTER_PORT in the environment), spawned directly: torchrun's elastic agent
# adds nothing the example uses, and under a loaded CI machine its workers
# have aborted in gloo's teardown after finishing.
DDP_LAUNCHER = """
import os, runpy, sys
import torch.multiprocessing as mp

def run(rank, example, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    runpy.run_path(example, run_name="__main__")
    open(f"finished_rank{rank}", "w").close()  # what an abort after this cannot undo
    # Done: out without the interpreter's teardown, where gloo's threads have
    # aborted a finished rank and `spawn` then killed the other before it
    # wrote its file (so `launch` could not tell a teardown abort and retry).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
"""


def _two_ranks(example, tmp_path):
    """Runs `example` on two ranks as torchrun starts them; returns its last line."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = tmp_path / "launch.py"
    launcher.write_text(DDP_LAUNCHER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    from tests.test_distributed import launch  # retries once after a gloo teardown abort

    proc = launch(
        [sys.executable, str(launcher), str(EXAMPLES / example), str(port)],
        finished=lambda: all((tmp_path / f"finished_rank{r}").exists() for r in (0, 1)),
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.xdist_group("torch_distributed")  # one gloo job at a time (see test_distributed)
def test_ddp_example_on_two_ranks(tmp_path):
    last = _two_ranks("torch_ddp.py", tmp_path)
    assert last.startswith("ranks 2") and float(re.search(r"loss (\S+)", last).group(1)) < 0.05
    # 299 applied steps: the poisoned one was skipped on both ranks.
    assert "steps 299" in last


@pytest.mark.xdist_group("torch_distributed")
def test_fsdp2_example_on_two_ranks(tmp_path):
    last = _two_ranks("fsdp2.py", tmp_path)
    assert last.startswith("ranks 2") and float(re.search(r"loss (\S+)", last).group(1)) < 0.05
    # One shard overflowed at step 100: both ranks skipped it.
    assert "steps 199" in last and "parameters 321" in last


@pytest.mark.parametrize("backend", ["jax"])
def test_keras_fit_example_learns_in_mixed_float16(backend, tmp_path):
    code = (EXAMPLES / "keras_fit.py").read_text()
    assert len(code.splitlines()) <= 20
    # Printed verbatim in the README's Keras quickstart.
    assert f"```python\n{code}```" in README.read_text()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KERAS_BACKEND": backend}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "keras_fit.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert float(re.search(r"accuracy (\S+)", last).group(1)) > 0.95
    # 160 finite steps at the default 2000 growth steps: the scale stays at 2**15.
    assert float(re.search(r"loss scale (\S+)", last).group(1)) == 2.0**15
    assert "steps 160" in last


def test_diagnosing_example_prints_what_its_page_shows(tmp_path):
    # docs/diagnosing.md includes the script and its output file verbatim;
    # the script's run here must print that output, line for line.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "diagnosing_float16.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    expected = (EXAMPLES / "diagnosing_float16_output.txt").read_text()
    # Line for line; a measured magnitude to 5% (float16 kernels round a
    # little differently from one CPU to another, as tests/test_trajectories.py
    # found), everything else exactly.
    assert _numbers_close(proc.stdout, expected), (proc.stdout, expected)
    page = (ROOT / "docs" / "diagnosing.md").read_text()
    for included in ("examples/diagnosing_float16.py", "examples/diagnosing_float16_output.txt"):
        assert f"--8<--\n{included}\n--8<--" in page
    # What the page reads from that output.
    assert "'variables': ['hidden.weight'], 'module': None, 'loss_finite': True" in expected
    assert "  step 0: nonfinite_loss, loss NaN/inf; non-finite: 4 variables" in expected
    assert "  step 1: overflow, loss finite; non-finite: 1 variable (hidden.weight)" in expected
    assert "fixed: 4 skipped" in expected and "statistics: 0 skipped" in expected


def _numbers_close(got, expected):
    """Whether two printouts match, each decimal number within 5% of its counterpart."""
    pattern = re.compile(r"\d+\.\d+(?:e[+-]\d+)?|\d+e[+-]\d+")
    got_lines, expected_lines = got.splitlines(), expected.splitlines()
    if len(got_lines) != len(expected_lines):
        return False
    for a, b in zip(got_lines, expected_lines):
        if pattern.sub("#", a) != pattern.sub("#", b):
            return False
        for x, y in zip(pattern.findall(a), pattern.findall(b)):
            if abs(float(x) - float(y)) > 0.05 * abs(float(y)):
                return False
    return True


def _run_recipe(name, page, cwd):
    """Runs examples/`name`, which docs/`page` includes; returns the finished process."""
    text = (EXAMPLES / name).read_text()
    assert len(text.splitlines()) < 80
    assert f"--8<--\nexamples/{name}\n--8<--" in (ROOT / "docs" / page).read_text()
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_jmp_to_optax_example_follows_jmp_step_for_step(tmp_path):
    text = (EXAMPLES / "jmp_to_optax.py").read_text()
    assert "lso.dynamic_loss_scale(optax." in text and "jmp.select_tree(" in text
    proc = _run_recipe("jmp_to_optax.py", "switching_from_jmp.md", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = proc.stdout.strip().splitlines()[-2:]
    # 2**24 overflows float16: 8 skipped steps (down to 2**16), then 292 finite
    # steps double it every 50, 5 times: 2**21.
    assert first == "skipped 8 of 300, scale 2.09715e+06"
    assert float(re.search(r"accuracy (\S+)", last).group(1)) > 0.95
    assert "same scales True" in last  # at every one of the 300 steps
    # Parameters, Adam's moments and count: equal bit for bit on the CPU
    # (docs/switching_from_jmp.md); a few ulp apart would still be right.
    assert float(re.search(r"max difference (\S+)", last).group(1)) <= 1e-5


def test_adamw_example_shows_torch_exact_routes_and_keras_numbers(tmp_path):
    page = (ROOT / "docs/adamw.md").read_text()
    proc = _run_recipe("adamw_keras_vs_torch.py", "adamw.md", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()[-5:]
    exact = [line.endswith("bit for bit: yes") for line in lines]
    assert exact == [True, True, True, False, False]
    losses = [float(re.search(r"final loss (\S+)", line).group(1)) for line in lines]
    assert losses[0] == losses[1] == losses[2] < 0.2
    assert all(abs(loss - losses[0]) < 0.01 for loss in losses[3:])  # close, not equal
    # The page prints this output; float16 kernels may round a little otherwise
    # on another CPU, so the numbers within 5%, the rest exactly.
    printed = page.split("It prints:\n\n```text\n")[1].split("```")[0]
    assert _numbers_close("\n".join(lines) + "\n", printed)


def test_nnx_scan_example_reads_the_scale_from_the_split_state(tmp_path):
    text = (EXAMPLES / "nnx_scan.py").read_text()
    assert "jax.lax.scan(" in text and "nnx.split(" in text
    proc = _run_recipe("nnx_scan.py", "jax_recipes.md", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    # 2**20 overflows twice (down to 2**18), then 298 finite steps double it twice.
    assert lines[-3].endswith("scales [524288.0, 262144.0, 262144.0]")
    assert lines[-2] == "loss scale 1048576.0 steps 300"
    assert float(re.search(r"accuracy (\S+)", lines[-1]).group(1)) > 0.95
    assert "skipped 2  scale 1.04858e+06" in lines[-1]


def test_hf_trainer_example_logs_unscaled_norms_and_holds_the_lr_on_skips(tmp_path):
    text = (EXAMPLES / "hf_trainer_fp16.py").read_text()
    assert "lossscale.torch.GradScaler(" in text and "fp16=True" in text
    proc = _run_recipe("hf_trainer_fp16.py", "hf_trainer.md", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = proc.stdout.strip().splitlines()[-2:]
    # Steps that overflowed, as Trainer logged them (a grad_norm of inf or NaN),
    # and as the scaler counted them: the same number, at least the first one
    # (2**24 overflows float16).
    steps = re.search(r"skipped steps \[([\d, ]*)\], scaler counted (\d+)", first)
    skipped = [int(s) for s in steps.group(1).split(",") if s.strip()]
    assert skipped[:1] == [1] and len(skipped) == int(steps.group(2))
    assert "LR held on skipped steps True" in last
    # Unscaled: the scaled gradients' norm would be ~1e5 times larger.
    assert float(re.search(r"largest grad_norm (\S+)", last).group(1)) < 10
    losses = re.search(r"loss (\S+) -> (\S+)", last)
    assert float(losses.group(2)) < float(losses.group(1)) - 1.0  # it learns
    assert float(re.search(r"loss scale (\S+)", last).group(1)) >= 2.0**16


def test_scale_collapse_example_stops_at_the_persistent_step(tmp_path):
    proc = _run_recipe("scale_collapse.py", "scale_collapse.md", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout.strip()
    # The page shows the output verbatim.
    assert f"```text\n{printed}\n```" in (ROOT / "docs" / "scale_collapse.md").read_text()
    assert printed.splitlines()[-1] == "  step 13: persistent, ['2.weight']"
    assert (tmp_path / "persistent.pt").exists()  # the hook saved the model and the batch
