"""The checkpoint file format: written durably, read back verified."""

import json
import os

import numpy as np
import pytest

from lossscale import checkpoint_files as files
from lossscale import saving


def write(path, arrays, format_name=files.FORMAT):
    entries = [files.entry(f"v{i}", a) for i, a in enumerate(arrays)]
    config = {"class_name": "SGD", "kind": "transform"}
    files.write(path, arrays, files.metadata(format_name, config, entries))


def test_what_is_written_reads_back_exactly(tmp_path):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((3, 2)).astype(np.float32), np.array(7, np.int32)]
    path = tmp_path / "c.safetensors"
    write(path, arrays)
    checkpoint = files.read(os.fspath(path))
    assert [e["path"] for e in checkpoint.entries] == ["v0", "v1"]
    for a, b in zip(arrays, checkpoint.arrays):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert checkpoint.config["class_name"] == "SGD"
    assert os.listdir(tmp_path) == ["c.safetensors"]  # no temporary left behind


def test_a_file_of_the_other_format_names_the_way_to_restore_it(tmp_path):
    path = tmp_path / "state.safetensors"
    write(path, [np.ones(2, np.float32)], files.STATE_FORMAT)
    with pytest.raises(files.CheckpointError, match=r"restore\(tx, path, state=target\)"):
        files.read(os.fspath(path))
    assert files.read(os.fspath(path), files.STATE_FORMAT).arrays[0].tolist() == [1.0, 1.0]


def test_changed_bytes_fail_the_digest(tmp_path):
    path = tmp_path / "c.safetensors"
    write(path, [np.arange(4, dtype=np.float32)])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the array's data
    path.write_bytes(bytes(data))
    with pytest.raises(files.CheckpointError, match="SHA-256"):
        files.read(os.fspath(path))


def test_a_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    write(path, [np.zeros(2, np.float32)])

    def broken_replace(source, target):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write(path, [np.ones(2, np.float32)])
    monkeypatch.undo()
    assert files.read(os.fspath(path)).arrays[0].tolist() == [0.0, 0.0]
    assert os.listdir(tmp_path) == ["c.safetensors"]


def test_saving_raises_the_same_error_class():
    assert saving.CheckpointError is files.CheckpointError
    assert json.loads(files.metadata(files.FORMAT, {"a": 1}, [])["config"]) == {"a": 1}


def test_an_extra_unlisted_array_is_refused(tmp_path):
    # The metadata lists two arrays; the file holds a third ("2"), which no entry
    # describes and no digest covers.
    arrays = [np.arange(3, dtype=np.float32), np.array(5, np.int32)]
    entries = [files.entry(f"v{i}", a) for i, a in enumerate(arrays)]
    path = tmp_path / "c.safetensors"
    files.write(
        path,
        arrays + [np.ones(4, np.float32)],
        files.metadata(files.FORMAT, {"class_name": "SGD"}, entries),
    )
    with pytest.raises(
        files.CheckpointError,
        match=r"it lists 2 variables but holds arrays \['0', '1', '2'\]",
    ):
        files.read(os.fspath(path))


def test_a_missing_listed_array_is_refused(tmp_path):
    arrays = [np.arange(3, dtype=np.float32), np.array(5, np.int32)]
    entries = [files.entry(f"v{i}", a) for i, a in enumerate(arrays)]
    path = tmp_path / "c.safetensors"
    files.write(path, arrays[:1], files.metadata(files.FORMAT, {"class_name": "SGD"}, entries))
    with pytest.raises(
        files.CheckpointError, match=r"it lists 2 variables but holds arrays \['0'\]"
    ):
        files.read(os.fspath(path))


def test_restore_of_a_file_with_an_extra_array_writes_nothing(tmp_path):
    import lossscale as ls

    w = ls.Variable(np.ones(2, np.float32), name="w")
    opt = ls.LossScaleOptimizer(ls.optimizers.SGD(0.1), initial_scale=4.0)
    opt.build([w])
    path = tmp_path / "opt.safetensors"
    saving.save(opt, path)
    checkpoint = files.read(os.fspath(path))
    arrays = [np.asarray(np.asarray(a) * 2) for a in checkpoint.arrays]
    entries = [files.entry(e["path"], a) for e, a in zip(checkpoint.entries, arrays)]
    files.write(
        path,
        arrays + [np.zeros(3, np.float32)],
        files.metadata(files.FORMAT, checkpoint.config, entries),
    )
    with pytest.raises(files.CheckpointError, match="but holds arrays"):
        saving.restore(opt, path)
    assert float(opt.dynamic_scale) == 4.0 and int(opt.step_counter) == 0
