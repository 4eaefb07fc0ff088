"""Index runs without a Python loop: the gather that pack's blocks and the byte-level encoder's ids share."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


def gather_runs(starts: np.ndarray, lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Indices starts[0], starts[0] + 1, ..., starts[0] + lengths[0] - 1, starts[1], ...: one
    cumulative sum of steps that are 1 inside a run and jump at each run's first element. `out`: an
    intp array of at least that many elements to build them in (a view of it is returned), so that a
    caller gathering chunk after chunk does not fault in fresh pages for every chunk."""
    import numpy as np

    nonempty = lengths > 0
    starts, lengths = starts[nonempty], lengths[nonempty]
    total = int(lengths.sum())
    # numpy's own index type: an int32 index would be converted to it by every gather, a copy of it each time.
    steps = np.empty(total, dtype=np.intp) if out is None else out[:total]
    if total == 0:
        return steps
    steps.fill(1)
    first = np.cumsum(lengths) - lengths
    steps[0] = starts[0]
    steps[first[1:]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    return np.cumsum(steps, out=steps)  # in place: a second array this size costs more than the sum
