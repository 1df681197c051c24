"""`lossscale.saving`: safetensors checkpoints, across backends, and every bad file."""

import hashlib
import json
import os
import struct

import numpy as np
import pytest

import lossscale as ls
from lossscale import saving
from lossscale.optimizers import SGD, Adam, LossScaleOptimizer
from tests.conftest import Backend

SHAPES = [(5, 3), (3,), (3, 2)]

pytestmark = pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")


def make(backend, init, **kwargs):
    variables = [ls.Variable(backend.array(x), name=f"w{i}") for i, x in enumerate(init)]
    kwargs = {"initial_scale": 64.0, "dynamic_growth_steps": 2, **kwargs}
    inner = kwargs.pop("inner", None) or Adam(0.01, amsgrad=True)
    return variables, LossScaleOptimizer(inner, **kwargs)


def steps(rng, count, scale_of):
    """`count` lists of gradients (float32 NumPy), every third one overflowing."""
    out = []
    for i in range(count):
        grads = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
        if i % 3 == 2:
            grads[i % len(SHAPES)].flat[0] = np.inf if i % 2 else np.nan
        out.append(grads)
    return out


def trained(backend, rng, count=5, **kwargs):
    init = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    variables, opt = make(backend, init, **kwargs)
    for grads in steps(rng, count, None):
        scale = np.float32(float(opt.dynamic_scale))
        opt.apply([backend.array(g * scale) for g in grads], variables)
    return variables, opt


def state(backend, opt):
    return [backend.numpy(v).copy() for v in opt.variables]


def test_round_trip_on_each_backend(backend, rng, tmp_path):
    variables, opt = trained(backend, rng, telemetry=True, max_consecutive_skips=4)
    path = tmp_path / "opt.safetensors"
    saving.save(opt, path)
    twins = [ls.Variable(backend.array(backend.numpy(v)), name=v.name) for v in variables]
    clone = saving.load(path, twins)
    assert type(clone) is LossScaleOptimizer and clone.policy == opt.policy
    assert clone.get_config() == opt.get_config()
    for a, b in zip(opt.variables, clone.variables):
        np.testing.assert_array_equal(backend.numpy(b), backend.numpy(a))
        assert a.path == b.path
    assert clone.summary() == opt.summary()
    fresh = make(
        backend, [backend.numpy(v) for v in variables], telemetry=True, max_consecutive_skips=4
    )[1]
    fresh.build(twins)
    saving.restore(fresh, str(path))
    for a, b in zip(opt.variables, fresh.variables):
        np.testing.assert_array_equal(backend.numpy(b), backend.numpy(a))


@pytest.mark.parametrize(
    "source, target",
    [("torch", "numpy"), ("torch", "jax"), ("jax", "torch"), ("numpy", "jax")]
    # TensorFlow to and from each of the other three.
    + [("tensorflow", other) for other in ("numpy", "torch", "jax")]
    + [(other, "tensorflow") for other in ("numpy", "torch", "jax")],
)
def test_resume_on_another_backend_continues_the_trajectory(source, target, tmp_path):
    source, target = Backend(source), Backend(target)
    rng = np.random.default_rng(7)
    init = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    schedule = steps(rng, 12, None)
    variables, opt = make(source, init, telemetry=True, hysteresis=2)
    resumed = None
    for i, grads in enumerate(schedule):
        if i == 6:
            path = tmp_path / "mid.safetensors"
            saving.save(opt, path)
            twins = [ls.Variable(target.array(source.numpy(v)), name=v.name) for v in variables]
            resumed = saving.load(path, twins)
        scale = np.float32(float(opt.dynamic_scale))
        opt.apply([source.array(g * scale) for g in grads], variables)
        if resumed is not None:
            resumed.apply([target.array(g * scale) for g in grads], twins)
            assert float(resumed.dynamic_scale) == float(opt.dynamic_scale)
    for a, b in zip(variables + opt.variables, twins + resumed.variables):
        np.testing.assert_allclose(target.numpy(b), source.numpy(a), rtol=1e-5, atol=1e-7)
    assert resumed.summary() == opt.summary()
    assert int(resumed.iterations) == int(opt.iterations) == 8


def test_file_layout_is_plain_safetensors(rng, tmp_path):
    from safetensors import safe_open

    backend = Backend("numpy")
    _, opt = trained(backend, rng)
    path = tmp_path / "opt.safetensors"
    saving.save(opt, path)
    with safe_open(str(path), framework="np") as f:
        metadata = f.metadata()
        assert sorted(f.keys(), key=int) == [str(i) for i in range(len(opt.variables))]
        np.testing.assert_array_equal(f.get_tensor("1"), backend.numpy(opt.dynamic_scale))
    assert metadata["format"] == "lossscale.optimizer" and metadata["format_version"] == "1"
    assert json.loads(metadata["config"]) == json.loads(json.dumps(ls.optimizers.serialize(opt)))
    entries = json.loads(metadata["variables"])
    assert [e["path"] for e in entries] == [v.path for v in opt.variables]
    assert entries[0]["dtype"] == "int32" and entries[1]["shape"] == []
    assert not list(tmp_path.glob("*.tmp-*"))


# --- every bad file: a clear error naming the path, and nothing changed -------


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_metadata(path, **changes):
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    header["__metadata__"].update(changes)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def other_count(tmp_path, backend, rng):
    _, other = trained(backend, rng, count=1, telemetry=True)
    saving.save(other, tmp_path / "other.safetensors")
    return tmp_path / "other.safetensors"


def other_class(tmp_path, backend, rng):
    _, other = trained(backend, rng, count=1, inner=SGD(0.1, momentum=0.5))
    saving.save(other, tmp_path / "other.safetensors")
    return tmp_path / "other.safetensors"


def other_shapes(tmp_path, backend, rng):
    variables = [
        ls.Variable(np.ones((4, 3), np.float32)),
        ls.Variable(np.ones(3, np.float32)),
        ls.Variable(np.ones((3, 2), np.float32)),
    ]
    other = LossScaleOptimizer(Adam(0.01, amsgrad=True), initial_scale=64.0, dynamic_growth_steps=2)
    other.build(variables)
    saving.save(other, tmp_path / "other.safetensors")
    return tmp_path / "other.safetensors"


def not_ours(tmp_path, backend, rng):
    from safetensors.numpy import save_file

    save_file({"weight": np.ones(3, np.float32)}, str(tmp_path / "model.safetensors"))
    return tmp_path / "model.safetensors"


def float_counters(path):
    """Rewrites a valid file with its integer counters stored as floats (digests updated)."""
    from safetensors.numpy import load_file, save_file

    arrays = load_file(str(path))
    data = path.read_bytes()
    header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])["__metadata__"]
    entries = json.loads(header["variables"])
    for entry in entries:
        key = str(entries.index(entry))
        if arrays[key].dtype.kind == "i":
            arrays[key] = np.asarray(arrays[key].astype(np.float32) + np.float32(0.7))
            entry["dtype"] = "float32"
            entry["sha256"] = hashlib.sha256(arrays[key].tobytes()).hexdigest()
    header["variables"] = json.dumps(entries)
    save_file(arrays, str(path), metadata=header)


def written(tmp_path, opt, damage):
    path = tmp_path / "opt.safetensors"
    saving.save(opt, path)
    damage(path)
    return path


BAD_FILES = {
    "missing": (lambda tmp, opt, b, r: tmp / "nope.safetensors", r"no such file"),
    "directory": (lambda tmp, opt, b, r: tmp, r"not a regular file"),
    "empty": (
        lambda tmp, opt, b, r: written(tmp, opt, lambda p: p.write_bytes(b"")),
        r"not a readable safetensors file \(truncated or corrupt\)",
    ),
    "truncated": (
        lambda tmp, opt, b, r: written(tmp, opt, lambda p: p.write_bytes(p.read_bytes()[:-5])),
        r"not a readable safetensors file \(truncated or corrupt\): .*(?i:incomplete)",
    ),
    "header cut": (
        lambda tmp, opt, b, r: written(tmp, opt, lambda p: p.write_bytes(p.read_bytes()[:40])),
        r"not a readable safetensors file",
    ),
    "garbage": (
        lambda tmp, opt, b, r: written(tmp, opt, lambda p: p.write_bytes(os.urandom(300))),
        r"not a readable safetensors file",
    ),
    "flipped byte": (
        lambda tmp, opt, b, r: written(tmp, opt, flip_last_byte),
        r"variable \d+ \('[^']+'\) is corrupt: its bytes do not "
        r"match the shape, dtype and SHA-256 digest",
    ),
    "not ours": (
        lambda tmp, opt, b, r: not_ours(tmp, b, r),
        r"not a lossscale optimizer checkpoint \(metadata 'format' is None",
    ),
    "future version": (
        lambda tmp, opt, b, r: written(tmp, opt, lambda p: edit_metadata(p, format_version="2")),
        r"format version '2' is not supported \(this lossscale reads version 1\)",
    ),
    "bad config json": (
        lambda tmp, opt, b, r: written(tmp, opt, lambda p: edit_metadata(p, config="{not json")),
        r"its metadata is corrupt \(JSONDecodeError",
    ),
    "bad variable list": (
        lambda tmp, opt, b, r: written(tmp, opt, lambda p: edit_metadata(p, variables="[1, 2]")),
        r"its metadata is corrupt \(TypeError",
    ),
    "float counters": (
        lambda tmp, opt, b, r: written(tmp, opt, float_counters),
        r"variable 0 \('loss_scale_optimizer/step_counter'\) holds float32 values but this "
        r"optimizer's \('loss_scale_optimizer/step_counter'\) is int32",
    ),
    "other optimizer class": (
        lambda tmp, opt, b, r: other_class(tmp, b, r),
        r"holds the state of a LossScaleOptimizer\(SGD\), not of this "
        r"LossScaleOptimizer\(Adam\)",
    ),
    "other count": (
        lambda tmp, opt, b, r: other_count(tmp, b, r),
        r"holds \d+ optimizer variables but this LossScaleOptimizer\(Adam\) has 1\d; "
        r"it was saved with other settings or for another model",
    ),
    "other shapes": (
        lambda tmp, opt, b, r: other_shapes(tmp, b, r),
        r"variable 4 \('adam/variable_momentum'\) has shape \(4, 3\) but this "
        r"optimizer's \('adam/\w+_momentum'\) has shape \(5, 3\)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_raises_and_changes_nothing(case, backend, rng, tmp_path):
    make_path, message = BAD_FILES[case]
    variables, opt = trained(backend, rng, count=4)
    path = make_path(tmp_path, opt, backend, rng)
    before = state(backend, opt)
    model_before = [backend.numpy(v).copy() for v in variables]
    with pytest.raises(saving.CheckpointError, match=message) as info:
        saving.restore(opt, path)
    assert str(info.value).startswith(f"Checkpoint {str(path)!r}: ")
    for b, a in zip(before, state(backend, opt)):
        np.testing.assert_array_equal(a, b)
    # `load` builds whatever optimizer the file describes, so only a damaged
    # file, or one for other model shapes, stops it.
    if case not in ("other count", "other optimizer class"):
        with pytest.raises(saving.CheckpointError, match=message):
            saving.load(path, [ls.Variable(backend.array(x)) for x in model_before])
    for b, v in zip(model_before, variables):
        np.testing.assert_array_equal(backend.numpy(v), b)


def test_load_never_imports_what_the_config_names(rng, tmp_path):
    _, opt = trained(Backend("numpy"), rng, count=1)
    path = tmp_path / "opt.safetensors"
    saving.save(opt, path)
    config = json.loads(json.dumps(ls.optimizers.serialize(opt)))
    config.update(module="os", class_name="system")
    edit_metadata(path, config=json.dumps(config))
    with pytest.raises(
        saving.CheckpointError,
        match=r"its config does not rebuild an optimizer: "
        r"Unknown class_name 'system'",
    ):
        saving.load(path, [ls.Variable(np.ones(s, np.float32)) for s in SHAPES])


def test_custom_objects(rng, tmp_path):
    class MyAdam(Adam):
        pass

    variables = [ls.Variable(np.ones(s, np.float32)) for s in SHAPES]
    opt = LossScaleOptimizer(MyAdam(0.01))
    opt.apply([np.ones(s, np.float32) for s in SHAPES], variables)
    saving.save(opt, tmp_path / "opt.safetensors")
    clone = saving.load(tmp_path / "opt.safetensors", variables, custom_objects={"MyAdam": MyAdam})
    assert type(clone.inner_optimizer) is MyAdam and int(clone.iterations) == 1


def test_plain_optimizer_and_failed_save_keeps_the_old_file(rng, tmp_path):
    variables = [ls.Variable(np.ones(s, np.float32)) for s in SHAPES]
    opt = SGD(0.1, momentum=0.9)
    opt.apply([np.ones(s, np.float32) for s in SHAPES], variables)
    path = tmp_path / "opt.safetensors"
    saving.save(opt, path)
    original = path.read_bytes()
    callable_lr = SGD(lambda: 0.1)
    callable_lr.build(variables)
    with pytest.raises(
        ValueError,
        match=r"The config of SGD cannot be written as JSON .*a "
        r"callable learning rate, for one, cannot be saved",
    ):
        saving.save(callable_lr, path)
    assert path.read_bytes() == original
    clone = saving.load(path, variables)
    assert type(clone) is SGD and int(clone.iterations) == 1


def test_usage_errors(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"`optimizer` must be a lossscale.optimizers.Optimizer, or a lossscale.pytree "
        r"transform or an optax transformation passed with its `state=`. "
        r"Received: optimizer='adam'",
    ):
        saving.save("adam", tmp_path / "x")
    with pytest.raises(ValueError, match=r"`optimizer` must be built before saving"):
        saving.save(Adam(), tmp_path / "x")
    with pytest.raises(
        ValueError,
        match=r"`optimizer` must be built before `restore`.*use "
        r"`lossscale.saving.load\(path, trainable_variables\)`",
    ):
        saving.restore(Adam(), tmp_path / "x")
    assert not list(tmp_path.iterdir())


def test_values_cast_within_their_kind(rng, tmp_path):
    """float64 state restores into float32 state, int64 counters into int32 ones."""
    init = [rng.normal(size=s) for s in SHAPES]
    variables = [ls.Variable(x.copy(), name=f"w{i}") for i, x in enumerate(init)]  # float64
    _, opt = make(Backend("numpy"), init)
    for grads in steps(rng, 4, None):
        opt.apply([g.astype(np.float64) * float(opt.dynamic_scale) for g in grads], variables)
    opt.step_counter.rebind(np.asarray(opt.step_counter.numpy(), np.int64))  # as if saved wide
    path = tmp_path / "wide.safetensors"
    saving.save(opt, path)
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        saved = {e["dtype"] for e in json.loads(f.metadata()["variables"])}
    assert {"float64", "int64"} <= saved
    narrow_vars, narrow = make(Backend("numpy"), [x.astype(np.float32) for x in init])
    narrow.build(narrow_vars)
    saving.restore(narrow, path)
    for wide, cast in zip(opt.variables, narrow.variables):
        assert cast.dtype in ("float32", "int32", "bool")
        np.testing.assert_array_equal(cast.numpy(), wide.numpy().astype(cast.dtype))


def test_save_syncs_the_file_before_the_rename_and_the_directory_after(rng, tmp_path, monkeypatch):
    variables, opt = trained(Backend("numpy"), rng, count=2)
    path = tmp_path / "opt.safetensors"
    path.write_bytes(b"the previous checkpoint")
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        # The temporary file's bytes are complete when it is synced.
        size = os.fstat(fd).st_size if os.path.isfile(target) else None
        events.append(("fsync", target, size))
        real_fsync(fd)

    def replace(source, destination):
        events.append(("replace", str(source), str(destination)))
        real_replace(source, destination)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    saving.save(opt, path)
    kinds = [e[0] for e in events]
    assert kinds == ["fsync", "replace", "fsync"], events
    temporary = events[1][1]
    assert events[0][1] == temporary and events[0][2] == path.stat().st_size  # whole file
    assert events[1][2] == str(path)
    assert events[2][1] == str(tmp_path) and events[2][2] is None  # the directory
    assert not os.path.exists(temporary)
    assert int(saving.load(path, [v.numpy() for v in variables]).iterations) == 2
