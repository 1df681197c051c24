"""Safe, portable optimizer checkpoints: one safetensors file, no pickle.

A checkpoint holds every variable of an optimizer as plain arrays and, in
its metadata, the config as JSON and each variable's path, shape, dtype and
SHA-256 digest. Loading executes nothing, and a state saved from one backend
resumes on any other. Every problem with a file raises `CheckpointError`
before any variable is written; `save` replaces a file atomically and
durably.

A `lossscale.pytree` transform or an optax transformation is saved with its
state, `save(tx, path, state=state)`, and restored into a target of the same
structure, `state = restore(tx, path, state=target)` (the target may be
`jax.eval_shape(tx.init, params)`).

`safetensors` is an optional dependency, imported on first use.

Examples:
    >>> import numpy as np, lossscale as ls, lossscale.saving, tempfile, os
    >>> w = ls.Variable(np.ones(2, np.float32), name="w")
    >>> opt = ls.LossScaleOptimizer(ls.optimizers.Adam(0.1), initial_scale=8.0)
    >>> _ = opt.scale_loss(1.0)
    >>> opt.apply([np.full(2, 8.0, np.float32)], [w])
    >>> path = os.path.join(tempfile.mkdtemp(), "opt.safetensors")
    >>> ls.saving.save(opt, path)
    >>> twin = ls.saving.load(path, [ls.Variable(w.numpy(), name="w")])
    >>> int(twin.iterations), float(twin.dynamic_scale)
    (1, 8.0)
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lossscale import checkpoint_files, validation
from lossscale.checkpoint_files import CheckpointError
from lossscale.typing import Array, PyTree

if TYPE_CHECKING:
    from lossscale.optimizers.base import Optimizer
    from lossscale.pytree import Transform
    from lossscale.variables import Variable


__all__ = ["CheckpointError", "load", "restore", "save"]


def save(
    optimizer: Optimizer | Transform | Any,
    path: str | os.PathLike[str],
    state: PyTree | None = None,
) -> None:
    """Writes `optimizer`'s config and every variable (or a transform's `state`) to a file.

    Args:
        optimizer: A built `lossscale.optimizers.Optimizer`; or a
            `lossscale.pytree.Transform` or `optax.GradientTransformation`
            together with `state`.
        path: The file to write (replaced atomically if it exists).
        state: The state pytree of a transform (required for one, refused
            for an `Optimizer`, whose variables hold its state).
    """
    from lossscale import serialization
    from lossscale.optimizers.base import Optimizer
    from lossscale.pytree import _checkpoint

    if not isinstance(optimizer, Optimizer):
        config, names, arrays = _checkpoint.payload(optimizer, state)
        format_name = checkpoint_files.STATE_FORMAT
    else:
        _check_optimizer(
            optimizer,
            state,
            "save",
            "`optimizer` must be built before saving, so that all of its variables exist. "
            "Call `optimizer.build(trainable_variables)` or `apply` first.",
        )
        try:
            config = json.dumps(serialization.serialize(optimizer))
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"The config of {type(optimizer).__name__} cannot be written as JSON ({error}); "
                "a callable learning rate, for one, cannot be saved: use a float or a "
                "LearningRateSchedule."
            ) from None
        arrays = [np.asarray(v.numpy(), order="C") for v in optimizer.variables]
        names, format_name = [v.path for v in optimizer.variables], checkpoint_files.FORMAT
    entries = [checkpoint_files.entry(name, a) for name, a in zip(names, arrays)]
    checkpoint_files.write(path, arrays, checkpoint_files.metadata(format_name, config, entries))


def _check_optimizer(optimizer, state, verb, unbuilt):
    """Refuses a `state`, a `lossscale.pytree.transform` blueprint and an unbuilt optimizer."""
    from lossscale.pytree._transform import is_blueprint

    if state is not None:
        raise ValueError(
            f"`state` is for transforms, whose state is a pytree; an Optimizer {verb}s its "
            f"own variables: lossscale.saving.{verb}(optimizer, path). Received: state of "
            f"type {type(state).__name__}"
        )
    if not optimizer.built and is_blueprint(optimizer):
        raise ValueError(
            "This optimizer was given to lossscale.pytree.transform, which never builds or "
            "writes it: the training state is the `state` pytree that `tx.init` and "
            "`tx.apply` return. Save that instead, lossscale.saving.save(tx, path, "
            "state=state), and restore it with lossscale.saving.restore(tx, path, "
            f"state=tx.init(params)). Received: optimizer={optimizer!r}"
        )
    if not optimizer.built:
        raise ValueError(unbuilt)


def restore(
    optimizer: Optimizer | Transform | Any,
    path: str | os.PathLike[str],
    state: PyTree | None = None,
) -> PyTree | None:
    """Loads the state saved in `path` into `optimizer` (built, same structure).

    Everything is checked first; on any error nothing is written. For a
    transform, `state` is the target (such as `tx.init(params)` or
    `jax.eval_shape(tx.init, params)`) and a new state is returned, each
    array made like the target's; the target's values are not read.

    Args:
        optimizer: A built optimizer of the classes that wrote the file; or
            a transform or optax transformation.
        path: A file written by `save`.
        state: The target state, for a transform.

    Returns:
        `None` for an optimizer (restored in place); the restored state for
        a transform.

    Raises:
        CheckpointError: The file is missing, damaged or does not match.
    """
    from lossscale.optimizers.base import Optimizer
    from lossscale.pytree import _checkpoint

    if not isinstance(optimizer, Optimizer):
        _checkpoint.describe(optimizer)  # raises, naming what is accepted
        checkpoint = checkpoint_files.read(os.fspath(path), checkpoint_files.STATE_FORMAT)
        return _checkpoint.restore(
            optimizer, checkpoint, state, checkpoint_files.fail, validation.dtype_kind
        )
    _check_optimizer(
        optimizer,
        state,
        "restore",
        "`optimizer` must be built before `restore`, so that all of its variables exist. "
        "Call `optimizer.build(trainable_variables)` first, or use "
        "`lossscale.saving.load(path, trainable_variables)`.",
    )
    _assign(optimizer, checkpoint_files.read(os.fspath(path)))


def load(
    path: str | os.PathLike[str],
    variables: Sequence[Variable | Array],
    custom_objects: dict[str, Any] | None = None,
) -> Optimizer:
    """Rebuilds the optimizer saved in `path` for `variables`, with its state.

    Args:
        path: A file written by `save`.
        variables: The model variables (`lossscale.Variable`s or native
            arrays of any backend), in the order the saved optimizer was
            built with.
        custom_objects: Optional dict of user-defined optimizer or schedule
            classes named in the saved config.

    Returns:
        A new, built optimizer holding the saved state.

    Raises:
        CheckpointError: The file is missing, damaged or does not match.
    """
    from lossscale import serialization

    checkpoint = checkpoint_files.read(os.fspath(path))
    try:
        optimizer = serialization.deserialize(checkpoint.config, custom_objects=custom_objects)
    except (ValueError, TypeError) as error:
        raise CheckpointError(
            f"Checkpoint {checkpoint.path!r}: its config does not rebuild an optimizer: {error}"
        ) from None
    optimizer.build(variables)
    _assign(optimizer, checkpoint)
    return optimizer


def _structure(config):
    """`LossScaleOptimizer(Adam)`-style description of a serialized optimizer."""
    inner = config.get("config", {}).get("inner_optimizer")
    name = config["class_name"]
    return f"{name}({_structure(inner)})" if isinstance(inner, dict) else name


def _assign(optimizer, checkpoint):
    """Checks `checkpoint` against `optimizer`, then writes every variable."""
    from lossscale import serialization

    path = checkpoint.path
    ours = _structure(serialization.serialize(optimizer))
    theirs = _structure(checkpoint.config)
    if ours != theirs:
        checkpoint_files.fail(path, f"it holds the state of a {theirs}, not of this {ours}")
    variables = optimizer.variables
    if len(variables) != len(checkpoint.arrays):
        checkpoint_files.fail(
            path,
            f"it holds {len(checkpoint.arrays)} optimizer variables but this {ours} "
            f"has {len(variables)}; it was saved with other settings or for another "
            "model",
        )
    for i, (variable, entry, array) in enumerate(
        zip(variables, checkpoint.entries, checkpoint.arrays)
    ):
        if tuple(variable.shape) != tuple(array.shape):
            checkpoint_files.fail(
                path,
                f"variable {i} ({entry['path']!r}) has shape {tuple(array.shape)} but "
                f"this optimizer's ({variable.path!r}) has shape {variable.shape}",
            )
        if validation.dtype_kind(array.dtype.name) != validation.dtype_kind(variable.dtype):
            checkpoint_files.fail(
                path,
                f"variable {i} ({entry['path']!r}) holds {array.dtype.name} values "
                f"but this optimizer's ({variable.path!r}) is {variable.dtype}",
            )
    _check_loss_scale_values(optimizer, checkpoint)
    # Its public write: what an optimizer keeps on the host follows the load.
    optimizer.set_weights(checkpoint.arrays)


def _check_loss_scale_values(optimizer, checkpoint):
    """Refuses a loss-scale field the step could never have reached (a NaN scale, say)."""
    from lossscale.mixed_precision import restored
    from lossscale.optimizers.loss_scale_optimizer import LossScaleOptimizer

    arrays = dict(zip((v.path for v in optimizer.variables), checkpoint.arrays))
    while optimizer is not None:
        if isinstance(optimizer, LossScaleOptimizer):
            own = optimizer.variables[: -len(optimizer.inner_optimizer.variables) or None]
            fields = restored.variable_fields([v.path.rsplit("/", 1)[-1] for v in own])
            for v in own:
                field = fields.get(v.path.rsplit("/", 1)[-1])
                found = field and restored.problem(field, v.path, arrays[v.path], optimizer.policy)
                if found:
                    checkpoint_files.fail(checkpoint.path, found)
        optimizer = getattr(optimizer, "inner_optimizer", None)
