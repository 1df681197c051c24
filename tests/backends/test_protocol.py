"""backends/protocol.py: every backend provides what `BackendOps` declares.

For each of the four backend modules: every declared constant with its
type (`NAME` the backend's own name, `INT_DTYPE` int32), every declared
function, callable with the protocol's signature (the same parameters, in
order, of the same kind, with the same defaults; any extra parameter has a
default), and the optional names where a backend needs them.
"""

import inspect
import typing

import pytest

from lossscale.backends import BACKENDS, get_ops, protocol

DECLARED = protocol.BackendOps
CONSTANTS = typing.get_type_hints(DECLARED)
FUNCTIONS = {
    name: inspect.signature(value)
    for name, value in vars(DECLARED).items()
    if inspect.isfunction(value) and not name.startswith("_")
}


def test_the_protocol_declares_what_optimizer_code_uses():
    # Not an empty seam: the constants and the primitives of each section.
    assert CONSTANTS == {"NAME": str, "MUTABLE": bool, "INT_DTYPE": str}
    assert {"asarray", "assign_add", "where", "unscale_checked", "fused_update", "cond"} <= set(
        FUNCTIONS
    )
    assert len(FUNCTIONS) == 52


def _parameters(signature):
    """The parameters after `self`, as (name, kind, default)."""
    return [(p.name, p.kind, p.default) for p in list(signature.parameters.values())[1:]]


@pytest.mark.parametrize("name", BACKENDS)
def test_each_backend_has_every_constant(name):
    ops = get_ops(name)
    for constant, kind in CONSTANTS.items():
        assert isinstance(getattr(ops, constant), kind), constant
    assert ops.NAME == name and ops.INT_DTYPE == "int32"
    assert ops.MUTABLE is (name != "jax")  # tf.Variable assigns in place too


@pytest.mark.parametrize("name", BACKENDS)
def test_each_backend_has_every_function_with_a_compatible_signature(name):
    ops = get_ops(name)
    missing = sorted(f for f in FUNCTIONS if not callable(getattr(ops, f, None)))
    assert missing == []
    for function, declared in FUNCTIONS.items():
        got = inspect.signature(getattr(ops, function))
        wanted = _parameters(declared)
        params = [(p.name, p.kind, p.default) for p in got.parameters.values()]
        # Keyword-only options of the backend's own, with defaults, may follow;
        # a positional-or-keyword one may too, if it has a default.
        assert params[: len(wanted)] == wanted, (function, str(got), str(declared))
        extra = list(got.parameters.values())[len(wanted) :]
        assert all(
            p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            for p in extra
        ), (function, str(got))


@pytest.mark.parametrize(
    "name, optional",
    [
        ("numpy", set()),
        ("torch", set()),
        ("jax", {"is_traced", "all_mean"}),
        ("tensorflow", {"variable_storage", "dense_gradient"}),
    ],
)
def test_the_optional_names_are_where_the_backends_need_them(name, optional):
    # TensorFlow's state lives in its own variable objects, and its
    # gradients may be sparse; a JAX tracer may not be kept in a variable. (One backend a case: the
    # minimum-versions leg leaves out the backends it lacks.)
    names = ("variable_storage", "is_traced", "dense_gradient", "all_mean")
    has = {n for n in names if hasattr(get_ops(name), n)}
    assert has == optional
