"""The pretraining loop: step until the budget is spent, with side jobs (logging, checkpointing, the
divergence check) as hooks that the loop runs when they fall due.

Each optimizer step accumulates `n_micro` microbatches of a fixed shape and then applies AdamW; the
number of microbatches grows with the budget's progress (cramming's batch ramp). Both reach the
compiled steps as tensors, so nothing recompiles.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cram.stages import Context
from cram.stages.pretraining.budget import Clock, progress
from cram.stages.pretraining.config import Budget, Config
from cram.stages.pretraining.head_warmup import HeadWarmup, schedule_position
from cram.stages.pretraining.state import Params, TrainState
from cram.stages.pretraining.telemetry import Interval

if TYPE_CHECKING:
    import numpy as np
    import torch

    from cram.stages.pretraining.batches import Microbatch, PhaseStream
    from cram.stages.shared.blocks import Boundary
    from cram.stages.shared.masking import MaskSpec


@dataclass(frozen=True)
class Schedule:
    """The lr schedule: `peak` times the factor of `model.lr_schedule`'s `name` at a position in [0, 1],
    with its decay's shape and end (`decay_shape`, `decay_to`) and its arguments."""

    peak: float
    name: str
    decay_shape: str
    decay_to: float
    args: Mapping[str, float]

    @classmethod
    def of(cls, config: Config, peak: float) -> Schedule:
        return cls(peak, config.schedule, config.decay_shape, config.decay_to, config.schedule_args)

    def lr(self, position: float) -> float:
        from cram import model

        return self.peak * model.lr_schedule(self.name, position, self.decay_shape, self.decay_to, **self.args)


@dataclass(frozen=True)
class Course:
    """What the loop reads of pretrain's config: the budget it steps until, the batch ramp (the fraction of
    the budget at which the batch is full; 0: from the start), the lr schedule, how often the ranks agree on
    an hours budget's clock, and the head warm-up that comes first (None: none)."""

    budget: Budget
    schedule: Schedule
    ramp: float
    clock_sync_every_steps: int
    warmup: HeadWarmup | None

    @classmethod
    def of(cls, config: Config, peak_lr: float, warmup: HeadWarmup | None) -> Course:
        """The course of `config` with the schedule at `peak_lr` and `warmup`, as the run resolved them."""
        return cls(config.budget, Schedule.of(config, peak_lr), config.ramp, config.clock_sync_every_steps, warmup)

    def lr(self, state: TrainState, spent: float, head_alone: bool) -> float:
        """The warm-up's constant lr for the head alone; otherwise the schedule's, started with the whole
        model."""
        if head_alone and self.warmup is not None:
            return self.warmup.lr
        return self.schedule.lr(schedule_position(spent, state.full_start))


class Batches(Protocol):
    """A stream of this rank's microbatches."""

    def next(self) -> Microbatch: ...


@dataclass
class Steps:
    """The compiled steps, and what turns a prefetched microbatch into their input on the device.

    `whole` (one graph: forward, backward, clipping, AdamW) when every step is one microbatch;
    otherwise `accumulate` per microbatch and `apply` per step (two graphs)."""

    # (params, opt_state, batch, lr) -> (params, opt_state, {loss, accuracy, grad_norm})
    whole: Callable[[Params, Params, Params, torch.Tensor], tuple[Params, Params, Params]] | None
    # (params, grads, batch) -> (grads, {loss, accuracy})
    accumulate: Callable[[Params, Params, Params], tuple[Params, Params]] | None
    # (params, opt_state, grads, n_micro, lr) -> (params, opt_state, {grad_norm})
    apply: Callable[[Params, Params, Params, torch.Tensor, torch.Tensor], tuple[Params, Params, Params]] | None
    generator: torch.Generator
    device: torch.device
    autocast: torch.dtype | None  # the forward's autocast dtype; None: fp32
    documents: Boundary | None = None  # attention within documents: the batch carries `document_ids`
    trained: tuple[str, ...] | None = None  # the params these steps train; None: all
    head: Steps | None = None  # the same steps training the MLM head alone (`head_warmup.py`); None: no warm-up
    optimizer_flops: float = 0.0  # matmul FLOPs of one update (Muon's Newton-Schulz): hardware FLOPs, not model

    def batch(self, micro: Microbatch, spec: MaskSpec) -> Params:
        from cram.stages.shared.blocks import document_ids
        from cram.stages.shared.masking import mask_tokens

        self.generator.manual_seed(micro.mask_seed)
        ids = micro.ids.to(self.device, non_blocking=True)
        batch = mask_tokens(ids, spec, self.generator)
        if self.documents is not None:
            batch["document_ids"] = document_ids(ids, self.documents)
        return batch

    def scalar(self, value: float) -> torch.Tensor:
        import torch

        from cram.stages.shared.device import to_device

        return to_device(torch.tensor(value, dtype=torch.float32), self.device)

    def step(
        self, params: Params, opt_state: Params, data: Batches, n_micro: int, lr: float, spec: MaskSpec
    ) -> tuple[Params, Params, torch.Tensor]:
        """One optimizer step over `n_micro` microbatches from `data`, masked by `spec`: (params, opt_state,
        [loss, accuracy, grad_norm] on the device)."""
        import torch

        if self.whole is not None:
            params, opt_state, m = self.whole(params, opt_state, self.batch(data.next(), spec), self.scalar(lr))
            return params, opt_state, torch.stack([m["loss"], m["accuracy"], m["grad_norm"]])
        grads = {k: torch.zeros_like(v) for k, v in params.items() if self.trained is None or k in self.trained}
        loss = accuracy = 0.0
        for _ in range(n_micro):
            grads, m = self.accumulate(params, grads, self.batch(data.next(), spec))
            loss, accuracy = loss + m["loss"], accuracy + m["accuracy"]
        params, opt_state, m = self.apply(params, opt_state, grads, self.scalar(n_micro), self.scalar(lr))
        return params, opt_state, torch.stack([loss / n_micro, accuracy / n_micro, m["grad_norm"]])

    def warm_up(self, params: Params, opt_state: Params, train: np.ndarray, microbatch: int, spec: MaskSpec) -> float:
        """Compile the steps for one shape (`microbatch` blocks of `train`, `spec`'s masked rows) on a
        throwaway batch, before the budget clock starts; return seconds.

        The steps are pure functions, so discarding their results leaves the training state as it was.
        """
        import torch

        from cram.stages.pretraining.batches import Microbatch, read_sequences

        began = time.perf_counter()
        ids = torch.from_numpy(read_sequences(train, 0, 0, microbatch, {}))

        class Once:
            def next(self) -> Microbatch:
                return Microbatch(ids, 0, 0)

        _, _, row = self.step(params, opt_state, Once(), 1, 0.0, spec)
        row.tolist()  # wait for the device
        return time.perf_counter() - began


@dataclass(frozen=True)
class Canary:
    """`steps` optimizer steps compiled and eagerly at `lr` (the peak, so that updates compound)."""

    steps: int
    lr: float


def canary(run: Canary, ctx: Context, compiled: Steps, eager: Steps, state: TrainState, data: PhaseStream) -> float:
    """Run `run.steps` optimizer steps compiled and eagerly from `state` (left as it was) on the same
    batches (the stream's first, of the first phase, one microbatch a step as the ramp starts); return the
    largest difference of their readings on this rank (`step_difference`; inf for a non-finite one);
    `precision.choose` takes the worst over all ranks, so that every rank decides alike."""
    import torch

    from cram.stages.pretraining.batches import Microbatch, read_sequences
    from cram.stages.shared.masking import mask_seed

    span = data.plan.spans[0]
    pieces = data.plan.chunk // span.seq_len

    class Replay:
        def __init__(self) -> None:
            self.first = ctx.rank * span.microbatch

        def next(self) -> Microbatch:
            ids = torch.from_numpy(read_sequences(data.chunks, ctx.seed, self.first, span.microbatch, {}, pieces))
            micro = Microbatch(ids, self.first, mask_seed(ctx.seed, self.first))
            self.first += ctx.world_size * span.microbatch
            return micro

    worst = 0.0
    state_c = state_e = (state.params, state.opt_state)
    data_c, data_e = Replay(), Replay()
    for _ in range(run.steps):
        *state_c, row_c = compiled.step(*state_c, data_c, 1, run.lr, span.spec)
        *state_e, row_e = eager.step(*state_e, data_e, 1, run.lr, span.spec)
        worst = max(worst, step_difference(row_c, row_e))
    return worst


def step_difference(compiled: torch.Tensor, eager: torch.Tensor) -> float:
    """How far a compiled step's [loss, accuracy, grad_norm] is from the eager step's: the relative
    difference of the loss and of the gradient norm, the absolute difference of the accuracy (a fraction of
    the masked tokens); inf where one is not finite. Relative to the few tokens an untrained model gets
    right, one near-tie that bf16 rounding flips reads as several percent (1/36 at seed 1 of the default
    pipeline, which then fell back to fp32); as a fraction of the masked tokens it is a tenth of a percent."""
    import torch

    diff = (compiled.double() - eager.double()).abs()
    scale = eager.double().abs().clamp(min=1e-6)
    scale[1] = 1.0
    worst = (diff / scale).max()
    return float(worst) if torch.isfinite(worst) else float("inf")


@dataclass
class StepInfo:
    """What the loop hands its hooks: the state after a step, how that step was taken, and the readings a
    hook may take. `final`: the budget is spent, and the loop calls its hooks one last time."""

    state: TrainState
    metrics: Interval  # [loss, accuracy, grad_norm] of each step since the last log step
    clock: Clock
    data: PhaseStream
    lr: float = 0.0
    batch: int = 0  # global sequences in the step
    seq_len: int = 0  # their length: the phase's
    spent: float = 0.0  # the budget's progress after the step, as the loop reads it to decide whether to stop
    final: bool = False

    def sync(self) -> None:
        """Bring the state's budget seconds and data wait up to now."""
        self.state.elapsed_s = self.clock.local()
        self.state.data_wait_s = self.data.wait_s


class Hook(Protocol):
    """A side job of the loop with its own cadence: after every step, and once more when the budget is
    spent, the loop calls each hook that is `due`, in order."""

    def due(self, info: StepInfo) -> bool: ...

    def __call__(self, info: StepInfo) -> None: ...


def train(
    course: Course, ctx: Context, steps: Steps, state: TrainState, data: PhaseStream, hooks: Sequence[Hook]
) -> None:
    """Step until `course`'s budget is spent, from `state` on (updated in place), over `data`, the stream of
    its phases; the head alone first while its warm-up is active."""
    from cram.stages.pretraining.phases import enter

    plan, budget = data.plan, course.budget
    clock = Clock(
        state.elapsed_s,
        agree=ctx.world_size > 1 and budget.hours is not None,
        device=steps.device,
        every=course.clock_sync_every_steps,
        end_s=None if budget.hours is None else 3600 * budget.hours,
    )
    metrics = Interval(state, data.wait_s, rows=state.unlogged)
    info = StepInfo(state, metrics, clock, data)
    spent = info.spent = progress(budget, state, clock.agreed(state.step))
    while spent < 1:
        enter(plan, state, spent)
        data.follow(state)
        span = plan.spans[state.phase]
        n_micro = micro_steps(spent, course.ramp, span.batch_size // (ctx.world_size * span.microbatch))
        active = _mode(ctx, steps, state, spent, course.warmup)
        info.lr = course.lr(state, spent, head_alone=active is steps.head)
        info.batch, info.seq_len = n_micro * ctx.world_size * span.microbatch, span.seq_len
        spec = plan.spec_at(span, spent)
        params, opt_state, row = active.step(state.params, state.opt_state, data, n_micro, info.lr, spec)
        metrics.add(row)
        flops = span.head_flops_per_token if active is steps.head else span.flops_per_token
        state.advance(params, opt_state, info.batch, span.seq_len, flops, active.optimizer_flops)
        # Read before the hooks, so that a row logged at the stopping step shows the budget spent.
        spent = info.spent = progress(budget, state, clock.agreed(state.step))
        _run_due(hooks, info)
    info.final = True
    info.sync()
    _run_due(hooks, info)


def _mode(ctx: Context, steps: Steps, state: TrainState, spent: float, warmup: HeadWarmup | None) -> Steps:
    """The steps to take now: the head's while the warm-up lasts; at its end the whole model's, with a fresh
    optimizer state in the same layout (the encoder's moments were never updated, and the shared step count
    would skip their bias correction)."""
    import torch

    if warmup is None or state.full_start is not None:
        return steps
    if warmup.active(state, spent):
        return steps.head
    state.full_start = spent
    state.opt_state = {key: torch.zeros_like(value) for key, value in state.opt_state.items()}
    if ctx.is_main:
        ctx.log.info("head warm-up done", step=state.step, tokens=state.tokens_seen, progress=round(spent, 4))
    return steps


def _run_due(hooks: Sequence[Hook], info: StepInfo) -> None:
    for hook in hooks:
        if hook.due(info):
            hook(info)


def micro_steps(progress: float, ramp: float, target: int) -> int:
    """Microbatches per step: one at the start, growing linearly to `target` at `ramp` (cramming)."""
    if ramp == 0:
        return target
    return min(target, int(progress / ramp * target) + 1)
