"""The checkpoint file format of `lossscale.saving`: written durably, read and verified.

One safetensors file: arrays "0", "1", ... and metadata naming the format, its
version, the config and, per array, its path, shape, dtype and SHA-256 digest.
"""

import hashlib
import json
import os

import numpy as np

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


class CheckpointError(ValueError):
    """A checkpoint file cannot be used: missing, damaged, or for another optimizer."""


def entry(name, array):
    return {
        "path": name,
        "shape": list(array.shape),
        "dtype": array.dtype.name,
        "sha256": _digest(array),
    }


def metadata(format_name, config, entries):
    return {
        "format": format_name,
        "format_version": str(FORMAT_VERSION),
        "config": config if isinstance(config, str) else json.dumps(config),
        "variables": json.dumps(entries),
    }


def write(path, arrays, metadata):
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
    """Renames `temporary` to `path`, syncing the bytes before and the directory after."""
    with open(temporary, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temporary, path)
    if hasattr(os, "O_DIRECTORY"):  # POSIX: a directory can be opened and synced
        directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


class Checkpoint:
    """What `read` found: the config and the arrays, every check passed."""

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


def fail(path, problem):
    raise CheckpointError(f"Checkpoint {path!r}: {problem}")


def read(path, format_name=FORMAT):
    """Reads and checks a whole checkpoint; raises `CheckpointError` on any problem."""
    safetensors = _safetensors()
    if not os.path.isfile(path):
        fail(path, "no such file" if not os.path.exists(path) else "not a regular file")
    try:
        with safetensors.safe_open(path, framework="np") as f:
            metadata = f.metadata() or {}
            keys = set(f.keys())
            raw = {key: f.get_tensor(key) for key in keys}
    except Exception as error:  # the reader's own error types; the file is unusable
        fail(path, f"not a readable safetensors file (truncated or corrupt): {error}")
    found = metadata.get("format")
    if found != format_name:
        fail(
            path,
            f"not a {_FORMAT_NAMES[format_name]} (metadata 'format' is {found!r}, expected "
            f"{format_name!r}){_FORMAT_HINTS.get(found, '')}",
        )
    if metadata.get("format_version") != str(FORMAT_VERSION):
        fail(
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
        fail(path, f"its metadata is corrupt ({type(error).__name__}: {error})")
    key, what = ("class_name", "optimizer class") if format_name == FORMAT else ("kind", "kind")
    if not isinstance(config, dict) or key not in config:
        fail(path, f"its metadata is corrupt (the config names no {what})")
    if keys != {str(i) for i in range(len(entries))}:
        fail(path, f"it lists {len(entries)} variables but holds arrays {sorted(keys)}")
    arrays = [raw[str(i)] for i in range(len(entries))]
    for i, (entry, array) in enumerate(zip(entries, arrays)):
        if (
            tuple(array.shape) != entry["shape"]
            or array.dtype.name != entry["dtype"]
            or (_digest(np.asarray(array, order="C")) != entry["sha256"])
        ):
            fail(
                path,
                f"variable {i} ({entry['path']!r}) is corrupt: its bytes do not match "
                "the shape, dtype and SHA-256 digest recorded when it was saved",
            )
    return Checkpoint(path, config, entries, arrays)
