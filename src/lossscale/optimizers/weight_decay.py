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
        # The variables are kept beside their ids: a copy of the optimizer holds new ones.
        self._excluded = list(var_list or ())
        self._ids = {id(v) for v in self._excluded}
        names = list(var_names or ())
        self._pattern = re.compile("|".join(sorted(set(names)))) if names else None
        self._variables = []  # what `decide` settled, at build
        self._decided = {}  # id(variable) -> bool

    def decide(self, variables):
        """Settles, once, which of an optimizer's variables are decayed (a name search each)."""
        self._variables = list(variables)
        self._decided = {id(v): self._matches(v) for v in variables}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._ids = {id(v) for v in self._excluded}
        self.decide(self._variables)

    def excludes_any(self):
        """Whether any variable may be excluded (some given, or some name pattern)."""
        return bool(self._ids) or self._pattern is not None

    def uses_weight_decay(self, variable):
        """Returns whether weight decay applies to `variable`."""
        decided = self._decided.get(id(variable))
        return self._matches(variable) if decided is None else decided

    def _matches(self, variable):
        return id(variable) not in self._ids and not (
            self._pattern is not None and self._pattern.search(variable.name)
        )


def partition_by_decay(variables, exclusions):
    """`(decayed, excluded)`: the positions of the `variables` that decay, and of the others."""
    if not exclusions.excludes_any():  # the common case: no look-up per variable
        return range(len(variables)), ()
    decayed, excluded = [], []
    for i, variable in enumerate(variables):
        (decayed if exclusions.uses_weight_decay(variable) else excluded).append(i)
    return decayed, excluded


def apply_weight_decay(ops, variables, weight_decay, learning_rate, exclusions, cache, keep=None):
    """Decays each non-excluded variable, by the backend's fused kernel where it has one.

    Each rounds as Keras 3 does on that backend. `keep`: None, or a boolean
    scalar the decay takes effect under (given to kernels only).
    """
    decayed = [v for v in variables if exclusions.uses_weight_decay(v)]
    if not decayed:
        return
    kernel = ops.fused_weight_decay()
    if kernel is not None:
        options = {} if keep is None else {"keep": keep}
        kernel(decayed, weight_decay, learning_rate, cache=cache, **options)
        return
    for variable in decayed:
        lr = ops.cast(learning_rate, variable.dtype)
        variable.assign_sub(variable.value * weight_decay * lr)
