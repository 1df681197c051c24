"""`dynamic_loss_scale`: dynamic loss scaling as an optax transformation.

A thin adapter: the unscale, the finite check and the scale rule are the
ones every lossscale interface runs (the JAX backend's `unscale` and
`all_finite`, `mixed_precision.next_loss_scale`); what is added here is the
optax shape of the step (pure `init` / `update` over pytrees) and the skip
(`gate.gated_update`: selects XLA runs in place, no `lax.cond`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from lossscale import validation
from lossscale.backends import get_ops
from lossscale.mixed_precision import diagnostics, inspection
from lossscale.mixed_precision.loss_scale import (
    LossScalePolicy,
    LossScaleState,
    may_apply,
    next_loss_scale,
    replaced,
    state_fields,
)
from lossscale.optax import checks, gate, placement
from lossscale.optax.state import DynamicLossScaleState

_ops = get_ops("jax")


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    initial_scale: float = 2.0**15,
    dynamic_growth_steps: int = 2000,
    *,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    hysteresis: int = 1,
    min_scale: float | None = None,
    max_scale: float | None = None,
    max_consecutive_skips: int | None = None,
    growth_policy: str = "fixed",
    telemetry: bool = False,
    diagnostics_every: int | None = None,
    history_length: int = 8,
    axis_name: str | tuple[str, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax transformation with dynamic loss scaling.

    Differentiate `scale_loss(loss, state)`; `update` then does:

    ```
    grads = grads / scale                # in the wider of the gradient's and
                                         # the parameter's dtype
    if all(isfinite(grads)):             # checked after unscaling
        updates, inner_state = inner.update(grads, inner_state, params)
        counter += 1; every dynamic_growth_steps finite steps: scale *= growth_factor
    else:                                # the step is skipped
        updates = -0.0 everywhere        # p + (-0.0) is p, bit for bit, -0.0 included
        inner_state unchanged            # not even optax's count moves
        counter = 0; scale *= backoff_factor (after `hysteresis` overflows in a row)
    ```

    The scale follows lossscale's one state machine
    (`lossscale.mixed_precision.next_loss_scale`): the defaults are Keras's
    (2^15, doubled after 2000 finite steps, halved on overflow), with its two
    guards (no growth to a non-finite scale, no backoff below the smallest
    normal float32). Apply the updates with `optax.apply_updates` (or
    `TrainState.apply_gradients`, `nnx.Optimizer.update`,
    `eqx.apply_updates`).

    `init` is pure: it runs under `jax.jit`, `jax.vmap` and `jax.eval_shape`
    (an abstract restore target for orbax). On concrete sharded parameters
    it places the loss-scale scalars, and the inner state's scalars (optax's
    `count`), replicated over the parameters' mesh; per-parameter state
    follows its parameter. A jitted step therefore compiles once. Under
    sharding the finite check reduces over every shard inside the step, so
    all devices take the same decision.

    Args:
        inner: The `optax.GradientTransformation` to drive, such as
            `optax.adam(1e-3)` or an `optax.chain` (clipping goes in it),
            or an `optax.MultiSteps`. Every transformation of optax and
            `optax.contrib` runs inside (docs/jax.md lists the one
            refused); `optax.lookahead` takes its `LookaheadParams` as
            `params`, and per-example gradients (`optax.contrib.dpsgd`)
            may carry leading axes. A `dynamic_loss_scale` inside it is
            refused.
        initial_scale: Float. The initial loss scale.
        dynamic_growth_steps: Int. After this many consecutive finite
            steps, the scale grows by `growth_factor`.
        growth_factor: Float > 1. Defaults to 2.
        backoff_factor: Float in (0, 1). Defaults to 0.5.
        hysteresis: Int >= 1. Overflowing steps in a row, each skipped,
            before the scale backs off. Defaults to 1.
        min_scale: Float or `None`. A backoff below it records an error:
            every later step is skipped, and `check(state)` raises
            `LossScaleError`.
        max_scale: Float or `None`. Growth stops here.
        max_consecutive_skips: Int or `None`. More skipped steps in a row
            record an error (see `check`).
        growth_policy: `"fixed"` (default) or `"headroom"` (grow only while
            the largest scaled gradient leaves room; see
            `LossScalePolicy`).
        telemetry: Boolean. Record skip counters, the last scales and,
            for each overflow of the window, its step, which parameters had
            non-finite gradients and whether the loss was finite (known when
            `update` is given the loss as `value=`, optax's name for it;
            read with `summary(state)`). On whenever a fail-fast limit is
            set.
        diagnostics_every: Int or `None`. Every this many steps, measure
            each parameter's scaled gradient against float16's range, in
            the state (under `jit`: a `lax.cond`, so other steps do not pay
            for it); `summary(state)["float16_range"]`.
        history_length: Int in [1, 30]. Scales and overflows kept.
        axis_name: Inside `shard_map` or `pmap`, where each device holds
            its own block of the gradients (model parallelism), the mapped
            axis name (or a tuple of them) whose devices must agree on
            every skip: the finite flag is combined with `lax.pmin`, the
            peaks the policy reads with `lax.pmax`, so the loss-scale state
            stays replicated. `None` (default): global arrays under `jit`,
            or gradients already averaged over the axis.

    Returns:
        An `optax.GradientTransformationExtraArgs`; extra keyword arguments
        of `update` (a line search's `value`, `grad`, `value_fn`: unscaled)
        go to `inner`. A skipped step leaves the inner state bit for bit;
        an applied one matches `inner.update` jitted alone to within a few
        units in the last place (most bit for bit; see docs/jax.md).

    Examples:
        >>> import jax.numpy as jnp, optax, lossscale.optax as lso
        >>> tx = lso.dynamic_loss_scale(optax.sgd(0.5), initial_scale=4.0)
        >>> params = {"w": jnp.array([1.0, -0.0])}
        >>> state = tx.init(params)
        >>> grads = {"w": jnp.array([4.0, 8.0])}  # gradients of scale_loss(loss, state)
        >>> updates, state = tx.update(grads, state, params)
        >>> optax.apply_updates(params, updates)["w"], float(lso.loss_scale(state))
        (Array([ 0.5, -1. ], dtype=float32), 4.0)
        >>> updates, state = tx.update({"w": jnp.array([jnp.inf, 0.0])}, state, params)
        >>> optax.apply_updates(params, updates)["w"], float(lso.loss_scale(state))
        (Array([ 1., -0.], dtype=float32), 2.0)
    """
    arguments = dict(locals())  # first: holds exactly the named arguments
    settings = {f.name: arguments[f.name] for f in dataclasses.fields(LossScalePolicy)}
    validation.check_axis_name(axis_name, None)
    inner = checks.inner_transformation(inner)
    policy = LossScalePolicy(**settings)
    inner = optax.with_extra_args_support(inner)
    unscale = _unscaler(policy)

    def init_fn(params):
        like = placement.anchor(params)
        inner_state = placement.replicate_uncommitted(inner.init(params), like)
        checks.check_inner_init(inner_state)
        named = policy.records_details or policy.diagnoses
        paths = leaf_paths(checks.like_gradients(params)) if named else ()
        return DynamicLossScaleState(
            _initial_state(policy, len(paths), like), inner_state, policy, paths
        )

    def update_fn(updates, state, params=None, **extra_args):
        checks.check_state(state, policy)
        leaves, treedef, dtypes = checks.check_updates(updates, params, state)
        checks.check_inner_state_matches(inner, state.inner_state, params)
        scale = state.scale
        current = _observed(
            state.loss_scale_state, leaves, policy, extra_args.get("value"), axis_name
        )
        finite, peak, variable_finite = _inspect(leaves, dtypes, scale, policy)
        if axis_name is not None:  # each device's own block: one decision over the axes
            finite = _ops.all_true(finite, axis_name)
            peak = None if peak is None else _ops.all_max(peak, axis_name)
            variable_finite = inspection.agreed_flags(_ops, variable_finite, axis_name)
        # A barrier keeps XLA from fusing the reduction behind the decision
        # into each consumer.
        applied = jax.lax.optimization_barrier(may_apply(_ops, current, finite, policy))
        grads = _sanitised(applied, unscale(leaves, dtypes, scale), treedef)
        new_updates, new_inner = gate.gated_update(
            inner.update,
            applied,
            grads,
            state.inner_state,
            params,
            extra_args,
            check=checks.inner_output_check(state.inner_state),
        )
        measured = diagnostics.due(policy, current.steps) if policy.diagnoses else None
        new_loss_scale = next_loss_scale(
            _ops,
            current,
            finite,
            policy,
            peak=peak,
            variable_finite=variable_finite,
            measured=measured,
        )
        return new_updates, DynamicLossScaleState(new_loss_scale, new_inner, policy, state.paths)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _observed(current, leaves, policy, loss, axis_name):
    """`current` with this step's loss flag (telemetry) and float16 range (when due) in it.

    The range is measured on the scaled gradients under a `lax.cond`: a step
    that is not due runs none of it. With `axis_name`, over the devices
    (`diagnostics.over_axes`).
    """
    if policy.records_details and loss is not None:
        flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(loss)]
        finite = functools.reduce(jnp.logical_and, flags, jnp.asarray(True))
        if axis_name is not None:  # each device's own loss: finite only if all are
            finite = _ops.all_true(finite, axis_name)
        current = replaced(current, loss_finite=finite.astype(jnp.int32))
    if not policy.diagnoses:
        return current
    old = tuple(getattr(current, name) for name in diagnostics.FIELDS)
    present = [i for i, g in enumerate(leaves) if g.size]

    def measure():
        grads = [leaves[i] for i in present]
        columns = diagnostics.measure_at(_ops, grads, policy.growth_factor, old, present)
        return columns if axis_name is None else diagnostics.over_axes(_ops, columns, axis_name)

    if not present:
        return current
    ranges = jax.lax.cond(diagnostics.due(policy, current.steps), measure, lambda: old)
    return replaced(current, **dict(zip(diagnostics.FIELDS, ranges)))


def _sanitised(applied, unscaled, treedef):
    """The unscaled gradients as a tree, zeros where the step is skipped.

    The inner update then only ever computes on finite values (its outputs
    are discarded on a skipped step): an inner transformation with a loop
    that runs until a value-dependent condition holds (a line search, a
    `lax.while_loop` on a norm) ends, where inf or NaN could keep it going.
    """
    return jax.tree_util.tree_unflatten(
        treedef, [jnp.where(applied, g, jnp.zeros((), g.dtype)) for g in unscaled]
    )


def _unscaler(policy):
    """`unscale(grads, dtypes, scale)`: each gradient divided by `scale`, cast to its dtype.

    The JAX backend's `unscale`, by the exact reciprocal where every scale
    the policy can reach is a power of two (Keras's defaults: 2^15, doubled,
    halved, floored at 2^-126; see `LossScalePolicy.scales_are_powers_of_two`).
    """
    by_reciprocal = policy.scales_are_powers_of_two

    def unscale(grads, dtypes, scale):
        unscaled = _ops.unscale(grads, scale, reciprocal=by_reciprocal)
        return [u.astype(dtype) for u, dtype in zip(unscaled, dtypes)]

    return unscale


def leaf_paths(tree):
    """`/`-joined key paths of the array leaves of `tree`, in leaf order."""
    return tuple(
        jax.tree_util.keystr(path, simple=True, separator="/")
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    )


def _initial_state(policy, count, like):
    """The `LossScaleState` a policy starts from, placed like `like` (or not at all)."""
    values = {}
    for f in state_fields(policy):
        meta = f.metadata
        value = policy.initial_scale if meta["initial"] is None else meta["initial"]
        if meta["per"] == "vector":
            values[f.name] = _ops.full((count,), value, meta["dtype"], like=like)
            continue
        number = {"step": None, "history": policy.history_length, "variable": count}[meta["per"]]
        scalars = [_ops.full((), value, meta["dtype"], like=like) for _ in range(number or 1)]
        values[f.name] = scalars[0] if number is None else tuple(scalars)
    return LossScaleState(**values)


def _finite_in(group, dtype, scale):
    """Whether every gradient of `group`, divided by `scale` and cast to `dtype`, is finite.

    For float32 and float64 that is whether the float32 division is
    finite (the peaks are float32): the backend's `finite_unscaled`, which
    settles most steps with sums (see its doc). A narrower dtype's range
    is checked on the divided peak, cast to it.
    """
    if dtype in (jnp.float32, jnp.float64):
        return _ops.finite_unscaled(group, scale)
    return _ops.isfinite((_ops.max_abs(group) / scale).astype(dtype))


def _inspect(leaves, dtypes, scale, policy):
    """`(finite, peak, variable_finite)` of the gradients for `next_loss_scale`.

    The flag alone is one check per unscaled dtype (`_finite_in`); a
    statistic (the headroom policy's peak, telemetry's per-leaf flags) is
    `inspection.inspect` of each leaf's largest scaled magnitude (each
    dtype's, without telemetry): each scaled gradient read once, and a
    finite gradient that overflows when unscaled counts as an overflow.
    """
    if policy.records_details:
        peaks = [_ops.max_abs([g]) if g.size else None for g in leaves]
        return inspection.inspect(_ops, peaks, [jnp.dtype(d).name for d in dtypes], scale, policy)
    # One reduction per unscaled dtype, not per gradient: on CPU each is
    # several XLA thunks.
    groups = {}
    for g, d in zip(leaves, dtypes):
        groups.setdefault(jnp.dtype(d), []).append(g)
    if policy.growth_policy != "headroom":  # the flag alone
        flags = [_finite_in(group, dtype, scale) for dtype, group in groups.items()]
        finite = functools.reduce(jnp.logical_and, flags, jnp.asarray(True))
        return finite, None, ()
    peaks = [_ops.max_abs(group) for group in groups.values()]
    return inspection.inspect(_ops, peaks, [d.name for d in groups], scale, policy)
