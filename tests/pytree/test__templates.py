"""A transform's built copies of its optimizer: clones, signatures, concrete and abstract builds."""

import numpy as np

from lossscale import optimizers
from lossscale.optimizers import LossScaleOptimizer
from lossscale.pytree import _flatten, _templates


def blueprint():
    return LossScaleOptimizer(optimizers.Adam(0.05), initial_scale=16.0)


def test_clone_copies_the_optimizer_and_shares_only_modules():
    original = optimizers.SGD(np.float32(0.1), momentum=0.9)
    copy = _templates.clone(original)
    assert type(copy) is type(original) and copy is not original
    assert copy.get_config() == original.get_config()
    assert copy.__dict__.keys() == original.__dict__.keys()
    copy.build([np.ones(2, np.float32)])
    assert copy.built and not original.built  # building the copy leaves the blueprint


def test_build_names_the_variables_after_the_paths():
    rng = np.random.default_rng(0)
    leaves = [rng.standard_normal(3).astype(np.float32), rng.standard_normal(2).astype(np.float32)]
    built = _templates.build(blueprint(), leaves, ["dense/bias", ""])
    names = [v.path for v in built.variables]
    assert "adam/dense_bias_momentum" in names and "adam/param_momentum" in names
    assert built.built and built.inner_optimizer.built
    # Built on the leaves themselves: the state starts from their values.
    first_moments = [v for v in built.variables if v.path.endswith("_momentum")]
    assert [v.shape for v in first_moments] == [(3,), (2,)]
    np.testing.assert_array_equal(first_moments[0].numpy(), np.zeros(3, np.float32))


def test_signature_is_the_structure_and_each_leafs_backend_shape_and_dtype():
    import jax.numpy as jnp
    import torch

    def signature(tree):
        leaves, treedef, _ = _flatten.flatten(tree, "params", use_jax=False)
        return _templates.signature(treedef, leaves)

    tree = {"a": np.ones((2, 3), np.float32), "b": [torch.ones(4, dtype=torch.float16)]}
    treedef, described = signature(tree)
    assert described == (("numpy", (2, 3), "float32"), ("torch", (4,), "float16"))
    assert signature(tree) == signature(
        {"a": np.zeros((2, 3), np.float32), "b": [torch.ones(4).half()]}
    )
    for other in [
        {"a": np.ones((3, 2), np.float32), "b": [torch.ones(4, dtype=torch.float16)]},
        {"a": np.ones((2, 3), np.float64), "b": [torch.ones(4, dtype=torch.float16)]},
        {"a": jnp.ones((2, 3), jnp.float32), "b": [torch.ones(4, dtype=torch.float16)]},
        {"a": np.ones((2, 3), np.float32), "b": (torch.ones(4, dtype=torch.float16),)},
    ]:
        assert signature(other) != signature(tree)


def test_abstract_holds_shapes_and_dtypes_only():
    import jax
    import jax.numpy as jnp

    leaves = [jnp.ones((5, 2), jnp.float32), jnp.ones(3, jnp.bfloat16)]
    abstract = _templates.abstract(blueprint(), leaves, ["w", "b"])
    concrete = _templates.build(blueprint(), leaves, ["w", "b"])
    assert [v.path for v in abstract.variables] == [v.path for v in concrete.variables]
    for a, c in zip(abstract.variables, concrete.variables):
        assert isinstance(a.storage, jax.ShapeDtypeStruct), a.path
        assert a.storage.shape == tuple(c.shape) and a.storage.dtype == c.value.dtype, a.path
