"""Each script in examples/ runs as a user would run it, and learns."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
NAMES = ("torch_autocast.py", "jax_pytree.py", "numpy_mlp.py")


@pytest.mark.parametrize("name", NAMES)
def test_example_runs_and_learns(name, tmp_path):
    # One thread: the examples' matrices are tiny, and spinning worker
    # threads on a busy test machine would only slow them down.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert float(re.search(r"accuracy (\S+)", last).group(1)) > 0.95
    # 300 steps, no overflow, doubling every 100 finite steps: 2**15 -> 2**18.
    assert float(re.search(r"loss scale (\S+)", last).group(1)) == 2.0 ** 18


@pytest.mark.parametrize("name", NAMES)
def test_example_is_short_and_uses_the_wrapper(name):
    text = (EXAMPLES / name).read_text()
    assert len(text.splitlines()) < 80
    assert "LossScaleOptimizer(" in text and ("scale_loss(" in text or "dynamic_scale" in text)
