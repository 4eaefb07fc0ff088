"""What the ranks of a torchrun job agree on or share: one value from rank 0, a mean, every rank's
object. Each is a no-op (or the value itself) with one rank, so callers need no special case."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def agree_on(path: Path | None, world_size: int) -> Path | None:
    """Rank 0's value of `path` on every rank."""
    if world_size == 1:
        return path
    import torch.distributed as dist

    box = [None if path is None else str(path)]
    dist.broadcast_object_list(box, src=0)
    return None if box[0] is None else Path(box[0])


def mean_over_ranks(values: list[float], world_size: int, device: torch.device) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / world_size).tolist()


def all_gather(obj: T, world_size: int) -> list[T]:
    """Every rank's `obj` (picklable), on every rank."""
    if world_size == 1:
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, obj)
    return gathered
