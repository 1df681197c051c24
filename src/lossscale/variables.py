"""`Variable`: a named, assignable array on one backend."""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from lossscale import initializers
from lossscale.backends import backend_of, get_ops, unwrap
from lossscale.typing import Array, Initializer, Shape

AGGREGATIONS = (None, "none", "mean", "sum", "only_first_replica")


class Variable:
    """A named, assignable array living on one backend (NumPy, torch or JAX).

    It wraps a native array without copying (updated in place; on JAX,
    `assign` rebinds) or creates one from an initializer, shape and dtype.

    Args:
        initializer: A native array or a Keras 3 `keras.Variable` to wrap
            (with its name, path and constraint), a number or nested list,
            or an initializer (`"zeros"`, `"ones"`, `"random_normal"`,
            `"random_uniform"`, a callable `(shape, dtype)`) used with `shape`.
        shape: Shape tuple; required with a string or callable initializer.
        dtype: Dtype name such as `"float32"`. Defaults to the wrapped
            array's (another converts it), else `"float32"`.
        trainable: Boolean, whether the variable is trained.
        name: String name. Defaults to `"variable"`.
        aggregation: One of `None`, `"none"`, `"mean"`, `"sum"`,
            `"only_first_replica"`: how replicas combine this variable.
        overwrite_with_gradient: Boolean. If `True`, optimizers assign it its gradient.
        constraint: Optional callable applied to the value after each update.
        backend: `"numpy"`, `"torch"` or `"jax"`, for a variable created from
            an initializer. Defaults to `like`'s backend, else `"numpy"`.
        like: Optional array: new variables take its backend and device.

    Examples:
        >>> import numpy as np, lossscale as ls
        >>> v = ls.Variable(np.zeros(3, np.float32), name="bias")
        >>> v.assign_add(np.ones(3, np.float32))
        >>> v.numpy()
        array([1., 1., 1.], dtype=float32)
    """

    _is_lossscale_variable = True
    # Makes `ndarray <op> Variable` defer to the Variable's reflected operator.
    __array_ufunc__ = None

    def __init__(
        self,
        initializer: Initializer,
        shape: Shape | None = None,
        dtype: str | None = None,
        trainable: bool = True,
        name: str | None = None,
        aggregation: str | None = "none",
        overwrite_with_gradient: bool = False,
        constraint: Callable[[Array], Array] | None = None,
        backend: str | None = None,
        like: Array | None = None,
    ) -> None:
        source = initializer if is_keras_variable(initializer) else None
        if source is not None:  # its array is wrapped (on JAX, written back after each step)
            initializer, name = source.value, name or source.name
            constraint = constraint if constraint is not None else source.constraint
            overwrite_with_gradient = overwrite_with_gradient or source.overwrite_with_gradient
        if name is not None and not isinstance(name, str):
            raise ValueError(f"`name` must be a string. Received: name={name!r}")
        if aggregation not in AGGREGATIONS:
            raise ValueError(
                f"`aggregation` must be one of {AGGREGATIONS}. "
                f"Received: aggregation={aggregation!r}"
            )
        if constraint is not None and not callable(constraint):
            raise ValueError(f"`constraint` must be callable. Received: constraint={constraint!r}")
        self.name = name or "variable"
        self.path = source.path if source is not None else self.name
        self._source = source
        self.trainable = bool(trainable)
        self.aggregation = aggregation
        self.overwrite_with_gradient = bool(overwrite_with_gradient)
        self.constraint = constraint
        self._storage = None
        self._shape = None
        self._init_storage(initializer, shape, dtype, backend, like)
        self._shape = self._ops.shape(self._storage)

    def _init_storage(self, initializer, shape, dtype, backend, like):
        if dtype is not None and not isinstance(dtype, str) and not _numpy_dtype(dtype):
            raise ValueError(
                "`dtype` must be a dtype name such as 'float32', 'float16' or 'bfloat16' "
                f"(a framework's dtype object is not accepted). Received: dtype={dtype!r}"
            )
        native = _native_or_none(initializer)
        if native is not None:
            if backend is not None and backend != backend_of(native):
                raise ValueError(
                    f"`backend` is {backend!r} but the wrapped array is a "
                    f"{backend_of(native)} array. "
                    f"Received: backend={backend!r}"
                )
            self._ops = get_ops(backend_of(native))
            if shape is not None and tuple(shape) != self._ops.shape(native):
                raise ValueError(
                    f"`shape` does not match the wrapped array's shape {self._ops.shape(native)}. "
                    f"Received: shape={tuple(shape)}"
                )
            if dtype is not None and dtype != self._ops.dtype_name(native):
                native = self._ops.cast(native, dtype)
            self._storage = self._new_storage(native)
            return
        if (
            shape is None
            and isinstance(initializer, (int, float))
            and not isinstance(initializer, bool)
        ):
            shape = ()
        if shape is None:
            raise ValueError(
                "`shape` is required when `initializer` is not an array. "
                f"Received: initializer={initializer!r}, shape=None"
            )
        shape = tuple(int(s) for s in shape)
        dtype = dtype or "float32"
        # NumPy has no bfloat16: such state starts as float32, cast by the backend.
        host = "float32" if dtype == "bfloat16" else dtype
        value = np.asarray(initializers.get(initializer)(shape, host), dtype=host)
        if value.shape != shape:
            raise ValueError(
                f"The initializer returned shape {value.shape}, expected {shape}. "
                f"Received: initializer={initializer!r}"
            )
        backend = backend or (backend_of(like) if like is not None else "numpy")
        self._ops = get_ops(backend)
        self._storage = self._new_storage(value, dtype, like)

    def _new_storage(self, value, dtype=None, like=None, ops=None):
        """What holds `value` on `ops`: its `variable_storage` (TensorFlow), or the array."""
        ops = ops or self._ops
        make = getattr(ops, "variable_storage", None)
        if make is not None:
            if dtype is not None and not ops.is_native(value):
                value = np.asarray(value, dtype=dtype)
            return make(value, like=like, name=self.name, trainable=self.trainable)
        if dtype is None and ops.is_native(value):
            return value  # wrapped without copying
        return ops.asarray(value, dtype=dtype, like=like)

    # --- a wrapped keras.Variable ------------------------------------------
    @property
    def source(self) -> object | None:
        """The `keras.Variable` this variable wraps, or None."""
        return self._source

    def sync_to_source(self) -> None:
        """Makes the wrapped `keras.Variable` hold this value, where a write rebound it (JAX)."""
        source = self._source
        if source is not None and self._storage is not source.value:
            source.assign(self._storage)

    def sync_from_source(self) -> None:
        """Takes the wrapped `keras.Variable`'s value, where it was rebound (JAX)."""
        source = self._source
        if source is not None and self._storage is not source.value:
            self._storage = source.value

    # --- storage ---------------------------------------------------------
    @property
    def storage(self) -> object:
        """What holds the value: the native array, or on TensorFlow the `tf.Variable`.

        Read-only: `rebind` replaces it, `assign` writes into it.
        """
        return self._storage

    def rebind(self, storage: object) -> None:
        """Makes `storage` (of this backend, shape and dtype) hold the value, unchecked."""
        self._storage = storage

    # --- reading ---------------------------------------------------------
    @property
    def backend(self) -> str:
        return self._ops.NAME

    @property
    def ops(self) -> Any:
        """The backend module of the value (`lossscale.backends.protocol.BackendOps`)."""
        return self._ops

    @property
    def value(self) -> Array:
        """The native array (a detached view on torch)."""
        return self._ops.read(self._storage)

    def numpy(self) -> np.ndarray:
        """Returns a copy of the value as a NumPy array, as Keras does."""
        return np.array(self._ops.to_numpy(self._storage), copy=True)

    @property
    def shape(self) -> tuple[int, ...]:
        # Read once, at creation: a compiled step sees a constant.
        return self._shape

    @property
    def dtype(self) -> str:
        return self._ops.dtype_name(self._storage)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    # --- writing ---------------------------------------------------------
    def _write(self, method, value, exact=False):
        value = self._coerce(value, method)
        self._check_shape(value, method, exact and not isinstance(value, (int, float, bool)))
        self._storage = getattr(self._ops, method)(self._storage, value)

    def _coerce(self, value, method):
        value = unwrap(value)
        if isinstance(value, (int, float, bool, np.number)):
            return value
        source = backend_of(value)
        if source != self.backend:
            if source != "numpy":
                raise ValueError(
                    f"`variable.{method}(value)` got a {source} array for a {self.backend} "
                    f"variable (path={self.path!r}). Received: value of type {type(value).__name__}"
                )
            value = self._ops.asarray(value, dtype=self.dtype, like=self._storage)
        return value

    def _check_shape(self, value, method, exact):
        value_shape = self._ops.shape(value) if not isinstance(value, (int, float, bool)) else ()
        ok = value_shape == self.shape
        if not ok and not exact:
            try:
                ok = np.broadcast_shapes(value_shape, self.shape) == self.shape
            except ValueError:
                ok = False
        if not ok:
            raise ValueError(
                f"The shape of the target variable and the shape of the target value in "
                f"`variable.{method}(value)` must match. variable.shape={self.shape} "
                f"(path={self.path!r}), Received: value.shape={value_shape}"
            )

    def assign(self, value: Array) -> None:
        """Assigns `value` (same shape) to the variable, in place where possible."""
        self._write("assign", value, exact=True)

    def assign_add(self, value: Array) -> None:
        """Adds `value` (broadcastable to the variable's shape) in place."""
        self._write("assign_add", value)

    def assign_sub(self, value: Array) -> None:
        """Subtracts `value` (broadcastable to the variable's shape) in place."""
        self._write("assign_sub", value)

    # --- copies ----------------------------------------------------------
    def __getstate__(self) -> dict:
        """The attributes a copy takes: the backend by its name (a module cannot be copied)."""
        state = dict(self.__dict__)
        state["_ops"] = self._ops.NAME
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        state["_ops"] = get_ops(state["_ops"])
        self.__dict__.update(state)

    def move_to(self, like: Array) -> None:
        """Re-creates this variable on `like`'s backend and device (before it is used)."""
        ops = get_ops(backend_of(like))
        if ops is self._ops and (not ops.MUTABLE or hasattr(ops, "variable_storage")):
            return  # immutable arrays, or a backend variable: already in place
        dtype = ops.INT_DTYPE if self.dtype.startswith("int") else self.dtype
        storage = self._new_storage(self._ops.to_numpy(self._storage), dtype, like, ops)
        self._ops, self._storage = ops, storage

    # --- array protocol and arithmetic -----------------------------------
    def __array__(self, dtype=None, copy=None):
        out = self.numpy()  # a copy, whatever `copy` asks
        return out.astype(dtype) if dtype is not None else out

    def __float__(self):
        return float(self.numpy())

    def __int__(self):
        return int(self.numpy())

    def __index__(self):
        return int(self.numpy())

    def __bool__(self):
        return bool(self.numpy())

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, idx):
        return self.value[idx]

    def __neg__(self):
        return -self.value

    def __abs__(self):
        return abs(self.value)

    def __repr__(self):
        return (
            f"<Variable path={self.path}, shape={self.shape}, dtype={self.dtype}, "
            f"backend={self.backend}, value={self.numpy()!r}>"
        )


def _numpy_dtype(dtype):
    """Whether `dtype` is a NumPy dtype (or a type NumPy reads as one)."""
    try:
        np.dtype(dtype)
    except TypeError:
        return False
    return True


def is_keras_variable(x) -> bool:
    """Whether `x` is a Keras 3 `keras.Variable` (Keras is not imported to tell)."""
    # getattr: a module named keras need not be Keras (a namespace package).
    keras_variable = getattr(sys.modules.get("keras"), "Variable", None)
    return keras_variable is not None and isinstance(x, keras_variable)


def _native_or_none(x):
    """Returns `x` as a native array if it is one (lists become NumPy), else None."""
    if getattr(x, "_is_lossscale_variable", False):
        raise ValueError(
            "`initializer` cannot be another Variable; pass `variable.value` to share it. "
            f"Received: initializer={x!r}"
        )
    if isinstance(x, (list, tuple)):
        return np.asarray(x, dtype=np.float32 if np.asarray(x).dtype.kind == "f" else None)
    if isinstance(x, str) or callable(x) and not hasattr(x, "shape"):
        return None
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return None
    try:
        backend_of(x)
    except TypeError:
        return None
    return np.asarray(x) if isinstance(x, np.generic) else x


def _forward(fn):
    return lambda self, other: fn(self.value, unwrap(other))


def _reflected(fn):
    return lambda self, other: fn(unwrap(other), self.value)


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow"):
    setattr(Variable, f"__{_name}__", _forward(getattr(operator, _name)))
    setattr(Variable, f"__r{_name}__", _reflected(getattr(operator, _name)))
for _name in ("lt", "le", "gt", "ge"):
    setattr(Variable, f"__{_name}__", _forward(getattr(operator, _name)))
del _name
