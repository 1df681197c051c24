"""`state_dict` / `load_state_dict` of `TorchAdapter`: the native state and the step counter."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lossscale.torch.adapter_messages import check_value

if TYPE_CHECKING:
    from lossscale.variables import Variable

STATE_DICT_KEYS = ("state", "param_groups", "optimizer_variables")


class AdapterCheckpointMixin:
    """The native optimizer's `state_dict()`, copied, plus the adapter's own variables."""

    # --- state ------------------------------------------------------------------
    def state_dict(self, *, extra_variables: Sequence[Variable] = ()) -> dict[str, Any]:
        """Returns the native optimizer's state dict plus the adapter's step counter.

        ```
        {
            "state": ...,                # the native state_dict()'s, copied
            "param_groups": [...],       # likewise
            "optimizer_variables": {"torch_optimizer/iteration": tensor(n)},
        }
        ```

        Everything is copied, so later steps do not change the dict. A plain
        torch optimizer loads it too (it ignores `optimizer_variables`).

        Args:
            extra_variables: Variables of an enclosing wrapper (a
                `LossScaleOptimizer` passes its own) to carry in
                `optimizer_variables` too, keyed by path, before the step
                counter.

        Returns:
            A dict that `load_state_dict` accepts.
        """
        state = copy.deepcopy(self.optimizer.state_dict())
        state["optimizer_variables"] = {
            v.path: _tensor(v._ops.copy(v.value)) for v in [*extra_variables, self._iterations]
        }
        return state

    def load_state_dict(
        self, state_dict: dict[str, Any], *, extra_variables: Sequence[Variable] = ()
    ) -> None:
        """Restores the state written by `state_dict()`.

        Everything is checked before anything is written: the keys, shapes
        and kinds of `optimizer_variables` here, the native part (number and
        sizes of param groups) by the native optimizer. A fresh optimizer
        (built or not, never stepped) loads it as torch optimizers do; a
        wrapper's variables then move next to the parameters. What is loaded
        is copied: later steps never write into `state_dict`. A plain `torch.optim`
        state dict (no step counter) loads with
        `adapter.optimizer.load_state_dict(...)`.

        Args:
            state_dict: A dict returned by `state_dict()`.
            extra_variables: The variables passed to `state_dict()` as
                `extra_variables`, to restore as well.
        """
        if not isinstance(state_dict, dict) or set(state_dict) != set(STATE_DICT_KEYS):
            got = (
                sorted(map(str, state_dict))
                if isinstance(state_dict, dict)
                else type(state_dict).__name__
            )
            raise ValueError(
                f"`state_dict` must be a dict with keys {list(STATE_DICT_KEYS)}, as returned by "
                "TorchAdapter.state_dict(); a plain torch.optim state dict loads with "
                f"`adapter.optimizer.load_state_dict(...)`. Received: {got}"
            )
        variables = [*extra_variables, self._iterations]
        saved = state_dict["optimizer_variables"]
        paths = [v.path for v in variables]
        if not isinstance(saved, dict) or set(saved) != set(paths):
            received = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(
                f"`state_dict['optimizer_variables']` must have the keys {paths} of this "
                f"optimizer. Received: {received}"
            )
        for variable in variables:
            check_value(
                f"state_dict['optimizer_variables'][{variable.path!r}]",
                saved[variable.path],
                variable,
            )
        # torch keeps the tensors it loads when their dtype and device already
        # fit, so later steps would write into the caller's dict: load a copy.
        # The native optimizer checks its part before it writes any of it.
        native = copy.deepcopy({key: state_dict[key] for key in STATE_DICT_KEYS[:2]})
        self.optimizer.load_state_dict(native)
        anchor = next(p for group in self.optimizer.param_groups for p in group["params"])
        for variable in variables:
            if variable.backend != "torch":  # a fresh wrapper's scalars, made on NumPy
                variable.move_to(anchor)
            variable.assign(saved[variable.path])


def _tensor(value):
    """`value` as a torch tensor: a wrapper never stepped holds its scalars on NumPy.

    A state dict of tensors and plain values is what `torch.load(...,
    weights_only=True)` reads; a NumPy array is not. `value` is a copy
    already, so the tensor may share its memory.
    """
    import torch

    return value if torch.is_tensor(value) else torch.from_numpy(np.asarray(value))
