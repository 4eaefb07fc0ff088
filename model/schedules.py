"""Learning-rate schedules: the multiplier of the peak rate at a point of the budget's progress.

A schedule with a decay (all but `constant`) takes its shape, `shape` (linear, cosine or 1-sqrt: the
multiplier at fraction d of the decay is 1 - d, (1 + cos(pi d)) / 2 or 1 - sqrt(d); "": the
schedule's own, cosine's cosine and the others' linear), and its floor, `decay_to` (the decay ends at
that fraction of the peak, e.g. 0.02 as ModernBERT's and mmBERT's warmup-stable-decay, instead of 0).
Progress is the budget's (time, steps or tokens), so the shapes apply alike to every budget.

Plain arithmetic, free of torch: validating a config checks a schedule's arguments without loading torch.
"""

from __future__ import annotations

import math

DECAY_SHAPES: tuple[str, ...] = ("linear", "cosine", "1-sqrt")


def lr_schedule(name: str, progress: float, shape: str = "", decay_to: float = 0.0, **kw: float) -> float:
    """Multiplier of the peak learning rate at `progress` in [0, 1] (clamped) of the budget."""
    if name not in _SCHEDULES:
        raise ValueError(f"schedule {name!r}: allowed {', '.join(SCHEDULES)}")
    if shape and shape not in DECAY_SHAPES:
        raise ValueError(f"decay_shape {shape!r}: allowed {', '.join(DECAY_SHAPES)}")
    if not 0 <= decay_to < 1:
        raise ValueError(f"decay_to {decay_to}: allowed [0, 1)")
    if name == "constant" and (shape or decay_to):
        raise ValueError("schedule 'constant' has no decay: decay_shape and decay_to do not apply")
    value, decayed = _SCHEDULES[name](min(max(progress, 0.0), 1.0), **kw)
    if decayed is None:
        return value
    fall = _SHAPES[shape or ("cosine" if name == "cosine" else "linear")](decayed)
    return decay_to + (1 - decay_to) * fall


# Each schedule returns (multiplier, None) before its decay and (0, d) at fraction d of its decay.


def _constant(p: float) -> tuple[float, float | None]:
    return 1.0, None


def _budget_triangle(p: float, start: float = 0.25, decay: float = 0.25) -> tuple[float, float | None]:
    """cramming's budget-triangle2: rise linearly from `start` to 1, reaching it where the decay begins."""
    _check_fractions(start=start, decay=decay)
    if p > 1 - decay:
        return 0.0, (p - (1 - decay)) / decay
    return min(start + p * (1 - start) / (1 - decay), 1.0), None


def _one_cycle(p: float) -> tuple[float, float | None]:
    return (2 * p, None) if p < 0.5 else (0.0, 2 * p - 1)


def _cosine(p: float, warmup: float = 0.1) -> tuple[float, float | None]:
    _check_fractions(warmup=warmup)
    if p < warmup:
        return p / warmup, None
    return 0.0, (p - warmup) / (1 - warmup)


def _wsd(p: float, warmup: float = 0.1, decay: float = 0.2) -> tuple[float, float | None]:
    _check_fractions(warmup=warmup, decay=decay)
    if warmup + decay > 1:
        raise ValueError(f"schedule wsd: warmup={warmup} + decay={decay} must not exceed 1")
    if p < warmup:
        return p / warmup, None
    if p > 1 - decay:
        return 0.0, (p - (1 - decay)) / decay
    return 1.0, None


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
_SHAPES = {
    "linear": lambda d: 1 - d,
    "cosine": lambda d: 0.5 * (1 + math.cos(math.pi * d)),
    "1-sqrt": lambda d: 1 - math.sqrt(d),
}
