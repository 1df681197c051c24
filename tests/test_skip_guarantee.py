"""The promise above all others (SPEC section 5): one inf or NaN anywhere skips the step.

Every interface, at every size threshold any backend branches on (JAX's
chunks of small arrays and its sums first for large ones, NumPy's packed,
blocked and threaded kernels, torch's packs), with the bad value at the
first and last element, at a block or chunk boundary and at a random
position; NaN, +inf, -inf, and a finite value that overflows only once
divided by a scale below 1 (TensorFlow's interfaces, whose backend
branches on no size, two of the positions per size); half, single and
double precision (where the backend has them), contiguous and strided
gradients, one bad tensor among many. After every such step the
parameters, the optimizer's state and its step counter are bitwise what
they were, and the scale is halved.

One optimizer per interface and dtype holds a tensor of each size, so each
step reads every size at once and its one bad value sits in one of them.
The multi-process interfaces (a JAX device mesh, DDP, FSDP2,
MirroredStrategy) have their own tests beside their workers
(`test_skip_guarantee_distributed.py`).
"""

import functools

import numpy as np
import pytest

import lossscale as ls

# Both sides of every size threshold in the backends: 4,096 (JAX's small
# arrays), 16,384 (NumPy packs), 65,536 (JAX chunks, torch packs), 131,072
# (NumPy's reduction blocks), 262,144 (NumPy's update blocks, JAX's sums
# first), and one over 1M, odd, so that blocks and vector lanes have tails
# (and NumPy shares it among threads). Three models, so that a step reads
# the sizes of one only (the suite's time is steps times elements). The
# first holds many small tensors too: one bad tensor among many, over more
# than one JAX chunk and one NumPy pack of them.
MODELS = (
    (1, 7, 4095, 4096, 4097, 16383, 16384, 16385) + (1021,) * 70,
    (65535, 65536, 65537, 131071, 131072, 131073),
    (262143, 262144, 262145, 1_048_579),
)
# For a backend that branches on no size (`SAMPLED`): the same sizes, and
# "one bad tensor among many" among 8 small tensors, not 70 (70 only cross
# JAX's chunks and NumPy's packs; TensorFlow traces and compiles each).
SAMPLED_MODELS = (tuple(n for n in MODELS[0] if n != 1021) + (1021,) * 8, *MODELS[1:])
BOUNDARIES = (262144, 131072, 65536, 16384, 4096, 2048)
VALUES = (np.nan, np.inf, -np.inf)
HUGE = np.float32(3e38)  # finite; overflows float32 once divided by a scale below 1
SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)
INITIAL_SCALE = 2.0**15


def bad_cases(sizes, seed, sampled=False):
    """`(tensor index, flat position, value)` for every step: each size, four positions.

    Then, for float32 (`overflows`), a finite value that overflows once
    divided by the scale, which has fallen below 1 by then. `sampled`: two
    positions per size, for a backend that branches on no size: the first
    or the last element (alternately from size to size), and the boundary
    or a random position.
    """
    rng = np.random.default_rng(seed)
    distinct = [i for i, n in enumerate(sizes) if n != 1021]
    cases = []
    for nth, i in enumerate(distinct):
        n = sizes[i]
        boundary = next((b for b in BOUNDARIES if b < n), n // 2)
        positions = [0, n - 1, boundary, int(rng.integers(n))]
        if sampled:
            positions = [positions[nth % 2], positions[2 + (nth + 1) % 2]]
        positions = dict.fromkeys(positions)
        for k, position in enumerate(positions):
            cases.append((i, position, VALUES[(i + k) % len(VALUES)]))
    many = [i for i, n in enumerate(sizes) if n == 1021]
    for value in VALUES if many else ():  # in one of the many small tensors
        cases.append((int(rng.choice(many)), int(rng.integers(1021)), value))
    # Enough halvings to bring the scale below 1 before the overflow cases.
    while len(cases) <= np.log2(INITIAL_SCALE):
        cases.append((distinct[-1], int(rng.integers(sizes[-1])), VALUES[len(cases) % 3]))
    overflows = [distinct[0], distinct[-1]] + ([int(rng.choice(many))] if many else [])
    return cases, [(i, int(rng.integers(sizes[i])), HUGE) for i in overflows]


def make_weights(sizes, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for n in sizes]


@functools.lru_cache(maxsize=2)
def _clean_gradients(sizes, seed, dtype, layout):
    rng = np.random.default_rng(seed)
    grads = []
    for n in sizes:
        # At most the scale in magnitude: finite in float16 too.
        g = (rng.uniform(-1, 1, n) * INITIAL_SCALE).astype(np.float32).astype(dtype)
        if layout == "strided":  # every other element of a buffer twice the size
            buffer = np.zeros(2 * n, dtype)
            buffer[::2] = g
            g = buffer[::2]
        g.flags.writeable = False
        grads.append(g)
    return tuple(grads)


def make_gradients(sizes, seed, dtype, layout, bad=None):
    """Scaled gradients (magnitudes up to 1 once unscaled), one bad value in one of them."""
    grads = list(_clean_gradients(sizes, seed, dtype, layout))
    if bad is not None:
        i, position, value = bad
        g = grads[i].copy() if layout == "contiguous" else grads[i].base.copy()[::2]
        g[position] = value
        grads[i] = g
    return grads


def bitwise_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        view = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
        a, b = a.view(view), b.view(view)
    return np.array_equal(a, b)


def native(backend, x):
    """`x` (a NumPy array, maybe a strided view) as `backend`'s array of its dtype and strides."""
    if backend == "numpy":
        return x.copy() if x.flags.c_contiguous else x.base.copy()[::2]
    if backend == "jax":
        import jax.numpy as jnp

        return jnp.asarray(x)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.constant(x)
    import torch

    # A copy: GradScaler unscales the gradients it is given in place.
    if x.dtype.name == "bfloat16":
        t = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    else:
        t = torch.from_numpy(np.array(x, order="C"))  # a writable copy of the read-only cache
    if not x.flags.c_contiguous:  # the same strides as the NumPy view
        buffer = torch.zeros(2 * x.size, dtype=t.dtype)
        buffer[::2] = t
        t = buffer[::2]
    return t


def run_guarantee(make_interface, dtype, layout, seed=0, sampled=False):
    """Each model: an applied step, then every bad case; checks each skip.

    `sampled`: two bad positions per size instead of four (`bad_cases`),
    in `SAMPLED_MODELS`.
    """
    for sizes in SAMPLED_MODELS if sampled else MODELS:
        interface = make_interface()
        weights = make_weights(sizes, seed)
        if dtype == np.float64:  # float64 gradients of float64 parameters
            weights = [w.astype(np.float64) for w in weights]
        state = interface.start(weights, make_gradients(sizes, seed, dtype, layout))
        reference = interface.snapshot(state)
        scale = interface.scale(state)
        assert scale == INITIAL_SCALE, scale
        cases, overflows = bad_cases(sizes, seed, sampled)
        if dtype == np.float32:
            cases += overflows
        for case in cases:
            if case[2] is HUGE:
                assert scale < 1, "the overflow cases need a scale below 1 by now"
            grads = make_gradients(sizes, seed, dtype, layout, bad=case)
            state = interface.step(state, grads)
            after = interface.snapshot(state)
            for name, before in reference.items():
                assert bitwise_equal(after[name], before), (interface, dtype, layout, case, name)
            new_scale = interface.scale(state)
            assert new_scale == max(scale / 2, SMALLEST_NORMAL), (case, scale, new_scale)
            scale = new_scale


class Interface:
    """One way in: `start` (an applied step), `step`, `snapshot` and `scale` of a state."""

    def __repr__(self):
        return type(self).__name__


# --- LossScaleOptimizer on each backend --------------------------------------


class Wrapper(Interface):
    """`LossScaleOptimizer(Adam)`'s stateful `apply` on `backend`'s arrays."""

    def __init__(self, backend, compile=None):
        self.backend, self.compile = backend, compile

    def __repr__(self):
        return f"Wrapper({self.backend}, {self.compile})"

    def native(self, x):
        return native(self.backend, x)

    def build(self, weights):
        self.variables = [ls.Variable(native(self.backend, w)) for w in weights]
        self.opt = ls.LossScaleOptimizer(ls.optimizers.Adam(learning_rate=1e-3))
        self.opt.build(self.variables)

    def start(self, weights, grads):
        self.build(weights)
        self.apply = lambda g: self.opt.apply(g, self.variables)
        if self.compile is not None:
            import tensorflow as tf

            self.apply = tf.function(self.apply, jit_compile=self.compile == "jit_compile")
        return self.step(None, grads)

    def step(self, state, grads):
        self.apply([self.native(g) for g in grads])
        return None

    def snapshot(self, state):
        from tests.conftest import Backend

        read = Backend(self.backend).numpy
        values = {f"param {i}": read(v) for i, v in enumerate(self.variables)}
        inner = self.opt.inner_optimizer.variables
        values.update({f"state {v.name} {i}": read(v) for i, v in enumerate(inner)})
        return values

    def scale(self, state):
        return float(np.asarray(ls.backends.unwrap(self.opt.dynamic_scale.value)))


class JittedWrapper(Wrapper):
    """`jax.jit(LossScaleOptimizer(Adam).stateless_apply)`."""

    def __init__(self):
        super().__init__("jax")

    def __repr__(self):
        return "JittedWrapper"

    def start(self, weights, grads):
        import jax

        self.build(weights)
        self.jitted = jax.jit(self.opt.stateless_apply)
        self.index = [v is self.opt.dynamic_scale for v in self.opt.variables].index(True)
        state = ([v.value for v in self.opt.variables], [v.value for v in self.variables])
        return self.step(state, grads)

    def step(self, state, grads):
        optimizer_values, model = state
        model, optimizer_values = self.jitted(
            optimizer_values, [self.native(g) for g in grads], model
        )
        return optimizer_values, model

    def snapshot(self, state):
        optimizer_values, model = state
        values = {f"param {i}": np.asarray(v) for i, v in enumerate(model)}
        own = len(self.opt.variables) - len(self.opt.inner_optimizer.variables)
        values.update(
            {f"state {i}": np.asarray(v) for i, v in enumerate(optimizer_values[own:], own)}
        )
        return values

    def scale(self, state):
        return float(state[0][self.index])


# --- torch's slots ------------------------------------------------------------


class TorchScaler(Interface):
    """`lossscale.torch.GradScaler` around `optimizer_class` (torch's Adam, or ours)."""

    def __init__(self, ours):
        self.ours = ours

    def __repr__(self):
        return f"TorchScaler(lossscale.torch.Optimizer={self.ours})"

    def start(self, weights, grads):
        import torch

        import lossscale.torch

        self.params = [torch.nn.Parameter(native("torch", w)) for w in weights]
        if self.ours:
            self.opt = lossscale.torch.Optimizer(self.params, ls.optimizers.Adam(1e-3))
        else:
            self.opt = torch.optim.Adam(self.params, lr=1e-3)
        self.scaler = lossscale.torch.GradScaler("cpu", init_scale=INITIAL_SCALE)
        self.scaler.scale(torch.ones(()))  # creates the scale, as a training loop's first loss
        return self.step(None, grads)

    def step(self, state, grads):
        for p, g in zip(self.params, grads):
            p.grad = native("torch", g)
        self.scaler.step(self.opt)
        self.scaler.update()
        return None

    def snapshot(self, state):
        values = {f"param {i}": p.detach().numpy().copy() for i, p in enumerate(self.params)}
        for key, tensors in self.opt.state_dict()["state"].items():
            for name, t in tensors.items():
                values[f"state {key} {name}"] = np.asarray(t).copy()
        return values

    def scale(self, state):
        return self.scaler.get_scale()


# --- JAX's slots ----------------------------------------------------------------


class Optax(Interface):
    """`jax.jit` of `lossscale.optax.dynamic_loss_scale(optax.adam)`'s update."""

    def start(self, weights, grads):
        import jax
        import optax

        import lossscale.optax as lso

        self.lso = lso
        tx = lso.dynamic_loss_scale(optax.adam(1e-3), initial_scale=INITIAL_SCALE)
        params = {f"w{i:02d}": jax.numpy.asarray(w) for i, w in enumerate(weights)}

        def update(grads, opt_state, params):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self.update = jax.jit(update)
        return self.step((params, tx.init(params)), grads)

    def step(self, state, grads):
        import jax

        params, opt_state = state
        grads = {f"w{i:02d}": jax.numpy.asarray(g) for i, g in enumerate(grads)}
        return self.update(grads, opt_state, params)

    def snapshot(self, state):
        import jax

        params, opt_state = state
        values = {f"param {k}": np.asarray(v) for k, v in params.items()}
        inner = jax.tree_util.tree_leaves_with_path(opt_state.inner_state)
        values.update({f"state {jax.tree_util.keystr(p)}": np.asarray(v) for p, v in inner})
        return values

    def scale(self, state):
        return float(self.lso.loss_scale(state[1]))


class Pytree(Interface):
    """`jax.jit` of `lossscale.pytree.transform(LossScaleOptimizer(Adam)).apply`."""

    def start(self, weights, grads):
        import jax

        import lossscale.pytree

        self.tx = lossscale.pytree.transform(ls.LossScaleOptimizer(ls.optimizers.Adam(1e-3)))
        params = [jax.numpy.asarray(w) for w in weights]
        self.apply = jax.jit(self.tx.apply)
        return self.step((params, self.tx.init(params)), grads)

    def step(self, state, grads):
        import jax

        params, opt_state = state
        new_params, opt_state = self.apply([jax.numpy.asarray(g) for g in grads], opt_state, params)
        return new_params, opt_state

    def snapshot(self, state):
        params, opt_state = state
        values = {f"param {i}": np.asarray(v) for i, v in enumerate(params)}
        for name, value in opt_state.items():
            if not name.endswith(("dynamic_scale", "step_counter")):
                values[f"state {name}"] = np.asarray(value)
        return values

    def scale(self, state):
        return float(self.tx.loss_scale(state[1]))


# --- the table ----------------------------------------------------------------------

# name -> (interface, [(gradient dtype, layout)]). Half-precision gradients
# of float32 parameters are what mixed precision hands every optimizer;
# float64 runs where the backend computes in it by default; strided views
# where the backend keeps strides. Each dtype runs where its path differs.
HALF = [("float16", "contiguous")]
INTERFACES = {
    "numpy": (
        lambda: Wrapper("numpy"),
        [
            ("float32", "contiguous"),
            ("float32", "strided"),
            ("float16", "strided"),
            ("float64", "contiguous"),
        ],
    ),
    "torch": (
        lambda: Wrapper("torch"),
        [
            ("float32", "strided"),
            ("float16", "strided"),
            ("bfloat16", "contiguous"),
            ("float64", "contiguous"),
        ],
    ),
    # Eager JAX and TensorFlow take the same checks as their compiled steps
    # (one dispatch per operation: float32 only, to keep the suite's time).
    "jax": (lambda: Wrapper("jax"), [("float32", "contiguous")]),
    "jax-jit": (JittedWrapper, [("float32", "contiguous"), ("bfloat16", "contiguous")] + HALF),
    "tensorflow": (lambda: Wrapper("tensorflow"), [("float32", "contiguous")]),
    "tf.function": (lambda: Wrapper("tensorflow", "function"), [("float32", "contiguous")]),
    "jit_compile": (
        lambda: Wrapper("tensorflow", "jit_compile"),
        [("float32", "contiguous")] + HALF,
    ),
    "GradScaler": (
        lambda: TorchScaler(ours=False),
        [("float32", "strided")],
    ),
    "lossscale.torch.Optimizer": (lambda: TorchScaler(ours=True), [("float32", "strided")]),
    "optax": (Optax, [("float32", "contiguous"), ("bfloat16", "contiguous")] + HALF),
    "pytree": (Pytree, [("float32", "contiguous")] + HALF),
}
# TensorFlow's backend branches on no size (on the dtype only: a half
# gradient is unscaled in float32), and its steps cost the most here: its
# interfaces take two bad positions per size (`bad_cases`), every size
# still in every model, the many small tensors 8 (`SAMPLED_MODELS`).
SAMPLED = {"tensorflow", "tf.function", "jit_compile"}
# The backend each interface runs on (a parameter, so that an environment
# without that backend leaves the row out: tests/floors.py).
BACKEND_OF = {
    "numpy": "numpy",
    "torch": "torch",
    "GradScaler": "torch",
    "lossscale.torch.Optimizer": "torch",
    "tensorflow": "tensorflow",
    "tf.function": "tensorflow",
    "jit_compile": "tensorflow",
}
PARAMS = [
    pytest.param(name, BACKEND_OF.get(name, "jax"), dtype, layout, id=f"{name}-{dtype}-{layout}")
    for name, (_, cases) in INTERFACES.items()
    for dtype, layout in cases
]


@pytest.mark.filterwarnings("ignore::lossscale.mixed_precision.UnscaledLossWarning")
@pytest.mark.parametrize("name, backend_name, dtype, layout", PARAMS)
def test_one_bad_value_anywhere_skips_the_step(name, backend_name, dtype, layout):
    if dtype == "bfloat16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    run_guarantee(INTERFACES[name][0], np.dtype(dtype), layout, sampled=name in SAMPLED)


# --- the backends' finite check itself, drawn -------------------------------------

BACKEND_DTYPES = {
    "numpy": ("float16", "float32", "float64"),
    "torch": ("float16", "bfloat16", "float32", "float64"),
    "jax": ("float16", "bfloat16", "float32"),
    "tensorflow": ("float16", "bfloat16", "float32"),
}


@pytest.mark.parametrize("backend_name", list(BACKEND_DTYPES))
def test_the_finite_check_of_every_backend_finds_one_drawn_bad_value(backend_name):
    """`finite_unscaled` over drawn sizes, positions, values and dtypes, among clean arrays."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from lossscale.backends import get_ops

    ops = get_ops(backend_name)

    @settings(max_examples=40, deadline=None)
    @given(
        size=st.one_of(
            st.sampled_from([1, 4095, 4096, 4097, 65536, 65537, 262145]), st.integers(1, 300_000)
        ),
        where=st.floats(0, 1),
        value=st.sampled_from(["nan", "nan", "inf", "-inf", "huge", "finite"]),
        dtype=st.sampled_from(BACKEND_DTYPES[backend_name]),
        scale=st.sampled_from([2.0**15, 1.0, 0.5]),
    )
    def check(size, where, value, dtype, scale):
        if value == "huge" and dtype != "float32":
            value = "finite"  # overflows only float32's range once divided
        position = min(int(where * size), size - 1)
        if dtype == "bfloat16":
            import ml_dtypes

            dtype = ml_dtypes.bfloat16
        g = (np.random.default_rng(size).uniform(-1, 1, size) * min(scale, 1.0)).astype(dtype)
        g[position] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "huge": HUGE}.get(
            value, g[position]
        )
        clean = [np.ones(7, np.float32), np.full(5000, 0.5, np.float32)]
        arrays = [native(backend_name, a) for a in clean + [g]]
        expected = value in ("nan", "inf", "-inf") or (value == "huge" and scale < 1)
        finite = ops.finite_unscaled(arrays, native(backend_name, np.float32(scale)))
        assert bool(np.asarray(ops.to_numpy(finite))) is not expected, (size, position, value)

    check()
