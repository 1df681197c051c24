"""`ParameterRanges`: the last float16-range measurement per parameter, kept as vectors.

Checked against a dict of per-name values kept in float64 (the rule the
vectors stand for: a parameter takes its newest measurement and keeps it
while it is not measured; one never measured reads 0.0), through random
sequences of measurements over 120 parameters, each naming a random subset
in a random order, and the first measurement, the same names again, and a
measurement of new names only.
"""

import numpy as np
import pytest
import torch

from lossscale.mixed_precision import diagnostics
from lossscale.torch.scaler_ranges import ParameterRanges

PARAMETERS = [f"layer{i // 4}.w{i % 4}" for i in range(120)]


def measurement(rng, names):
    """Four float32 vectors over `names`: shares, and peaks with an inf and a NaN at times."""
    columns = [rng.random(len(names)).astype(np.float32) for _ in range(3)]
    peak = (rng.random(len(names)) * 6e4).astype(np.float32)
    if len(names) > 2:
        peak[rng.integers(len(names))] = np.inf
        peak[rng.integers(len(names))] = np.nan
    columns.append(peak)
    return tuple(torch.from_numpy(c) for c in columns)


def read(ranges, names):
    return {f: v.numpy() for f, v in ranges.values(names).items()}


def test_random_measurements_keep_each_parameters_newest_values():
    rng = np.random.default_rng(11)
    ranges, want = ParameterRanges(), {}
    for _ in range(40):
        size = int(rng.integers(1, len(PARAMETERS) + 1))
        names = list(rng.choice(PARAMETERS, size=size, replace=False))
        columns = measurement(rng, names)
        ranges.record(names, columns, torch.device("cpu"))
        for i, name in enumerate(names):
            want[name] = [float(c[i]) for c in columns]
        assert set(ranges.names) == set(want)
        asked = PARAMETERS + ["never"]
        got = read(ranges, asked)
        for k, field in enumerate(diagnostics.FIELDS):
            expected = np.array([want.get(n, [0.0] * 4)[k] for n in asked])
            np.testing.assert_array_equal(got[field], expected)
            assert got[field].dtype == np.float64


def test_the_same_names_again_replace_the_vectors_without_a_copy():
    rng = np.random.default_rng(3)
    ranges = ParameterRanges()
    first = measurement(rng, PARAMETERS)
    ranges.record(PARAMETERS, first, torch.device("cpu"))
    second = measurement(rng, PARAMETERS)
    ranges.record(list(PARAMETERS), second, torch.device("cpu"))
    assert ranges.names == PARAMETERS
    for field, column in zip(diagnostics.FIELDS, second):
        assert ranges.columns[field] is column  # kept as measured: no operation


def test_new_names_are_appended_after_the_known_ones():
    rng = np.random.default_rng(5)
    ranges = ParameterRanges()
    first, second = PARAMETERS[:70], PARAMETERS[70:]
    a, b = measurement(rng, first), measurement(rng, second)
    ranges.record(first, a, torch.device("cpu"))
    ranges.record(second, b, torch.device("cpu"))
    assert ranges.names == PARAMETERS
    for field, x, y in zip(diagnostics.FIELDS, a, b):
        np.testing.assert_array_equal(ranges.columns[field].numpy(), np.concatenate([x, y]))


@pytest.mark.parametrize("names", [[], ["a", "b"]])
def test_before_any_measurement_every_value_is_zero(names):
    got = read(ParameterRanges(), names)
    assert set(got) == set(diagnostics.FIELDS)
    for column in got.values():
        np.testing.assert_array_equal(column, np.zeros(len(names)))
