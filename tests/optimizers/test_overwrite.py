"""`overwrite.take_gradients`: overwrite-with-gradient variables take their gradient.

Through a whole optimizer step (slots, accumulation) they are tested in
`tests/optimizers/test_base.py`; here the function itself.
"""

import numpy as np

import lossscale as ls
from lossscale.backends import get_ops
from lossscale.optimizers import overwrite


def test_overwritten_variables_take_their_gradient_and_leave_the_step(backend):
    ops = get_ops(backend.name)
    w = ls.Variable(backend.array(np.array([1.0, 2.0])), name="w")
    amax = ls.Variable(backend.array(np.array([0.5])), name="amax")
    skipped = ls.Variable(backend.array(np.array([7.0])), name="skipped")
    amax.overwrite_with_gradient = skipped.overwrite_with_gradient = True
    g_w = backend.array(np.array([0.1, 0.2]))
    g_amax = backend.array(np.array([3.0], np.float64))  # cast to the variable's dtype
    grads, variables = overwrite.take_gradients(ops, [g_w, g_amax, None], [w, amax, skipped])
    assert variables == [w] and len(grads) == 1 and grads[0] is g_w
    assert backend.numpy(amax).tolist() == [3.0] and amax.dtype == "float32"
    assert backend.numpy(skipped).tolist() == [7.0]  # no gradient: left as it is
    assert backend.numpy(w).tolist() == [1.0, 2.0]


def test_nothing_to_overwrite_returns_the_same_lists(backend):
    ops = get_ops(backend.name)
    variables = [ls.Variable(backend.array(np.array([1.0])), name="w")]
    grads = [backend.array(np.array([0.5]))]
    assert overwrite.take_gradients(ops, grads, variables) == (grads, variables)
