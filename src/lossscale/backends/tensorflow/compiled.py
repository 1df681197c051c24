"""Eager steps traced once: many small ops as one `tf.function` call.

In eager mode every TensorFlow op is a Python dispatch of tens of
microseconds. Adam's `update_step` is about thirty ops per variable, twelve
thousand for a 400-tensor model; the same ops traced into a graph run in
one call. So, when an optimizer steps eagerly on `tf.Variable`s, the
kernels of `kernels` trace their rule once (per optimizer, kept in its
kernel cache, for its variables and hyperparameters) and call the traced
function at every step after that. The rule is the same Python code either
way: the per-variable `update_step`, or a `fused` kernel.

A skipped loss-scale step hands its `keep` flag over as an argument, and
the traced rule runs under `tf.cond` on it: a skipped step writes nothing.

Variables bound to plain tensors (`stateless_apply`) pass their values
into the traced function and take the results back, so a stateless step
runs the same graph as a stateful one. Inside a `tf.function` (the
caller's own) the rule is traced into that graph as it is.

The traced graph runs TensorFlow's ordinary kernels, and equals the eager
ops bit for bit (the tests check every rule): these calls are made with
the graph optimizer's arithmetic rewrites turned off. Grappler would
otherwise rewrite `x / sqrt(y)` as `x * rsqrt(y)` and regroup chains of
additions and of constants, which moves results by a rounding, and
differently for a variable read than for a tensor passed in (so
`stateless_apply` would no longer equal `apply`). A `tf.function` of the
caller's own is optimized as the caller's settings say.

The multi-tensor helpers (`unscale`, `finite_flags`) are pure functions of
their tensors; eagerly, lists of `MIN_TENSORS` or more run as one traced
call (shorter ones cost less op by op).
"""

import contextlib

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

from lossscale.backends._common import bound, unscale_then_check
from lossscale.backends.tensorflow import control, multi, ops

# Below this many tensors an eager helper runs op by op: a traced call
# costs about as much as ten eager ops.
MIN_TENSORS = 8

_PLAIN = (bool, int, float, str, type(None))


def run(rule, static, targets, inputs, cache, extra=(), keep=None):
    """Runs `rule(*static, *inputs)`, traced once when eager; only where `keep` holds.

    Args:
        rule: A module-level function writing only `targets`.
        static: Python objects the rule takes (variables, the reference
            `update_step`, hyperparameters), fixed for one trace.
        targets: Every `Variable` the rule may read or write.
        inputs: Tensors (or lists of tensors) that change between steps.
        cache: The optimizer's kernel cache, where the traced functions live.
        extra: Python values the rule depends on (part of the cache key).
        keep: None, or the step's boolean flag.
    """
    if not tf.executing_eagerly():
        if keep is None:
            rule(*static, *inputs)
        else:
            control.cond(keep, lambda: rule(*static, *inputs), None, targets)
        return
    # tf.Variables are captured by the traced function and written there;
    # variables bound to tensors (`stateless_apply`) pass in and out.
    held = [ops.is_variable(v.storage) for v in targets]
    carried = [v for v, is_held in zip(targets, held) if not is_held]
    key = (
        "tensorflow traced",
        rule,
        tuple(map(id, targets)),
        tuple(id(v.storage) if is_held else None for v, is_held in zip(targets, held)),
        tuple(x for x in extra if isinstance(x, _PLAIN)),
    )
    function = cache.get(key)
    if function is None:
        function = cache[key] = _trace(rule, static, carried)
    keep = tf.constant(True) if keep is None else tf.cast(ops.read(keep), tf.bool)
    with _exact_arithmetic():
        new = function(list(inputs), [v.storage for v in carried], keep)
    for v, value in zip(carried, new):
        v.rebind(value)


@contextlib.contextmanager
def _exact_arithmetic():
    """Calls made in here optimize their graphs without rewriting arithmetic.

    Off: the arithmetic optimizer, and constant folding, which also
    regroups constants (`(x * a) * b` as `x * (a * b)`).

    TensorFlow reads the graph optimizer's settings for an eager call of a
    `tf.function` from the context's per-thread function-call options (an
    internal of TensorFlow's eager runtime, stable since 2.0), and applies
    them the first time each traced function runs.
    """
    eager = context.context()
    saved = eager.function_call_options
    config = config_pb2.ConfigProto()
    if saved.config_proto_serialized:
        config.ParseFromString(saved.config_proto_serialized)
    rewrites = config.graph_options.rewrite_options
    rewrites.arithmetic_optimization = rewriter_config_pb2.RewriterConfig.OFF
    rewrites.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
    eager.function_call_options = context.FunctionCallOptions(
        executor_type=saved.executor_type, config_proto=config
    )
    try:
        yield
    finally:
        eager.function_call_options = saved


def _trace(rule, static, carried):
    def step(inputs, values, keep):
        def branch(write):
            def run_branch():
                with bound(carried, values):
                    write()
                    return [v.storage for v in carried]

            return run_branch

        return tf.cond(keep, branch(lambda: rule(*static, *inputs)), branch(lambda: None))

    return tf.function(step)


@tf.function(reduce_retracing=True)
def _traced_unscale(grads, scale):
    return multi.unscale(grads, scale)


@tf.function(reduce_retracing=True)
def _traced_finite_flags(arrays):
    return multi.finite_flags(arrays)


def _many(arrays):
    return len(arrays) >= MIN_TENSORS and tf.executing_eagerly()


def unscale(grads, scale, in_place=False):
    """`multi.unscale`, one traced call for a long eager list."""
    grads = list(grads)
    if _many(grads):
        return list(_traced_unscale(multi.sparse_or_tensors(grads), ops._tensor(scale)))
    return multi.unscale(grads, scale, in_place)


def finite_flags(arrays):
    """`multi.finite_flags`, one traced call for a long eager list."""
    arrays = list(arrays)
    if _many(arrays):
        return _traced_finite_flags([ops._tensor(a) for a in arrays])
    return multi.finite_flags(arrays)


def unscale_checked(grads, scale, in_place=False):
    """`(unscaled, finite, skip)`: `unscale`, then `finite_flags` of the result."""
    return unscale_then_check(unscale, finite_flags, grads, scale, in_place)


def all_finite(arrays):
    """`multi.all_finite`, one traced call for a long eager list."""
    arrays = list(arrays)
    if _many(arrays):
        return _traced_finite_flags([ops._tensor(a) for a in arrays])[0]
    return multi.all_finite(arrays)
