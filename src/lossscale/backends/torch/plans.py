"""The tensor lists torch's multi-tensor kernels take, kept between steps.

torch's `_foreach_*` and `_fused_*` kernels take lists of tensors on one
device and of one dtype. `plan(params, slots, cache)` splits the variables
of one step into such groups, each holding the parameter storages and the
matching slot storages (`slots[name][i]` beside `params[i]`).

Building the lists costs a Python loop over every variable; a model with
hundreds of small tensors would pay it on every step. So a plan is kept in
the optimizer's kernel `cache` and reused while it still describes the
step: the same variables in the same order, each variable and slot still
bound to the same tensor. `stateless_apply` binds copies for the length of one call, a load or
a device move may replace a storage; the identity check (a C-level `is`
over every storage, tens of microseconds for hundreds of tensors) sees
every such rebinding and the plan is rebuilt.

`Writer` performs a kernel's writes: in place when the step has no `keep`
flag, and as `where(keep, new, old)` into the same storage when it has one,
so a skipped step leaves every tensor bit for bit as it was.
"""

import operator
import threading

import torch

from lossscale.backends.torch import dtensors, layout, multi, ops

_storage_of = operator.attrgetter("storage")


class Group:
    """Variables of one device and dtype, with their slots.

    Attributes:
        device, dtype: Those of the parameters (and slots) in the group.
        indices: Positions of the group's variables in the `variables` (and
            `grads`) list the plan was made for.
        params: The parameters' storages.
        slots: `{slot name: [storage, ...]}`, aligned with `params`.
        dense: Whether every parameter is `layout.dense` and each of its
            slots laid out as it is: what torch's fused kernels, which walk
            each tensor's memory as one block, need (else the `foreach`
            kernels, which follow any strides).
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
        """A 0-d tensor of the group's dtype and device, kept with the plan.

        Written by `foreach.step_count` each step: `torch.add(..., out=)`
        casts an integer sum into it in the same kernel.
        """
        if self._step is None:
            self._step = torch.empty((), dtype=self.dtype, device=self.device)
        return self._step

    def pair_buffer(self):
        """`(pair, (first, second))`: a 2-element tensor of the group's dtype, and views of it.

        Kept with the plan, views made once: a kernel writes a pair of
        scalars into it (`torch.sub(..., out=pair)`) and reads each element
        without an `unbind` or `select` per step.
        """
        if self._pair is None:
            pair = torch.empty(2, dtype=self.dtype, device=self.device)
            self._pair = (pair, (pair[0], pair[1]))
        return self._pair

    def grads(self, grads):
        """This group's gradients, cast to its dtype as `update_step` does.

        Each is laid out as its parameter (`layout.in_layout_of`: copied
        where it is not), so a kernel may walk both as one block and write
        the gradient in place.
        """
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
    """Returns the (cached) `Plan` of `params` and their `slots`.

    Args:
        params: The `Variable`s of this step, in order.
        slots: `{slot name: [Variable, ...]}`, each list aligned with `params`.
        cache: The optimizer's kernel cache (a dict kept between steps).
        purpose: Which kernel the plan is for: plans for other lists of
            variables (weight decay's, say) are kept apart.
    """
    if torch.compiler.is_compiling():
        # A compiled step builds its lists once, at trace time; the cache
        # (identity checks) is for eager steps.
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
        # Detached aliases share memory (and version counter) with the
        # storages; torch's kernels take them several times faster than
        # `nn.Parameter`s, whose in-place updates go through autograd checks.
        params = [storage.detach() for _, storage, _ in entries]
        group_slots = {
            name: [own[k].storage.detach() for _, _, own in entries]
            for k, name in enumerate(slot_names)
        }
        groups.append(Group(device, dtype, indices, params, group_slots, whole))
    return Plan(variables, watched, groups)


def derived(cache, key, source, make):
    """`make(source)`, kept in `cache` under `key` while `source` is the same, unwritten tensor.

    For 0-d values derived from a learning rate, which moves only when a
    schedule or a user sets it: the tensor itself is kept with its version
    counter (which every in-place write advances), so a step pays nothing
    for them. Made at every call for a Python number, under `torch.compile`
    (the compiler folds the arithmetic into the step) and for an inference
    tensor (which keeps no version counter).
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
    # The tensor itself is kept: an `is` check on a live object cannot be
    # fooled by a new tensor at a recycled address.
    cache[key] = (source, version, value)
    return value


# Under a `keep` flag, the small tensors of a write are gathered into one flat
# buffer pair and selected there at once: four kernels whatever their number
# (a launch per tensor would make a step of many small tensors launch-bound).
# A tensor too large to pack takes its own `where`, which is then memory-bound.
# Which tensors are packed is `multi.split_small`'s rule, the finite check's
# (two float32 buffers of at most `multi.PACK_CAPACITY` elements, kept between
# steps, per thread, for the last few tensor lists).
_SELECT_BUFFERS = threading.local()
_BUFFERS_KEPT = 4


class Writer:
    """In-place multi-tensor writes that take effect only where `keep` holds.

    Each method writes into `targets` and returns the values written (what a
    later read of the targets would see if the step is taken), so the rest
    of a kernel can go on computing from them.

    Args:
        keep: None (write), or the step's boolean 0-d tensor.
        device: The device of the tensors written.
        found_inf: None, or `keep` as torch's AMP flag (float32, 1.0: skip),
            made by the caller's check: `found_inf()` returns it.
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
        # torch has no multi-tensor select: small tensors are selected in a
        # packed copy, large ones each in its own memory.
        keep = self.keep
        small, large = multi.split_small(targets)
        # Packing copies into plain buffers: not for DTensors (sharded state),
        # nor while torch.compile traces (the compiler fuses the selects).
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
        """`1.0` where the step is skipped, for kernels taking a `found_inf` flag.

        What torch's fused optimizer kernels take (they skip the update where
        it is exactly 1.0), as `torch.amp.GradScaler` passes it.
        """
        if self.keep is None:
            return None
        if self._found_inf is not None:  # the caller's check made it: no select
            found = self._found_inf
            return found if found.device == self.device else found.to(self.device)
        # One kernel: a select between two cached constants.
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
