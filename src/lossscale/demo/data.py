"""The demo's data: scikit-learn's 8x8 digits (shipped in its wheel), pixels / 16."""

import dataclasses

import numpy as np

TRAIN_SIZE = 1437
NUM_PIXELS = 64
NUM_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class Digits:
    """Train and test arrays (float32 images of 64 pixels, int64 labels)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits(seed):
    """Loads the digits and splits them with a permutation seeded by `seed`, as `Digits`."""
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


def initial_weights(seed, hidden_units):
    """He-normal weights and zero biases, float32: `[w1, b1, w2, b2]`, for every backend."""
    rng = np.random.default_rng([seed, 2])
    w1 = rng.normal(0.0, np.sqrt(2.0 / NUM_PIXELS), (NUM_PIXELS, hidden_units))
    w2 = rng.normal(0.0, np.sqrt(1.0 / hidden_units), (hidden_units, NUM_CLASSES))
    return [
        w1.astype(np.float32),
        np.zeros(hidden_units, np.float32),
        w2.astype(np.float32),
        np.zeros(NUM_CLASSES, np.float32),
    ]
