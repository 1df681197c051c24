"""Native optimizers in lossscale wrappers.

`wrap_native` (from `lossscale.adapters`, where the adapter packages
register themselves) gives a torch or optax optimizer its adapter;
`NativeInnerStateMixin` lets a wrapper checkpoint an inner optimizer whose
state lives outside lossscale variables.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from lossscale import adapters
from lossscale.mixed_precision.policy import state_fields
from lossscale.typing import Array


def wrap_native(optimizer: Any) -> Any:
    """Returns `optimizer` wrapped in its adapter, or unchanged if it needs none.

    A `torch.optim.Optimizer` becomes a `TorchAdapter` and an
    `optax.GradientTransformation` an `OptaxAdapter` (the adapters their
    packages register in `lossscale.adapters`); anything else (a lossscale
    optimizer, or a value the caller will reject) is returned as it is.
    Only the adapter packages of libraries already loaded are imported.

    Args:
        optimizer: Any object.

    Returns:
        A lossscale optimizer for a native one, else `optimizer`.

    Examples:
        >>> import torch
        >>> from lossscale.optimizers.native import wrap_native
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> wrap_native(torch.optim.SGD([w], lr=0.1))
        <TorchAdapter name='torch_optimizer' built=False>
    """
    return adapters.adapt(optimizer)


class NativeInnerStateMixin:
    """Checkpointing for a wrapper whose inner optimizer keeps native state.

    A `TorchAdapter` keeps its state in the torch optimizer, not in
    `variables` (it says so with `keeps_native_state = True`). A wrapper
    holding one in `inner_optimizer` (`LossScaleOptimizer`) takes this mixin
    before `Optimizer` among its bases: `state_dict()` / `load_state_dict()` then go
    through the inner optimizer's, with the wrapper's own variables carried
    in `optimizer_variables`, and `save_own_variables` /
    `load_own_variables` raise the inner optimizer's error instead of
    silently saving the variables only. Any other inner optimizer keeps the
    wrapper's usual behaviour.
    """

    def _native_inner(self):
        inner = getattr(self, "inner_optimizer", None)
        return inner if getattr(inner, "keeps_native_state", False) else None

    def _build_over_native(self, inner) -> None:
        """Builds the wrapper over `inner.parameters()` if its state needs them.

        Telemetry and diagnostics keep variables per model variable (named
        after it) or per model (sized by it), made by `build`. A torch
        optimizer knows its parameters from the start, so a state dict
        saved or loaded before the first step holds those too, as after
        it: the wrapper builds itself, as its first step would with the
        parameters in param-group order (their Variables are named
        `param_0`, `param_1`, ...). A wrapper without such state stays
        unbuilt.
        """
        if self.built or not any(
            f.metadata["per"] in ("variable", "vector") for f in state_fields(self.policy)
        ):
            return
        self.build(inner.parameters())

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state; with a native inner optimizer, its `state_dict()`
        carrying this wrapper's variables in `optimizer_variables`."""
        inner = self._native_inner()
        if inner is None:
            return super().state_dict()
        self._build_over_native(inner)
        return inner.state_dict(extra_variables=self._variables)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the state written by `state_dict()` (checked before writing).

        With a native inner optimizer, a wrapper never stepped whose
        telemetry or diagnostics keep per-variable state builds itself
        first (as `state_dict()` does), so it loads a dict saved before or
        after any step; a dict that does not fit then leaves every
        variable's value as it was.
        """
        inner = self._native_inner()
        if inner is None:
            super().load_state_dict(state_dict)
            return
        self._build_over_native(inner)
        inner.load_state_dict(state_dict, extra_variables=self._variables)

    def save_own_variables(self, store: MutableMapping[str, Array]) -> None:
        """Writes every variable to `store`; raises if the inner optimizer keeps native state."""
        inner = self._native_inner()
        if inner is not None:
            inner.save_own_variables(store)  # raises, naming `state_dict()`
        super().save_own_variables(store)

    def load_own_variables(self, store: Mapping[str, Array]) -> None:
        """Restores the variables from `store`; raises if the inner optimizer keeps native state."""
        inner = self._native_inner()
        if inner is not None:
            inner.load_own_variables(store)  # raises, naming `load_state_dict()`
        super().load_own_variables(store)
