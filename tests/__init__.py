"""lossscale's tests: a package, so that its folders mirror `src/lossscale/` (tests/README.md).

Pytest imports every test module by its full name (`tests.torch.test_adapter`)
with the repository root, not `tests/`, on `sys.path`: a folder named
`torch`, `tensorflow`, `keras` or `optax` here is `tests.torch` and shadows no
framework. Helpers are imported the same way (`from tests import reference`).
"""
