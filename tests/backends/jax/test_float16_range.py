"""backends/jax/float16_range.py: many gradients' float16 range, bit for bit `measure`'s."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lossscale.backends import jax as jax_ops
from lossscale.backends.jax import float16_range
from lossscale.bench import workloads
from lossscale.mixed_precision import diagnostics
from tests.float16_range_cases import EDGES, SUBNORMAL, gradient_values

# The old packing threshold (2^17 elements): sizes around it stay covered.
PACK_UP_TO = 1 << 17
TINY = np.finfo(np.float32).tiny


def _gradient(rng, shape, dtype, growth_factor):
    """Random magnitudes across float16's range, every class present, at random places."""
    values = gradient_values(rng, int(np.prod(shape)), growth_factor)
    return jnp.asarray(values.astype(np.float32)).astype(dtype).reshape(shape)


def _assert_as_measure(grads, growth_factor, jit=False):
    def run(grads):
        return float16_range.measure(grads, SUBNORMAL, diagnostics.near_max_limit(growth_factor))

    out = jax.jit(run)(grads) if jit else run(grads)
    for column in out:
        assert column.dtype == jnp.float32 and column.shape == (len(grads),)
    for i, g in enumerate(grads):
        expected = diagnostics.measure(jax_ops, g, growth_factor)
        for key, got, want in zip(diagnostics.KEYS, (col[i] for col in out), expected):
            got, want = np.asarray(got), np.asarray(want)
            if key == "max_abs" and want < TINY and got < TINY:
                # XLA on CPU flushes float32 subnormals to zero in some
                # reductions and not in others: `measure`'s own peak of a
                # subnormal is 0 or the subnormal by the array's shape.
                continue
            assert got == want or (np.isnan(got) and np.isnan(want)), (i, key, got, want)


# Every dtype, and each growth factor (the near-maximum limit), not their
# whole product: each case measures a whole transformer's gradients.
@pytest.mark.parametrize(
    "dtype, growth_factor", [(jnp.float32, 3.0), (jnp.float16, 2.0), (jnp.bfloat16, 3.0)]
)
def test_tiny_gradients_match_measure(dtype, growth_factor):
    rng = np.random.default_rng(0)
    grads = [_gradient(rng, s, dtype, growth_factor) for s in workloads.TRANSFORMER]
    _assert_as_measure(grads, growth_factor)


def test_under_jit_the_same_values():
    rng = np.random.default_rng(1)
    grads = [_gradient(rng, s, jnp.float32, 2.0) for s in workloads.TRANSFORMER]
    _assert_as_measure(grads, 2.0, jit=True)


@pytest.mark.parametrize(
    "sizes",
    [
        [PACK_UP_TO - 1, PACK_UP_TO, PACK_UP_TO + 1, 7],  # both sides of the packing threshold
        [PACK_UP_TO + 1, 3, PACK_UP_TO + 2],  # one small one between large ones: alone
        [1, 1],
        [5],
        [2 * PACK_UP_TO + 5, 2, 9],
    ],
)
def test_sizes_on_both_sides_of_the_packing_threshold_match_measure(sizes):
    rng = np.random.default_rng(len(sizes))
    dtypes = [jnp.float32, jnp.float16, jnp.bfloat16]
    grads = [_gradient(rng, (n,), dtypes[i % 3], 2.0) for i, n in enumerate(sizes)]
    _assert_as_measure(grads, 2.0)


def test_many_sizes_in_one_measurement():
    sizes = [100, 199, 1, 150, 1]
    rng = np.random.default_rng(3)
    grads = [_gradient(rng, (n,), jnp.float32, 2.0) for n in sizes]
    _assert_as_measure(grads, 2.0)


def test_a_gradient_of_one_value_everywhere():
    for value in EDGES + [1.0, 65504.0, -7e4]:
        grads = [jnp.full((33, 3), value), jnp.full((65,), value).astype(jnp.float16)]
        _assert_as_measure(grads, 2.0)
        _assert_as_measure(grads[:1], 2.0)  # alone


def test_inf_and_nan_together_give_nan_as_max_abs():
    grads = [jnp.asarray([1.0, np.nan, np.inf, 2.0]), jnp.asarray([np.inf, 3.0])]
    _assert_as_measure(grads, 2.0)
    assert np.isnan(float16_range.measure(grads, SUBNORMAL, 1e4)[3][0])
    assert float16_range.measure(grads, SUBNORMAL, 1e4)[3][1] == np.inf


def test_no_gradients_are_left_to_measure():
    assert float16_range.measure([], SUBNORMAL, 1.0) is None


def test_the_number_of_operations_does_not_grow_with_the_gradients():
    # XLA on CPU pays for each operation of a conditional branch on every
    # step, taken or not: the measurement must stay a few operations.
    def count(n):
        # Whole rows: a gradient of another size adds one operation (its padding).
        grads = [jnp.zeros((i + 1, float16_range.ROW), jnp.float32) for i in range(n)]

        def run(grads):
            return float16_range.measure(grads, SUBNORMAL, 1e4)

        text = jax.jit(run).lower(grads).compile().as_text()
        entry = text[text.index("ENTRY") :].splitlines()[1:]
        # A bitcast (a reshape of a parameter) is a view: no work.
        return sum(" parameter(" not in line and " bitcast(" not in line for line in entry)

    assert count(40) == count(10)


def test_rows_of_padding_and_a_gradient_shorter_than_a_row():
    row = float16_range.ROW
    rng = np.random.default_rng(4)
    sizes = [1, row - 1, row, row + 1, 3 * row, 2]
    grads = [_gradient(rng, (n,), jnp.float32, 2.0) for n in sizes]
    _assert_as_measure(grads, 2.0)
    _assert_as_measure([jnp.zeros((row + 1,))], 2.0)  # padding is not counted as zero


# Past `PACK_CAPACITY` packed elements a gradient is measured alone, in
# place: on both sides of that capacity (made small here), with every
# class at random places, and a NaN or an inf at an alone gradient's ends.
@pytest.mark.parametrize(
    "sizes, alone",
    [
        ([100, 156], []),  # exactly the capacity: packed
        ([100, 157], [1]),  # one element past it
        ([257, 3, 9], [0]),  # a first gradient alone, back into order
        ([300, (20, 17)], [0, 1]),  # every gradient alone, one of two dimensions
        ([254, 1, 1, 2, 64], [3, 4]),  # small ones alone once the capacity is full
        ([200, 100, 50], [1]),  # a later one that fits is packed
    ],
)
def test_sizes_on_both_sides_of_the_packing_capacity_match_measure(monkeypatch, sizes, alone):
    monkeypatch.setattr(float16_range, "PACK_CAPACITY", 256)
    rng = np.random.default_rng(len(sizes))
    dtypes = [jnp.float32, jnp.float16, jnp.bfloat16]
    shapes = [s if isinstance(s, tuple) else (s,) for s in sizes]
    grads = [_gradient(rng, s, dtypes[i % 3], 2.0) for i, s in enumerate(shapes)]
    assert float16_range._split(grads)[1] == alone
    _assert_as_measure(grads, 2.0, jit=True)
    # Each alone gradient with a NaN first, then an inf last (its ends).
    for place, value in ((0, np.nan), (-1, np.inf)):
        bad = [
            g.ravel().at[place].set(value).reshape(g.shape) if i in alone else g
            for i, g in enumerate(grads)
        ]
        _assert_as_measure(bad, 2.0, jit=True)
    _assert_as_measure(bad, 2.0)  # eager too


def _gpt2(layers, width=768, vocabulary=50257, context=1024):
    """The parameter shapes of a GPT-2 of `layers` blocks (12: GPT-2 small, 124M parameters)."""
    block = [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,)]
    block += [(width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,)]
    return [(vocabulary, width), (context, width), *block * layers, (width,), (width,)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_memory_a_jitted_measurement_reserves_does_not_grow_with_the_model(dtype):
    """XLA reserves a branch's working memory on every step: it must not be a copy of every gradient.

    Compiled only, on abstract gradients: GPT-2's embeddings with two
    blocks (53M parameters, whose float32 copy is 204 MiB) and with four
    (67M) each reserve at most two float32 copies of the packed elements
    (the half-precision ones' casts, then the packed matrix) and the rows'
    counts; each gradient measured alone adds a few KiB (its reduction's
    partial results), not its size. (GPT-2 small's 12 blocks: 512 MiB
    when every gradient was packed, 15.9 MiB now.)
    """

    def reserved(shapes):
        grads = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
        run = jax.jit(lambda grads: float16_range.measure(grads, SUBNORMAL, 1e4))
        return run.lower(grads).compile().memory_analysis().temp_size_in_bytes

    small, twice = reserved(_gpt2(2)), reserved(_gpt2(4))
    bound = 4 * float16_range.PACK_CAPACITY * (1 if dtype == jnp.float32 else 2) * 1.2
    assert small <= twice <= bound, (small, twice, bound)
    assert (twice - small) / (len(_gpt2(4)) - len(_gpt2(2))) < 8 * 1024


def test_at_the_real_capacity_the_next_gradient_is_measured_alone():
    """The pack full at exactly `PACK_CAPACITY` (4M) elements: the next one alone, a NaN at its end."""
    rng = np.random.default_rng(9)
    capacity = float16_range.PACK_CAPACITY
    grads = [_gradient(rng, (capacity // 2,), jnp.float32, 2.0) for _ in range(2)]
    grads.append(_gradient(rng, (3, 5), jnp.float32, 2.0).at[2, 4].set(np.nan))
    assert float16_range._split(grads) == ([0, 1], [2])
    _assert_as_measure(grads, 2.0, jit=True)
