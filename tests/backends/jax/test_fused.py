"""The folded JAX kernels (`backends/jax/fused.py`) against the generic path.

The generic path is the step as it was before the kernels: no JAX kernel
registered, so `LossScaleOptimizer` runs the inner `update_step` under a
`lax.cond` and unscales the gradients itself. Every jitted step of the
folded path must equal it bit for bit, applied or skipped, over steps with
injected inf and NaN gradients, zeros of both signs in the parameters, the
slots and the gradients, a scale that is not a power of two, one variable
or several, and half-precision dtypes. The compiled step must hold no
`lax.cond`, no select of a full-size state buffer and no full-size scratch
buffer at all.
"""

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossscale as ls
from lossscale import backends, optimizers
from lossscale.backends.jax import fused, kernels
from lossscale.backends.jax import multi as jax_multi
from lossscale.backends.kernel import Kernel
from lossscale.optimizers import LossScaleOptimizer

pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")

CASES = {
    "adam": lambda: optimizers.Adam(0.05),
    "adam_amsgrad": lambda: optimizers.Adam(0.05, amsgrad=True),
    "adam_weight_decay": lambda: optimizers.Adam(0.05, weight_decay=0.1),
    "adamw": lambda: optimizers.AdamW(0.05, weight_decay=0.1),
    "adamw_amsgrad": lambda: optimizers.AdamW(0.05, weight_decay=0.1, amsgrad=True),
    "sgd": lambda: optimizers.SGD(0.05),
    "sgd_weight_decay": lambda: optimizers.SGD(0.05, weight_decay=0.1),
    "sgd_momentum": lambda: optimizers.SGD(0.05, momentum=0.9),
    "sgd_nesterov": lambda: optimizers.SGD(0.05, momentum=0.9, nesterov=True),
}
STEPS = 20
# Overflows (inf, NaN, -inf) at these steps: each is skipped.
BAD = {3: np.inf, 7: np.nan, 8: -np.inf, 15: np.nan}
# (initial scale, growth factor): powers of two, then a scale whose
# reciprocal is inexact (XLA could multiply by it instead of dividing).
SCALES = {"pow2": (8.0, 2.0), "inexact": (1000.0, 3.0)}
SHAPES = {"several": [(16, 9), (17,), (5, 3), (1,)], "one": [(257,)]}


@contextlib.contextmanager
def generic_path():
    """The step as it was before the folded kernels: no JAX kernel at all."""
    package = backends.get_ops("jax")
    saved = dict(kernels.KERNELS), package.fused_weight_decay
    kernels.KERNELS.clear()
    package.fused_weight_decay = lambda: None
    try:
        yield
    finally:
        kernels.KERNELS.update(saved[0])
        package.fused_weight_decay = saved[1]


def make_weights(shapes, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    weights = [rng.normal(size=s).astype(dtype) for s in shapes]
    weights[0].flat[:4] = [-0.0, 0.0, -0.0, 0.0]
    return weights


def make_gradients(shapes, scale, dtype=np.float32, seed=1):
    rng = np.random.default_rng(seed)
    steps = []
    for step in range(STEPS):
        grads = [(rng.normal(size=s) * scale).astype(dtype) for s in shapes]
        # Zero gradients of both signs, one of them on a -0.0 weight.
        grads[0].flat[:2] = [0.0, -0.0]
        grads[0].flat[5] = -0.0
        if step in BAD:
            bad = grads[step % len(shapes)]
            bad.flat[step % bad.size] = BAD[step]
        steps.append(grads)
    return steps


def trajectory(make_inner, weights, grads, scale, growth, generic=False):
    """Every step's `(model, optimizer)` values of a jitted `stateless_apply`, and the traces."""
    context = generic_path() if generic else contextlib.nullcontext()
    with context:
        opt = LossScaleOptimizer(
            make_inner(), initial_scale=scale, dynamic_growth_steps=2, growth_factor=growth
        )
        opt.build([jnp.asarray(w) for w in weights])
        traces = []

        def step(model, own, g):
            traces.append(1)
            return opt.stateless_apply(own, g, model)

        step = jax.jit(step)
        model, own = [jnp.asarray(w) for w in weights], [v.value for v in opt.variables]
        history = []
        for g in grads:
            model, own = step(model, own, [jnp.asarray(x) for x in g])
            history.append([np.asarray(x) for x in model + own])
    return history, len(traces), [v.path for v in opt.variables]


def assert_bitwise(got, expected, where):
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), (where, a, b)


# Each optimizer with both layouts and both scales, in two pairs that
# alternate along the table (not the whole product: two compilations a
# case, the suite's time).
PAIRS = [
    pair
    for k, case in enumerate(sorted(CASES))
    for pair in (
        (case, "several", ("pow2", "inexact")[k % 2]),
        (case, "one", ("inexact", "pow2")[k % 2]),
    )
]


@pytest.mark.parametrize("case, shapes, scales", PAIRS)
def test_folded_step_is_bitwise_the_generic_step(case, shapes, scales):
    scale, growth = SCALES[scales]
    weights = make_weights(SHAPES[shapes])
    grads = make_gradients(SHAPES[shapes], scale)
    folded, traces, names = trajectory(CASES[case], weights, grads, scale, growth)
    generic, _, _ = trajectory(CASES[case], weights, grads, scale, growth, generic=True)
    assert traces == 1
    for step, (a, b) in enumerate(zip(folded, generic)):
        assert_bitwise(a, b, (case, step))
    # The skips happened: the inner step count lags by the bad steps.
    iteration = len(weights) + names.index(f"{CASES[case]().name}/iteration")
    assert int(folded[-1][iteration]) == STEPS - len(BAD)


@pytest.mark.parametrize(
    "dtype, grad_dtype",
    [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float16")],
)
@pytest.mark.parametrize("case", ["adam", "adamw_amsgrad", "sgd_nesterov"])
def test_half_precision_is_bitwise_the_generic_step(case, dtype, grad_dtype):
    shapes = SHAPES["several"]
    weights = [w.astype(dtype) for w in make_weights(shapes)]
    grads = make_gradients(shapes, 8.0, dtype=grad_dtype)
    folded, traces, _ = trajectory(CASES[case], weights, grads, 8.0, 2.0)
    generic, _, _ = trajectory(CASES[case], weights, grads, 8.0, 2.0, generic=True)
    assert traces == 1
    for step, (a, b) in enumerate(zip(folded, generic)):
        assert_bitwise(a, b, (case, step))


def _signed_zero_state(opt, weights):
    """Optimizer values whose float slots hold zeros of both signs and normal numbers."""
    rng = np.random.default_rng(5)
    values = []
    for v in opt.variables:
        x = np.asarray(v.value)
        if x.ndim and x.dtype.kind == "f":
            x = np.abs(rng.normal(size=x.shape)).astype(x.dtype)
            if x.size >= 5:
                x.flat[:4] = [-0.0, 0.0, -0.0, 0.0]
                if "velocity" not in v.path:  # second moments are >= 0
                    x.flat[4] = -1.5
            else:
                x.flat[0] = -0.0
        values.append(jnp.asarray(x))
    return values


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_skipped_step_leaves_every_buffer_bitwise(case):
    shapes = SHAPES["several"]
    weights = make_weights(shapes)
    opt = LossScaleOptimizer(CASES[case](), initial_scale=8.0)
    opt.build([jnp.asarray(w) for w in weights])
    own = _signed_zero_state(opt, weights)
    grads = [jnp.asarray(g) for g in make_gradients(shapes, 8.0)[0]]
    step = jax.jit(lambda m, o, g: opt.stateless_apply(o, g, m))
    for bad in (np.inf, -np.inf, np.nan):
        broken = list(grads)
        broken[1] = broken[1].at[2].set(bad)
        model, new_own = step([jnp.asarray(w) for w in weights], own, broken)
        assert_bitwise([np.asarray(x) for x in model], weights, (case, bad))
        for name, before, after in zip((v.path for v in opt.variables), own, new_own):
            if name == "loss_scale_optimizer/dynamic_scale":
                assert float(after) == 4.0
            else:
                assert_bitwise([np.asarray(after)], [np.asarray(before)], (case, name))
    # And the same state through an applied step equals the generic path's.
    folded = step([jnp.asarray(w) for w in weights], own, grads)
    with generic_path():
        generic = jax.jit(lambda m, o, g: opt.stateless_apply(o, g, m))(
            [jnp.asarray(w) for w in weights], own, grads
        )
    for a, b in zip(jax.tree.leaves(folded), jax.tree.leaves(generic)):
        assert_bitwise([np.asarray(a)], [np.asarray(b)], case)


# --- what the compiled step holds ---------------------------------------


def _full_size_selects(closed_jaxpr, state_inputs):
    """The primitive names of `closed_jaxpr` (nested ones included) and its full-size selects.

    A `cond` whose results are scalars is named "scalar cond".

    Returns `(names, selects)`: `selects` is a list of `(eqn, reads_state)`
    for each `select_n` with a result of more than one element, where
    `reads_state` says whether any of its operands depends on an input in
    `state_inputs` (indices into the jaxpr's inputs).
    """
    names, selects = [], []

    def walk(jaxpr, depends):
        deps = dict(zip(jaxpr.invars, depends))
        for eqn in jaxpr.eqns:
            inputs = [
                frozenset() if hasattr(v, "val") else deps.get(v, frozenset()) for v in eqn.invars
            ]
            union = frozenset().union(*inputs)
            name = eqn.primitive.name
            if name == "cond" and all(np.prod(v.aval.shape) <= 1 for v in eqn.outvars):
                name = "scalar cond"  # a flag, as the finite check's: no state in it
            names.append(name)
            if eqn.primitive.name == "select_n" and np.prod(eqn.outvars[0].aval.shape) > 1:
                selects.append((eqn, bool(union)))
            for inner in _inner_jaxprs(eqn):
                same = len(inputs) == len(inner.invars)
                walk(inner, inputs if same else [union] * len(inner.invars))
            for v in eqn.outvars:
                deps[v] = union

    jaxpr = closed_jaxpr.jaxpr
    walk(
        jaxpr,
        [frozenset({i}) if i in state_inputs else frozenset() for i in range(len(jaxpr.invars))],
    )
    return names, selects


def _inner_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
                yield item.jaxpr
            elif hasattr(item, "eqns"):
                yield item


def step_jaxpr(opt, weights):
    """`jax.make_jaxpr(opt.stateless_apply)` and the indices of its full-size state inputs."""
    model = [jnp.asarray(w) for w in weights]
    own = [v.value for v in opt.variables]
    grads = [jnp.ones_like(w) for w in model]
    closed = jax.make_jaxpr(opt.stateless_apply)(own, grads, model)
    sizes = [x.size for x in own] + [0] * len(grads) + [x.size for x in model]
    return closed, {i for i, size in enumerate(sizes) if size > 1}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_step_holds_no_cond_and_no_select_of_state(case):
    weights = make_weights(SHAPES["several"])
    opt = LossScaleOptimizer(CASES[case]())
    opt.build([jnp.asarray(w) for w in weights])
    names, selects = _full_size_selects(*step_jaxpr(opt, weights))
    assert "cond" not in names and "while" not in names
    assert [eqn for eqn, reads_state in selects if reads_state] == []
    # The full-size selects left are the gradients' sanitisers and their
    # divisors (`fused._divided`): two per loop that reads a gradient (Adam's
    # moments and Nesterov read it in two loops).
    loops = 2 if case.startswith("adam") or case == "sgd_nesterov" else 1
    assert len(selects) == 2 * loops * sum(w.size > 1 for w in weights)


def test_the_checker_sees_a_cond_and_a_select_of_state():
    """The checks above can fail: the generic step has a cond, selected writes have selects."""
    weights = make_weights(SHAPES["several"])
    opt = LossScaleOptimizer(optimizers.Adam(0.05))
    opt.build([jnp.asarray(w) for w in weights])
    with generic_path():
        names, _ = _full_size_selects(*step_jaxpr(opt, weights))
    assert "cond" in names

    def select_writes(params, grads, slots, hyper, *, update_step, keep, lr, **_):
        # `keep` honoured by a select of every state the rule writes.
        targets = list(params) + [s for lst in slots.values() for s in lst]
        old = [t.value for t in targets]
        for g, v in zip(grads, params):
            update_step(g, v, lr)
        for t, o in zip(targets, old):
            t.rebind(jnp.where(keep, t.storage, o))

    with generic_path():
        kernels.KERNELS["adam"] = Kernel(select_writes, folds_keep=True)
        names, selects = _full_size_selects(*step_jaxpr(opt, weights))
    assert "cond" not in names
    assert sum(reads_state for _, reads_state in selects) == 3 * sum(w.size > 1 for w in weights)


def compiled_step(opt, weights):
    """The step compiled as `docs/jax.md` advises: donated, in output order."""
    step = jax.jit(lambda m, o, g: opt.stateless_apply(o, g, m), donate_argnums=(0, 1))
    model = [jnp.asarray(w) for w in weights]
    return step.lower(model, [v.value for v in opt.variables], model).compile()


@pytest.mark.parametrize("case", ["adam", "adamw_amsgrad", "sgd_momentum", "sgd_nesterov"])
def test_the_compiled_step_has_no_conditional_and_no_scratch_buffer(case):
    weights = [np.ones((256, 256), np.float32)] * 3
    gradient_bytes = weights[0].nbytes
    opt = LossScaleOptimizer(CASES[case]())
    opt.build([jnp.asarray(w) for w in weights])
    compiled = compiled_step(opt, weights)
    text = compiled.as_text()
    # No branch over state: the one `conditional` is the finite check's
    # peak under a scale below 1, returning a flag.
    conditionals = re.findall(r"= (\S+) conditional\(", text)
    assert [c.strip("()") for c in conditionals] == ["pred[]"], conditionals
    # Scalars only: no unscaled, sanitised or copied gradient, no copy of a slot.
    assert compiled.memory_analysis().temp_size_in_bytes < gradient_bytes // 64
    with generic_path():
        generic = compiled_step(opt, weights)
    # The measure sees scratch where there is some: the generic step writes
    # the unscaled gradients out (and more).
    assert generic.memory_analysis().temp_size_in_bytes >= 3 * gradient_bytes
    generic_conditionals = re.findall(r"= (.*?) conditional\(", generic.as_text())
    assert any(c.strip("()") != "pred[]" for c in generic_conditionals), generic_conditionals


@pytest.mark.parametrize("case", ["adam", "sgd_momentum"])
def test_gradients_checked_by_their_sums_take_the_same_steps(case, monkeypatch):
    """Above the sum threshold: the same steps bit for bit, and `cond`s of scalars only."""
    scale, growth = SCALES["inexact"]
    weights = make_weights(SHAPES["several"])
    grads = make_gradients(SHAPES["several"], scale)
    expected, _, _ = trajectory(CASES[case], weights, grads, scale, growth)
    monkeypatch.setattr(jax_multi, "_SUMMED", 2)  # every gradient but the (1,) one
    got, traces, _ = trajectory(CASES[case], weights, grads, scale, growth)
    assert traces == 1
    for step, (a, b) in enumerate(zip(got, expected)):
        assert_bitwise(a, b, (case, step))
    weights = [np.ones((256, 256), np.float32)] * 3
    opt = LossScaleOptimizer(CASES[case]())
    opt.build([jnp.asarray(w) for w in weights])
    compiled = compiled_step(opt, weights)
    conditionals = re.findall(r"= (\S+) conditional\(", compiled.as_text())
    # The sums' exact branch and the small gradient's peak: flags only.
    assert {c.strip("()") for c in conditionals} == {"pred[]"}, conditionals
    # Scalars only: the exact branch copies no gradient.
    assert compiled.memory_analysis().temp_size_in_bytes < weights[0].nbytes // 64


def _full_size_loops(hlo_text):
    """The bodies of the compiled fused computations whose result has more than one element."""
    bodies = re.findall(r"^(%\S+ \(.*?\) -> (\S+) \{\n.*?^\})", hlo_text, re.M | re.S)
    return [body for body, result in bodies if re.search(r"\[\d", result)]


@pytest.mark.parametrize("case", ["adam", "adamw_amsgrad", "sgd_nesterov"])
def test_the_update_loops_read_the_flag_as_opaque_scalars(case):
    """No update loop decides on the flag itself (see `fused._opaque_one`).

    Else XLA copies the finite check's last reductions into every loop, and
    LLVM may split a loop on the flag, moving parts of an expression apart.
    """
    weights = [np.ones((64, 64), np.float32)] * 3
    opt = LossScaleOptimizer(CASES[case]())
    opt.build([jnp.asarray(w) for w in weights])
    loops = _full_size_loops(compiled_step(opt, weights).as_text())
    assert len(loops) >= 2 * len(weights)
    for body in loops:
        assert not re.search(r"= \w+\[\] (select|is-finite|maximum)\(", body), body


# --- the pieces ------------------------------------------------------------

SPECIAL = np.array(
    [-0.0, 0.0, 1.5, -1.5, 3e38, -3e38, 1e-30, -1e-30, np.inf, -np.inf, np.nan], np.float32
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gate_writes_are_exact_under_jit(dtype):
    """`add`/`subtract` are the plain write where applied and the storage where skipped.

    Under jit, so XLA's simplifier and LLVM see the identities (no fast
    math may drop `x * 1.0`, `x + -0.0` or the sign of a zero).
    """
    info = jnp.finfo(dtype)
    finite = [-0.0, 0.0, 1.5, -1.5, float(info.max), -float(info.max), 4 * float(info.tiny)]
    storage, value = np.meshgrid(finite + [np.inf, -np.inf, np.nan], finite)
    storage = jnp.asarray(storage.ravel(), dtype)
    value = jnp.asarray(value.ravel(), dtype)

    @jax.jit
    def writes(s, x, keep):
        gate = fused._Gate(keep, s.dtype, {})
        return gate.add(s, x), gate.subtract(s, x)

    for keep in (True, False):
        added, subtracted = writes(storage, value, keep)
        plain_add, plain_sub = jax.jit(lambda s, x: (s + x, s - x))(storage, value)
        expected = (plain_add, plain_sub) if keep else (storage, storage)
        assert_bitwise(
            [np.asarray(added), np.asarray(subtracted)], [np.asarray(e) for e in expected], keep
        )


def test_sanitised_gradient_is_the_gradient_or_zero():
    g = jnp.asarray(SPECIAL)
    for keep in (True, False):
        out = jax.jit(lambda g, k: fused._Gate(k, "float32", {}).gradient(g, "float32"))(g, keep)
        if keep:
            finite = np.isfinite(SPECIAL)
            assert_bitwise([np.asarray(out)[finite]], [SPECIAL[finite]], keep)
        else:
            assert np.asarray(out).tobytes() == np.zeros_like(SPECIAL).tobytes()


@pytest.mark.parametrize("shape", [(1,), (17,), (257,), (64, 65)])
@pytest.mark.parametrize("scale", [3.0, 1000.0, 2.0**-7])
def test_unscaling_inside_the_loop_is_a_true_division(shape, scale):
    """A division fused into a loop is a division (XLA may multiply by a reciprocal instead).

    XLA does so, for one, to `ops.unscale` compiled on its own (as an eager
    step runs it); inside the generic jitted step the quotient also feeds
    the finite check and stays a division, which the folded step matches.
    """
    rng = np.random.default_rng(2)
    g = rng.normal(size=shape).astype(np.float32) * 1000
    quotient = g / np.float32(scale)
    for loop in (0, 1):

        def read(g, keep, scale, loop=loop):
            return fused._Gate(keep, "float32", {}, scale).gradient(g, "float32", loop)

        got = jax.jit(read)(g, True, jnp.float32(scale))
        assert np.asarray(got).tobytes() == quotient.tobytes()
        skipped = jax.jit(read)(g, False, jnp.float32(scale))
        assert np.asarray(skipped).tobytes() == np.zeros_like(g).tobytes()
    # The data tells the two roundings apart (where the scale is no power of two).
    if scale != 2.0**-7 and g.size > 1:
        assert (g * (np.float32(1) / np.float32(scale))).tobytes() != quotient.tobytes()


def _eager_variables(weights):
    return [ls.Variable(jnp.asarray(w), name=f"w{i}") for i, w in enumerate(weights)]


@pytest.mark.parametrize("case", ["adam", "adam_amsgrad", "sgd", "sgd_nesterov"])
@pytest.mark.parametrize("grad_scale", [None, 1000.0])
def test_without_a_flag_the_kernels_run_update_step(case, grad_scale):
    weights = make_weights(SHAPES["several"])
    grads = [jnp.asarray(g) for g in make_gradients(SHAPES["several"], 1000.0)[1]]
    results = []
    for kernel in (fused.adam if "adam" in case else fused.sgd, None):
        opt = CASES[case]()
        variables = _eager_variables(weights)
        opt.build(variables)
        if kernel is None:
            unscaled = grads
            if grad_scale is not None:  # as the wrapper unscales them
                unscaled = backends.get_ops("jax").unscale(grads, jnp.float32(grad_scale))
            for g, v in zip(unscaled, variables):
                opt.update_step(g, v, opt.learning_rate)
        else:
            scale = None if grad_scale is None else jnp.float32(grad_scale)
            assert opt._fused_kernel().fn is kernel
            opt._update_variables(grads, variables, opt.learning_rate, grad_scale=scale)
        results.append([np.asarray(v.value) for v in variables + opt.variables])
    assert_bitwise(results[0], results[1], case)


def _decayed(variables, values, flag):
    with backends._common.bound(variables, values):
        fused.weight_decay(variables, 0.1, jnp.float32(0.05), cache={}, keep=flag)
        return [v.storage for v in variables]


def test_weight_decay_kernel_is_the_generic_rule():
    weights = make_weights(SHAPES["several"])
    for keep in (None, True, False):
        variables = _eager_variables(weights)
        flag = None if keep is None else jnp.asarray(keep)
        # Traced, as under `jax.jit` (a concrete flag is a plain `if`).
        step = jax.jit(functools.partial(_decayed, variables))
        values = step([v.value for v in variables], flag)
        for v, value in zip(variables, values):
            v.rebind(value)
        expected = [w - w * np.float32(0.1) * np.float32(0.05) for w in weights]
        if keep is False:
            expected = weights
        assert_bitwise([np.asarray(v.value) for v in variables], expected, keep)
