"""What counts as a figure: a number that a table, a chart or an experiment logger can show and sort."""

from __future__ import annotations

import math


def is_number(value: object) -> bool:
    """An int or a finite float. Not a bool (Python counts True as the int 1, but a flag is no figure),
    and not NaN or infinity, which neither order in a sorted table nor plot."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
