"""`Optimizer`: a `torch.optim.Optimizer` that runs a lossscale optimizer.

Each param group runs its own copy of the rule, following the group's keys,
so torch's schedulers, scalers, Lightning and Accelerate take it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from lossscale import validation
from lossscale.backends import get_ops
from lossscale.mixed_precision import diagnosis
from lossscale.optimizers.base import Optimizer as LossscaleOptimizer
from lossscale.optimizers.loss_scale_optimizer import LossScaleOptimizer
from lossscale.variables import Variable

_OPS = get_ops("torch")
# The param-group key of its rule's variables other than the slots.
RULE_VARIABLES = "optimizer_variables"
_STRIDED = torch.strided


class Optimizer(torch.optim.Optimizer):
    """Runs a lossscale optimizer (SGD ... Lamb) as a `torch.optim.Optimizer`.

    ```
    for group in param_groups:                # torch's groups, torch's keys
        rule = copy of `optimizer`, with the group's lr, weight_decay
               (and momentum / betas where the rule has them)
        rule.apply([p.grad for p in group["params"]], group["params"])
    ```

    Parameters without a gradient are left alone, as torch's optimizers do.
    Weight decay is the rule's own (Keras's decoupled `v -= v * wd * lr`),
    so a group with `"weight_decay": 0.0` is not decayed.

    Under a `GradScaler` (torch's or ours) the class says
    `_step_supports_amp_scaling`: the scaler reads no flag on the host, it
    hands over `grad_scale` (the gradients are unscaled in place, or inside
    a fused kernel) and `found_inf`, and a step where `found_inf` is 1
    leaves every parameter and state bit for bit as it was.

    A learning-rate schedule belongs to a torch scheduler on this optimizer
    (the rule's `learning_rate` must be a float). `self.state[p]` holds
    parameter `p`'s slots and each group's `"optimizer_variables"` its
    rule's other variables: the live tensors the rule writes in place.

    Args:
        params: The parameters (leaf tensors, each once) or param-group
            dicts, as torch's optimizers take them. A group may set `"lr"`,
            `"weight_decay"` and, for a rule that has them, `"momentum"` or
            `"betas"`.
        optimizer: A lossscale optimizer, not built, e.g.
            `lossscale.optimizers.AdamW(1e-3, weight_decay=0.01)`: the rule
            and its defaults. It is used as a template and not changed.
        agreement_every: Int >= 1 or `None` (default). Every this many
            steps, check that every rank of `process_group` holds the same
            step count and learning rate in each param group (one small
            all-reduce), and raise `LossScaleError` on every rank where not.
        process_group: The `torch.distributed` group `agreement_every`
            checks; `None`: the default group.

    Examples:

        >>> import torch, lossscale as ls, lossscale.torch
        >>> model = torch.nn.Linear(3, 1)
        >>> opt = lossscale.torch.Optimizer(
        ...     [{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}],
        ...     ls.optimizers.AdamW(1e-2, weight_decay=0.1))
        >>> schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
        >>> model(torch.ones(2, 3)).sum().backward()
        >>> opt.step(); schedule.step()
        >>> opt.param_groups[0]["lr"]
        0.005
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer: LossscaleOptimizer,
        *,
        agreement_every: int | None = None,
        process_group: Any = None,
    ) -> None:
        if not isinstance(optimizer, LossscaleOptimizer) or isinstance(
            optimizer, LossScaleOptimizer
        ):
            raise ValueError(
                "`optimizer` must be a lossscale optimizer (lossscale.optimizers.SGD, Adam, "
                "...), whose rule each param group runs; loss scaling is the GradScaler's job "
                "here, so not a LossScaleOptimizer. Received: "
                f"optimizer={optimizer!r}"
            )
        if optimizer.built:
            raise ValueError(
                "`optimizer` must not be built yet: it is the template each param group's "
                f"copy is made from. Received: optimizer={optimizer!r} (built)"
            )
        if not isinstance(optimizer._learning_rate, Variable):
            raise ValueError(
                "The learning rate of `optimizer` must be a float: schedule it with a torch "
                "LR scheduler on this optimizer, which sets each param group's 'lr'. "
                f"Received: learning_rate={optimizer._learning_rate!r}"
            )
        self._template = optimizer.get_config()
        self._rule_class = type(optimizer)
        self._tunable = [key for key in ("momentum", "betas") if _read(optimizer, key) is not None]
        defaults = {
            "lr": float(str(optimizer._learning_rate.numpy())),  # 0.01, not 0.0099999998
            "weight_decay": optimizer.weight_decay or 0.0,
        }
        defaults.update({key: _read(optimizer, key) for key in self._tunable})
        self._rules = []
        self._rule_lrs = []  # each group's float "lr" as its rule last received it
        self.last_step_applied = None
        self._agreement = diagnosis.Agreement(agreement_every)
        self._process_group = process_group
        self._steps_taken = 0  # on the host, for `agreement_every`
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a param group (torch's method) and the rule that runs it."""
        params = param_group["params"] if isinstance(param_group, dict) else param_group
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):  # a set: torch's own error (its order changes)
            params = list(params)  # read once (a generator): torch is given the list
            if isinstance(param_group, dict):
                param_group["params"] = params
        seen = set()
        for p in params:
            if id(p) in seen:
                raise ValueError(
                    "A param group lists the same tensor twice; give each parameter once. "
                    f"Received: a tensor of shape {tuple(p.shape)} twice"
                )
            seen.add(id(p))
        super().add_param_group(param_group)  # torch's checks: leaf tensors, no overlap
        group = self.param_groups[-1]
        index = len(self._rules)
        config = {**self._template, "name": f"{self._template['name']}_group{index}"}
        validation.check_number("weight_decay", group["weight_decay"], low=0)
        config.update(_rule_settings(group, self._tunable))
        if torch.is_tensor(config["learning_rate"]):  # read once, here; assigned each step
            config["learning_rate"] = float(config["learning_rate"])
        rule = self._rule_class.from_config(config)
        if group["params"]:  # an empty group (torch takes one) has nothing to build or step
            rule.build(
                [Variable(p, name=f"group{index}_param{j}") for j, p in enumerate(group["params"])]
            )
        rule.weight_decay = config["weight_decay"] or None  # 0: not decayed at all
        self._rules.append(rule)
        self._rule_lrs.append(group["lr"])
        # An entry per parameter, slots or none: torch's distributed checkpoint
        # steps an optimizer whose `state` is empty, which would count a step.
        slots, shared = rule.state_variables() if rule.built else ({}, {})
        for j, p in enumerate(group["params"]):
            self.state[p] = {name: v.value for name, v in slots.get(j, {}).items()}
        group[RULE_VARIABLES] = {path: v.value for path, v in shared.items()}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Takes one step of every param group's rule (torch's signature).

        Args:
            closure: Optional callable that recomputes the loss (run with
                gradients enabled, as torch's optimizers run it).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)  # set by a GradScaler's `step`
        found_inf = getattr(self, "found_inf", None)
        # Everything is checked before anything is written.
        steps = []
        for index, (group, rule) in enumerate(zip(self.param_groups, self._rules)):
            grads, variables = _gradients(index, group, rule)
            if grads:
                steps.append((index, group, rule, grads, variables))
        moved = [self._moved(index, group, rule) for index, group, rule, _, _ in steps]
        keep = flag = None
        if found_inf is not None and steps:
            keep = _keep(found_inf, steps[0][3][0].device)  # the first gradient's
            flag = found_inf.reshape(()) if found_inf.ndim else found_inf
        for (index, _, rule, _, _), settings in zip(steps, moved):
            self._take(index, rule, settings)
        for _, _, rule, grads, variables in steps:
            folded = None
            if grad_scale is not None:  # still scaled
                if rule._step_plan(variables).takes_grad_scale:
                    folded = grad_scale
                else:  # unscaled in place, as fused kernels do
                    grads = _OPS.unscale(grads, grad_scale, in_place=True)
            # torch checked each `p.grad` against its parameter: no `apply` checks.
            with rule._ops.quiet():
                rule._step(grads, variables, keep=keep, grad_scale=folded, found_inf=flag)
        self.last_step_applied = True if found_inf is None else keep
        self._steps_taken += 1
        if self._agreement.due(self._steps_taken - 1):
            self._agree(self._steps_taken - 1)
        return loss

    def _agree(self, step):
        """`agreement_every`: each group's step count and lr, alike on every rank."""
        fields = {}
        for index, (group, rule) in enumerate(zip(self.param_groups, self._rules)):
            fields[f"param_groups[{index}] step"] = rule.iterations.value
            fields[f"param_groups[{index}] lr"] = torch.as_tensor(
                group["lr"], dtype=torch.float32, device=rule.iterations.value.device
            )
        self._agreement.check(_OPS, self._process_group, fields, step, "optimizer states")

    def _moved(self, index, group, rule):
        """`{setting: value}` the group moved since the rule took it, checked, not set."""
        moved = {}
        for key, value in _rule_settings(group, self._tunable).items():
            taken = (value or None) if key == "weight_decay" else value  # 0: no decay
            if key == "learning_rate" or getattr(rule, key) == taken:
                continue
            if key == "weight_decay":  # checked where moved: the rule took a checked one
                validation.check_number("weight_decay", value, low=0)
            if key == "momentum" and (value == 0) != (rule.momentum == 0):
                raise ValueError(
                    "A param group's 'momentum' cannot move between 0 and a positive value: "
                    "the rule keeps momentum slots only when it starts with one. Received: "
                    f"momentum={value} for a rule built with momentum={rule.momentum}"
                )
            moved[key] = taken
        lr = group["lr"]
        # A tensor lr may be filled in place by a scheduler: copied every step.
        if torch.is_tensor(lr) or lr != self._rule_lrs[index]:
            moved["learning_rate"] = lr
        return moved

    def _take(self, index, rule, moved):
        """Sets the rule's settings that `_moved` found."""
        for key, value in moved.items():
            if key != "learning_rate":
                setattr(rule, key, value)
            elif torch.is_tensor(value):
                rule._learning_rate.assign(value)
            else:
                rule.learning_rate = value
                self._rule_lrs[index] = value

    # --- state dicts, in torch's layout --------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state of every param group's rule, in torch's layout (copies).

        Returns:
            A dict for `load_state_dict`, `torch.save` and
            `torch.load(..., weights_only=True)`.
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
        # Saved ids (ints, or torch's distributed checkpoint's names) map by position.
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
                # An empty entry is a parameter without slots.
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
            self._rule_lrs[index] = None  # the rule takes the group's lr at the next step

    def __getstate__(self) -> dict[str, Any]:
        """What a copy is rebuilt from: the rule's class and settings, the groups, the state.

        The rules hold caches keyed by identity: a copy is a new optimizer
        over the copied parameters that loads this one's state dict.
        """
        groups = [
            {k: v for k, v in group.items() if k != RULE_VARIABLES} for group in self.param_groups
        ]
        return {
            "rule": (self._rule_class, self._template),
            "param_groups": groups,
            "state_dict": self.state_dict(),
            "last_step_applied": self.last_step_applied,
            "agreement_every": self._agreement.every,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuilds the optimizer over `state`'s parameters and loads its state dict."""
        rule_class, config = state["rule"]
        Optimizer.__init__(
            self,
            state["param_groups"],
            rule_class.from_config(config),
            agreement_every=state.get("agreement_every"),
        )
        self.load_state_dict(state["state_dict"])
        self.last_step_applied = state["last_step_applied"]

    @property
    def rules(self) -> list[LossscaleOptimizer]:
        """The lossscale optimizer running each param group, in group order."""
        return list(self._rules)


def _read(optimizer, key):
    """The optimizer's `momentum`, or `betas` as `(beta_1, beta_2)`; None if it has none."""
    if key == "betas":
        b1, b2 = getattr(optimizer, "beta_1", None), getattr(optimizer, "beta_2", None)
        return None if b1 is None or b2 is None else (b1, b2)
    value = getattr(optimizer, key, None)
    return value if isinstance(value, float | int) and not isinstance(value, bool) else None


def _gradients(index, group, rule):
    """`(gradients, variables)` of the group's parameters that have a (dense) gradient."""
    grads = [p.grad for p in group["params"]]
    variables = rule._trainable_variables
    if all(g is not None and g.layout is _STRIDED for g in grads):
        return grads, variables
    for j, (p, g) in enumerate(zip(group["params"], grads)):
        if g is not None and g.layout is not _STRIDED:
            raise ValueError(
                "lossscale.torch.Optimizer takes dense gradients only (an embedding with "
                "`sparse=False`, say). Received: a gradient with layout "
                f"{g.layout} for parameter {j} of param group {index} (shape {tuple(p.shape)})"
            )
    present = [j for j, g in enumerate(grads) if g is not None]
    return [grads[j] for j in present], [variables[j] for j in present]


def _rule_settings(group, tunable):
    """The rule's constructor arguments that the group's keys set (not checked here)."""
    settings = {"learning_rate": group["lr"], "weight_decay": group["weight_decay"]}
    if "momentum" in tunable:
        settings["momentum"] = group["momentum"]
    if "betas" in tunable:
        settings["beta_1"], settings["beta_2"] = group["betas"]
    return settings


def _keep(found_inf, device):
    """The step's `keep` flag from a scaler's `found_inf` (1.0: skip), checked and on `device`."""
    if (
        not torch.is_tensor(found_inf)
        or found_inf.numel() != 1
        or not found_inf.is_floating_point()
    ):
        raise ValueError(
            "`found_inf` must be a one-element float tensor (1.0: skip the step), as "
            f"torch.amp.GradScaler sets it. Received: found_inf={found_inf!r}"
        )
    if found_inf.device != device:
        raise ValueError(
            f"`found_inf` must be on the parameters' device {device}, where the step runs "
            f"without a host read. Received: found_inf on {found_inf.device}"
        )
    # Reshaped only when it is not 0-d already: a `view` is a dispatch too.
    return (found_inf.reshape(()) if found_inf.ndim else found_inf) == 0
