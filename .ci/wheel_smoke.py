"""The installed wheel, in a clean venv: `python wheel_smoke.py EXTRA SPEC`.

`./run wheel` installs the built wheel (`SPEC`, with `[EXTRA]` unless
EXTRA is `numpy`) into a new venv under constraints.txt and runs this from
outside the repository, so `lossscale` is the installed one. It checks the
metadata (version, `lossscale --version`, classifiers, no `==`
pin), that `import lossscale` imports no framework, one exact step on NumPy
and on the extra's framework, and, for an extra, that installing it again
without the constraints file into this venv, which already has that
framework, would change nothing.
"""

import importlib.metadata
import json
import pathlib
import subprocess
import sys

import numpy as np

EXTRA, SPEC = sys.argv[1], sys.argv[2]


def check(condition, message):
    if not condition:
        sys.exit(f"wheel smoke [{EXTRA}]: {message}")


def check_metadata():
    import lossscale

    check(
        pathlib.Path(lossscale.__file__).is_relative_to(pathlib.Path(sys.prefix)),
        f"lossscale imported from {lossscale.__file__}, not from this venv",
    )
    for framework in ("torch", "jax", "tensorflow", "keras", "optax"):
        check(framework not in sys.modules, f"`import lossscale` imported {framework}")
    meta = importlib.metadata.metadata("lossscale")
    check(meta["Version"] == lossscale.__version__, f"version {meta['Version']}")
    script = pathlib.Path(sys.executable).parent / "lossscale"
    out = subprocess.run([script, "--version"], capture_output=True, text=True, check=True)
    check(out.stdout == f"lossscale {lossscale.__version__}\n", f"--version: {out.stdout!r}")
    check(meta.get_all("Classifier"), "no classifiers")
    pinned = [r for r in meta.get_all("Requires-Dist") if "==" in r.split(";")[0]]
    check(not pinned, f"exact pins in the metadata: {pinned}")


def numpy_step():
    """An applied step (w - lr * g exactly) and a skipped one (inf: w kept, scale halved)."""
    import lossscale as ls

    w = ls.Variable(np.array([1.0, -2.0, 3.0], np.float32), name="w")
    opt = ls.LossScaleOptimizer(ls.optimizers.SGD(0.5), initial_scale=4.0)
    g = np.array([0.25, 0.5, -1.0], np.float32)
    check(float(opt.scale_loss(1.0)) == 4.0, "scale_loss")
    opt.apply([g * 4], [w])
    check(w.numpy().tolist() == [0.875, -2.25, 3.5], f"numpy step: {w.numpy()}")
    opt.apply([np.array([np.inf, 0, 0], np.float32)], [w])
    check(w.numpy().tolist() == [0.875, -2.25, 3.5], "numpy skipped step wrote")
    check(float(opt.dynamic_scale) == 2.0, f"scale after inf: {float(opt.dynamic_scale)}")


def torch_step():
    import torch

    import lossscale as ls
    import lossscale.torch

    w = torch.tensor([1.0, -2.0, 3.0])
    opt = ls.LossScaleOptimizer(ls.optimizers.SGD(0.5), initial_scale=4.0)
    opt.scale_loss(torch.tensor(1.0))
    opt.apply([torch.tensor([1.0, 2.0, -4.0])], [w])
    check(w.tolist() == [0.875, -2.25, 3.5], f"torch step: {w}")
    model = torch.nn.Linear(3, 1)
    scaler = lossscale.torch.GradScaler("cpu", init_scale=8.0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    scaler.step(sgd)
    scaler.update()
    check(float(scaler.get_scale()) == 8.0, f"GradScaler scale {scaler.get_scale()}")


def jax_step():
    import jax
    import jax.numpy as jnp
    import optax

    import lossscale.optax as lso

    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    tx = lso.dynamic_loss_scale(optax.sgd(0.5), initial_scale=4.0)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: lso.scale_loss(jnp.sum(p["w"] * g), state))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    g = jnp.array([0.25, 0.5, -1.0])
    params, state = step(params, state)
    check(params["w"].tolist() == [0.875, -2.25, 3.5], f"jax step: {params['w']}")
    check(float(lso.loss_scale(state)) == 4.0, "jax scale")


def would_install_nothing():
    """`pip install SPEC` without constraints.txt, into this venv: nothing to do."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", SPEC],
        capture_output=True,
        text=True,
        check=True,
    )
    wanted = [i["metadata"]["name"] for i in json.loads(out.stdout)["install"]]
    check(not wanted, f"installing {SPEC} again would install {wanted}")


check_metadata()
numpy_step()
if EXTRA != "numpy":
    {"torch": torch_step, "jax": jax_step}[EXTRA]()
    would_install_nothing()
print(f"wheel smoke [{EXTRA}]: ok")
