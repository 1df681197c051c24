"""Flattening parameter trees: `jax.tree_util` once JAX is imported, else the same here.

Without JAX, nested dicts, lists and tuples give the same leaf order (dict
keys sorted, `None` an empty subtree) and print the same way.
"""

import sys


def jax_in_use():
    """Whether trees are flattened with `jax.tree_util` (JAX has been imported)."""
    return "jax" in sys.modules


def flatten(tree, argname, use_jax):
    """Returns `(leaves, treedef, paths)`; paths are `/`-joined key strings."""
    if use_jax:
        jax = sys.modules["jax"]
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        leaves = [leaf for _, leaf in with_paths]
        paths = ["/".join(_key_name(k) for k in path) for path, _ in with_paths]
    else:
        leaves, paths = [], []
        treedef = _ContainerDef.of(tree, (), leaves, paths)
    if not leaves:
        raise ValueError(f"`{argname}` must hold at least one array. Received: {argname}={tree!r}")
    return leaves, treedef, paths


def unflatten(treedef, leaves):
    if isinstance(treedef, _ContainerDef):
        return treedef.build(iter(leaves))
    return sys.modules["jax"].tree_util.tree_unflatten(treedef, leaves)


def _key_name(key):
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


class _ContainerDef:
    """Structure of a tree of dicts, lists and tuples (used without JAX)."""

    __slots__ = ("kind", "keys", "children")

    def __init__(self, kind, keys=(), children=()):
        self.kind, self.keys, self.children = kind, tuple(keys), tuple(children)

    @classmethod
    def of(cls, tree, path, leaves, paths):
        if tree is None:
            return cls("none")
        if isinstance(tree, dict):
            keys = sorted(tree)
            return cls(
                "dict", keys, [cls.of(tree[k], path + (str(k),), leaves, paths) for k in keys]
            )
        if isinstance(tree, (list, tuple)):
            return cls(
                type(tree).__name__,
                range(len(tree)),
                [cls.of(x, path + (str(i),), leaves, paths) for i, x in enumerate(tree)],
            )
        leaves.append(tree)
        paths.append("/".join(path))
        return cls("leaf")

    def build(self, leaves):
        if self.kind == "leaf":
            return next(leaves)
        if self.kind == "none":
            return None
        children = [c.build(leaves) for c in self.children]
        if self.kind == "dict":
            return dict(zip(self.keys, children))
        return list(children) if self.kind == "list" else tuple(children)

    def _key(self):
        return (self.kind, self.keys, tuple(c._key() for c in self.children))

    def __eq__(self, other):
        return isinstance(other, _ContainerDef) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        if self.kind == "leaf":
            return "*"
        if self.kind == "none":
            return "None"
        inner = ", ".join(
            repr(c) if self.kind != "dict" else f"{k!r}: {c!r}"
            for k, c in zip(self.keys, self.children)
        )
        return {"dict": "{%s}", "list": "[%s]", "tuple": "(%s)"}[self.kind] % inner
