"""Learning-rate schedules: the multiplier of the peak rate at a point of the budget's progress.

Plain arithmetic, free of torch: validating a config checks a schedule's arguments without loading torch.
"""

from __future__ import annotations

import math


def lr_schedule(name: str, progress: float, **kw: float) -> float:
    """Multiplier of the peak learning rate at `progress` in [0, 1] (clamped) of the budget."""
    if name not in _SCHEDULES:
        raise ValueError(f"schedule {name!r}: allowed {', '.join(SCHEDULES)}")
    return _SCHEDULES[name](min(max(progress, 0.0), 1.0), **kw)


def _constant(p: float) -> float:
    return 1.0


def _budget_triangle(p: float, start: float = 0.25, decay: float = 0.25) -> float:
    """cramming's budget-triangle2: rise linearly from `start` to 1, reaching it where the decay begins."""
    _check_fractions(start=start, decay=decay)
    rise = start + p * (1 - start) / (1 - decay)
    fall = (1 - p) / decay
    return max(0.0, min(rise, fall, 1.0))


def _one_cycle(p: float) -> float:
    return 1 - abs(2 * p - 1)


def _cosine(p: float, warmup: float = 0.1) -> float:
    _check_fractions(warmup=warmup)
    if p < warmup:
        return p / warmup
    return 0.5 * (1 + math.cos(math.pi * (p - warmup) / (1 - warmup)))


def _wsd(p: float, warmup: float = 0.1, decay: float = 0.2) -> float:
    _check_fractions(warmup=warmup, decay=decay)
    if warmup + decay > 1:
        raise ValueError(f"schedule wsd: warmup={warmup} + decay={decay} must not exceed 1")
    if p < warmup:
        return p / warmup
    if p > 1 - decay:
        return (1 - p) / decay
    return 1.0


def _check_fractions(**fractions: float) -> None:
    # Fractions of the budget: a phase may be empty but never the whole budget (no division by 0).
    for key, value in fractions.items():
        if not 0 <= value < 1 or (key == "decay" and value == 0):
            raise ValueError(f"schedule {key}={value}: allowed " + ("(0, 1)" if key == "decay" else "[0, 1)"))


_SCHEDULES = {
    "constant": _constant,
    "budget-triangle": _budget_triangle,
    "one-cycle": _one_cycle,
    "cosine": _cosine,
    "wsd": _wsd,
}
SCHEDULES: tuple[str, ...] = tuple(_SCHEDULES)
