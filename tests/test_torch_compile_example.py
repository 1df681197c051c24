"""examples/torch_compile.py: a compiled training step with a state_dict resume learns."""

import os
import pathlib
import re
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "torch_compile.py"


def test_compiled_example_learns_without_recompiling(tmp_path):
    # aot_eager traces like the default backend but skips code generation,
    # which would take most of a minute here.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "aot_eager"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert float(re.search(r"accuracy (\S+)", last).group(1)) > 0.95
    # 300 finite steps, doubling every 100: 2**15 -> 2**18, across the resume.
    assert float(re.search(r"loss scale (\S+)", last).group(1)) == 2.0**18
    assert int(re.search(r"steps applied (\d+)", last).group(1)) == 300
    # Fresh gradients every step must not defeat the compiled code's guards.
    assert "recompile_limit" not in proc.stderr


def test_example_is_short():
    text = EXAMPLE.read_text()
    assert len(text.splitlines()) < 80
    assert "torch.compile(" in text and "state_dict()" in text and "load_state_dict(" in text
