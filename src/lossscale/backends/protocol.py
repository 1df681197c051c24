"""The backend seam: the complete list of primitives optimizer code may use.

Every backend package (`lossscale.backends.numpy`, `.torch`, `.jax`,
`.tensorflow`) provides exactly these names, plus optional ones listed at
the end. Optimizer, clipping, weight-decay, EMA, accumulation and
loss-scale code call them through the module returned by
`lossscale.backends.ops_for(...)` and never branch on a backend name.

Arithmetic operators (`+ - * / **`, comparisons) work on the native arrays of
every backend and on `lossscale.Variable`, so update rules use them directly;
the functions below cover the rest. Every function accepts a `Variable`
where it accepts an array.
"""

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Protocol


class BackendOps(Protocol):
    """Structural type of a backend module."""

    NAME: str
    # True when `assign*` write into the existing buffer (NumPy, torch);
    # False when they return a new array (JAX).
    MUTABLE: bool
    # The dtype of integer optimizer state (`iterations`, `step_counter`):
    # int32 on every backend, as in Keras 3 (and as JAX has without x64).
    INT_DTYPE: str

    # --- recognising and creating arrays -------------------------------
    def is_native(self, x: Any) -> bool: ...
    def records_calls(self) -> bool:
        """Whether a front end may keep Python-side records of this call (`diagnosis`).

        False while a compiler traces Python that must stay free of such side
        effects (torch.compile, a TensorFlow graph).
        """

    def host_control(self) -> bool:
        """Whether a Python branch inside a step is taken again at every call.

        True on NumPy and eager torch: a step may decide there, on a count
        kept on the host, with no device read. False where a step is traced
        once and replayed (JAX's `jit`, TensorFlow's `tf.function`,
        `torch.compile`): it decides on the device (`cond`).
        """

    def asarray(self, x: Any, dtype: str | None = None, like: Any = None) -> Any: ...
    def full(self, shape: tuple, value: Any, dtype: str, like: Any = None) -> Any: ...
    def copy(self, x: Any) -> Any: ...
    def to_numpy(self, x: Any) -> Any: ...
    def dtype_name(self, x: Any) -> str: ...
    def shape(self, x: Any) -> tuple: ...
    def place(self, x: Any, like: Any) -> Any: ...

    # --- variable storage ------------------------------------------------
    def read(self, storage: Any) -> Any: ...
    def assign(self, storage: Any, value: Any) -> Any: ...
    def assign_add(self, storage: Any, value: Any) -> Any: ...
    def assign_sub(self, storage: Any, value: Any) -> Any: ...

    # --- elementwise and reductions -------------------------------------
    def cast(self, x: Any, dtype: str) -> Any: ...
    def sqrt(self, x: Any) -> Any: ...
    def square(self, x: Any) -> Any: ...
    def abs(self, x: Any) -> Any: ...
    def sign(self, x: Any) -> Any: ...
    def exp(self, x: Any) -> Any: ...
    def log(self, x: Any) -> Any: ...
    def cos(self, x: Any) -> Any: ...
    def floor(self, x: Any) -> Any: ...
    def power(self, x: Any, y: Any) -> Any: ...
    def maximum(self, x: Any, y: Any) -> Any: ...
    def minimum(self, x: Any, y: Any) -> Any: ...
    def where(self, cond: Any, x: Any, y: Any) -> Any: ...
    def clip(self, x: Any, lo: Any, hi: Any) -> Any: ...
    def sum(self, x: Any) -> Any: ...
    def stack(self, values: Sequence[Any]) -> Any: ...
    def isfinite(self, x: Any) -> Any: ...
    def logical_and(self, x: Any, y: Any) -> Any: ...
    def logical_not(self, x: Any) -> Any: ...

    # --- multi-tensor helpers (fast paths live here) ---------------------
    def unscale(self, grads: Sequence[Any], scale: Any, in_place: bool = False) -> list:
        """`grads` divided by `scale` (float32 for half gradients).

        `in_place` permits (does not demand) dividing the caller's own
        buffers: torch does, saving a full-size copy.
        """

    def unscale_checked(self, grads: Sequence[Any], scale: Any, in_place: bool = False) -> tuple:
        """`(unscaled, finite, skip)`: `unscale`, and `finite_flags` of its result.

        torch does both in one pass where that is exact (see
        `backends/torch/multi.unscale_checked`).
        """

    def checks_while_unscaling(self) -> bool:
        """Whether `unscale_checked` divides and checks in one pass here.

        Then a wrapper unscales there rather than leaving the scale to the
        update kernel (`StepPlan.takes_grad_scale`): torch's AMP kernel,
        eagerly.
        """

    def all_finite(self, arrays: Sequence[Any]) -> Any: ...
    def finite_flags(self, arrays: Sequence[Any]) -> tuple:
        """`(finite, skip)`: `all_finite(arrays)`, and as a float32 flag (1.0: not finite).

        The arrays must be the caller's own: torch checks them with its AMP
        kernel, which stores the values it reads.
        """

    def finite_unscaled(self, arrays: Sequence[Any], scale: Any) -> Any:
        """Whether every element of `arrays` divided by `scale` is finite, as a boolean scalar.

        `isfinite(max_abs(arrays) / scale)`, the check of a step whose
        kernel divides as it reads each gradient; JAX on CPU settles most
        steps with a cheaper sum first (see `backends/jax/multi.finite_unscaled`).
        """

    def global_norm(self, arrays: Sequence[Any]) -> Any: ...
    def max_abs(self, arrays: Sequence[Any]) -> Any: ...
    def all_max(self, x: Any, group: Any = None) -> Any: ...
    def all_true(self, flag: Any, group: Any = None) -> Any: ...
    def several_participants(self, group: Any = None) -> bool:
        """Whether `all_true` / `all_max` over `group` combine other participants' values.

        False where they return their input as it is (one process, no
        mapped axes, one replica).
        """

    def fused_update(self, name: str) -> Any:
        """The `lossscale.backends.kernel.Kernel` named `name`, or None.

        `name` is an optimizer class's `update_kernel`: the kernel reproduces
        that class's `update_step` exactly, from the state it is given as
        arguments (see `lossscale.backends.kernel`).
        """

    def fused_weight_decay(self) -> Callable | None:
        """A kernel `(params, weight_decay, lr, *, cache, keep=None)` decaying them all.

        Or None.

        Equal, bit for bit, to `v.assign_sub(v * weight_decay * lr)` per
        variable, taking effect only where `keep` holds.
        """

    def fused_scale_update(self) -> Callable | None:
        """A kernel for the plain dynamic loss-scale update, or None.

        `kernel(scale, counter, finite, growth_steps, growth_factor,
        backoff_factor, floor, skip=None, in_place=False)` returns the new
        `(scale, counter)` of a policy without hysteresis, limits, headroom
        or telemetry (a backoff stops at `floor`): what
        `loss_scale.next_loss_scale` computes for it, exactly. `skip` is
        `finite` as a float flag (1.0: not finite) if the caller has it;
        with `in_place`, `scale` and `counter` may be updated where they are.
        """

    def fused_float16_range(self) -> Callable | None:
        """A kernel measuring many gradients' float16 range at once, or None.

        `kernel(grads, subnormal_below, near_from)` returns what
        `mixed_precision.diagnostics.measure` gives for each gradient, bit
        for bit, as `(zero, subnormal, near_max, max_abs)`: four float32
        vectors whose entry i is `grads[i]`'s; or None for gradients it
        does not take.
        """

    # --- control flow ---------------------------------------------------
    def cond(
        self,
        pred: Any,
        true_fn: Callable[[], None],
        false_fn: Callable[[], None] | None,
        variables: Sequence[Any],
    ) -> None:
        """Runs `true_fn` where `pred` holds, else `false_fn` (None: nothing).

        `variables`: every variable either branch may write.
        """

    def cond_values(
        self, pred: Any, true_fn: Callable[[], tuple], false_fn: Callable[[], tuple]
    ) -> tuple:
        """`true_fn()` where `pred` holds, else `false_fn()`: tuples of arrays alike.

        Neither branch writes anything; a device `pred` is not read on the host.
        """

    def quiet(self) -> ContextManager: ...

    # --- optional --------------------------------------------------------
    # `variable_storage(value, like=None, name=None, trainable=False)`: on a
    # backend whose state lives in its own variable objects (TensorFlow),
    # the object a `Variable` holds for `value` (a NumPy array or a native
    # array; one of those objects is kept as it is). `Variable` asks for it
    # with `getattr`; the other backends hold the array itself.
    # `is_traced(x)`: whether `x` is a value being traced (a JAX tracer),
    # which no variable may keep. Read with `getattr`; absent: never.
    # `all_mean(x, group)`: on a backend whose steps may run on blocks of
    # the gradients mapped over named axes (JAX's `shard_map` / `pmap`),
    # the mean of `x` over `group`'s axes. Called only with an `axis_name`,
    # which only such a backend takes.
    # `all_gather(x, group)`: on a backend whose participants are processes
    # (torch.distributed), `x` of each one stacked along a new first axis.
    # Called only where `several_participants(group)`.
    # `dense_gradient(x)`: on a backend whose autodiff gives sparse
    # gradients (TensorFlow's `tf.IndexedSlices`), such a gradient as a
    # dense native array, else None. Read with `getattr`; absent: none.
