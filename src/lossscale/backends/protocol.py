"""The backend seam: the complete list of primitives optimizer code may use.

Every backend package provides exactly these names (plus the optional ones
listed at the end); optimizer code calls them through
`lossscale.backends.ops_for(...)` and never branches on a backend name.
Arithmetic operators work on native arrays and on `lossscale.Variable`;
every function accepts a `Variable` where it accepts an array.
"""

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Protocol


class BackendOps(Protocol):
    """Structural type of a backend module."""

    NAME: str
    MUTABLE: bool  # whether `assign*` write into the existing buffer (not on JAX)
    INT_DTYPE: str  # of integer optimizer state: int32 everywhere, as in Keras 3

    # --- recognising and creating arrays -------------------------------
    def is_native(self, x: Any) -> bool: ...
    def records_calls(self) -> bool:
        """Whether a front end may keep Python-side records of this call (not while tracing)."""

    def host_control(self) -> bool:
        """Whether a Python branch inside a step is taken again at every call (not if traced)."""

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
    def unstack(self, x: Any) -> tuple: ...
    def isfinite(self, x: Any) -> Any: ...
    def logical_and(self, x: Any, y: Any) -> Any: ...
    def logical_not(self, x: Any) -> Any: ...

    # --- multi-tensor helpers (fast paths live here) ---------------------
    def unscale(self, grads: Sequence[Any], scale: Any, in_place: bool = False) -> list:
        """`grads` divided by `scale` (float32 for half); `in_place` permits reusing grads."""

    def unscale_checked(self, grads: Sequence[Any], scale: Any, in_place: bool = False) -> tuple:
        """`(unscaled, finite, skip)`: `unscale`, and `finite_flags` of its result."""

    def checks_while_unscaling(self) -> bool:
        """Whether `unscale_checked` divides and checks in one pass (eager torch)."""

    def all_finite(self, arrays: Sequence[Any]) -> Any: ...
    def finite_flags(self, arrays: Sequence[Any]) -> tuple:
        """`(finite, skip)`: `all_finite(arrays)`, and as a float32 flag (1.0: not finite).

        The arrays must be the caller's own: torch's AMP kernel writes them.
        """

    def finite_unscaled(self, arrays: Sequence[Any], scale: Any) -> Any:
        """`isfinite(max_abs(arrays) / scale)`, as a boolean scalar."""

    def global_norm(self, arrays: Sequence[Any]) -> Any: ...
    def max_abs(self, arrays: Sequence[Any]) -> Any: ...
    def all_max(self, x: Any, group: Any = None) -> Any: ...
    def all_true(self, flag: Any, group: Any = None) -> Any: ...
    def several_participants(self, group: Any = None) -> bool:
        """Whether `all_true` / `all_max` over `group` combine other participants' values."""

    def fused_update(self, name: str) -> Any:
        """The `Kernel` reproducing the `update_step` of the class whose `update_kernel` is `name`.

        Or None.
        """

    def fused_weight_decay(self) -> Callable | None:
        """A kernel `(params, weight_decay, lr, *, cache, keep=None)`, or None.

        Equal, bit for bit, to `v.assign_sub(v * weight_decay * lr)` where `keep` holds.
        """

    def fused_scale_update(self) -> Callable | None:
        """A kernel for the plain dynamic loss-scale update, or None.

        `kernel(scale, counter, finite, growth_steps, growth_factor,
        backoff_factor, floor, skip=None, in_place=False)` returns the new
        `(scale, counter)`, exactly as `loss_scale.next_loss_scale` does for a
        policy without hysteresis, limits, headroom or telemetry.
        """

    def fused_float16_range(self) -> Callable | None:
        """A kernel measuring many gradients' float16 range at once, or None.

        `kernel(grads, subnormal_below, near_from)` returns `diagnostics.measure`'s
        `(zero, subnormal, near_max, max_abs)` as float32 vectors, bit for bit (or None).
        """

    # --- control flow ---------------------------------------------------
    def cond(
        self,
        pred: Any,
        true_fn: Callable[[], None],
        false_fn: Callable[[], None] | None,
        variables: Sequence[Any],
    ) -> None:
        """Runs `true_fn` where `pred` holds, else `false_fn`; both write only `variables`."""

    def cond_values(
        self, pred: Any, true_fn: Callable[[], tuple], false_fn: Callable[[], tuple]
    ) -> tuple:
        """`true_fn()` where `pred` holds, else `false_fn()`; a device `pred` is not read."""

    def quiet(self) -> ContextManager: ...

    # --- optional --------------------------------------------------------
    # Read with `getattr` where a backend needs them:
    # `variable_storage(value, like=None, name=None, trainable=False)`: the
    #   variable object a `Variable` holds for `value` (TensorFlow).
    # `is_traced(x)`: whether `x` is a JAX tracer, which no variable may keep.
    # `all_mean(x, group)`: the mean over `group`'s mapped axes (JAX).
    # `all_gather(x, group)`: `x` of each process stacked (torch.distributed).
    # `peaks(xs)`: each array's largest magnitude (NaN where it holds one), in
    #   its own dtype (torch: per-parameter telemetry, `watch`).
    # `dense_gradient(x)`: a sparse gradient (`tf.IndexedSlices`) made dense.
