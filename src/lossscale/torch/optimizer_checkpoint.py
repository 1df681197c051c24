"""`state_dict` / `load_state_dict` of `lossscale.torch.Optimizer`, in torch's layout.

```
{
    "state": {0: {"momentum": m0, "velocity": v0}, 1: {...}, ...},  # every group's
    "param_groups": [
        {"lr": ..., "weight_decay": ..., ..., "params": [0, 1],
         "optimizer_variables": {"adam_group0/iteration": t, ...}},   # the rule's own
        ...
    ],
}
```

Parameters are numbered across the groups in order, as torch numbers them;
`state[i]` holds the slots of parameter `i` (what the rule's own
`state_dict()` holds), copies that later steps do not change. Loading checks
every group before it writes anything, and restores the groups' hyper-
parameters as torch's optimizers do (a scheduler's `initial_lr` included).
"""

from __future__ import annotations

from typing import Any

_OWN = "optimizer_variables"


class OptimizerCheckpointMixin:
    """Torch-layout state dicts over the rules of the param groups."""

    def state_dict(self) -> dict[str, Any]:
        """The state of every param group's rule, in torch's layout (copies).

        Returns:
            A dict that `load_state_dict` accepts; `torch.save` and
            `torch.load(..., weights_only=True)` handle it.
        """
        state, groups, offset = {}, [], 0
        for group, rule in zip(self.param_groups, self._rules):
            own = rule.state_dict()
            count = len(group["params"])
            state.update({offset + i: slots for i, slots in own["state"].items()})
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyper, "params": list(range(offset, offset + count)), _OWN: own[_OWN]})
            offset += count
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the state written by `state_dict()`; nothing is written unless all of it fits.

        Args:
            state_dict: A dict returned by `state_dict()`.
        """
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            got = (
                sorted(map(str, state_dict))
                if isinstance(state_dict, dict)
                else type(state_dict).__name__
            )
            raise ValueError(
                "`state_dict` must be a dict with keys ['state', 'param_groups'], as "
                f"{type(self).__name__}.state_dict() returns it. Received: {got}"
            )
        saved_groups = state_dict["param_groups"]
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"`state_dict['param_groups']` must hold {len(self.param_groups)} groups, one per "
                f"param group of this optimizer. Received: {saved_groups!r}"[:400]
            )
        writes, offset = [], 0
        for index, (group, rule, saved) in enumerate(
            zip(self.param_groups, self._rules, saved_groups)
        ):
            count = len(group["params"])
            if not isinstance(saved, dict) or _OWN not in saved:
                raise ValueError(
                    f"`state_dict['param_groups'][{index}]` has no {_OWN!r}: this is not the "
                    f"state dict of a {type(self).__name__} (a torch optimizer's, say). "
                    f"Received keys: {sorted(saved) if isinstance(saved, dict) else saved!r}"
                )
            if list(saved.get("params", ())) != list(range(offset, offset + count)):
                raise ValueError(
                    f"`state_dict['param_groups'][{index}]['params']` must list the {count} "
                    f"parameters of group {index} ({offset} to {offset + count - 1}). "
                    f"Received: {saved.get('params')!r}"
                )
            own = {
                "state": {
                    i - offset: slots
                    for i, slots in state_dict["state"].items()
                    if offset <= i < offset + count
                },
                "param_groups": [{"params": list(range(count))}],
                _OWN: saved[_OWN],
            }
            writes += rule._state_dict_writes(own)
            offset += count
        extra = [i for i in state_dict["state"] if not 0 <= i < offset]
        if extra:
            raise ValueError(
                f"`state_dict['state']` names parameters {extra} that this optimizer does not "
                f"have (it has {offset})."
            )
        for variable, value in writes:
            variable.assign(value)
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k not in ("params", _OWN)})
