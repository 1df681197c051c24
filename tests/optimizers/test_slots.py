"""optimizers/slots.py: how an optimizer makes, wraps and finds its variables.

Slot names and paths after the model variable, on its backend; raw arrays
wrapped once, and the same arrays again resolved to the same variables
(never a keras.Variable, whose array may be rebound); the `assign*` hooks,
on Variables and on mutable raw arrays.
"""

import numpy as np
import pytest

import lossscale as ls
from lossscale.optimizers import SGD, Adam
from tests.reference import ReferenceOptimizer, sgd_rule

from .test_base import SHAPES, assert_close, make_vars, random_grads


def test_add_variable_helpers(backend, rng):
    _, variables = make_vars(backend, rng)
    variables[2].overwrite_with_gradient = True
    opt = SGD()
    opt.build(variables)
    ref = opt.add_variable_from_reference(variables[0], "slot", initializer="ones")
    assert ref.name == "kernel_slot" and ref.path == "sgd/kernel_slot"
    assert ref.shape == (3, 4) and ref.dtype == "float32" and ref.backend == backend.name
    np.testing.assert_array_equal(backend.numpy(ref), np.ones((3, 4)))
    a, b = opt.add_optimizer_variables(variables, ["a", "b"], initializer=["zeros", "ones"])
    assert [x.name if x is not None else None for x in a] == ["kernel_a", "bias_a", None]
    np.testing.assert_array_equal(backend.numpy(b[1]), np.ones(5))
    single = opt.add_optimizer_variables(variables, "c")
    assert isinstance(single, list) and len(single) == 3
    with pytest.raises(ValueError, match="number of provided names must match"):
        opt.add_optimizer_variables(variables, ["a", "b"], initializer=["zeros"])
    extra = opt.add_variable((2,), initializer=3.0, dtype="float32", name="extra")
    np.testing.assert_array_equal(backend.numpy(extra), [3.0, 3.0])
    assert extra.backend == backend.name


def test_assign_helpers(backend):
    v = ls.Variable(backend.array(np.array([1.0, 2.0])))
    opt = SGD()
    opt.assign(v, backend.array(np.array([3.0, 4.0])))
    opt.assign_add(v, backend.array(np.array([1.0, 1.0])))
    opt.assign_sub(v, backend.array(np.array([0.5, 0.5])))
    np.testing.assert_array_equal(backend.numpy(v), [3.5, 4.5])


def test_assign_on_raw_arrays():
    import jax.numpy as jnp

    x = np.array([1.0, 2.0])
    SGD().assign_add(x, np.array([1.0, 1.0]))
    np.testing.assert_array_equal(x, [2.0, 3.0])
    with pytest.raises(TypeError, match="immutable"):
        SGD().assign(jnp.ones(2), jnp.zeros(2))


def test_raw_tensors_are_wrapped_once_in_place():
    import torch

    model = torch.nn.Linear(4, 3)
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    opt = Adam(learning_rate=0.1)
    for _ in range(2):
        opt.apply([torch.ones_like(p) for p in params], params)
    assert len(opt._trainable_variables) == 2 and len(opt._wrappers) == 2
    assert all(v.storage is p for v, p in zip(opt._trainable_variables, params))
    for p, b in zip(params, before):
        assert p.requires_grad and p.grad is None
        assert not torch.equal(p.detach(), b)
    # Autograd still works on the updated parameters.
    model(torch.ones(1, 4)).sum().backward()
    assert params[0].grad is not None


def test_names_and_paths_of_slots_of_raw_arrays_and_before_build(backend):
    opt = SGD(name="opt")
    own = opt.variables  # the iteration count and the learning rate
    early = opt.add_variable((2, 3), initializer="ones", name="early", layout="rows")
    # Before `build` there is no model variable to follow: NumPy.
    assert early.backend == "numpy" and early.path == "opt/early" and early.layout == "rows"
    assert early.dtype == "float32" and not early.trainable
    raw = [backend.array(np.arange(3.0)), backend.array(np.ones((2, 2)))]
    slots = opt.add_optimizer_variables(raw, "m", initializer=0.5)
    # A raw array gets a name of its own, once: the same wrapper each time.
    assert [s.name for s in slots] == ["param_0_m", "param_1_m"]
    assert [s.path for s in slots] == ["opt/param_0_m", "opt/param_1_m"]
    assert opt.add_variable_from_reference(raw[0]).name == "param_0_var"
    assert [s.backend for s in slots] == [backend.name] * 2
    np.testing.assert_array_equal(backend.numpy(slots[1]), np.full((2, 2), 0.5, np.float32))
    assert opt.variables == [*own, early, *slots, opt.variables[-1]]
    assert opt.variables is not opt._variables  # a copy


def test_mismatched_names_and_initializers_are_refused_naming_both():
    opt = SGD()
    own = opt.variables
    message = (
        r"^The number of provided names must match the number of provided initializers. "
        r"Received: name=\['a', 'b'\], initializer=\('zeros',\)$"
    )
    with pytest.raises(ValueError, match=message):
        opt.add_optimizer_variables([np.ones(2, np.float32)], ["a", "b"], initializer=("zeros",))
    assert opt.variables == own


def test_weight_decay_exclusions_only_before_build(backend, rng):
    _, variables = make_vars(backend, rng)
    opt = Adam(weight_decay=0.1)
    opt.exclude_from_weight_decay(var_names=["bias"])
    opt.build(variables)
    message = (
        r"^`exclude_from_weight_decay\(\)` can only be configured before the optimizer is "
        r"built.$"
    )
    with pytest.raises(ValueError, match=message):
        opt.exclude_from_weight_decay(var_list=variables[:1])


def test_assign_on_an_immutable_raw_array_names_the_backend_and_type():
    import jax.numpy as jnp

    message = (
        r"^`variable` must be a lossscale.Variable on the jax backend, whose arrays are "
        r"immutable. Received: variable of type ArrayImpl$"
    )
    for method in ("assign", "assign_add", "assign_sub"):
        with pytest.raises(TypeError, match=message):
            getattr(SGD(), method)(jnp.ones(2), jnp.zeros(2))


def test_raw_arrays_of_two_backends_are_refused_naming_the_argument():
    import torch

    with pytest.raises(
        ValueError,
        match=r"^All `trainable_variables` must come from one backend; found both 'numpy' and "
        r"'torch'. Convert them to one array library first.$",
    ):
        SGD()._as_variables([np.ones(2, np.float32), torch.ones(2)])


def test_a_slot_is_named_after_its_variable_s_path_with_underscores():
    kernel = ls.Variable(np.ones((2, 2), np.float32), name="kernel")
    kernel.path = "model/dense/kernel"  # as a Keras variable's path reads
    slot = SGD(name="opt").add_variable_from_reference(kernel, "momentum")
    assert slot.name == "model_dense_kernel_momentum"
    assert slot.path == "opt/model_dense_kernel_momentum"


def test_the_same_native_arrays_resolve_again_and_a_new_one_is_refused(backend, rng):
    # The arrays of the last call are remembered (eager torch, NumPy): the
    # same objects again, in any sequence, are the same variables; any other
    # object is resolved anew and refused. Every check still runs on them.
    init = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    arrays = [backend.array(x) for x in init]
    opt = SGD(learning_rate=0.1)
    ref = ReferenceOptimizer(sgd_rule(), init, lr=0.1)
    grads = random_grads(rng)
    opt.apply([backend.array(g) for g in grads], arrays)
    ref.apply(grads)
    if backend.name == "jax":
        # Immutable arrays: the step rebound each variable to a new one, so
        # the caller's old arrays are no longer the optimizer's.
        with pytest.raises(ValueError, match="Unknown variable: 'param_3'"):
            opt.apply([backend.array(g) for g in grads], arrays)
        return
    for given in (list(arrays), tuple(arrays), iter(arrays), arrays):
        grads = random_grads(rng)
        opt.apply([backend.array(g) for g in grads], given)
        ref.apply(grads)
        assert_close(backend, arrays, ref.w)
    state = [backend.numpy(a).copy() for a in arrays] + [
        backend.numpy(v).copy() for v in opt.variables
    ]
    good = [backend.array(g) for g in random_grads(rng)]
    with pytest.raises(ValueError, match="Received: 2 gradients for 3 variables"):
        opt.apply(good[:2], arrays)
    with pytest.raises(ValueError, match=r"must have the variable's shape \(5,\)"):
        opt.apply([good[0], backend.array(np.ones(4, np.float32)), good[2]], arrays)
    with pytest.raises(ValueError, match="must have a floating-point dtype"):
        opt.apply([good[0], backend.array(np.ones(5, np.int32)), good[2]], arrays)
    stranger = backend.array(init[1])  # equal values, another array
    with pytest.raises(ValueError, match="Unknown variable: 'param_3'"):
        opt.apply(good, [arrays[0], stranger, arrays[2]])
    after = [backend.numpy(a) for a in arrays] + [backend.numpy(v) for v in opt.variables]
    for b, a in zip(state, after):
        np.testing.assert_array_equal(a, b)


KERAS_NUMPY_SCRIPT = """
import numpy as np, keras
import lossscale as ls
variable = keras.Variable(np.ones(3, np.float32))
opt = ls.optimizers.SGD(learning_rate=0.5)
grad = np.ones(3, np.float32)
opt.apply([grad], [variable])
opt.apply([grad], [variable])
variable.assign(np.full(3, 10.0, np.float32))  # Keras's NumPy backend binds a new array
opt.apply([grad], [variable])
print(keras.__version__, np.asarray(variable.value).tolist())
"""


def test_a_keras_variable_is_taken_again_at_every_call_not_remembered():
    # Keras's NumPy backend rebinds a variable's array on `assign`: the step
    # after it must update the new array (the remembered arrays of the last
    # call would hold the old one).
    import os
    import subprocess
    import sys

    import keras  # the subprocess's Keras, with the NumPy backend

    proc = subprocess.run(
        [sys.executable, "-c", KERAS_NUMPY_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KERAS_BACKEND": "numpy"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == f"{keras.__version__} [9.5, 9.5, 9.5]"
