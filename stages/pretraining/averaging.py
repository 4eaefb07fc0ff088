"""`[pretrain] average_last`: the model pretrain outputs is the mean of its last N checkpoints' params
(ModernBERT-base is the average of its last checkpoints; issue 46).

The averaged checkpoints are those at `checkpoint_every_steps` and the one written at the end of the
budget (the final state, counted as one). So that the key can promise which checkpoints those are, the
cadence is part of it while averaging (`pretrain.key_config`), minute checkpoints and an hours limit are
refused with it (`Config`: they fall at steps no config names), and the budget's steps are planned
before any stage runs: an `average_last` larger than the checkpoints the budget writes is refused
(`check`). A resumed run writes the same checkpoints an uninterrupted one would, so it averages the same.
Each checkpoint keeps its own, un-averaged params; the mean is what `params.safetensors` holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cram.stages import StageError
from cram.stages.pretraining.budget import progress
from cram.stages.pretraining.config import Config
from cram.stages.pretraining.phases import Plan

if TYPE_CHECKING:
    from cram.stages.pretraining.state import Params


def planned_steps(config: Config, plan: Plan, world_size: int = 1) -> int:
    """The optimizer steps that `config`'s steps or tokens budget takes over `world_size` ranks (the loop's
    own progress through the batch ramp and the phases, stepped without training)."""
    from cram.stages.pretraining.loop import micro_steps
    from cram.stages.pretraining.state import TrainState

    state = TrainState(seed=0)
    while (spent := progress(config.budget, state, 0.0)) < 1:
        span = plan.span_at(spent)
        n_micro = micro_steps(spent, config.ramp, span.batch_size // (world_size * span.microbatch))
        state.advance({}, {}, n_micro * world_size * span.microbatch, span.seq_len, 0.0)
    return state.step


def checkpoints_written(steps: int, every_steps: int) -> int:
    """How many checkpoints a run of `steps` steps writes: one every `every_steps` steps, and one at the end
    unless the last step fell on that cadence (none for a budget that takes no step)."""
    return steps // every_steps + (steps % every_steps != 0)


def check(config: Config, plan: Plan, world_size: int = 1) -> None:
    """StageError when `average_last` asks for more checkpoints than the budget writes over `world_size`
    ranks (`validate` plans one; the stage checks again with the ranks it runs on, before training)."""
    if config.average_last <= 1:
        return
    steps = planned_steps(config, plan, world_size)
    written = checkpoints_written(steps, config.checkpoint_every_steps)
    if config.average_last > written:
        raise StageError(
            f"pretrain.average_last: {config.average_last}, but the budget writes {written} checkpoints "
            f"({steps} steps, one every checkpoint_every_steps = {config.checkpoint_every_steps} and one at the "
            "end): lower average_last or checkpoint_every_steps"
        )


def average(root: Path, count: int) -> tuple[Params, list[int]]:
    """The mean of the params of the newest `count` checkpoints under `root` (summed in float64, stored in
    each tensor's dtype), and their steps; StageError when fewer are there."""
    import torch

    from cram.stages.pretraining import checkpoint

    paths = checkpoint.newest(root, count)
    if len(paths) < count:
        raise StageError(f"pretrain.average_last: {count}, but {root} holds {len(paths)} intact checkpoints")
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for path in paths:
        params, _, _ = checkpoint.load(path)
        for name, p in params.items():
            total[name] = total[name] + p.double() if name in total else p.double()
            dtypes[name] = p.dtype
    mean = {name: (t / count).to(dtypes[name]) for name, t in total.items()}
    return mean, [checkpoint.step_of(path) for path in paths]
