"""optimizers/base.py: the `Optimizer` base class, on every backend, against the float64 oracle.

Its surface in the order of the class: construction, variable creation and
wrapping, `apply`, `stateless_apply` (the same step on given values). The
pipeline's pieces are in `test_pipeline.py`, the plan in `test_plan.py`.
"""

import warnings

import numpy as np
import pytest

import lossscale as ls
from lossscale.backends import ops_for
from lossscale.optimizers import SGD, Adam, Optimizer
from tests.reference import ReferenceOptimizer, sgd_rule

SHAPES = [(3, 4), (5,), ()]


def make_vars(backend, rng, names=("kernel", "bias", "scalar"), shapes=SHAPES):
    init = [rng.normal(size=s).astype(np.float32) for s in shapes]
    return init, [ls.Variable(backend.array(x), name=n) for x, n in zip(init, names)]


def random_grads(rng, shapes=SHAPES, scale=1.0):
    return [(scale * rng.normal(size=s)).astype(np.float32) for s in shapes]


def assert_close(backend, variables, expected, rtol=1e-5, atol=1e-6):
    for v, e in zip(variables, expected):
        np.testing.assert_allclose(backend.numpy(v), e, rtol=rtol, atol=atol)


def test_weight_decay_exclusions(backend, rng):
    init, variables = make_vars(backend, rng)
    opt = SGD(learning_rate=0.1, weight_decay=0.5)
    opt.exclude_from_weight_decay(var_list=[variables[0]], var_names=["bia"])
    grads = random_grads(rng)
    ref = ReferenceOptimizer(sgd_rule(), init, lr=0.1, weight_decay=0.5, exclude={0, 1})
    opt.apply([backend.array(g) for g in grads], variables)
    ref.apply(grads)
    assert_close(backend, variables, ref.w)
    with pytest.raises(ValueError, match="before the optimizer is built"):
        opt.exclude_from_weight_decay(var_names=["x"])


def test_overwrite_with_gradient(backend, rng):
    init, variables = make_vars(backend, rng)
    variables[1].overwrite_with_gradient = True
    opt = Adam(learning_rate=0.1)
    grads = random_grads(rng)
    opt.apply([backend.array(g) for g in grads], variables)
    np.testing.assert_array_equal(backend.numpy(variables[1]), grads[1])
    # No slots are made for an overwritten variable.
    assert opt._momentums[1] is None and opt._velocities[1] is None
    assert len(opt.variables) == 2 + 2 * 2


def test_overwrite_with_gradient_accumulates_running_max(backend):
    v = ls.Variable(backend.array(np.array([1.0, 5.0])), name="amax")
    v.overwrite_with_gradient = True
    w = ls.Variable(backend.array(np.array([1.0])), name="w")
    opt = SGD(learning_rate=0.1, gradient_accumulation_steps=2)
    opt.apply([backend.array(np.array([3.0, 2.0])), backend.array(np.array([1.0]))], [v, w])
    np.testing.assert_array_equal(backend.numpy(v), [1.0, 5.0])  # not an update step
    opt.apply([backend.array(np.array([2.0, 4.0])), backend.array(np.array([1.0]))], [v, w])
    np.testing.assert_array_equal(backend.numpy(v), [3.0, 4.0])


def test_none_gradients_warn_and_skip(backend, rng):
    init, variables = make_vars(backend, rng)
    opt = SGD(learning_rate=0.1)
    grads = random_grads(rng)
    with pytest.warns(UserWarning, match=r"Gradients do not exist for variables \['bias'\]"):
        opt.apply([backend.array(grads[0]), None, backend.array(grads[2])], variables)
    np.testing.assert_array_equal(backend.numpy(variables[1]), init[1])
    np.testing.assert_allclose(backend.numpy(variables[0]), init[0] - 0.1 * grads[0], rtol=1e-6)


def test_all_none_gradients_raise_before_build(backend, rng):
    _, variables = make_vars(backend, rng)
    opt = SGD()
    with pytest.raises(ValueError, match="No gradients provided for any variable"):
        opt.apply([None, None, None], variables)
    assert not opt.built


def test_errors_leave_everything_unchanged(backend, rng):
    init, variables = make_vars(backend, rng)
    opt = Adam(learning_rate=0.1)
    grads = [backend.array(g) for g in random_grads(rng)]
    opt.apply(grads, variables)
    before = [backend.numpy(v).copy() for v in variables + opt.variables]
    bad_shape = grads[:2] + [backend.array(np.ones((2,), np.float32))]
    with pytest.raises(
        ValueError, match=r"must have the variable's shape \(\). Received: gradient shape \(2,\)"
    ):
        opt.apply(bad_shape, variables)
    with pytest.raises(ValueError, match="Received: 2 gradients for 3 variables"):
        opt.apply(grads[:2], variables)
    other = ls.Variable(backend.array(np.ones(2)), name="stranger")
    with pytest.raises(ValueError, match="Unknown variable: 'stranger'"):
        opt.apply([backend.array(np.ones(2, np.float32))], [other])
    after = [backend.numpy(v) for v in variables + opt.variables]
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_mixed_backend_gradient_is_rejected(rng):
    import torch

    _, variables = make_vars(type("B", (), {"array": staticmethod(lambda x: np.asarray(x))})(), rng)
    grads = [torch.ones(3, 4), None, None]
    with pytest.raises(ValueError, match="is a torch array but the variables are numpy arrays"):
        SGD().apply(grads, variables)


def test_mixed_backend_variables_are_rejected():
    import torch

    with pytest.raises(ValueError, match="found both 'numpy' and 'torch'"):
        SGD().build([np.ones(2, np.float32), torch.ones(2)])


def test_apply_without_variables_needs_build():
    with pytest.raises(ValueError, match="must already be built"):
        SGD().apply([np.ones(2)])


def test_apply_gradients_returns_iterations(backend, rng):
    _, variables = make_vars(backend, rng)
    opt = SGD()
    grads = [backend.array(g) for g in random_grads(rng)]
    iterations = opt.apply_gradients(zip(grads, variables))
    assert int(iterations) == 1
    opt.apply(grads)  # built: variables may be omitted
    assert int(opt.iterations) == 2


def test_learning_rate_float_settable_and_callable(backend, rng):
    _, variables = make_vars(backend, rng)
    opt = SGD(learning_rate=0.1)
    assert float(opt.learning_rate) == pytest.approx(0.1)
    opt.learning_rate = 0.5
    opt.apply([backend.array(np.ones(s, np.float32)) for s in SHAPES], variables)
    assert float(backend.numpy(opt.learning_rate)) == pytest.approx(0.5)
    assert opt.variables[1].name == "learning_rate"
    calls = []
    opt2 = SGD(learning_rate=lambda: calls.append(1) or 0.25)
    assert [v.name for v in opt2.variables] == ["iteration"]
    x = ls.Variable(backend.array(np.array([1.0])))
    opt2.apply([backend.array(np.array([1.0]))], [x])
    np.testing.assert_allclose(backend.numpy(x), [0.75])
    assert calls


def test_learning_rate_schedule_reads_raw_iterations(backend):
    class Halving(ls.schedules.LearningRateSchedule):
        def __call__(self, step):
            # Cast first: TensorFlow does not promote `float ** int32 tensor`.
            return 1.0 * 0.5 ** ops_for(step).cast(step, "float32")

        def get_config(self):
            return {}

    x = ls.Variable(backend.array(np.array([0.0])))
    opt = SGD(learning_rate=Halving())
    for _ in range(3):
        opt.apply([backend.array(np.array([1.0]))], [x])
    np.testing.assert_allclose(backend.numpy(x), [-(1 + 0.5 + 0.25)])
    with pytest.raises(TypeError, match="not settable"):
        opt.learning_rate = 0.1


def test_constructor_errors():
    with pytest.raises(
        ValueError, match="Only one of `clipnorm`, `clipvalue` and `global_clipnorm`"
    ):
        SGD(clipnorm=1.0, clipvalue=1.0)
    with pytest.raises(
        ValueError,
        match=r"`gradient_accumulation_steps` must be an integer >= 2 or None. Received: gradient_accumulation_steps=1",
    ):
        SGD(gradient_accumulation_steps=1)
    with pytest.raises(
        ValueError,
        match=r"`ema_momentum` must be a finite number >= 0 and <= 1. Received: ema_momentum=1.5",
    ):
        SGD(use_ema=True, ema_momentum=1.5)
    with pytest.raises(
        ValueError,
        match=r"`learning_rate` must be a finite number >= 0. Received: learning_rate=-1",
    ):
        SGD(learning_rate=-1)
    with pytest.raises(
        ValueError, match=r"`learning_rate` must be .* Received: learning_rate='fast'"
    ):
        SGD(learning_rate="fast")
    with pytest.raises(ValueError, match=r"Argument\(s\) not recognized by SGD: \['bogus'\]"):
        SGD(bogus=1)
    with pytest.raises(
        ValueError, match="`clipnorm` must be a finite number > 0 or None. Received: clipnorm=0"
    ):
        SGD(clipnorm=0)
    with pytest.raises(ValueError, match="`name` must be a string or None"):
        SGD(name=3)
    with pytest.raises(ValueError, match="`use_ema` must be a boolean. Received: use_ema=1"):
        SGD(use_ema=1)


def test_update_step_must_be_implemented():
    class Bare(Optimizer):
        pass

    x = ls.Variable(np.ones(2, np.float32))
    with pytest.raises(NotImplementedError, match="Bare must implement `update_step"):
        Bare(learning_rate=0.1).apply([np.ones(2, np.float32)], [x])


def test_scale_loss_with_static_factor():
    assert SGD(loss_scale_factor=8.0).scale_loss(2.0) == 16.0
    assert SGD().scale_loss(2.0) == 2.0


def test_iterations_setter(backend, rng):
    _, variables = make_vars(backend, rng)
    opt = SGD(gradient_accumulation_steps=2)
    opt.build(variables)
    opt.iterations = 3
    assert int(backend.numpy(opt._iterations)) == 6 and int(backend.numpy(opt.iterations)) == 3


def test_no_warning_on_clean_step(backend, rng):
    _, variables = make_vars(backend, rng)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Adam().apply([backend.array(g) for g in random_grads(rng)], variables)


def test_save_load_and_set_weights(backend, rng):
    _, variables = make_vars(backend, rng)
    opt = Adam(learning_rate=0.1)
    opt.apply([backend.array(g) for g in random_grads(rng)], variables)
    store = {}
    opt.save_own_variables(store)
    assert sorted(store, key=int) == [str(i) for i in range(len(opt.variables))]
    assert all(isinstance(x, np.ndarray) for x in store.values())
    other = Adam(learning_rate=0.1)
    other.build(variables)
    other.load_own_variables(store)
    for a, b in zip(opt.variables, other.variables):
        np.testing.assert_array_equal(backend.numpy(a), backend.numpy(b))
    weights = [np.asarray(x) + 1 for x in store.values()]
    other.set_weights(weights)
    np.testing.assert_array_equal(backend.numpy(other.variables[2]), weights[2])


def test_load_count_mismatch_warns_and_loads_nothing(backend, rng):
    _, variables = make_vars(backend, rng)
    opt = Adam()
    opt.build(variables)
    before = [backend.numpy(v).copy() for v in opt.variables]
    with pytest.warns(
        UserWarning,
        match="Skipping variable loading for optimizer 'adam', because it has 8 variables whereas the saved optimizer has 1",
    ):
        opt.load_own_variables({"0": np.zeros(())})
    with pytest.warns(UserWarning, match="not been called/built yet"):
        Adam().load_own_variables({"0": np.zeros(()), "1": np.zeros(()), "2": np.zeros(())})
    for v, b in zip(opt.variables, before):
        np.testing.assert_array_equal(backend.numpy(v), b)


def test_shape_mismatch_raises_before_writing(backend, rng):
    _, variables = make_vars(backend, rng)
    opt = Adam()
    opt.build(variables)
    store = {}
    opt.save_own_variables(store)
    store = {k: np.asarray(v) + 5 for k, v in store.items()}
    store["5"] = np.zeros((9,), np.float32)
    before = [backend.numpy(v).copy() for v in opt.variables]
    with pytest.raises(
        ValueError,
        match=r"Optimizer variable 'adam/bias_velocity' has shape \(5,\).*Received: store\[5\].shape=\(9,\)",
    ):
        opt.load_own_variables(store)
    with pytest.raises(
        ValueError,
        match=r"`weights` must hold one array per optimizer variable \(8\). Received: 1 arrays",
    ):
        opt.set_weights([np.zeros(())])
    for v, b in zip(opt.variables, before):
        np.testing.assert_array_equal(backend.numpy(v), b)
    with pytest.raises(ValueError, match="has not yet been built"):
        Adam().set_weights([])


@pytest.mark.parametrize(
    "cls_name, expected",
    [
        ("LossScaleOptimizer", "loss_scale_optimizer"),
        ("RMSprop", "rm_sprop"),
        ("SGD", "sgd"),
        ("MyAdam", "my_adam"),
    ],
)
def test_default_names_follow_keras(cls_name, expected):
    cls = type(
        cls_name, (SGD,), {"__init__": lambda self, **kw: Optimizer.__init__(self, 0.1, **kw)}
    )
    assert cls().name == expected


def test_variables_of_two_backends_are_refused_before_anything_is_written():
    import torch

    np_var = ls.Variable(np.ones(2, np.float32), name="a")
    torch_var = ls.Variable(torch.ones(2), name="b")
    opt = ls.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="found both 'numpy' and 'torch'"):
        opt.build([np_var, torch_var])
    opt.build([np_var])
    with pytest.raises(
        ValueError,
        match=r"All `trainable_variables` must come from one backend; found both 'numpy' and 'torch'",
    ):
        opt.apply([np.ones(2, np.float32), torch.ones(2)], [np_var, torch_var])
    assert np_var.numpy().tolist() == [1.0, 1.0] and torch_var.value.tolist() == [1.0, 1.0]


def _copied(how, obj):
    import copy
    import pickle

    return copy.deepcopy(obj) if how == "deepcopy" else pickle.loads(pickle.dumps(obj))


def _decaying_adam(variables):
    """Adam with weight decay, one variable excluded by identity and one by name."""
    opt = Adam(0.1, weight_decay=0.5)
    opt.exclude_from_weight_decay(var_list=[variables[1]], var_names=["scal"])
    return opt


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize(
    "make",
    [
        lambda variables: Adam(0.1),
        lambda variables: ls.LossScaleOptimizer(Adam(0.1)),
        lambda variables: ls.LossScaleOptimizer(_decaying_adam(variables)),
    ],
    ids=["Adam", "LossScaleOptimizer(Adam)", "LossScaleOptimizer(Adam(weight_decay))"],
)
def test_a_copy_with_its_model_trains_on_as_the_original(backend, rng, how, make):
    """`copy.deepcopy` or `pickle` of (variables, optimizer): the copy steps its own
    variables bit for bit as the original steps its own, through a skipped step,
    and leaves the original's alone."""
    _, variables = make_vars(backend, rng)
    opt = make(variables)
    if isinstance(opt, ls.LossScaleOptimizer):
        opt.scale_loss(1.0)
    for _ in range(2):  # built, slots and the kernels' derived data made
        opt.apply([backend.array(g) for g in random_grads(rng)], variables)
    copied_vars, copied = _copied(how, (variables, opt))
    assert copied._trainable_variables == copied_vars
    before = [backend.numpy(v).copy() for v in variables]
    steps = [random_grads(rng, scale=2.0**10) for _ in range(3)]
    steps[1][0][0, 0] = np.inf  # skipped by the loss-scale wrapper
    for grads in steps:
        copied.apply([backend.array(g) for g in grads], copied_vars)
    for v, b in zip(variables, before):  # the original untouched by the copy's steps
        np.testing.assert_array_equal(backend.numpy(v), b)
    for grads in steps:
        opt.apply([backend.array(g) for g in grads], variables)
    for a, b in zip(variables + opt.variables, copied_vars + copied.variables):
        np.testing.assert_array_equal(backend.numpy(a), backend.numpy(b))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_with_its_raw_tensors_resolves_them(how):
    """Raw torch tensors, wrapped by the optimizer: the copy finds its own copies."""
    import torch

    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = ls.LossScaleOptimizer(Adam(0.1))
    opt.scale_loss(1.0)
    grads = lambda: [torch.full(p.shape, 0.5) * 1024 for p in params]  # noqa: E731
    opt.apply(grads(), params)
    copied_params, copied = _copied(how, (params, opt))
    copied.apply(grads(), copied_params)
    opt.apply(grads(), params)
    for a, b in zip(params, copied_params):
        assert torch.equal(a, b) and a is not b
    with pytest.raises(ValueError, match="Unknown variable"):
        copied.apply(grads(), params)  # the original's tensors are not the copy's


@pytest.mark.parametrize("dtype", ["int32", "bool", "complex64"])
def test_build_refuses_a_variable_that_is_not_real_floating_point(backend, dtype):
    w = ls.Variable(backend.array(np.ones(3, np.float32)), name="w")
    other = ls.Variable(backend.array(np.ones(3, dtype)), name="other")
    opt = Adam()
    with pytest.raises(
        ValueError,
        match=r"`var_list` must hold real floating-point variables: the update rules train "
        r"neither integers, booleans nor complex numbers\. Received: variable 'other' of "
        rf"dtype {dtype}",
    ):
        opt.build([w, other])
    assert not opt.built


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


def test_stateless_apply_equals_apply_and_mutates_nothing(backend, rng):
    init, variables = make_vars(backend, rng)
    twin = [ls.Variable(backend.array(x), name=v.name) for x, v in zip(init, variables)]
    kwargs = dict(
        learning_rate=0.05,
        weight_decay=0.01,
        use_ema=True,
        ema_overwrite_frequency=2,
        gradient_accumulation_steps=2,
    )
    stateful, stateless = Adam(**kwargs), Adam(**kwargs)
    stateless.build(twin)
    opt_values = [v.value for v in stateless.variables]
    model_values = [v.value for v in twin]
    frozen = [backend.numpy(v).copy() for v in twin + stateless.variables]
    for _ in range(5):
        grads = [backend.array(g) for g in random_grads(rng)]
        stateful.apply(grads, variables)
        model_values, opt_values = stateless.stateless_apply(opt_values, grads, model_values)
    for v, new in zip(variables + stateful.variables, model_values + opt_values):
        np.testing.assert_allclose(backend.numpy(new), backend.numpy(v), rtol=1e-6)
    for v, f in zip(twin + stateless.variables, frozen):
        np.testing.assert_array_equal(backend.numpy(v), f)


def test_stateless_apply_errors(backend, rng):
    _, variables = make_vars(backend, rng)
    opt = SGD()
    with pytest.raises(ValueError, match="must be built"):
        opt.stateless_apply([], [], [])
    opt.build(variables)
    values = [v.value for v in opt.variables]
    with pytest.raises(
        ValueError, match=r"`optimizer_variables` must be a list .* \(2 expected\). Received: 1"
    ):
        opt.stateless_apply(values[:1], [None] * 3, [v.value for v in variables])
    with pytest.raises(
        ValueError, match=r"`trainable_variables` entry for 'kernel' must have shape \(3, 4\)"
    ):
        opt.stateless_apply(
            values, [None] * 3, [backend.array(np.ones(2))] + [v.value for v in variables[1:]]
        )


def test_an_unbuilt_optimizer_is_refused_naming_its_class():
    message = (
        r"^To call `stateless_apply`, Adam must be built \(i.e. its variables must have been "
        r"created\). Call `optimizer.build\(trainable_variables\)`.$"
    )
    with pytest.raises(ValueError, match=message):
        Adam().stateless_apply([], [], [])


@pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")
@pytest.mark.parametrize("where", ["first", "last", "random"])
def test_a_skipped_step_returns_the_values_it_was_given(backend, rng, where):
    # Inside LossScaleOptimizer: an inf or NaN in one gradient skips the
    # inner step; the model values come back bit for bit, the scale halved,
    # as `apply` does on a twin.
    init, variables = make_vars(backend, rng)
    twin = [ls.Variable(backend.array(x), name=v.name) for x, v in zip(init, variables)]
    stateless, stateful = (
        ls.LossScaleOptimizer(Adam(0.05), initial_scale=2.0**8, dynamic_growth_steps=2)
        for _ in range(2)
    )
    stateless.build(twin)
    stateful.build(variables)
    model_values = [v.value for v in twin]
    opt_values = [v.value for v in stateless.variables]
    for step in range(4):
        grads = random_grads(rng, scale=2.0**8)
        if step == 2:
            flat = grads[0].reshape(-1)
            index = {"first": 0, "last": flat.size - 1, "random": int(rng.integers(flat.size))}
            flat[index[where]] = np.nan if where == "random" else np.inf
        grads = [backend.array(g) for g in grads]
        before = [backend.numpy(x).copy() for x in model_values]
        model_values, opt_values = stateless.stateless_apply(opt_values, grads, model_values)
        stateful.apply(grads, variables)
        if step == 2:
            for x, b in zip(model_values, before):
                np.testing.assert_array_equal(backend.numpy(x), b)
        for new, v in zip(model_values + opt_values, variables + stateful.variables):
            np.testing.assert_array_equal(backend.numpy(new), backend.numpy(v))
    scale = {v.name: backend.numpy(x) for v, x in zip(stateless.variables, opt_values)}
    assert float(scale["dynamic_scale"]) == 2.0**8  # grew after 2 steps, halved at the skip
    # The optimizer's own variables were left as they were built.
    assert float(stateless.dynamic_scale) == 2.0**8 and int(stateless.iterations) == 0
    for v, x in zip(twin, init):
        np.testing.assert_array_equal(backend.numpy(v), x)


class _Failing(SGD):
    def update_step(self, gradient, variable, learning_rate):
        variable.assign_sub(gradient)  # a write the failure must not leave behind
        raise RuntimeError("update failed")


def test_an_error_inside_the_step_restores_the_bindings(backend, rng):
    init, variables = make_vars(backend, rng)
    opt = _Failing(0.1)
    opt.build(variables)
    storages = [v.storage for v in variables + opt.variables]
    grads = [backend.array(g) for g in random_grads(rng)]
    with pytest.raises(RuntimeError, match="update failed"):
        opt.stateless_apply(
            [v.value for v in opt.variables], grads, [backend.array(x) for x in init]
        )
    assert all(v.storage is s for v, s in zip(variables + opt.variables, storages))
    for v, x in zip(variables, init):
        np.testing.assert_array_equal(backend.numpy(v), x)
