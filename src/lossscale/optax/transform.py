"""`dynamic_loss_scale`: dynamic loss scaling as an optax transformation.

The unscale, finite check and scale rule are every interface's; added here is
the optax shape of the step and the skip (`gate.gated_update`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from lossscale import validation
from lossscale.backends import get_ops
from lossscale.mixed_precision import diagnostics, step
from lossscale.mixed_precision import state as state_layout
from lossscale.mixed_precision.loss_scale import LossScalePolicy, LossScaleState, replaced
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

    The scale follows `lossscale.mixed_precision.next_loss_scale`, with
    Keras's defaults. `init` is pure (`jax.jit`, `jax.vmap`,
    `jax.eval_shape`); on sharded parameters it replicates the scalars over
    the parameters' mesh, so a jitted step compiles once.

    Args:
        inner: The `optax.GradientTransformation` to drive, such as
            `optax.adam(1e-3)`, an `optax.chain` (clipping goes in it) or an
            `optax.MultiSteps` (docs/jax.md lists the one transformation
            refused). A `dynamic_loss_scale` inside it is refused.
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
        telemetry: Boolean. Record skip counters, the last scales and, per
            overflow, its step, the non-finite parameters and whether the
            loss (`update`'s `value=`) was finite; read with
            `summary(state)`. On whenever a fail-fast limit is set.
        diagnostics_every: Int or `None`. Every this many steps, measure
            each parameter's scaled gradient against float16's range
            (`summary(state)["float16_range"]`).
        history_length: Int in [1, 30]. Scales and overflows kept.
        axis_name: Inside `shard_map` or `pmap`, where each device holds
            its own block of the gradients, the mapped axis name (or a
            tuple of them) whose devices must agree on every skip. `None`
            (default): global arrays under `jit`.

    Returns:
        An `optax.GradientTransformationExtraArgs`; extra keyword arguments
        of `update` go to `inner`. A skipped step leaves the inner state
        bit for bit.

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
        skipped = _ops.full((), False, "bool", like=like)
        return DynamicLossScaleState(
            _initial_state(policy, len(paths), like), skipped, inner_state, policy, paths
        )

    def update_fn(updates, state, params=None, **extra_args):
        checks.check_state(state, policy)
        leaves, treedef, dtypes = checks.check_updates(updates, params, state)
        checks.check_inner_state_matches(inner, state.inner_state, params)
        current = _with_loss(state.loss_scale_state, policy, extra_args.get("value"), axis_name)
        gradients = step.Gradients(
            leaves,
            divided=[True] * len(leaves),
            index_of=_same_index,
            variable_count=len(leaves),
            unscale="after_check",
            divide_fn=lambda grads, scale: unscale(grads, dtypes, scale),
            unscaled_dtypes=[jnp.dtype(d).name for d in dtypes],
        )

        def inner_step(decision):
            # Keeps XLA from fusing the reduction behind the decision into each consumer.
            applied = jax.lax.optimization_barrier(decision.keep)
            new_updates, new_inner = gate.gated_update(
                inner.update,
                applied,
                _sanitised(applied, decision.grads, treedef),
                state.inner_state,
                params,
                extra_args,
                check=checks.inner_output_check(state.inner_state),
            )
            return new_updates, jnp.logical_not(applied), new_inner

        new_loss_scale, (new_updates, skipped, new_inner) = step.run(
            _ops,
            policy,
            current,
            gradients,
            inner_step,
            participants=_participants(axis_name),
            due=diagnostics.due(policy, current.steps) if policy.diagnoses else None,
        )
        new = DynamicLossScaleState(new_loss_scale, skipped, new_inner, policy, state.paths)
        return new_updates, new

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _with_loss(current, policy, loss, axis_name):
    """`current` with this step's loss flag (finite on every device), where telemetry keeps it."""
    if not policy.records_details or loss is None:
        return current
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(loss)]
    finite = functools.reduce(jnp.logical_and, flags, jnp.asarray(True))
    if axis_name is not None:
        finite = _ops.all_true(finite, axis_name)
    return replaced(current, loss_finite=finite.astype(jnp.int32))


def _participants(axis_name):
    """Each device's own block of the gradients, inside `shard_map` / `pmap`: one decision."""
    if axis_name is None:
        return step.Participants()
    return step.Participants(axis_name, per_variable=True, measurements="axes")


def _same_index(i):
    return i  # leaf i is parameter i


def _sanitised(applied, unscaled, treedef):
    """The unscaled gradients as a tree, zeros where the step is skipped.

    Finite inputs keep value-dependent loops in the inner update (a line search) finite.
    """
    return jax.tree_util.tree_unflatten(
        treedef, [jnp.where(applied, g, jnp.zeros((), g.dtype)) for g in unscaled]
    )


def _unscaler(policy):
    """`unscale(grads, dtypes, scale)`: each gradient divided by `scale`, cast to its dtype.

    By the exact reciprocal where every reachable scale is a power of two.
    """
    by_reciprocal = policy.scales_are_powers_of_two

    def unscale(grads, dtypes, scale):
        unscaled = _ops.unscale(grads, scale, reciprocal=by_reciprocal)
        return [u.astype(dtype) for u, dtype in zip(unscaled, dtypes)]

    return unscale


def leaf_paths(tree):
    """`/`-joined key paths of the leaves of `tree` (an NNX `Variable`'s, not its `.value`'s)."""
    return tuple(
        jax.tree_util.keystr(_without_value_key(path), simple=True, separator="/")
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    )


def _without_value_key(path):
    last = path[-1] if path else None
    wrapped = isinstance(last, jax.tree_util.GetAttrKey) and last.name == "value"
    return path[:-1] if wrapped and len(path) > 1 else path


def _initial_state(policy, count, like):
    """The `LossScaleState` a policy starts from, placed like `like` (or not at all)."""

    def make(spec):
        _, _, dtype, initial, shape, _ = spec
        value = policy.initial_scale if initial is None else initial
        return _ops.full(shape, value, dtype, like=like)

    specs = state_layout.variable_specs(policy, [""] * count)
    return LossScaleState(**state_layout.holders_of(specs, make))
