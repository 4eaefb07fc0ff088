"""The pretraining loop: step until the budget is spent, logging and checkpointing on the way.

Each optimizer step accumulates `n_micro` microbatches of a fixed shape and then applies AdamW; the
number of microbatches grows with the budget's progress (cramming's batch ramp). Both reach the
compiled steps as tensors, so nothing recompiles.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cram.stages import Context
from cram.stages.pretraining.budget import Clock, progress
from cram.stages.pretraining.telemetry import LOGGED, Interval, MetricsLog, ProgressBar, mfu, peak_memory_gb, short


class DivergedError(RuntimeError):
    """The loss or the gradient norm stopped being finite."""


@dataclass
class Steps:
    """The compiled steps, and what turns a prefetched microbatch into their input on the device.

    `whole` (one graph: forward, backward, clipping, AdamW) when every step is one microbatch;
    otherwise `accumulate` per microbatch and `apply` per step (two graphs)."""

    whole: Any
    accumulate: Any
    apply: Any
    spec: Any
    generator: Any
    device: Any
    autocast: Any  # the forward's autocast dtype; None: fp32

    def batch(self, micro) -> dict:
        from cram.stages.shared.masking import mask_tokens

        self.generator.manual_seed(micro.mask_seed)
        ids = micro.ids.to(self.device, non_blocking=True)
        return mask_tokens(ids, self.spec, self.generator)

    def scalar(self, value: float):
        import torch
        from cram.stages.shared.device import to_device

        return to_device(torch.tensor(value, dtype=torch.float32), self.device)

    def step(self, params: dict, opt_state: dict, data, n_micro: int, lr: float) -> tuple[dict, dict, Any]:
        """One optimizer step over `n_micro` microbatches from `data`: (params, opt_state, [loss, accuracy,
        grad_norm] on the device)."""
        import torch

        if self.whole is not None:
            params, opt_state, m = self.whole(params, opt_state, self.batch(data.next()), self.scalar(lr))
            return params, opt_state, torch.stack([m["loss"], m["accuracy"], m["grad_norm"]])
        grads = {k: torch.zeros_like(v) for k, v in params.items()}
        loss = accuracy = 0.0
        for _ in range(n_micro):
            grads, m = self.accumulate(params, grads, self.batch(data.next()))
            loss, accuracy = loss + m["loss"], accuracy + m["accuracy"]
        params, opt_state, m = self.apply(params, opt_state, grads, self.scalar(n_micro), self.scalar(lr))
        return params, opt_state, torch.stack([loss / n_micro, accuracy / n_micro, m["grad_norm"]])

    def warm_up(self, params: dict, opt_state: dict, train, microbatch: int) -> float:
        """Compile the steps on a throwaway batch, before the budget clock starts; return seconds.

        The steps are pure functions, so discarding their results leaves the training state as it was.
        """
        import torch
        from cram.stages.pretraining.batches import Microbatch, read_sequences

        began = time.perf_counter()
        ids = torch.from_numpy(read_sequences(train, 0, 0, microbatch, {}))

        class Once:
            def next(self) -> Microbatch:
                return Microbatch(ids, 0, 0)

        _, _, row = self.step(params, opt_state, Once(), 1, 0.0)
        row.tolist()  # wait for the device
        return time.perf_counter() - began


class CanaryError(RuntimeError):
    """The compiled steps disagree with the same steps run eagerly."""


def canary(config: Any, ctx: Context, compiled: Steps, eager: Steps, params: dict, opt_state: dict, blocks) -> float:
    """Run `config.canary_steps` optimizer steps compiled and eagerly from the same state on the same
    batches (the stream's first, one microbatch a step as the ramp starts, at the peak lr so that
    updates compound); raise `CanaryError` when loss, accuracy or gradient norm differ by more than
    `config.canary_tolerance` (relative). Returns the largest difference, the worst over all ranks."""
    import torch
    from cram.stages.pretraining.batches import Microbatch, read_sequences
    from cram.stages.shared.collectives import all_gather
    from cram.stages.shared.masking import mask_seed

    class Replay:
        def __init__(self) -> None:
            self.first = ctx.rank * config.microbatch

        def next(self) -> Microbatch:
            ids = torch.from_numpy(read_sequences(blocks, ctx.seed, self.first, config.microbatch, {}))
            micro = Microbatch(ids, self.first, mask_seed(ctx.seed, self.first))
            self.first += ctx.world_size * config.microbatch
            return micro

    worst = 0.0
    state_c = state_e = (params, opt_state)
    data_c, data_e = Replay(), Replay()
    for _ in range(config.canary_steps):
        *state_c, row_c = compiled.step(*state_c, data_c, 1, config.optimizer.lr)
        *state_e, row_e = eager.step(*state_e, data_e, 1, config.optimizer.lr)
        diff = ((row_c.double() - row_e.double()).abs() / row_e.double().abs().clamp(min=1e-6)).max()
        worst = max(worst, float(diff) if torch.isfinite(diff) else float("inf"))
    worst = max(all_gather(worst, ctx.world_size))  # every rank decides alike
    ctx.log.info("canary", steps=config.canary_steps, max_relative_diff=worst)
    if not worst <= config.canary_tolerance:
        raise CanaryError(
            f"pretrain: compile canary: the compiled step ({config.backend}) differs from eager by {worst:.3g} "
            f"(relative) over {config.canary_steps} steps, above canary_tolerance {config.canary_tolerance}; "
            "nothing was trained. Try another pretrain.backend, pretrain.compile = false, or canary_steps = 0 "
            "to train anyway"
        )
    return worst


def fresh_state(seed: int) -> dict[str, Any]:
    # The seed and the data position are the whole random state: batches and masks derive from them.
    return {
        "step": 0,
        "sequences": 0,  # data position: global sequences consumed
        "tokens_seen": 0,
        "elapsed_s": 0.0,  # budget time spent, carried over across resumes
        "data_wait_s": 0.0,  # of which waiting for batches
        "progress": 0.0,  # schedule position
        "seed": seed,
        "loss_start": None,
        "loss_end": None,
        "val_loss_start": None,
        "unlogged": [],  # metrics of the steps since the last log line, so that resuming keeps the curve
    }


def train(
    config: Any,
    ctx: Context,
    steps: Steps,
    params: dict,
    opt_state: dict,
    state: dict,
    data_blocks,
    out_dir: Path,
    last_saved: int,
    flops_per_token: float,
) -> tuple[dict, dict]:
    """Step until the budget of `config` (a `pretrain.Config`) is spent, logging and checkpointing
    (the last checkpoint is the end). Returns the final (params, opt_state); `state` is updated in place."""
    from cram import model
    from cram.stages.pretraining import checkpoint
    from cram.stages.pretraining.batches import Prefetcher

    seq_len = data_blocks.shape[1]
    target_micro = config.batch_size // (ctx.world_size * config.microbatch)
    clock = Clock(
        state["elapsed_s"],
        agree=ctx.world_size > 1 and config.budget.hours is not None,
        device=steps.device,
        every=config.clock_sync_every_steps,
        end_s=None if config.budget.hours is None else 3600 * config.budget.hours,
    )
    last_saved_at = time.perf_counter()
    metrics_log = MetricsLog(out_dir / "metrics.jsonl")
    lr = batch = 0.0
    wait_before_s = state["data_wait_s"]

    def save() -> None:
        """Write a checkpoint, unless the state went non-finite: then the next log step raises."""
        nonlocal last_saved, last_saved_at
        if interval.first_bad_step() is not None or not all_finite(params):
            return
        state["elapsed_s"] = clock.local()
        state["data_wait_s"] = wait_before_s + data.wait_s
        state["progress"] = progress(config.budget, state, state["elapsed_s"])
        state["unlogged"] = interval.fetch()
        checkpoint.save(out_dir / "checkpoints", state["step"], params, opt_state, state, config.keep_checkpoints)
        last_saved, last_saved_at = state["step"], time.perf_counter()
        ctx.log.info("checkpoint", step=state["step"])

    def log(interval: Interval) -> None:
        """Raise if the interval diverged (on every rank alike), else record its metrics."""
        stats = interval.close(state, data.wait_s, ctx.world_size, steps.device)
        if stats["bad_step"] is not None:
            raise DivergedError(
                f"pretrain: loss or gradient norm is not finite at step {stats['bad_step']}; last good "
                f"checkpoint: {checkpoint.latest(out_dir / 'checkpoints') or 'none'} (try a lower optimizer.lr)"
            )
        if state["loss_start"] is None:
            state["loss_start"] = stats["loss"]
        state["loss_end"] = stats["loss"]
        if not ctx.is_main:
            return
        elapsed = clock.local()
        record = {
            "step": state["step"],
            "progress": round(progress(config.budget, state, elapsed), 6),
            "elapsed_s": round(elapsed, 3),
            "loss": stats["loss"],
            "accuracy": stats["accuracy"],
            "grad_norm": stats["grad_norm"],
            "lr": lr,
            "batch_size": batch,
            "tokens_seen": state["tokens_seen"],
            "tokens_per_s": round(stats["tokens_per_s"], 1),
            "mfu": mfu(flops_per_token, stats["tokens_per_s"], steps.device, ctx.world_size, steps.autocast),
            "data_wait": round(stats["data_wait"], 4),
            "peak_mem_gb": round(peak_memory_gb(steps.device), 3),
        }
        metrics_log.write(record)
        ctx.metrics.log(state["step"], record)
        # One line per log step (torchtitan's): what a job log or a console without the bar shows.
        ctx.log.info("step", **{k: short(record[k]) for k in LOGGED})
        bar.update(record)

    with (
        Prefetcher(
            data_blocks,
            seed=ctx.seed,
            start=state["sequences"],
            microbatch=config.microbatch,
            rank=ctx.rank,
            world_size=ctx.world_size,
            depth=config.prefetch,
            pin=steps.device.type == "cuda",
        ) as data,
        ProgressBar(ctx.is_main) as bar,
    ):
        interval = Interval(state, data.wait_s, rows=state["unlogged"])
        while (spent := progress(config.budget, state, clock.agreed(state["step"]))) < 1:
            n_micro = micro_steps(spent, config.ramp, target_micro)
            lr = config.optimizer.lr * model.lr_schedule(config.schedule, spent, **config.schedule_args)
            params, opt_state, row = steps.step(params, opt_state, data, n_micro, lr)
            interval.add(row)
            batch = n_micro * ctx.world_size * config.microbatch
            state["step"] += 1
            state["sequences"] += batch
            state["tokens_seen"] += batch * seq_len
            if state["step"] == 1 or state["step"] % config.log_every_steps == 0:
                log(interval)
                interval = Interval(state, data.wait_s)
            if ctx.is_main and checkpoint_due(config, state["step"], last_saved_at):
                save()
        if interval.rows or interval.pending:
            log(interval)
            interval = Interval(state, data.wait_s)
        state["elapsed_s"] = clock.local()
        state["data_wait_s"] = wait_before_s + data.wait_s
        if ctx.is_main and last_saved != state["step"]:
            save()
    return params, opt_state


def micro_steps(progress: float, ramp: float, target: int) -> int:
    """Microbatches per step: one at the start, growing linearly to `target` at `ramp` (cramming)."""
    if ramp == 0:
        return target
    return min(target, int(progress / ramp * target) + 1)


def checkpoint_due(config: Any, step: int, last_saved_at: float) -> bool:
    """Whether a checkpoint is due by `checkpoint_every_steps` or `checkpoint_every_minutes` (0: off)."""
    by_steps = config.checkpoint_every_steps > 0 and step % config.checkpoint_every_steps == 0
    by_time = config.checkpoint_every_minutes > 0 and (
        time.perf_counter() - last_saved_at >= 60 * config.checkpoint_every_minutes
    )
    return by_steps or by_time


def all_finite(params: dict) -> bool:
    import torch

    return bool(torch.stack([p.isfinite().all() for p in params.values()]).all())
