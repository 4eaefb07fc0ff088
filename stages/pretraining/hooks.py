"""The loop's side jobs, each a `loop.Hook` with its own cadence: the divergence check and the report at
the log steps, checkpoints by steps or minutes. They run in that order: a diverged interval stops before
it is reported, and a checkpoint never holds a state that went non-finite."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cram.stages import Context
from cram.stages.pretraining import checkpoint
from cram.stages.pretraining.budget import progress
from cram.stages.pretraining.config import Budget, Config
from cram.stages.pretraining.loop import StepInfo, Steps

if TYPE_CHECKING:
    from cram.stages.protocols import Log
from cram.stages.pretraining.state import Params
from cram.stages.pretraining.telemetry import LOGGED, MetricsLog, ProgressBar, mfu, peak_memory_gb, short


class DivergedError(RuntimeError):
    """The loss or the gradient norm stopped being finite."""


def log_due(info: StepInfo, every: int) -> bool:
    """Step 1, every `every` steps, and at the end whatever steps are left unlogged."""
    if info.final:
        return bool(info.metrics.rows or info.metrics.pending)
    return info.state.step == 1 or info.state.step % every == 0


class DivergenceCheck:
    """Raise `DivergedError` at a log step whose interval holds a non-finite loss or gradient norm. The
    check fetches the interval's metrics (a host sync), hence the log steps' cadence; every rank reads the
    same gradient norms, so all raise alike."""

    def __init__(self, every: int, checkpoints: Path):
        self.every, self.checkpoints = every, checkpoints

    def due(self, info: StepInfo) -> bool:
        return log_due(info, self.every)

    def __call__(self, info: StepInfo) -> None:
        bad_step = info.metrics.first_bad_step()
        if bad_step is not None:
            raise DivergedError(
                f"pretrain: loss or gradient norm is not finite at step {bad_step}; last good "
                f"checkpoint: {checkpoint.latest(self.checkpoints) or 'none'} (try a lower optimizer.lr)"
            )


class Report:
    """At the log steps (every `every` steps): the interval's loss into the state (every rank), and on rank 0
    its record, with the loop's reading of the budget's progress, into `metrics.jsonl`, the experiment loggers,
    a console line and the progress bar."""

    def __init__(self, every: int, ctx: Context, steps: Steps, metrics_log: MetricsLog, bar: ProgressBar):
        self.every, self.ctx, self.metrics_log, self.bar = every, ctx, metrics_log, bar
        self.device, self.autocast = steps.device, steps.autocast

    def due(self, info: StepInfo) -> bool:
        return log_due(info, self.every)

    def __call__(self, info: StepInfo) -> None:
        state = info.state
        stats = info.metrics.close(state, info.data.wait_s, self.ctx.world_size, self.device)
        if state.loss_start is None:
            state.loss_start = stats["loss"]
        state.loss_end = stats["loss"]
        if self.ctx.is_main:
            self.write(self.record(info, stats))
        info.metrics.restart(state, info.data.wait_s)

    def record(self, info: StepInfo, stats: dict[str, float]) -> dict[str, Any]:
        elapsed = info.clock.local()
        tokens_per_s = stats["tokens_per_s"]
        return {
            "step": info.state.step,
            "progress": round(info.spent, 6),
            "elapsed_s": round(elapsed, 3),
            "loss": stats["loss"],
            "accuracy": stats["accuracy"],
            "grad_norm": stats["grad_norm"],
            "lr": info.lr,
            "batch_size": info.batch,
            "seq_len": info.seq_len,
            "tokens_seen": info.state.tokens_seen,
            "tokens_per_s": round(tokens_per_s, 1),
            # hardware FLOPs first: a rate above the peak raises the peak, which MFU then reads too
            "hfu": mfu(
                stats["hardware_flops_per_token"], tokens_per_s, self.device, self.ctx.world_size, self.autocast
            ),
            "mfu": mfu(stats["flops_per_token"], tokens_per_s, self.device, self.ctx.world_size, self.autocast),
            "data_wait": round(stats["data_wait"], 4),
            "peak_mem_gb": round(peak_memory_gb(self.device), 3),
        }

    def write(self, record: dict[str, Any]) -> None:
        self.metrics_log.write(record)
        self.ctx.metrics.log(record["step"], record)
        # One line per log step (torchtitan's): what a job log or a console without the bar shows.
        self.ctx.log.info("step", **{k: short(record[k]) for k in LOGGED})
        self.bar.update(record)


@dataclass(frozen=True)
class Checkpointing:
    """When checkpoints are written, by steps or by minutes (0: off), and how many are kept."""

    every_steps: int
    every_minutes: float
    keep: int

    @classmethod
    def of(cls, config: Config) -> Checkpointing:
        return cls(config.checkpoint_every_steps, config.checkpoint_every_minutes, config.keep_checkpoints)

    def due(self, step: int, last_saved_at: float) -> bool:
        """Whether a checkpoint is due at `step`, the last one written at `last_saved_at` (perf_counter)."""
        by_steps = self.every_steps > 0 and step % self.every_steps == 0
        by_time = self.every_minutes > 0 and time.perf_counter() - last_saved_at >= 60 * self.every_minutes
        return by_steps or by_time


class Checkpointer:
    """Rank 0's checkpoints under `root` when `every` says, and at the end unless the last step was saved
    already (`last_saved`: the step of the checkpoint resumed from); each records its progress through
    `budget`."""

    def __init__(self, every: Checkpointing, budget: Budget, root: Path, last_saved: int, log: Log):
        self.every, self.budget, self.root, self.log = every, budget, root, log
        self.last_saved, self.last_saved_at = last_saved, time.perf_counter()

    def due(self, info: StepInfo) -> bool:
        if info.final:
            return self.last_saved != info.state.step
        return self.every.due(info.state.step, self.last_saved_at)

    def __call__(self, info: StepInfo) -> None:
        """Write a checkpoint, unless the state went non-finite: then the next log step raises."""
        state = info.state
        if info.metrics.first_bad_step() is not None or not all_finite(state.params):
            return
        info.sync()
        state.progress = progress(self.budget, state, state.elapsed_s)
        state.unlogged = list(info.metrics.fetch())
        checkpoint.save(self.root, state.step, state.saved_params(), state.opt_state, state.to_json(), self.every.keep)
        self.last_saved, self.last_saved_at = state.step, time.perf_counter()
        self.log.info("checkpoint", step=state.step)


def all_finite(params: Params) -> bool:
    import torch

    return bool(torch.stack([p.isfinite().all() for p in params.values()]).all())
