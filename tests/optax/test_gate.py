"""`lossscale.optax.gate.gated_update`: exact on both branches, and no scratch buffer.

The reference for an applied step is the inner transformation's own
`update`, jitted alone: every update and every state leaf must match it bit
for bit. A skipped step must return the state it was given, bit for bit,
and `-0.0` updates.
"""

import functools
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.interpreters import mlir

import lossscale.optax as lso
from lossscale.optax import gate

SHAPES = [(6, 5), (5,), (3, 4, 2), (1,)]


def _arrays(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray((scale * rng.normal(size=s)).astype(np.float32)) for s in SHAPES]


class _Memory(optax.GradientTransformation):
    """Keeps the last gradient in its state: a state leaf that is an input of `update`."""

    def __new__(cls):
        def init(params):
            return {"last": jax.tree_util.tree_map(jnp.zeros_like, params)}

        def update(updates, state, params=None):
            return jax.tree_util.tree_map(lambda g, m: g - m, updates, state["last"]), {
                "last": updates
            }

        return super().__new__(cls, init, update)


def _twice():
    """One computed value returned as two state leaves (rerouted neither time)."""

    def init(params):
        return (jax.tree_util.tree_map(jnp.zeros_like, params),) * 2

    def update(updates, state, params=None):
        trace = jax.tree_util.tree_map(lambda g, t: 0.5 * t + g, updates, state[0])
        return jax.tree_util.tree_map(lambda t: -0.1 * t, trace), (trace, trace)

    return optax.GradientTransformation(init, update)


def _jitted_inside():
    """The whole update in one `jax.jit` helper: nothing visible to reroute."""
    tx = optax.adam(0.01)
    return optax.GradientTransformation(tx.init, jax.jit(tx.update))


def _control_flow():
    """Nested jaxprs in the update: a custom-JVP function, `lax.cond`, `lax.fori_loop`."""

    def init(params):
        return {
            "trace": jax.tree_util.tree_map(jnp.zeros_like, params),
            "n": jnp.zeros((), jnp.int32),
        }

    def update(updates, state, params=None):
        def one(g, t):
            t = jax.lax.fori_loop(0, 3, lambda i, t: 0.9 * t + 0.1 * jax.nn.relu(g), t)
            big = jnp.sum(jnp.abs(g)) > 1.0
            return jax.lax.cond(big, lambda: -0.01 * t, lambda: -0.1 * t), t

        pairs = [one(g, t) for g, t in zip(updates, state["trace"])]
        return [u for u, _ in pairs], {"trace": [t for _, t in pairs], "n": state["n"] + 1}

    return optax.GradientTransformation(init, update)


def _constant_state():
    """A state leaf the update returns as a constant (a literal in the jaxpr)."""

    def init(params):
        return {"flag": jnp.asarray(False), "trace": jax.tree_util.tree_map(jnp.zeros_like, params)}

    def update(updates, state, params=None):
        trace = jax.tree_util.tree_map(lambda g, t: 0.5 * t + g, updates, state["trace"])
        return jax.tree_util.tree_map(lambda t: -0.1 * t, trace), {"flag": False, "trace": trace}

    return optax.GradientTransformation(init, update)


_CONSTANT = np.linspace(0.5, 1.5, 30).astype(np.float32)


def _array_constant():
    """An update that closes over a NumPy array: a constant of the jaxpr."""

    def update(updates, state, params=None):
        return [-jnp.asarray(_CONSTANT[: g.size].reshape(g.shape)) * g for g in updates], state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _with_effects():
    """A host callback in the update: an effect, evaluated as traced."""

    def update(updates, state, params=None):
        jax.debug.callback(lambda x: None, updates[0])
        return optax.adam(0.01).update(updates, state, params)

    return optax.GradientTransformation(optax.adam(0.01).init, update)


def _with_references():
    """A mutable array reference inside the update."""

    def update(updates, state, params=None):
        out = []
        for g in updates:
            ref = jax.new_ref(g)
            ref[...] = ref[...] * -0.5
            out.append(ref[...])
        return out, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


_double_p = jax.extend.core.Primitive("lossscale_test_double")
_double_p.def_impl(lambda x: 2 * x)
_double_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(_double_p, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))


def _with_new_primitive():
    """A primitive outside `jax.extend.core.primitives` (a user's or a library's own)."""

    def update(updates, state, params=None):
        mu = [0.9 * m + _double_p.bind(g) for m, g in zip(state["mu"], updates)]
        return [-0.1 * m for m in mu], {"mu": mu}

    def init(params):
        return {"mu": [jnp.zeros_like(p) for p in params]}

    return optax.GradientTransformation(init, update)


INNERS = {
    "adam": lambda: optax.adam(0.01),
    "clip_adamw": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(0.01, weight_decay=0.1)
    ),
    "sgd_nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(0.01),
    "memory": _Memory,
    "twice": _twice,
    "jitted_inside": _jitted_inside,
    "control_flow": _control_flow,
    # optax's own wrappers: accumulation (its lax.cond), hyperparameters in
    # the state, its finite check, a schedule, a partial mask.
    "multi_steps": lambda: optax.MultiSteps(optax.adam(0.01), every_k_schedule=2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.01),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(0.01), 3),
    "schedule": lambda: optax.adam(optax.exponential_decay(0.01, 10, 0.5)),
    "masked": lambda: optax.masked(optax.adam(0.01), lambda p: [i % 2 == 0 for i in range(len(p))]),
    "optimistic": lambda: optax.optimistic_gradient_descent(0.1),
    "constant_state": _constant_state,
    "array_constant": _array_constant,
    # Evaluated as traced and selected at the outputs (see FALLBACKS).
    "effects": _with_effects,
    "references": _with_references,
    "new_primitive": _with_new_primitive,
}
FALLBACKS = {
    "effects": "effects",
    "references": "references",
    "new_primitive": "primitive lossscale_test_double",
}


def _states(tx, params, steps=3):
    """The inner state after a few ordinary steps: non-zero moments and counts."""
    state = tx.init(params)
    for k in range(steps):
        _, state = jax.jit(tx.update)(_arrays(10 + k), state, params)
    return state


# Both ways of gating: every inner evaluated equation by equation, and some
# with the whole update selected at its outputs (a JAX without the internals).
CASES = [(name, "interpreted") for name in sorted(INNERS)] + [
    (name, "selected_at_outputs")
    for name in ("adam", "clip_adamw", "memory", "optimistic", "control_flow")
]


@pytest.fixture
def evaluation(request, monkeypatch):
    if request.param == "selected_at_outputs":
        monkeypatch.setattr(gate, "_INTERNALS", None)
    return request.param


# Applied and skipped in one test: the flag is an argument of the one
# compiled step, so each inner compiles once (the suite's time).
@pytest.mark.parametrize("name, evaluation", CASES, indirect=["evaluation"])
def test_a_gated_step_applies_the_inner_update_or_keeps_the_state(name, evaluation):
    """Applied: bit for bit where evaluated equation by equation, within a few ulp where
    selected. Skipped: the state kept bit for bit (signs of zeros too), `-0.0` updates."""
    tx = INNERS[name]()
    params = _arrays(0)
    state = _states(tx, params)
    grads = _arrays(1)
    expected = jax.jit(tx.update)(grads, state, params)

    @jax.jit
    def gated(grads, state, params, applied):
        return gate.gated_update(tx.update, applied, grads, state, params, {})

    got = gated(grads, state, params, jnp.asarray(True))
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
    exact = evaluation == "interpreted" and name not in FALLBACKS
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        assert a.dtype == b.dtype
        if exact:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:  # XLA may fuse (and contract) the selected outputs otherwise: a few ulp
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=4e-7, atol=1e-7)

    updates, new_state = gated(grads, state, params, jnp.asarray(False))
    for a, b in zip(jax.tree_util.tree_leaves(new_state), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert np.array_equal(np.signbit(np.asarray(a)), np.signbit(np.asarray(b)))
    for u in jax.tree_util.tree_leaves(updates):
        assert np.all(np.asarray(u) == 0) and np.all(np.signbit(np.asarray(u)))


@pytest.mark.parametrize(
    "name, rerouted",
    [("adam", "all"), ("clip_adamw", "all"), ("memory", 0), ("twice", 0), ("jitted_inside", "all")],
)
def test_which_state_values_downstream_reads_see_selected(name, rerouted):
    """A state value computed in the top-level jaxpr is selected where it is computed.

    Its other readers (Adam's update arithmetic) then see the selected value,
    which lets XLA write each moment in place. An input passed through or a
    value returned twice is selected at the output only. A nested call that
    computes the state and the updates together has its state outputs
    selected as it returns: exact, but the updates inside it read the
    unselected values.
    """
    tx = INNERS[name]()
    params = _arrays(0)
    state = tx.init(params)
    closed = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(_arrays(1), state, params)
    n_updates = len(params)
    old = jax.tree_util.tree_leaves(state)
    reroute = gate._reroutes(closed.jaxpr, closed.jaxpr.outvars[n_updates:], old)
    assert len(reroute) == (len(old) if rerouted == "all" else rerouted)


def _adam_step(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1))


def test_the_compiled_step_holds_no_scratch_buffer_and_no_conditional():
    """No full-size buffer besides the donated ones: `lax.cond` needed one per update."""
    params = [jnp.ones((256, 256), jnp.float32) for _ in range(3)]
    grads = [jnp.full((256, 256), 3.0, jnp.float32) for _ in range(3)]
    tx = lso.dynamic_loss_scale(optax.adam(1e-3))
    compiled = _adam_step(tx).lower(params, tx.init(params), grads).compile()
    # No branch over the update: the only `conditional`s are the finite
    # check's, returning a flag (its peak under a scale below 1).
    conditionals = re.findall(r"= (.*?) conditional\(", compiled.as_text())
    assert {c.strip("()") for c in conditionals} <= {"pred[]"}, conditionals
    assert compiled.memory_analysis().temp_size_in_bytes < params[0].nbytes // 64

    # The measure sees scratch where there is some: a cond around the same update.
    def cond_update(grads, state, params=None):
        ok = jnp.isfinite(sum(jnp.sum(g) for g in grads))
        skip = functools.partial(lambda: (jax.tree_util.tree_map(lambda g: g * -0.0, grads), state))
        return jax.lax.cond(ok, lambda: optax.adam(1e-3).update(grads, state, params), skip)

    inner = optax.adam(1e-3)
    with_cond = optax.GradientTransformation(inner.init, cond_update)
    compiled = _adam_step(with_cond).lower(params, inner.init(params), grads).compile()
    assert compiled.memory_analysis().temp_size_in_bytes >= 3 * params[0].nbytes


def _jaxpr(tx):
    params = _arrays(0)
    return jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(_arrays(1), tx.init(params), params)


@pytest.mark.parametrize("name", sorted(INNERS))
def test_what_the_evaluation_does_not_recognise_is_selected_at_the_outputs(name):
    assert gate.unsupported(_jaxpr(INNERS[name]())) == FALLBACKS.get(name)


def test_a_constant_that_is_not_an_array_is_not_recognised():
    closed = _jaxpr(_array_constant())
    assert closed.consts and gate.unsupported(closed) is None

    class Opaque:
        pass

    odd = jax.extend.core.ClosedJaxpr(closed.jaxpr, [Opaque(), *closed.consts[1:]])
    assert gate.unsupported(odd) == "constant Opaque"


def test_on_a_jax_without_the_internals_everything_is_selected_at_the_outputs(monkeypatch):
    monkeypatch.setattr(gate, "_INTERNALS", None)
    assert gate.unsupported(_jaxpr(optax.adam(0.01))) == "jax"


def test_an_older_jax_imports_and_steps_with_the_fallback():
    """JAX releases before the tested ones: no internals used, the same results."""
    code = (
        "import jax; jax.__version_info__ = (0, 9, 0)\n"
        "import jax.numpy as jnp, optax, lossscale.optax as lso\n"
        "from lossscale.optax import gate\n"
        "assert gate._INTERNALS is None\n"
        "tx = lso.dynamic_loss_scale(optax.adam(0.1), initial_scale=4.0)\n"
        "p = {'w': jnp.ones(2)}\n"
        "u, s = jax.jit(tx.update)({'w': jnp.full(2, 4.0)}, tx.init(p), p)\n"
        "v, _ = jax.jit(optax.adam(0.1).update)({'w': jnp.ones(2)}, optax.adam(0.1).init(p), p)\n"
        "assert (u['w'] == v['w']).all(), (u, v)\n"
        "u, s = jax.jit(tx.update)({'w': jnp.full(2, jnp.inf)}, s, p)\n"
        "assert float(s.scale) == 2.0 and bool(jnp.signbit(u['w']).all())\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_the_inner_update_is_traced_once():
    calls = []
    adam = optax.adam(0.01)

    def update(updates, state, params=None):
        calls.append(1)
        return adam.update(updates, state, params)

    tx = lso.dynamic_loss_scale(optax.GradientTransformation(adam.init, update))
    params = _arrays(0)
    jax.jit(tx.update)(_arrays(1), tx.init(params), params)
    assert len(calls) == 1


def _inner_with_a_sine():
    def update(updates, state, params=None):
        return [jnp.sin(g) for g in updates], state  # the line the profile must name

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def test_the_inner_updates_operations_keep_their_source_information():
    """Profiles and tracebacks point at the user's code, not at gate.py."""
    tx = lso.dynamic_loss_scale(_inner_with_a_sine())
    params = _arrays(0)
    text = jax.jit(tx.update).lower(_arrays(1), tx.init(params), params).as_text(debug_info=True)
    defined = dict(line.split(" = ", 1) for line in text.splitlines() if line.startswith("#loc"))
    sines = [line for line in text.splitlines() if "stablehlo.sine" in line]
    assert len(sines) == len(SHAPES)
    for line in sines:
        chain, todo = [], _loc_names(line.rsplit("loc(", 1)[-1])
        while todo:
            name = todo.pop()
            chain.append(defined.get(name, ""))
            todo.extend(_loc_names(chain[-1]))
        where = " ".join(chain)
        # The traceback of the sine: its own line, not the evaluator re-binding it.
        assert "_inner_with_a_sine.<locals>.update" in where and "_evaluate" not in where, where


def _loc_names(text):
    return re.findall(r"#loc\d+", text)
