"""Saving, loading and setting an optimizer's variables.

Kept apart from the update logic: these methods only read and write the
`variables` list, in order, and check everything before writing anything.
"""

import warnings


class StateMixin:
    """`save_own_variables`, `load_own_variables` and `set_weights`."""

    def save_own_variables(self, store):
        """Writes every variable, as a NumPy array, to `store["0"]`, `store["1"]`, ..."""
        for i, variable in enumerate(self.variables):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):
        """Restores the variables from a store written by `save_own_variables`.

        A store holding a different number of variables is not loaded: a
        warning says so and nothing changes. A shape mismatch raises before
        anything is written.
        """
        variables = self.variables
        if len(store.keys()) != len(variables):
            msg = (f"Skipping variable loading for optimizer '{self.name}', because it has "
                   f"{len(variables)} variables whereas the saved optimizer has "
                   f"{len(store.keys())} variables.")
            if not self.built:
                msg += " This is likely because the optimizer has not been called/built yet."
            warnings.warn(msg, stacklevel=2)
            return
        values = [store[str(i)] for i in range(len(variables))]
        _check_shapes("store", variables, values)
        for variable, value in zip(variables, values):
            variable.assign(value)

    def set_weights(self, weights):
        """Sets every optimizer variable from a list of arrays, in `variables` order."""
        if not self.built:
            raise ValueError(
                "You are calling `set_weights()` on an optimizer that has not yet been built. "
                "Call `optimizer.build(trainable_variables)` first.")
        weights = list(weights)
        variables = self.variables
        if len(weights) != len(variables):
            raise ValueError(
                f"`weights` must hold one array per optimizer variable ({len(variables)}). "
                f"Received: {len(weights)} arrays")
        _check_shapes("weights", variables, weights)
        for variable, weight in zip(variables, weights):
            variable.assign(weight)


def _check_shapes(argname, variables, values):
    for i, (variable, value) in enumerate(zip(variables, values)):
        shape = tuple(getattr(value, "shape", ()))
        if shape != variable.shape:
            raise ValueError(
                f"Optimizer variable {variable.path!r} has shape {variable.shape}, not "
                f"compatible with the provided value's shape. Received: {argname}[{i}].shape="
                f"{shape}")
