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
    # The whole float16 step in one graph (a graph break would raise), and
    # what torch needs for it, as docs/torch_compile.md says.
    assert "fullgraph=True" in text and "dtype=torch.float16" in text
    assert "torch._dynamo.config.trace_autograd_ops = True" in text
    docs = (EXAMPLE.parent.parent / "docs" / "torch.md").read_text()
    assert "trace_autograd_ops" in docs and "examples/torch_compile.py" in docs
