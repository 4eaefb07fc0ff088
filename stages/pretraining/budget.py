"""The budget clock and what the ranks of a torchrun job must agree on (or share).

Progress through the budget drives the lr schedule and the batch ramp, and decides when training
stops, so under torchrun every rank must read the same progress: rank 0's clock is the one that
counts, and rank 0's newest checkpoint is the one every rank resumes from.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from cram.stages.pretraining.config import Budget

if TYPE_CHECKING:
    import torch

    from cram.stages.pretraining.state import TrainState


def progress(budget: Budget, state: TrainState, elapsed_s: float) -> float:
    """How much of `budget` is spent, in [0, 1+): the largest fraction of any limit."""
    spent = [0.0]
    if budget.hours is not None:
        spent.append(elapsed_s / (3600 * budget.hours))
    if budget.steps is not None:
        spent.append(state.step / budget.steps)
    if budget.tokens is not None:
        spent.append(state.tokens_seen / budget.tokens if budget.tokens else 1.0)  # a zero budget: spent
    return max(spent)


class Clock:
    """Budget seconds: those carried over from a checkpoint plus this process's.

    `agreed(step)` is the reading every rank acts on, so that with a time budget all ranks take the
    same steps at the same lr. Rank 0's clock is broadcast once every `every` steps (a broadcast and a
    host sync each time); in between, every rank extrapolates alike from the last two agreed readings
    (seconds per step), so the ranks never disagree and the hot path holds no collective. An
    extrapolation that reaches `end_s` (the time budget) is checked by a real reading before anyone
    stops: a slow stretch would otherwise end training early.
    """

    def __init__(self, before_s: float, agree: bool, device: torch.device, every: int = 1, end_s: float | None = None):
        self.before_s, self.agree, self.device, self.every, self.end_s = before_s, agree, device, every, end_s
        self.started = time.perf_counter()
        self.synced_step: int | None = None
        self.synced_s = before_s
        self.per_step_s = 0.0
        self.syncs = 0

    def local(self) -> float:
        return self.before_s + time.perf_counter() - self.started

    def agreed(self, step: int) -> float:
        if not self.agree:
            return self.local()
        if self.synced_step is not None and step - self.synced_step < self.every:
            estimate = self.synced_s + (step - self.synced_step) * self.per_step_s
            if self.end_s is None or estimate < self.end_s:
                return estimate
        import torch
        import torch.distributed as dist

        reading = torch.tensor([self.local()], dtype=torch.float64, device=self.device)
        dist.broadcast(reading, src=0)
        now = reading.item()
        self.syncs += 1
        if self.synced_step is not None and step > self.synced_step:
            self.per_step_s = (now - self.synced_s) / (step - self.synced_step)
        self.synced_step, self.synced_s = step, now
        return now
