"""Safe, portable optimizer checkpoints: one safetensors file, no pickle.

A checkpoint holds every variable of an optimizer (`optimizer.variables`,
in order, as plain arrays) and, in the file's text metadata, the optimizer's
config as JSON plus, per variable, its path, shape, dtype and SHA-256
digest. Loading parses JSON and raw arrays only: nothing is unpickled,
imported or executed. Arrays are written from NumPy and read back into any
backend, so a state saved from torch resumes on NumPy or JAX.

Every problem with a file (missing, truncated, corrupt, written by another
optimizer or for other variables) raises `CheckpointError` naming the path
and the problem, before any variable is written: a failed `restore` leaves
the optimizer exactly as it was. `save` writes a temporary file, flushes it
to disk (`fsync`), renames it over the checkpoint's name and flushes the
directory, so neither an interrupted save nor a power loss leaves a
truncated file under that name.

Pure optimizers keep their state in pytrees the caller holds: a
`lossscale.pytree` transform and an optax transformation (such as
`lossscale.optax.dynamic_loss_scale`) are saved with that state,
`save(tx, path, state=state)`, and restored into a target of the same
structure, `state = restore(tx, path, state=target)`, where the target may
be `jax.eval_shape(tx.init, params)`. Such a file has its own format name
(`lossscale.state`; see `lossscale.pytree._checkpoint`), so it never loads
as an optimizer's variables, nor the other way round.

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

import hashlib
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lossscale import validation
from lossscale.typing import Array, PyTree

if TYPE_CHECKING:
    from lossscale.optimizers.base import Optimizer
    from lossscale.pytree import Transform
    from lossscale.variables import Variable

FORMAT = "lossscale.optimizer"
STATE_FORMAT = "lossscale.state"
FORMAT_VERSION = 1
_FORMAT_NAMES = {
    FORMAT: "lossscale optimizer checkpoint",
    STATE_FORMAT: "lossscale state checkpoint",
}
_FORMAT_HINTS = {
    FORMAT: "; it holds an optimizer's variables: restore it with "
    "lossscale.saving.restore(optimizer, path) or load(path, variables)",
    STATE_FORMAT: "; it holds a transform's state: restore it with "
    "lossscale.saving.restore(tx, path, state=target)",
}


__all__ = ["CheckpointError", "load", "restore", "save"]


class CheckpointError(ValueError):
    """A checkpoint file cannot be used: missing, damaged, or for another optimizer."""


def save(
    optimizer: Optimizer | Transform | Any,
    path: str | os.PathLike[str],
    state: PyTree | None = None,
) -> None:
    """Writes `optimizer`'s config and every variable to one safetensors file.

    A `lossscale.pytree` transform or an optax transformation keeps its
    state in a pytree instead: pass it as `state`, the one `init`, `apply`
    or `update` last returned.

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
        entries = [_entry(name, a) for name, a in zip(names, arrays)]
        _write(path, arrays, _metadata(STATE_FORMAT, config, entries))
        return
    if state is not None:
        raise ValueError(
            "`state` is for transforms, whose state is a pytree; an Optimizer saves its own "
            f"variables: lossscale.saving.save(optimizer, path). Received: state of type "
            f"{type(state).__name__}"
        )
    _check_not_a_blueprint(optimizer)
    if not optimizer.built:
        raise ValueError(
            "`optimizer` must be built before saving, so that all of its variables exist. "
            "Call `optimizer.build(trainable_variables)` or `apply` first."
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
    entries = [_entry(v.path, a) for v, a in zip(optimizer.variables, arrays)]
    _write(path, arrays, _metadata(FORMAT, config, entries))


def _check_not_a_blueprint(optimizer):
    """Refuses an optimizer given to `lossscale.pytree.transform`: it holds no training state."""
    from lossscale.pytree._transform import is_blueprint

    if not optimizer.built and is_blueprint(optimizer):
        raise ValueError(
            "This optimizer was given to lossscale.pytree.transform, which never builds or "
            "writes it: the training state is the `state` pytree that `tx.init` and "
            "`tx.apply` return. Save that instead, lossscale.saving.save(tx, path, "
            "state=state), and restore it with lossscale.saving.restore(tx, path, "
            f"state=tx.init(params)). Received: optimizer={optimizer!r}"
        )


def _entry(name, array):
    return {
        "path": name,
        "shape": list(array.shape),
        "dtype": array.dtype.name,
        "sha256": _digest(array),
    }


def _metadata(format_name, config, entries):
    return {
        "format": format_name,
        "format_version": str(FORMAT_VERSION),
        "config": config if isinstance(config, str) else json.dumps(config),
        "variables": json.dumps(entries),
    }


def _write(path, arrays, metadata):
    """Writes `arrays` as tensors "0", "1", ... to a temporary file, then renames it."""
    path = os.fspath(path)
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        _safetensors().numpy.save_file(
            {str(i): a for i, a in enumerate(arrays)}, temporary, metadata=metadata
        )
        _durable_replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _durable_replace(temporary, path):
    """Renames `temporary` to `path` so that a power loss leaves one or the other.

    The file's bytes reach the disk before the rename (else the new name
    could point at a truncated file), and the directory entry after it.
    """
    with open(temporary, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temporary, path)
    if hasattr(os, "O_DIRECTORY"):  # POSIX: a directory can be opened and synced
        directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def restore(
    optimizer: Optimizer | Transform | Any,
    path: str | os.PathLike[str],
    state: PyTree | None = None,
) -> PyTree | None:
    """Loads the state saved in `path` into `optimizer` (built, same structure).

    Everything is checked first (the file, the optimizer classes, the
    number, shapes and kinds of the variables); on any error nothing is
    written.

    For a `lossscale.pytree` transform or an optax transformation, which
    hold no state, `state` is the target (a state of the same tree, such as
    `tx.init(params)` or `jax.eval_shape(tx.init, params)`) and a new state
    is returned, each array made like the target's (dtype, device,
    sharding); the target's values are not read.

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
        checkpoint = _read(os.fspath(path), STATE_FORMAT)
        return _checkpoint.restore(optimizer, checkpoint, state, _fail, validation.dtype_kind)
    if state is not None:
        raise ValueError(
            "`state` is for transforms, whose state is a pytree; an Optimizer restores its "
            "own variables: lossscale.saving.restore(optimizer, path). Received: state of "
            f"type {type(state).__name__}"
        )
    _check_not_a_blueprint(optimizer)
    if not optimizer.built:
        raise ValueError(
            "`optimizer` must be built before `restore`, so that all of its variables exist. "
            "Call `optimizer.build(trainable_variables)` first, or use "
            "`lossscale.saving.load(path, trainable_variables)`."
        )
    checkpoint = _read(os.fspath(path))
    _assign(optimizer, checkpoint)


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

    checkpoint = _read(os.fspath(path))
    try:
        optimizer = serialization.deserialize(checkpoint.config, custom_objects=custom_objects)
    except (ValueError, TypeError) as error:
        raise CheckpointError(
            f"Checkpoint {checkpoint.path!r}: its config does not rebuild an optimizer: {error}"
        ) from None
    optimizer.build(variables)
    _assign(optimizer, checkpoint)
    return optimizer


class _Checkpoint:
    """What `_read` found: the config and the arrays, every check passed."""

    def __init__(self, path, config, entries, arrays):
        self.path, self.config, self.entries, self.arrays = path, config, entries, arrays


def _safetensors():
    try:
        import safetensors.numpy
    except ImportError:
        raise ImportError(
            "lossscale.saving needs the `safetensors` package: pip install safetensors"
        ) from None
    return safetensors


def _digest(array):
    return hashlib.sha256(array.tobytes()).hexdigest()


def _fail(path, problem):
    raise CheckpointError(f"Checkpoint {path!r}: {problem}")


def _read(path, format_name=FORMAT):
    """Reads and checks a whole checkpoint; raises `CheckpointError` on any problem."""
    safetensors = _safetensors()
    if not os.path.isfile(path):
        _fail(path, "no such file" if not os.path.exists(path) else "not a regular file")
    try:
        with safetensors.safe_open(path, framework="np") as f:
            metadata = f.metadata() or {}
            keys = set(f.keys())
            raw = {key: f.get_tensor(key) for key in keys}
    except Exception as error:  # the reader's own error types; the file is unusable
        _fail(path, f"not a readable safetensors file (truncated or corrupt): {error}")
    found = metadata.get("format")
    if found != format_name:
        _fail(
            path,
            f"not a {_FORMAT_NAMES[format_name]} (metadata 'format' is {found!r}, expected "
            f"{format_name!r}){_FORMAT_HINTS.get(found, '')}",
        )
    if metadata.get("format_version") != str(FORMAT_VERSION):
        _fail(
            path,
            f"format version {metadata.get('format_version')!r} is not supported "
            f"(this lossscale reads version {FORMAT_VERSION})",
        )
    try:
        config = json.loads(metadata["config"])
        entries = json.loads(metadata["variables"])
        entries = [
            dict(
                path=str(e["path"]),
                shape=tuple(int(s) for s in e["shape"]),
                dtype=str(e["dtype"]),
                sha256=str(e["sha256"]),
            )
            for e in entries
        ]
    except (KeyError, TypeError, ValueError) as error:
        _fail(path, f"its metadata is corrupt ({type(error).__name__}: {error})")
    key, what = ("class_name", "optimizer class") if format_name == FORMAT else ("kind", "kind")
    if not isinstance(config, dict) or key not in config:
        _fail(path, f"its metadata is corrupt (the config names no {what})")
    if keys != {str(i) for i in range(len(entries))}:
        _fail(path, f"it lists {len(entries)} variables but holds arrays {sorted(keys)}")
    arrays = [raw[str(i)] for i in range(len(entries))]
    for i, (entry, array) in enumerate(zip(entries, arrays)):
        if (
            tuple(array.shape) != entry["shape"]
            or array.dtype.name != entry["dtype"]
            or (_digest(np.asarray(array, order="C")) != entry["sha256"])
        ):
            _fail(
                path,
                f"variable {i} ({entry['path']!r}) is corrupt: its bytes do not match "
                "the shape, dtype and SHA-256 digest recorded when it was saved",
            )
    return _Checkpoint(path, config, entries, arrays)


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
        _fail(path, f"it holds the state of a {theirs}, not of this {ours}")
    variables = optimizer.variables
    if len(variables) != len(checkpoint.arrays):
        _fail(
            path,
            f"it holds {len(checkpoint.arrays)} optimizer variables but this {ours} "
            f"has {len(variables)}; it was saved with other settings or for another "
            "model",
        )
    for i, (variable, entry, array) in enumerate(
        zip(variables, checkpoint.entries, checkpoint.arrays)
    ):
        if tuple(variable.shape) != tuple(array.shape):
            _fail(
                path,
                f"variable {i} ({entry['path']!r}) has shape {tuple(array.shape)} but "
                f"this optimizer's ({variable.path!r}) has shape {variable.shape}",
            )
        if validation.dtype_kind(array.dtype.name) != validation.dtype_kind(variable.dtype):
            _fail(
                path,
                f"variable {i} ({entry['path']!r}) holds {array.dtype.name} values "
                f"but this optimizer's ({variable.path!r}) is {variable.dtype}",
            )
    for variable, array in zip(variables, checkpoint.arrays):
        variable.assign(array)
