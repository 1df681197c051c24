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

# The key of each param group that holds its rule's variables other than
# the slots (live in `param_groups`, copies in a state dict).
RULE_VARIABLES = "optimizer_variables"


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
            # An empty group's rule is never built: no state.
            own = rule.state_dict() if rule.built else {"state": {}, RULE_VARIABLES: {}}
            count = len(group["params"])
            state.update({offset + i: slots for i, slots in own["state"].items()})
            hyper = {k: v for k, v in group.items() if k not in ("params", RULE_VARIABLES)}
            groups.append(
                {
                    **hyper,
                    "params": list(range(offset, offset + count)),
                    RULE_VARIABLES: own[RULE_VARIABLES],
                }
            )
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
        # Saved parameter ids map to this optimizer's parameters by position,
        # as torch's `load_state_dict` maps them: ints from `state_dict()`,
        # or the names torch's distributed checkpoint puts in their place.
        listed, writes = set(), []
        for index, (group, rule, saved) in enumerate(
            zip(self.param_groups, self._rules, saved_groups)
        ):
            count = len(group["params"])
            if not isinstance(saved, dict) or RULE_VARIABLES not in saved:
                raise ValueError(
                    f"`state_dict['param_groups'][{index}]` has no {RULE_VARIABLES!r}: this is "
                    f"not the state dict of a {type(self).__name__} (a torch optimizer's, say). "
                    f"Received keys: {sorted(saved) if isinstance(saved, dict) else saved!r}"
                )
            ids = saved.get("params")
            if not isinstance(ids, (list, tuple)) or len(ids) != count:
                raise ValueError(
                    f"`state_dict['param_groups'][{index}]['params']` must list the {count} "
                    f"parameters of group {index}, one id each. Received: {ids!r}"[:400]
                )
            for key in ids:
                if key in listed:
                    raise ValueError(
                        f"`state_dict['param_groups'][{index}]['params']` lists {key!r}, which "
                        "an earlier entry lists too: each parameter is listed once."
                    )
                listed.add(key)
            saved_state = state_dict["state"]
            own = {
                # An empty entry is a parameter without slots (torch's
                # flattened checkpoints give every parameter one).
                "state": {
                    j: saved_state[key]
                    for j, key in enumerate(ids)
                    if key in saved_state and saved_state[key] != {}
                },
                "param_groups": [{"params": list(range(count))}],
                RULE_VARIABLES: saved[RULE_VARIABLES],
            }
            if rule.built:
                writes += rule._state_dict_writes(own)
            elif saved[RULE_VARIABLES]:
                raise ValueError(
                    f"`state_dict['param_groups'][{index}]` holds variables "
                    f"{sorted(saved[RULE_VARIABLES])}, but group {index} of this optimizer "
                    "has no parameters: the state dict is of another optimizer."
                )
        extra = [key for key in state_dict["state"] if key not in listed]
        if extra:
            raise ValueError(
                f"`state_dict['state']` names parameters {extra} that no group of "
                f"`state_dict['param_groups']` lists (this optimizer has {len(listed)})."
            )
        for variable, value in writes:
            variable.assign(value)
        for index, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            group.update({k: v for k, v in saved.items() if k not in ("params", RULE_VARIABLES)})
            # The group's lr is the one torch's tools read and set: the rule
            # takes it at the next step, whatever lr its variables were
            # saved with.
            self._rule_lrs[index] = None
