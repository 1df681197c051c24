"""backends/_common.py: write masks shared through one cell per optimizer.

The masks' effect on writes is tested per backend (test_torch_masks.py,
test_jax_ops.py, test_tensorflow_control.py); here where a mask is stored:
on the one cell a group of variables shares, so that masking a step costs
one store whatever the number of variables.
"""

import numpy as np
import pytest
import torch

import lossscale as ls
from lossscale.backends._common import MaskCell, masked, share_mask_cell
from lossscale.variables import Variable


def variables(n):
    rng = np.random.default_rng(0)
    return [ls.Variable(rng.normal(size=3).astype(np.float32)) for _ in range(n)]


def test_variables_sharing_a_cell_are_masked_through_it():
    vs = variables(4)
    cell = MaskCell()
    share_mask_cell(vs, cell)
    with masked(vs, "m"):
        assert cell.mask == "m"
        assert [v._write_mask for v in vs] == ["m"] * 4
        assert all(v._mask_cell is cell for v in vs)
    assert cell.mask is None and all(v._mask_cell is cell for v in vs)


def test_variables_without_a_shared_cell_move_to_one_and_stay():
    vs = variables(3)
    with masked(vs, "m"):
        assert [v._write_mask for v in vs] == ["m"] * 3
    cell = vs[0]._mask_cell
    assert cell is not None and all(v._mask_cell is cell for v in vs)
    assert [v._write_mask for v in vs] == [None] * 3
    with masked(vs, "again"):  # the same group: the same cell, nothing moves
        assert all(v._mask_cell is cell for v in vs) and cell.mask == "again"


def test_a_nested_branch_over_some_variables_of_a_cell_masks_the_cell_and_restores_it():
    vs = variables(3)
    cell = MaskCell()
    share_mask_cell(vs, cell)
    with masked(vs, "outer"):
        with masked(vs[1:], "inner"):
            assert [v._write_mask for v in vs] == ["inner"] * 3
        assert [v._write_mask for v in vs] == ["outer"] * 3
    assert [v._write_mask for v in vs] == [None] * 3


def test_a_nested_branch_over_other_cells_moves_its_variables_back_into_the_open_branch():
    outer, extra = variables(2), variables(1)
    cell = MaskCell()
    share_mask_cell(outer, cell)
    with masked(outer, "outer"):
        with masked([outer[0], *extra], "inner"):
            assert outer[0]._write_mask == "inner" and extra[0]._write_mask == "inner"
            assert outer[1]._write_mask == "outer"
        # back under the enclosing branch's mask, in its cell
        assert outer[0]._mask_cell is cell and outer[0]._write_mask == "outer"
        assert extra[0]._write_mask is None
    assert [v._write_mask for v in outer + extra] == [None] * 3


def test_a_mask_is_restored_when_the_branch_raises():
    vs = variables(2)
    with pytest.raises(RuntimeError, match="boom"):
        with masked(vs, "m"):
            raise RuntimeError("boom")
    assert [v._write_mask for v in vs] == [None, None]


@pytest.mark.parametrize("name", ["adam", "sgd", "rmsprop"])
def test_an_optimizer_puts_every_variable_it_writes_in_its_own_cell(name):
    make = {"adam": ls.optimizers.Adam, "sgd": ls.optimizers.SGD, "rmsprop": ls.optimizers.RMSprop}
    params = variables(3)
    opt = ls.LossScaleOptimizer(make[name](0.1, use_ema=True))
    opt.build(params)
    inner = opt.inner_optimizer
    targets = inner._trainable_variables + inner.variables
    assert all(v._mask_cell is inner._mask_cell for v in targets)
    # the wrapper's own state is outside: it is written after the gated step
    assert all(v._mask_cell is opt._mask_cell for v in opt._variables)
    assert opt._mask_cell is not inner._mask_cell
    # The inner build took the model's variables from the wrapper's cell, so
    # only the inner cell may be trusted without a look (`masked(..., cell)`).
    assert inner._mask_cell.intact and not opt._mask_cell.intact


def test_a_gated_torch_step_stores_no_mask_on_any_variable(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=generator) for s in [(8, 4), (4,), (4, 2)]]
    for inner in (ls.optimizers.Adam(1e-3), ls.optimizers.RMSprop(1e-3)):  # fused, select
        opt = ls.LossScaleOptimizer(inner, initial_scale=16.0)
        opt.scale_loss(1.0)
        opt.build(params)
        stores = []
        original = Variable.__setattr__

        def counting(self, name, value, original=original, stores=stores):
            if name in ("_mask_cell", "_write_mask"):
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


def test_a_cell_stays_intact_until_a_variable_leaves_it():
    vs = variables(3)
    cell, other = MaskCell(), MaskCell()
    share_mask_cell(vs, cell)
    share_mask_cell(vs, cell)  # pointing at the same cell again is no departure
    assert cell.intact
    share_mask_cell(vs[1:2], other)
    assert not cell.intact and other.intact


def test_a_branch_that_moves_variables_breaks_their_old_cells():
    shared, loose = variables(2), variables(1)
    cell = MaskCell()
    share_mask_cell(shared, cell)
    with masked(shared + loose, "m"):  # no cell in common: all move to a new one
        pass
    assert not cell.intact
    assert shared[0]._mask_cell is not cell


class _Unreadable:
    """A stand-in variable whose cell must not be read."""

    @property
    def _mask_cell(self):
        raise AssertionError("the cell of a variable was read")


def test_an_intact_cell_is_trusted_without_reading_any_variable():
    cell = MaskCell()
    with masked([_Unreadable(), _Unreadable()], "m", cell):
        assert cell.mask == "m"
    assert cell.mask is None


def test_a_broken_cell_is_not_trusted():
    vs = variables(3)
    cell = MaskCell()
    share_mask_cell(vs, cell)
    share_mask_cell(vs[:1], MaskCell())  # vs[0] leaves: the cell is broken
    with masked(vs, "m", cell):
        assert [v._write_mask for v in vs] == ["m"] * 3
    with pytest.raises(AssertionError, match="was read"):
        cell.intact = False
        with masked([_Unreadable()], "m", cell):
            pass


@pytest.mark.parametrize("backend", ["torch", "jax"])  # NumPy's gate is a plain `if`
def test_a_skipped_step_writes_nothing_after_another_optimizer_took_the_variables(backend):
    """The model's variables leave the first optimizer's cell for the second's.

    The first optimizer's gated step must still mask them: with its cell
    trusted as if intact, its skipped step would write them.
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
    ls.optimizers.Adam(0.1).build(params)  # takes the variables into its own cell
    assert not first.inner_optimizer._mask_cell.intact
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
