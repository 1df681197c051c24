"""Decoupled weight decay (`v -= v * weight_decay * learning_rate`)."""

import re


class WeightDecayExclusions:
    """Which variables skip weight decay, by identity or by name pattern.

    Args:
        var_list: Variables to exclude.
        var_names: Strings; a variable whose name contains any of them (as a
            regular-expression search) is excluded.
    """

    def __init__(self, var_list=(), var_names=()):
        self._ids = {id(v) for v in var_list or ()}
        names = list(var_names or ())
        self._pattern = re.compile("|".join(sorted(set(names)))) if names else None

    def uses_weight_decay(self, variable):
        """Returns whether weight decay applies to `variable`."""
        if id(variable) in self._ids:
            return False
        return not (self._pattern is not None and self._pattern.search(variable.name))


def apply_weight_decay(ops, variables, weight_decay, learning_rate, exclusions):
    """Decays each non-excluded variable in place (or rebinds on JAX)."""
    for variable in variables:
        if exclusions.uses_weight_decay(variable):
            lr = ops.cast(learning_rate, variable.dtype)
            variable.assign_sub(variable.value * weight_decay * lr)
