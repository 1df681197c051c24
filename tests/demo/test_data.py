"""The demo's data: the digits split, the batch order, the initial weights."""

import re

import numpy as np
import pytest

from lossscale.demo import data as digits


@pytest.fixture(scope="module")
def data():
    return digits.load_digits(0)


def test_split(data):
    assert data.x_train.shape == (1437, 64) and data.x_test.shape == (360, 64)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    assert 0.0 <= data.x_train.min() and data.x_train.max() == 1.0
    assert set(np.unique(data.y_test)) == set(range(10))
    train_rows = {row.tobytes() for row in data.x_train}
    # The digits hold a few duplicate images, which may land on both sides.
    assert sum(row.tobytes() in train_rows for row in data.x_test) < 5


def test_split_follows_the_seed(data):
    again, other = digits.load_digits(0), digits.load_digits(1)
    np.testing.assert_array_equal(again.x_train, data.x_train)
    assert not np.array_equal(other.y_train, data.y_train)


def test_batch_indices():
    batches = digits.batch_indices(10, 3, 7, seed=0)
    assert batches.shape == (7, 3)
    for batch in batches:
        assert len(set(batch)) == 3
    # One epoch (3 batches of 3 of the 10 examples) never repeats an example.
    assert len(set(batches[:3].ravel())) == 9
    np.testing.assert_array_equal(batches, digits.batch_indices(10, 3, 7, seed=0))
    assert not np.array_equal(batches, digits.batch_indices(10, 3, 7, seed=1))


def test_batch_indices_rejects_a_batch_larger_than_the_data():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`batch_size` must be an integer from 1 to 10 (the number of training examples). "
            "Received: batch_size=11"
        ),
    ):
        digits.batch_indices(10, 11, 5, seed=0)


def test_initial_weights():
    w1, b1, w2, b2 = digits.initial_weights(3, 16)
    assert [w.shape for w in (w1, b1, w2, b2)] == [(64, 16), (16,), (16, 10), (10,)]
    assert all(w.dtype == np.float32 for w in (w1, b1, w2, b2))
    assert not b1.any() and not b2.any()
    assert w1.std() == pytest.approx(np.sqrt(2 / 64), rel=0.1)
    np.testing.assert_array_equal(w1, digits.initial_weights(3, 16)[0])
