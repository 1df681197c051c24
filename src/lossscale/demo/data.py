"""The demo's data: scikit-learn's 8x8 handwritten digits.

The 1,797 images ship inside the scikit-learn wheel, so nothing is
downloaded. Pixels (0..16) are divided by 16; 1,437 images train and 360
test, split by the seed.
"""

import dataclasses

import numpy as np

TRAIN_SIZE = 1437
NUM_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class Digits:
    """Train and test arrays (float32 images of 64 pixels, int64 labels)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits(seed):
    """Loads and splits the digits with a seeded permutation.

    Args:
        seed: Int >= 0.

    Returns:
        A `Digits`.
    """
    from sklearn.datasets import load_digits as sklearn_digits

    images, labels = sklearn_digits(return_X_y=True)
    images = (images / 16.0).astype(np.float32)
    labels = labels.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(images))
    train, test = order[:TRAIN_SIZE], order[TRAIN_SIZE:]
    return Digits(images[train], labels[train], images[test], labels[test])


def batch_indices(num_examples, batch_size, steps, seed):
    """Returns a `(steps, batch_size)` array of example indices.

    Each epoch is a fresh seeded permutation; batches never straddle two
    epochs, so every batch holds distinct examples.
    """
    if not 1 <= batch_size <= num_examples:
        raise ValueError(
            f"`batch_size` must be an integer from 1 to {num_examples} (the number of training "
            f"examples). Received: batch_size={batch_size}"
        )
    rng = np.random.default_rng([seed, 1])
    per_epoch = num_examples // batch_size
    epochs = -(-steps // per_epoch)
    batches = [
        rng.permutation(num_examples)[: per_epoch * batch_size].reshape(per_epoch, -1)
        for _ in range(epochs)
    ]
    return np.concatenate(batches)[:steps]


def initial_weights(seed, hidden_units, num_inputs=64):
    """He-normal weights and zero biases, as float32 NumPy arrays.

    Returns:
        `[w1 (inputs, hidden), b1, w2 (hidden, classes), b2]`, the same for
        every backend so that all runs start from one point.
    """
    rng = np.random.default_rng([seed, 2])
    w1 = rng.normal(0.0, np.sqrt(2.0 / num_inputs), (num_inputs, hidden_units))
    w2 = rng.normal(0.0, np.sqrt(1.0 / hidden_units), (hidden_units, NUM_CLASSES))
    return [
        w1.astype(np.float32),
        np.zeros(hidden_units, np.float32),
        w2.astype(np.float32),
        np.zeros(NUM_CLASSES, np.float32),
    ]
