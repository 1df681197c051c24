"""Eager steps traced once: many small ops as one `tf.function` call.

Every eager TensorFlow op is a Python dispatch, so an eager step on
`tf.Variable`s traces its rule once (kept in the optimizer's kernel cache)
and calls the traced function after that, under `tf.cond` on `keep`.
Variables bound to plain tensors (`stateless_apply`) pass in and out, so
both run the same graph; inside the caller's `tf.function` the rule is
traced into it as it is.

The calls turn off Grappler's arithmetic rewrites (`x / sqrt(y)` as
`x * rsqrt(y)`, regrouped sums and constants), so the graph equals the
eager ops bit for bit. Eager multi-tensor helpers on lists of `MIN_TENSORS`
or more run as one traced call too.
"""

import contextlib

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

from lossscale.backends._common import bound, unscale_then_check
from lossscale.backends.tensorflow import control, multi, ops

# Below this many tensors an eager helper runs op by op (a traced call costs ~10 ops).
MIN_TENSORS = 8

_PLAIN = (bool, int, float, str, type(None))


def run(rule, static, targets, inputs, cache, extra=(), keep=None):
    """Runs `rule(*static, *inputs)`, traced once when eager; only where `keep` holds.

    `static` (Python objects, fixed for one trace) and `extra` (Python values,
    part of the cache key) join `targets`, every `Variable` the rule may write,
    and `inputs`, the tensors that change between steps.
    """
    if not tf.executing_eagerly():
        if keep is None:
            rule(*static, *inputs)
        else:
            control.cond(keep, lambda: rule(*static, *inputs), None, targets)
        return
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
    """Calls made in here optimize their graphs without arithmetic rewrites or constant folding.

    Set through the eager context's function-call options (internal, stable since TF 2.0).
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
