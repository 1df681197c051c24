"""Checks and filtering of the gradients and values handed to an optimizer, before any write."""

import warnings

from lossscale.backends import common_backend
from lossscale.validation import dtype_kind


def drop_missing(grads, variables):
    missing = [v.path for g, v in zip(grads, variables) if g is None]
    if missing:
        warnings.warn(
            f"Gradients do not exist for variables {missing} when minimizing the "
            "loss; they are left unchanged.",
            stacklevel=4,
        )
    kept = [(g, v) for g, v in zip(grads, variables) if g is not None]
    return [g for g, _ in kept], [v for _, v in kept]


def validate_gradients(grads, variables):
    """Checks gradients against variables; returns them, sparse ones made dense in a copy.

    Integer and boolean gradients are refused, not cast: they almost always
    mean the wrong array was passed.
    """
    if all(g is None for g in grads):
        raise ValueError(
            "No gradients provided for any variable. Received: grads=" + repr([None] * len(grads))
        )
    ops = variables[0]._ops
    is_native, dtype_name = ops.is_native, ops.dtype_name
    # The common case in a few passes; the loop below names what is wrong.
    if (
        all(map(is_native, grads))
        and [g.shape for g in grads] == [v.shape for v in variables]
        and _all_float(ops, grads)
    ):
        return grads
    floats = {}  # native dtype -> whether it is a float dtype
    checked = grads
    for i, (g, v) in enumerate(zip(grads, variables)):
        if g is None:
            continue
        if not is_native(g) and (dense := _dense(ops, g)) is not None:
            if checked is grads:
                checked = list(grads)
            checked[i] = g = dense
        if not is_native(g):
            got = common_backend([g], what="`grads`")
            raise ValueError(
                f"The gradient for variable {v.path!r} is a {got} array but the variables are "
                f"{v.backend} arrays; all must come from one backend. Received: "
                f"{type(g).__name__}"
            )
        if g.shape != v.shape:
            raise ValueError(
                f"The gradient for variable {v.path!r} must have the variable's shape "
                f"{v.shape}. Received: gradient shape {tuple(g.shape)}"
            )
        is_float = floats.get(g.dtype)  # every backend's native arrays have one
        if is_float is None:
            is_float = floats[g.dtype] = dtype_kind(dtype_name(g)) == "float"
        if not is_float and dtype_kind(v.dtype) == "float":
            got = dtype_name(g)
            raise ValueError(
                f"The gradient for variable {v.path!r} must have a floating-point dtype, as "
                f"the variable does ({v.dtype}); integer and boolean gradients are not cast. "
                f"Received: gradient dtype {got}"
            )
    return checked


def _all_float(ops, arrays):
    """Whether every native array has a floating-point dtype (one test per dtype)."""
    return all(
        dtype_kind(ops.dtype_name(x)) == "float" for x in {x.dtype: x for x in arrays}.values()
    )


def _dense(ops, g):
    """`g` made dense by the backend (a sparse gradient), or None."""
    densify = getattr(ops, "dense_gradient", None)  # optional: TensorFlow's
    return None if densify is None else densify(g)


def check_values(argname, values, variables):
    if len(values) != len(variables):
        raise ValueError(
            f"`{argname}` must be a list of arrays matching the optimizer's variables one to "
            f"one ({len(variables)} expected). Received: {len(values)} arrays"
        )
    for x, v in zip(values, variables):
        shape = v._ops.shape(x)
        if shape != v.shape:
            raise ValueError(
                f"`{argname}` entry for {v.path!r} must have shape {v.shape}. "
                f"Received: shape {shape}"
            )
