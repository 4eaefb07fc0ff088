"""What the runner's torchrun ranks share: the process group's start and end, barriers, and what rank 0
decides. A single process (no WORLD_SIZE) never imports torch.distributed here.
"""

from __future__ import annotations

import os
from typing import Any

from cram.pipeline.errors import CramError


def barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def from_rank_0(value: bool, world_size: int) -> bool:
    if world_size == 1:
        return value
    import torch.distributed as dist

    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return bool(shared[0])


def agree(error: tuple[str, int] | None, world_size: int) -> tuple[str, int] | None:
    """Every rank learns whether the stage failed on any rank (rank 0's error wins)."""
    if world_size == 1:
        return error
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, error)
    return next((e for e in gathered if e is not None), None)


def device_problem(device: str) -> str | None:
    """Why `run.device` cannot serve this process's ranks, or None: under torchrun with more than one rank,
    `cuda:N` would put every rank on GPU N (NCCL refuses: "Duplicate GPU"); "cuda" gives each its own."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and device.startswith("cuda:"):
        return (
            f"run.device: {device!r} under torchrun (WORLD_SIZE={world_size}) would put every rank on one GPU; "
            "use 'cuda' or 'auto' (each rank takes cuda:LOCAL_RANK)"
        )
    return None


def init_distributed(device: str) -> tuple[int, int]:
    """(rank, world_size); under torchrun, also start the default process group.

    The group's time-out is long because ranks other than 0 wait in a barrier while rank 0 alone
    runs the non-distributed stages (tokenizing a large corpus can take hours).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1
    problem = device_problem(device)
    if problem is not None:
        raise CramError(problem)
    import datetime

    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        use_cuda = device != "cpu" and torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(hours=6))
    return dist.get_rank(), dist.get_world_size()


def finish_distributed() -> None:
    """Tear down the process group before the process exits: left to interpreter shutdown, gloo's
    threads can outlive a peer that already exited and abort the rank ("terminate called without an
    active exception")."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
