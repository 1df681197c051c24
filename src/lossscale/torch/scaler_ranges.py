"""The last float16-range measurement of each parameter a `GradScaler` measured.

`diagnostics.measure_all`'s four vectors are kept as they are, on the
scale's device: a scalar per parameter and field would cost an indexing
operation each. Only a measurement of other parameters than the last is
merged in, with one gather per field.
"""

from __future__ import annotations

import torch

from lossscale.mixed_precision import diagnostics


class ParameterRanges:
    """The four `range_*` vectors of the parameters measured so far, and their names.

    Attributes:
        names: The parameter names, in the order they were first measured:
            entry i of each vector is `names[i]`'s.
        columns: `{field: float32 vector}` for the fields of
            `diagnostics.FIELDS`, or `{}` before any measurement.
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self.columns: dict[str, torch.Tensor] = {}

    def record(self, names: list[str], columns: tuple, device: torch.device) -> None:
        """Takes a measurement: `columns[k][i]` is field k of `names[i]`; others keep theirs.

        Args:
            names: The measured parameters' names.
            columns: The four vectors of `diagnostics.measure_all`.
            device: Where the vectors are kept (the scale's device).
        """
        new = {f: c.to(device, non_blocking=True) for f, c in zip(diagnostics.FIELDS, columns)}
        if not self.columns or names == self.names:
            self.names, self.columns = list(names), new
            return
        # Entry j of `torch.cat([old, new])`: the old vectors' entries, then the new.
        at = {name: i for i, name in enumerate(self.names)}
        at.update({name: len(self.names) + j for j, name in enumerate(names)})
        known = set(self.names)
        merged = self.names + [n for n in names if n not in known]
        index = _on(device, [at[n] for n in merged])
        self.columns = {f: torch.cat([self.columns[f], new[f]]).index_select(0, index) for f in new}
        self.names = merged

    def values(self, names: list[str]) -> dict[str, torch.Tensor]:
        """`{field: float64 vector}` over `names` (0.0 where one was never measured)."""
        if not self.columns:
            zeros = torch.zeros(len(names), dtype=torch.float64)
            return {f: zeros for f in diagnostics.FIELDS}
        at = {name: i for i, name in enumerate(self.names)}
        device = next(iter(self.columns.values())).device
        # The last entry of `padded` is the initial 0.0 of a parameter never measured.
        index = torch.tensor([at.get(n, len(self.names)) for n in names], device=device)
        out = {}
        for f, column in self.columns.items():
            padded = torch.cat([column, column.new_zeros(1)])
            out[f] = padded.index_select(0, index).to(torch.float64)
        return out


def _on(device, indices):
    """`indices` as an int64 tensor on `device`, copied without a host synchronisation.

    (`torch.tensor(..., device="cuda")` from a list waits for the stream.)
    """
    index = torch.tensor(indices, dtype=torch.int64)
    if device.type == "cuda":
        index = index.pin_memory()
    return index.to(device, non_blocking=True)
