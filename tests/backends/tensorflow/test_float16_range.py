"""backends/tensorflow/float16_range.py: the float16 range a chunk at a time, bit for bit `measure`'s."""

import functools
import re

import numpy as np
import pytest
import tensorflow as tf

from lossscale.backends import tensorflow as tf_ops
from lossscale.backends.tensorflow import float16_range
from lossscale.bench import workloads
from lossscale.mixed_precision import diagnostics
from tests.float16_range_cases import SUBNORMAL, gradient_values

MODES = ["eager", "tf.function", "jit_compile"]


def _gradient(rng, shape, dtype, growth_factor):
    """Random magnitudes across float16's range, every class present, at random places."""
    values = gradient_values(rng, int(np.prod(shape)), growth_factor).astype(np.float32)
    return tf.reshape(tf.cast(tf.constant(values), dtype), shape)


def _compiled(mode, growth_factor):
    """The kernel and `measure` of each gradient, as functions of the gradients run in `mode`.

    Each is traced (and compiled) once per mode, for the gradients' shapes.
    """
    near = diagnostics.near_max_limit(growth_factor)

    def ours(*grads):
        return float16_range.measure(list(grads), SUBNORMAL, near)

    def reference(*grads):
        return [diagnostics.measure(tf_ops, g, growth_factor) for g in grads]

    if mode == "eager":
        return ours, reference
    compile_ = functools.partial(tf.function, jit_compile=mode == "jit_compile")
    return compile_(ours), compile_(reference)


def _assert_as_measure(grads, functions):
    """The kernel's vectors equal `measure` of each gradient, both run the same way."""
    ours, reference = functions
    out, expected = ours(*grads), reference(*grads)
    for column in out:
        assert column.dtype == tf.float32 and column.shape == (len(grads),)
    for i, want_row in enumerate(expected):
        for key, column, want in zip(diagnostics.KEYS, out, want_row):
            got, want = column[i].numpy(), want.numpy()
            assert got == want or (np.isnan(got) and np.isnan(want)), (i, key, got, want)


# Every dtype, mixed in one measurement of a whole transformer's gradients;
# each growth factor (the near-maximum limit) in some mode, not every pair.
@pytest.mark.parametrize(
    "mode, growth_factor", [("eager", 3.0), ("tf.function", 2.0), ("jit_compile", 3.0)]
)
def test_tiny_gradients_match_measure(mode, growth_factor):
    rng = np.random.default_rng(0)
    dtypes = [tf.float32, tf.float16, tf.bfloat16]
    grads = [
        _gradient(rng, s, dtypes[i % 3], growth_factor) for i, s in enumerate(workloads.TRANSFORMER)
    ]
    _assert_as_measure(grads, _compiled(mode, growth_factor))


# A gradient past `CHUNK` elements is read a chunk at a time: on both sides
# of that size (made small here), 1-D and 2-D, every class at random
# places, and a NaN or an inf on each side of a chunk's edge and at the ends.
SIZES = [(255,), (256,), (257,), (512,), (513,), (20, 17), (3, 256), (1000,)]


@pytest.mark.parametrize("mode", MODES)
def test_sizes_on_both_sides_of_the_chunk_match_measure(monkeypatch, mode):
    monkeypatch.setattr(float16_range, "CHUNK", 256)
    rng = np.random.default_rng(3)
    dtypes = [tf.float32, tf.float16, tf.bfloat16]
    grads = [_gradient(rng, s, dtypes[i % 3], 2.0) for i, s in enumerate(SIZES)]
    functions = _compiled(mode, 2.0)
    _assert_as_measure(grads, functions)
    for place, value in ((255, np.nan), (256, np.nan), (255, np.inf), (256, -np.inf), (-1, np.nan)):
        _assert_as_measure([_with(g, place, value) for g in grads], functions)


def _with(grad, place, value):
    """`grad` with `value` at flat index `place` (where it has one)."""
    flat = tf.reshape(grad, [-1]).numpy()
    if place < flat.size:
        flat[place] = value
    return tf.reshape(tf.constant(flat), grad.shape)


def test_a_gradient_of_whole_chunks_only_and_one_of_one_value(monkeypatch):
    monkeypatch.setattr(float16_range, "CHUNK", 256)
    grads = [tf.zeros([4, 256]), tf.fill([1024], 3e-6), tf.fill([600], -70000.0)]
    out = float16_range.measure(grads, SUBNORMAL, diagnostics.near_max_limit(2.0))
    # Rows: the gradients; columns: zero, subnormal, near the maximum.
    np.testing.assert_array_equal(np.stack([c.numpy() for c in out[:3]]).T, np.eye(3))
    np.testing.assert_array_equal(out[3].numpy(), np.float32([0.0, 3e-6, 70000.0]))


def test_no_gradients_are_left_to_measure():
    assert float16_range.measure([], SUBNORMAL, 1e4) is None


def test_at_the_real_chunk_a_nan_past_the_edge_and_an_inf_before_it():
    """A gradient of `CHUNK` (1M) + 1 elements under XLA: an inf last in the chunk, a NaN after it."""
    rng = np.random.default_rng(9)
    size = float16_range.CHUNK + 1
    clean = _gradient(rng, (size,), tf.float32, 2.0)
    functions = _compiled("jit_compile", 2.0)
    _assert_as_measure([clean, clean], functions)
    bad = _with(_with(clean, size - 2, np.inf), size - 1, np.nan)
    _assert_as_measure([bad, clean], functions)


def _largest_array(hlo):
    """The most elements of any array XLA's optimized HLO makes.

    Parameters, views of them (`bitcast`) and a loop's reads of its own
    state (`get-tuple-element`: the gradient it passes through) are left
    out; a copy of a gradient into the loop's state would be a `copy`.
    """
    largest = 0
    for line in hlo.splitlines():
        match = re.match(r"\s*(?:ROOT )?\S+ = (\w+)\[([\d,]*)\]\{[^}]*\} (\S+)\(", line)
        if match is None or match.group(3) in ("parameter", "bitcast", "get-tuple-element"):
            continue
        dims = [int(d) for d in match.group(2).split(",") if d]
        largest = max(largest, int(np.prod(dims)))
    return largest


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16])
def test_under_xla_no_array_larger_than_a_chunk_is_made(dtype):
    """XLA reserves a branch's working memory on every step: it must not grow with the gradients.

    Compiled only: an embedding of GPT-2's shape (38.6M elements), a
    vector of 4M + 3 and a (2048, 2049) matrix. Measured whole, each of
    `measure`'s comparisons was an int32 array of the largest gradient's size.
    """
    specs = [tf.TensorSpec(s, dtype) for s in [(50257, 768), (4 * 2**20 + 3,), (2048, 2049)]]

    @tf.function(jit_compile=True)
    def run(*grads):
        return float16_range.measure(list(grads), SUBNORMAL, 1e4)

    hlo = run.experimental_get_compiler_ir(*specs)(stage="optimized_hlo")
    assert 0 < _largest_array(hlo) <= float16_range.CHUNK


@pytest.mark.parametrize("mode", MODES)
def test_a_sparse_gradient_is_measured_dense_its_repeated_rows_summed(monkeypatch, mode):
    """An embedding's `tf.IndexedSlices`, eager and traced.

    (Keras's embedding gradient in a traced `fit` also loses its static
    shape once made dense: tests/keras/test_fit.py's embedding runs cover that.)
    """
    monkeypatch.setattr(float16_range, "CHUNK", 256)
    rng = np.random.default_rng(4)
    values = _gradient(rng, (6, 16), tf.float32, 2.0)
    near = diagnostics.near_max_limit(2.0)

    table = tf.Variable(tf.zeros([50, 16]))

    def sparse(values):
        # An embedding lookup's gradient, as a model's (its dense shape read
        # from the variable); rows 3 and 7 twice: their sums are measured,
        # as the update applies them.
        with tf.GradientTape() as tape:
            rows = tf.gather(table, tf.constant([3, 7, 3, 0, 7, 40]))
            loss = tf.reduce_sum(rows * values)
        grad = tape.gradient(loss, table)
        assert isinstance(grad, tf.IndexedSlices)
        return grad

    def ours(values):
        return float16_range.measure([sparse(values)], SUBNORMAL, near)

    def reference(values):
        return diagnostics.measure(tf_ops, tf.convert_to_tensor(sparse(values)), 2.0)

    if mode != "eager":
        compile_ = functools.partial(tf.function, jit_compile=mode == "jit_compile")
        ours, reference = compile_(ours), compile_(reference)
    for column, want in zip(ours(values), reference(values)):
        got, want = column[0].numpy(), want.numpy()
        assert got == want or (np.isnan(got) and np.isnan(want))
