"""`TorchAdapter`: a `torch.optim.Optimizer` used as a lossscale optimizer.

Under a `LossScaleOptimizer` the adapter takes the step's device flag `keep`
itself, since a native `step()` writes on its own:
- an optimizer that takes PyTorch's AMP `found_inf` protocol (fused Adam,
  AdamW, SGD and Adagrad) gets `found_inf = ~keep` as `torch.amp.GradScaler`
  passes it and skips in its kernel, with no synchronisation (except a fused
  SGD with momentum before its first applied step: `lossscale.torch.fused_sgd`);
- any other optimizer is stepped only if the flag, read on the host, is
  true: one synchronisation per step, as `GradScaler` does too.

torch is imported when an adapter is made, never by importing lossscale.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lossscale import adapters, validation
from lossscale.optimizers import clipping
from lossscale.optimizers.base import Optimizer
from lossscale.optimizers.plan import StepPlan
from lossscale.schedules.base import LearningRateSchedule
from lossscale.torch import fused_sgd
from lossscale.torch.adapter_messages import STATELESS_MESSAGE, check_value, store_message
from lossscale.typing import Array, Config

if TYPE_CHECKING:
    import torch

    from lossscale.variables import Variable

STATE_DICT_KEYS = ("state", "param_groups", "optimizer_variables")


def _torch():
    import torch

    return torch


class TorchAdapter(Optimizer):
    """Wraps a `torch.optim.Optimizer` so lossscale (and `LossScaleOptimizer`) can drive it.

    Build it with exactly the parameters the native optimizer holds (the
    tensors themselves, in any order). Each `apply` clips the gradients, sets
    them as the parameters' `.grad` (None: skipped), calls the native
    `step()` (skipped on overflow under a `LossScaleOptimizer`) and restores
    every `.grad`.

    What lives where:
    - `variables` holds the adapter's step counter only; the native state
      is in `optimizer.state`.
    - `state_dict()` / `load_state_dict()` carry both (for `torch.save`).
    - `save_own_variables`, `load_own_variables`, `stateless_apply`,
      `get_config` and `exclude_from_weight_decay` raise.
    - `learning_rate` reads and writes `param_groups[*]["lr"]`, so
      `torch.optim.lr_scheduler` keeps working; a scheduler stepped by your
      loop also advances on steps a `LossScaleOptimizer` skips.
    - `iterations` counts the steps applied through the adapter; setting it
      leaves the native per-parameter step counts alone.

    Args:
        optimizer: The `torch.optim.Optimizer` to drive.
        name: String. The name used for the adapter's variables.
            Defaults to `"torch_optimizer"`.
        clipnorm: Float. If set, each gradient is clipped so that its norm
            is no higher than this value, after unscaling.
        clipvalue: Float. If set, gradients are clipped elementwise to
            `[-clipvalue, clipvalue]`.
        global_clipnorm: Float. If set, all gradients are clipped together
            so that their global norm is no higher than this value.

    Examples:
        >>> import torch, lossscale as ls
        >>> from lossscale.torch import TorchAdapter
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = ls.LossScaleOptimizer(TorchAdapter(torch.optim.SGD([w], lr=0.5)),
        ...                             initial_scale=4.0)
        >>> loss = opt.scale_loss((w * torch.tensor([1.0, -1.0])).sum())
        >>> loss.backward()
        >>> opt.apply([w.grad], [w])
        >>> w.detach()
        tensor([0.5000, 1.5000])
        >>> opt.apply([torch.tensor([float("inf"), 0.0])], [w])  # overflow: skipped
        >>> w.detach(), float(opt.dynamic_scale)
        (tensor([0.5000, 1.5000]), 2.0)
    """

    # `variables` do not hold the whole state: checkpoint through `state_dict`.
    keeps_native_state = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        name: str | None = None,
        *,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise ValueError(
                f"Argument(s) not recognized by TorchAdapter: {sorted(kwargs)}. Accepted: "
                "optimizer, name, clipnorm, clipvalue, global_clipnorm. Set other settings on "
                "the native optimizer (weight decay in its param groups, for one)."
            )
        torch = _torch()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                "`optimizer` must be a torch.optim.Optimizer instance, such as "
                f"torch.optim.Adam(model.parameters()). Received: optimizer={optimizer!r}"
            )
        super().__init__(
            learning_rate=self._native_learning_rate,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            name=name or "torch_optimizer",
        )
        self.optimizer = optimizer
        # A tensor from the start, so `state_dict()` is all torch before `build`.
        self._iterations.move_to(torch.zeros(()))
        self._params = {}  # id(Variable) -> the native parameter it wraps
        self._uses_found_inf = bool(
            getattr(optimizer, "_step_supports_amp_scaling", False)
            and "grad_scaler" not in inspect.signature(optimizer.step).parameters
        )

    def _native_learning_rate(self):
        rates = [float(group["lr"]) for group in self.optimizer.param_groups]
        if any(rate != rates[0] for rate in rates):
            raise AttributeError(
                f"The param groups of the wrapped {type(self.optimizer).__name__} have "
                f"different learning rates ({rates}), so there is no single "
                "`learning_rate`: read or set `optimizer.param_groups[i]['lr']` instead."
            )
        return rates[0]

    @property
    def learning_rate(self) -> float:
        """The native optimizer's learning rate, `param_groups[*]["lr"]`, as a float.

        Raises `AttributeError` if the param groups hold different rates.
        Setting it writes every param group (a tensor rate in place).
        """
        return self._native_learning_rate()

    @learning_rate.setter
    def learning_rate(self, learning_rate: float) -> None:
        if isinstance(learning_rate, LearningRateSchedule) or callable(learning_rate):
            raise TypeError(
                "The learning rate of a TorchAdapter lives in the native optimizer's "
                "`param_groups`; schedule it with a torch.optim.lr_scheduler on "
                f"`optimizer` instead. Received: learning_rate={learning_rate!r}"
            )
        validation.check_number("learning_rate", learning_rate, low=0)
        torch = _torch()
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(learning_rate)
            else:
                group["lr"] = float(learning_rate)

    def parameters(self) -> list[torch.Tensor]:
        """The native optimizer's parameters, group after group: what `build` must be given.

        Returns:
            A new list of the tensors in `optimizer.param_groups`.
        """
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def __setstate__(self, state: dict) -> None:
        """A copy's own (see `Optimizer.__getstate__`): its variables wrap its parameters."""
        super().__setstate__(state)
        self._params = {id(v): v.storage for v in self._trainable_variables}

    def build(self, var_list: Sequence[Variable | Array]) -> None:
        """Checks that `var_list` is exactly the native optimizer's parameters."""
        if self.built:
            return
        variables = self._as_variables(var_list, "var_list")
        self._params = self._match_parameters(variables)
        super().build(variables)

    def _match_parameters(self, variables):
        """`{id(variable): parameter}`; raises unless `variables` are exactly the parameters."""
        torch = _torch()
        native = type(self.optimizer).__name__
        if variables and variables[0].backend != "torch":
            raise ValueError(
                f"TorchAdapter works on torch tensors. Received: var_list of "
                f"{variables[0].backend} arrays"
            )
        params = self.parameters()
        by_id = {id(p): p for p in params}
        matched, strangers, seen = {}, [], set()
        for v in variables:
            storage = v.storage
            if not isinstance(storage, torch.Tensor) or id(storage) not in by_id:
                strangers.append(v.path)
            elif id(storage) in seen:
                raise ValueError(
                    f"`var_list` lists the parameter behind {v.path!r} twice. Received: "
                    f"{len(variables)} variables"
                )
            else:
                seen.add(id(storage))
                matched[id(v)] = storage
        missing = [tuple(p.shape) for p in params if id(p) not in seen]
        if strangers or missing:
            raise ValueError(
                f"`var_list` must hold exactly the parameters of the wrapped {native} (matched "
                "by tensor identity: pass the parameters themselves, not copies). Received: "
                f"{len(strangers)} variable(s) that are not its parameters {strangers}, and "
                f"{len(missing)} of its parameters missing (shapes {missing})"
            )
        return matched

    def _step_plan(self, variables):
        # `_native_step` takes `keep`: no `ops.cond` over `variables` could skip it.
        return StepPlan(None, folds_keep=True, takes_grad_scale=False, folds_weight_decay=False)

    def _update(self, ops, grads, variables, plan, grad_scale=None, keep=None, found_inf=None):
        grads = clipping.clip_gradients(
            ops, grads, self.clipnorm, self.clipvalue, self.global_clipnorm
        )
        params = [self._parameter(v) for v in variables]
        everything = list(self._params.values())
        saved = [p.grad for p in everything]
        try:
            for p in everything:
                p.grad = None
            for p, g in zip(params, grads):
                p.grad = g.detach().to(dtype=p.dtype)
            self._native_step(keep, found_inf)
        finally:
            for p, g in zip(everything, saved):
                p.grad = g

    def _parameter(self, variable):
        p = self._params[id(variable)]
        if variable.storage is not p:
            # Only stateless application rebinds a variable to another tensor.
            raise NotImplementedError(STATELESS_MESSAGE)
        return p

    def _native_step(self, keep, found_inf=None):
        """Steps the native optimizer, only where `keep` holds if given (`found_inf`: `~keep`)."""
        if keep is None:
            self.optimizer.step()
        elif self._uses_found_inf and not fused_sgd.makes_momentum_buffers(self.optimizer):
            if found_inf is None:
                found_inf = (~keep).to(_torch().float32)
            self._step_with_found_inf(found_inf)
        elif bool(keep):  # the one host read of the flag (see the module doc)
            self.optimizer.step()

    def _step_with_found_inf(self, found_inf):
        # GradScaler's protocol; `grad_scale` stays unset: the gradients are unscaled.
        optimizer = self.optimizer
        previous = optimizer.__dict__.get("found_inf", _ABSENT)
        optimizer.found_inf = found_inf
        try:
            optimizer.step()
        finally:
            if previous is _ABSENT:
                del optimizer.found_inf
            else:
                optimizer.found_inf = previous

    def state_dict(self, *, extra_variables: Sequence[Variable] = ()) -> dict[str, Any]:
        """Returns the native optimizer's state dict plus the adapter's step counter.

        `{"state": ..., "param_groups": [...], "optimizer_variables": {path: tensor}}`,
        everything copied; a plain torch optimizer loads it too.

        Args:
            extra_variables: Variables of an enclosing wrapper (a
                `LossScaleOptimizer` passes its own) to carry in
                `optimizer_variables` too, keyed by path, before the step counter.

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

        Everything is checked before anything is written, and what is loaded
        is copied. A plain `torch.optim` state dict loads with
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
        # torch keeps loaded tensors that fit, so steps would write into the caller's dict.
        native = copy.deepcopy({key: state_dict[key] for key in STATE_DICT_KEYS[:2]})
        self.optimizer.load_state_dict(native)
        anchor = next(p for group in self.optimizer.param_groups for p in group["params"])
        for variable in variables:
            if variable.backend != "torch":  # a fresh wrapper's scalars, made on NumPy
                variable.move_to(anchor)
            variable.assign(saved[variable.path])

    def stateless_apply(
        self,
        optimizer_variables: Sequence[Array],
        grads: Sequence[Array | None],
        trainable_variables: Sequence[Array],
    ) -> tuple[list[Array], list[Array]]:
        """Not supported: raises `NotImplementedError` (see the class docstring)."""
        raise NotImplementedError(STATELESS_MESSAGE)

    def get_config(self) -> Config:
        """Not supported: raises `NotImplementedError`; recreate it and use `load_state_dict`."""
        raise NotImplementedError(
            f"TorchAdapter cannot be serialized: it wraps a live "
            f"{type(self.optimizer).__name__} holding the model's parameters, which no config "
            "can describe. Recreate it in code and save its state with `state_dict()` "
            "(torch.save) instead."
        )

    def save_own_variables(self, store: MutableMapping[str, Array]) -> None:
        """Not supported: raises `NotImplementedError`; use `state_dict()`."""
        raise NotImplementedError(store_message("save_own_variables", self.optimizer))

    def load_own_variables(self, store: Mapping[str, Array]) -> None:
        """Not supported: raises `NotImplementedError`; use `load_state_dict()`."""
        raise NotImplementedError(store_message("load_own_variables", self.optimizer))

    def exclude_from_weight_decay(
        self,
        var_list: Sequence[Variable | Array] | None = None,
        var_names: Sequence[str] | None = None,
    ) -> None:
        """Not supported: raises `NotImplementedError`; use a param group with `weight_decay=0`."""
        raise NotImplementedError(
            "TorchAdapter applies no weight decay of its own: the native "
            f"{type(self.optimizer).__name__} does. Put the parameters to exclude in a param "
            "group with weight_decay=0."
        )


_ABSENT = object()


def _is_torch_optimizer(optimizer):
    return isinstance(optimizer, _torch().optim.Optimizer)


adapters.register(_is_torch_optimizer, TorchAdapter)


def _tensor(value):
    """`value` (a copy) as a tensor, for `torch.load(..., weights_only=True)`."""
    torch = _torch()
    return value if torch.is_tensor(value) else torch.from_numpy(np.asarray(value))
