"""Runs lossscale under `tf.distribute.MirroredStrategy` on two logical CPUs (not a test module).

TensorFlow splits a CPU into logical devices only before it first runs an
op, so `tests/backends/tensorflow/test_replicas.py` runs this file in a fresh
process: `python -m tests.workers.tensorflow_mirrored_worker SCENARIO...` prints one JSON
line, `{scenario: what it observed}`.

Every step all-reduces the gradients (a mean over the replicas, as a
data-parallel step does) and then, where the pattern says so, makes one
replica's reduced gradient overflow: the replicas see different gradients
and must still take the same skip.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import lossscale as ls  # noqa: E402

DEVICES = ["/cpu:0", "/cpu:1"]
# Per step: which replica's gradient overflows (None: none).
PATTERN = [None, 1, None, 0, None, None, 1, None]
SHAPES = [(3, 2), (2,)]


def _data():
    rng = np.random.default_rng(0)
    weights = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    # One batch per replica per step: the replicas' gradients differ.
    batches = rng.normal(size=(len(PATTERN), 2, 4, 3)).astype(np.float32)
    return weights, batches


def _optimizer(name):
    inner = {
        "adam": lambda: ls.optimizers.Adam(0.05),
        "sgd": lambda: ls.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    }[name.split("-")[0]]()
    settings = {"growth_policy": "headroom"} if name.endswith("headroom") else {}
    return ls.LossScaleOptimizer(inner, initial_scale=64.0, dynamic_growth_steps=2, **settings)


def _loss(variables, x):
    w, b = variables
    return tf.reduce_mean(tf.square(x @ w + b))


def _local(strategy, variable):
    return [np.asarray(x).tolist() for x in strategy.experimental_local_results(variable)]


_STRATEGIES = {}


def _strategy(devices):
    # One strategy per device list for the whole process: two strategies
    # over the same devices would reuse each other's collective instance
    # keys and abort each other's all-reduces.
    key = tuple(devices)
    if key not in _STRATEGIES:
        _STRATEGIES[key] = tf.distribute.MirroredStrategy(devices)
    return _STRATEGIES[key]


def mirrored(name, compiled=True, jit_compile=False, devices=DEVICES, no_merge_call=False):
    """Trains under the strategy; returns per-step replica values and the reference's."""
    weights, batches = _data()
    strategy = _strategy(devices)
    if no_merge_call:
        # What MirroredStrategy does under XLA on GPUs (`_use_merge_call` is
        # False there): collectives in replica context, no merge_call. Any
        # merge_call in the step now fails the scenario.
        strategy.extended._use_merge_call = lambda: False

        def refuse(*args, **kwargs):
            raise AssertionError("merge_call was called")

        tf.distribute.ReplicaContext.merge_call = refuse
    with strategy.scope():
        variables = [tf.Variable(w) for w in weights]
    opt = _optimizer(name)
    opt.build(variables)  # outside the scope: the slots follow the model variables
    replicas = len(devices)

    def replica_step(x, poisoned):
        context = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(_loss(variables, x))
        grads = context.all_reduce("mean", tape.gradient(scaled, variables))
        mine = tf.equal(context.replica_id_in_sync_group, poisoned)
        grads[0] = tf.where(mine, tf.fill(tf.shape(grads[0]), np.float32(np.inf)), grads[0])
        opt.apply(grads, variables)

    def step(batch, poisoned):
        inputs = strategy.experimental_distribute_values_from_function(
            lambda ctx: batch[ctx.replica_id_in_sync_group]
        )
        strategy.run(replica_step, args=(inputs, poisoned))

    if compiled:
        step = tf.function(step, jit_compile=jit_compile)
    history = []
    for batch, poisoned in zip(batches, PATTERN):
        step(tf.constant(batch[:replicas]), tf.constant(-1 if poisoned is None else poisoned))
        history.append(
            {
                "variables": [_local(strategy, v) for v in variables],
                "slots": [_local(strategy, v.storage) for v in opt.inner_optimizer.variables],
                "scale": _local(strategy, opt.dynamic_scale.storage),
                "iterations": _local(strategy, opt.iterations.storage),
            }
        )
    return {
        "history": history,
        "reference": _reference(name, replicas),
        "kinds": sorted({type(v.storage).__name__ for v in opt.variables}),
        "traces": step.experimental_get_tracing_count() if compiled else None,
    }


def _reference(name, replicas):
    """The same steps on one device, without a strategy: any overflow skips."""
    weights, batches = _data()
    variables = [tf.Variable(w) for w in weights]
    opt = _optimizer(name)
    history = []
    for batch, poisoned in zip(batches, PATTERN):
        per_replica = []
        for x in batch[:replicas]:
            with tf.GradientTape() as tape:
                scaled = opt.scale_loss(_loss(variables, tf.constant(x)))
            per_replica.append(tape.gradient(scaled, variables))
        grads = [tf.add_n(list(gs)) / replicas for gs in zip(*per_replica)]
        if poisoned is not None and poisoned < replicas:
            grads[0] = tf.fill(tf.shape(grads[0]), np.float32(np.inf))
        opt.apply(grads, variables)
        history.append(
            {
                "variables": [np.asarray(v.numpy()).tolist() for v in variables],
                "scale": float(opt.dynamic_scale),
                "iterations": int(opt.iterations),
            }
        )
    return history


def lazy_build():
    """A first `apply` inside `strategy.run` (the optimizer not built yet)."""
    strategy = _strategy(DEVICES)
    with strategy.scope():
        w = tf.Variable(np.ones(2, np.float32))
    opt = _optimizer("adam")

    @tf.function
    def step():
        strategy.run(lambda: opt.apply([tf.ones(2) * 64.0], [w]))

    try:
        step()
    except ValueError as error:
        return {"error": str(error), "built": opt.built}
    return {"error": None, "built": opt.built}


def xla_two_devices():
    """`jit_compile=True` around `strategy.run` over two logical CPUs."""
    try:
        mirrored("adam", jit_compile=True)
    except tf.errors.InvalidArgumentError as error:
        return {"error": str(error).splitlines()[0]}
    return {"error": None}


SCENARIOS = {
    "adam": lambda: mirrored("adam"),
    "sgd": lambda: mirrored("sgd"),
    "adam-headroom": lambda: mirrored("adam-headroom"),
    "eager": lambda: mirrored("adam", compiled=False),
    "no_merge_call": lambda: mirrored("adam", no_merge_call=True),
    "xla_one_device": lambda: mirrored("adam", jit_compile=True, devices=["/cpu:0"]),
    "xla_two_devices": xla_two_devices,
    "lazy_build": lazy_build,
}


if __name__ == "__main__":
    print("RESULT " + json.dumps({name: SCENARIOS[name]() for name in sys.argv[1:]}))
