"""backends/_common.py, and what no longer rides on a variable: the skip decision.

A skipped step's flag is an argument of the inner optimizer's `_step` and
of its kernels (`lossscale.backends.kernel`); nothing is stored on a
`Variable` for it, and one optimizer's variables taken by another change
nothing about its skipped steps.
"""

import numpy as np
import pytest
import torch

import lossscale as ls
from lossscale.backends._common import bound
from lossscale.variables import Variable


def test_bound_rebinds_and_restores_even_when_the_body_raises():
    vs = [ls.Variable(np.full(3, float(i), np.float32)) for i in range(2)]
    saved = [v.storage for v in vs]
    with pytest.raises(RuntimeError):
        with bound(vs, [np.zeros(3, np.float32)] * 2):
            assert all(float(v.numpy()[0]) == 0.0 for v in vs)
            raise RuntimeError
    assert all(v.storage is s for v, s in zip(vs, saved))


def test_a_gated_torch_step_sets_nothing_but_storage_on_any_variable(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=generator) for s in [(8, 4), (4,), (4, 2)]]
    for inner in (ls.optimizers.Adam(1e-3), ls.optimizers.RMSprop(1e-3)):  # fused, select
        opt = ls.LossScaleOptimizer(inner, initial_scale=16.0)
        opt.scale_loss(1.0)
        opt.build(params)
        stores = []
        original = Variable.__setattr__

        def counting(self, name, value, original=original, stores=stores):
            if name != "_storage":
                stores.append(name)
            original(self, name, value)

        monkeypatch.setattr(Variable, "__setattr__", counting)
        for kind in ("f", "inf", "f"):
            grads = [torch.randn(p.shape, generator=generator) * 16 for p in params]
            if kind == "inf":
                grads[0][0, 0] = float("inf")
            opt.apply(grads, params)
        monkeypatch.undo()
        assert stores == [], type(inner).__name__


@pytest.mark.parametrize("backend", ["torch", "jax"])  # NumPy's skip is a plain `if`
def test_a_skipped_step_writes_nothing_after_another_optimizer_took_the_variables(backend):
    """A second optimizer built on the model's variables changes nothing for the first.

    (Write masks used to ride on the variables, shared through one cell per
    optimizer: the second one's build took the variables into its own.)
    """
    import jax
    import jax.numpy as jnp

    to_array = {"torch": torch.as_tensor, "jax": jnp.asarray}[backend]
    rng = np.random.default_rng(3)
    shapes = [(4, 3), (3,)]
    # torch.as_tensor would share the NumPy buffers: copies.
    params = [ls.Variable(to_array(rng.normal(size=s).astype(np.float32))) for s in shapes]
    first = ls.LossScaleOptimizer(ls.optimizers.Adam(0.1), initial_scale=8.0)
    first.scale_loss(1.0)
    first.build(params)
    ls.optimizers.Adam(0.1).build(params)
    steps = [[rng.normal(size=s).astype(np.float32) * 8 for s in shapes] for _ in range(2)]
    steps[1][0][1, 2] = np.inf  # the second step overflows: skipped
    step = jax.jit(first.stateless_apply)
    model, own = [p.value for p in params], [v.value for v in first.variables]
    for grads in steps:
        before = [np.asarray(x).copy() for x in model + own]
        if backend == "jax":  # traced: the flag is a device value, as on torch
            model, own = step(own, [to_array(g) for g in grads], model)
        else:
            first.apply([to_array(g) for g in grads], params)
            model, own = [p.value for p in params], [v.value for v in first.variables]
    after = [np.asarray(x) for x in model + own]
    wrapper = len(model) + len(first._variables)  # the loss-scale state comes first
    scale = next(i for i, v in enumerate(first.variables) if v is first.dynamic_scale)
    assert float(after[len(model) + scale]) == 4.0  # halved: the step was skipped
    # The model's variables and the inner optimizer's, bit for bit.
    for b, a in zip(before[: len(model)] + before[wrapper:], after[: len(model)] + after[wrapper:]):
        assert a.tobytes() == b.tobytes()
