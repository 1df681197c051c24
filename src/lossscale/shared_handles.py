"""A live handle in an object's copied state: shared by its copies, refused by `pickle` by name.

A `torch.distributed` process group is a communicator of this process, not
a value: a `copy.deepcopy` of an optimizer or scaler that holds one takes
the same group (as it takes the same device), and `pickle` cannot write it
anywhere another process could use. `SharedHandle.wrap` puts the handle
into the state `__getstate__` returns; `unwrap` takes it out in
`__setstate__`:

```
copy.deepcopy(opt).process_group is opt.process_group   # shared
copy.copy(opt).process_group is opt.process_group       # shared
pickle.dumps(opt)   # TypeError: names the argument, the value, and what to do
```
"""

from __future__ import annotations

from typing import Any


class SharedHandle:
    """A handle that `copy.deepcopy` shares and `pickle` refuses, saying why.

    Args:
        value: The handle (a process group).
        argument: The argument it was given as, for the error.
        owner: The class name of the object holding it, for the error.
    """

    def __init__(self, value: Any, argument: str, owner: str):
        self.value = value
        self.argument = argument
        self.owner = owner

    @classmethod
    def wrap(cls, value: Any, argument: str, owner: str) -> Any:
        """`value` wrapped for a copied state; None stays None (nothing to share)."""
        return None if value is None else cls(value, argument, owner)

    @staticmethod
    def unwrap(value: Any) -> Any:
        """The handle a copied state holds (a state pickled without one holds None)."""
        return value.value if isinstance(value, SharedHandle) else value

    def __deepcopy__(self, memo: dict) -> SharedHandle:
        return self

    def __reduce__(self):
        raise TypeError(
            f"A {self.owner} with a `{self.argument}` cannot be pickled: a process group is "
            "a live communicator of this process, which no other process can use. Save "
            "its state instead (`state_dict()` or the variables), or pickle one made with "
            f"{self.argument}=None. (`copy.deepcopy` works: the copy shares the group.) "
            f"Received: {self.argument}={self.value!r}"
        )
