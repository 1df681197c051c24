"""Gradients that exercise every class of the float16-range measurement (not a test module).

Shared by the backends' packed kernels' tests (tests/backends/*/test_float16_range.py),
which compare them bit for bit with `diagnostics.measure`.
"""

import numpy as np

from lossscale.mixed_precision import diagnostics

SUBNORMAL = diagnostics.FLOAT16_SMALLEST_NORMAL
# The edges of every class, as float32 and from either side.
EDGES = [
    0.0,
    -0.0,
    float(np.nextafter(np.float32(0), 1)),
    float(np.nextafter(np.float32(SUBNORMAL), 0)),
    SUBNORMAL,
    float("inf"),
    -float("inf"),
    float("nan"),
]


def gradient_values(rng, n, growth_factor):
    """`n` float64 values across float16's range, every class present, at random places."""
    near = diagnostics.near_max_limit(growth_factor)
    values = rng.choice([1e-9, 1e-6, 3e-5, 1.0, 2e3, near, 6e4], n) * rng.uniform(0.5, 1.5, n)
    values *= rng.choice([-1.0, 1.0], n)
    edges = EDGES + [float(np.nextafter(np.float32(near), 0)), float(np.float32(near))]
    # The edge values at both ends and at random positions.
    for edge in edges:
        if rng.random() < 0.6:
            values[rng.integers(n)] = edge
    values[0], values[-1] = rng.choice(edges, 2)
    return values
