"""The tensor lists torch's multi-tensor kernels take, kept between steps.

`plan(params, slots, cache)` splits a step's variables into groups of one
device and dtype, each holding the parameter storages and the matching slot
storages. A plan is kept in the optimizer's kernel `cache` and reused while
the same variables and slots are bound to the same tensors (an identity
check sees every rebinding: `stateless_apply`, a load, a device move).

`Writer` performs a kernel's writes: in place, or as `where(keep, new, old)`
into the same storage, so a skipped step leaves every tensor as it was.
"""

import operator
import threading

import torch

from lossscale.backends.torch import dtensors, layout, multi, ops

_storage_of = operator.attrgetter("storage")


class Group:
    """Variables of one device and dtype, with their slots.

    `indices` are the group's positions in the plan's variables; `params` and
    `slots` (`{slot name: [storage, ...]}`) hold storages; `dense`: whether
    every parameter and its slots are laid out alike and `layout.dense`, as
    torch's fused kernels need.
    """

    __slots__ = (
        "device",
        "dtype",
        "indices",
        "params",
        "slots",
        "dense",
        "_contiguous",
        "_whole",
        "_step",
        "_pair",
    )

    def __init__(self, device, dtype, indices, params, slots, whole):
        self.device, self.dtype, self.indices = device, dtype, indices
        self.params, self.slots = params, slots
        self._contiguous = layout.all_contiguous(params)
        self.dense = all(
            layout.dense(p) and all(s[i].stride() == p.stride() for s in slots.values())
            for i, p in enumerate(params)
        )
        self._whole = whole
        self._step = None
        self._pair = None

    def step_buffer(self):
        """A 0-d tensor of the group's dtype and device, kept (`foreach.step_count`)."""
        if self._step is None:
            self._step = torch.empty((), dtype=self.dtype, device=self.device)
        return self._step

    def pair_buffer(self):
        """`(pair, (first, second))`: a 2-element tensor of the group's dtype, and views of it."""
        if self._pair is None:
            pair = torch.empty(2, dtype=self.dtype, device=self.device)
            self._pair = (pair, (pair[0], pair[1]))
        return self._pair

    def grads(self, grads):
        """This group's gradients, cast as `update_step` does and laid out as the params."""
        if not self._whole:
            grads = [grads[i] for i in self.indices]
        dtype = self.dtype
        cast = [g if g.dtype == dtype else g.to(dtype) for g in map(ops.unwrap, grads)]
        if not self.dense:  # the `foreach` kernels follow any strides
            return cast
        return layout.in_layout_of(cast, self.params, self._contiguous)


class Plan:
    """Groups for one list of variables, valid while no storage is rebound."""

    def __init__(self, variables, watched, groups):
        self.variables = list(variables)
        self.groups = groups
        self._watched = watched
        self._storages = [w.storage for w in watched]

    def matches(self, variables):
        return (
            len(variables) == len(self.variables)
            and all(map(operator.is_, variables, self.variables))
            and all(map(operator.is_, map(_storage_of, self._watched), self._storages))
        )


def plan(params, slots, cache, purpose="update"):
    """Returns the `Plan` of `params` and their `slots`, kept in `cache` (per `purpose`)."""
    if torch.compiler.is_compiling():
        # A compiled step builds its lists once, at trace time.
        return _make(params, slots)
    key = ("torch plan", purpose, tuple(slots))
    cached = cache.get(key)
    if cached is not None and cached.matches(params):
        return cached
    cache[key] = made = _make(params, slots)
    return made


def _make(variables, slots):
    slot_names = tuple(slots)
    slot_lists = [slots[name] for name in slot_names]
    watched = list(variables)
    members = {}
    for position, variable in enumerate(variables):
        own = [slot_list[position] for slot_list in slot_lists]
        watched.extend(own)
        storage = variable.storage
        members.setdefault((storage.device, storage.dtype), []).append((position, storage, own))
    whole = len(members) == 1
    groups = []
    for (device, dtype), entries in members.items():
        indices = [position for position, _, _ in entries]
        # Detached aliases: faster in torch's kernels than `nn.Parameter`s.
        params = [storage.detach() for _, storage, _ in entries]
        group_slots = {
            name: [own[k].storage.detach() for _, _, own in entries]
            for k, name in enumerate(slot_names)
        }
        groups.append(Group(device, dtype, indices, params, group_slots, whole))
    return Plan(variables, watched, groups)


def derived(cache, key, source, make):
    """`make(source)`, kept in `cache` under `key` while `source` is the same, unwritten tensor.

    The tensor is kept with its version counter. Made at every call for a
    Python number, under `torch.compile` and for an inference tensor.
    """
    if (
        not isinstance(source, torch.Tensor)
        or torch.compiler.is_compiling()
        or source.is_inference()
    ):
        return make(source)
    made = cache.get(key)
    version = source._version
    if made is not None and made[0] is source and made[1] == version:
        return made[2]
    value = make(source)
    # The tensor itself: an `is` check cannot be fooled by a recycled address.
    cache[key] = (source, version, value)
    return value


# Under a `keep` flag, the small tensors of a write (`multi.split_small`) are
# selected at once in a flat buffer pair, kept per thread for the last few
# tensor lists: four kernels whatever their number. A large one takes its own `where`.
_SELECT_BUFFERS = threading.local()
_BUFFERS_KEPT = 4


class Writer:
    """In-place multi-tensor writes that take effect only where `keep` (None: always) holds.

    Each method returns the values written; `found_inf` is `keep` in torch's
    AMP form, if the caller made it.
    """

    def __init__(self, keep, device, found_inf=None):
        self._found_inf = found_inf
        if keep is not None:
            if keep.dtype != torch.bool:
                keep = keep.to(torch.bool)
            if keep.device != device:
                keep = keep.to(device)
        self.keep = keep
        self.device = device

    def add(self, targets, values):
        if self.keep is None:
            torch._foreach_add_(targets, values)
            return targets
        return self._select(targets, torch._foreach_add(targets, values))

    def sub(self, targets, values):
        if self.keep is None:
            torch._foreach_sub_(targets, values)
            return targets
        return self._select(targets, torch._foreach_sub(targets, values))

    def set(self, targets, values):
        if self.keep is None:
            torch._foreach_copy_(targets, values)
            return targets
        return self._select(targets, values)

    def _select(self, targets, values):
        keep = self.keep
        small, large = multi.split_small(targets)
        # Not for DTensors, nor while torch.compile traces (it fuses the selects).
        packable = not torch.compiler.is_compiling() and not dtensors.is_dtensor(targets[0])
        if len(small) > 1 and packable:
            new, new_views, old, old_views = _buffers([targets[i] for i in small])
            torch._foreach_copy_(new_views, [values[i] for i in small])
            torch._foreach_copy_(old_views, [targets[i] for i in small])
            torch.where(keep, new, old, out=old)
            torch._foreach_copy_([targets[i] for i in small], old_views)
        else:
            large = range(len(targets))
        for i in large:
            torch.where(keep, values[i], targets[i], out=targets[i])
        return values

    def found_inf(self):
        """`1.0` where the step is skipped, as torch's fused kernels take it (`GradScaler`'s)."""
        if self.keep is None:
            return None
        if self._found_inf is not None:  # the caller's check made it: no select
            found = self._found_inf
            return found if found.device == self.device else found.to(self.device)
        return torch.where(
            self.keep,
            ops.constant(0.0, torch.float32, self.device),
            ops.constant(1.0, torch.float32, self.device),
        )


def _buffers(tensors):
    """Two flat buffers for `tensors` (by dtype, device and shapes), with views shaped like them."""
    cache = getattr(_SELECT_BUFFERS, "by_key", None)
    if cache is None:
        cache = _SELECT_BUFFERS.by_key = {}
    first = tensors[0]
    key = (
        first.dtype,
        first.device,
        torch.is_inference_mode_enabled(),
        tuple(t.shape for t in tensors),
    )
    entry = cache.pop(key, None)
    if entry is None:
        sizes = [t.numel() for t in tensors]
        entry = []
        for _ in range(2):
            flat = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
            entry += [flat, [v.view(t.shape) for v, t in zip(flat.split(sizes), tensors)]]
        while len(cache) >= _BUFFERS_KEPT:
            cache.pop(next(iter(cache)))
    cache[key] = entry  # most recently used last
    return entry
