"""Where pretraining starts: the newest checkpoint of an interrupted run, `init`'s checkpoint (with a
masked-LM head made where it has none, or where its own measures no better than uniform: `continued.py`),
or the preset's random init; and the values the run trains with, resolved once the start is known
(`resolved.Resolved`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from cram.stages import Context, StageError
from cram.stages.pretraining import continued
from cram.stages.pretraining.config import Config
from cram.stages.pretraining.resolved import Batch, Resolved
from cram.stages.pretraining.setup import Setup

if TYPE_CHECKING:
    from cram.stages.pretraining.state import Params, TrainState

# Held-out blocks (at most) on which a checkpoint's own masked-LM head is measured before training: a
# random head's loss lies half a nat or more from a trained one's, which a few thousand masked tokens show.
JUDGED_BLOCKS = 64


def start(config: Config, batch: Batch, setup: Setup, out_dir: Path, ctx: Context) -> tuple[Resolved, TrainState]:
    """The state of the newest checkpoint (the one rank 0 sees, on every rank), or a fresh one (the init's,
    which a checkpoint would only repeat), on the device, trained at `batch` (a checkpoint trained at the
    other table's, `[pretrain]`'s or `[pretrain.fp32]`'s, is refused); and the values the run trains with,
    resolved once as `init`'s head measured (`TrainState.init_head_loss`): its optimizer, peak lr and head
    warm-up. Rank 0's metrics.jsonl loses the lines written after that state (a killed run's), all of them on
    a fresh start."""
    from cram import model
    from cram.stages.pretraining import checkpoint
    from cram.stages.pretraining.state import TrainState
    from cram.stages.pretraining.telemetry import MetricsLog
    from cram.stages.shared.collectives import agree_on

    resume_from = agree_on(checkpoint.latest(out_dir / "checkpoints", ctx.log), ctx.world_size)
    fp32_batch = batch.by_fp32
    if resume_from is None:
        state = _fresh(config, setup, ctx, batch.lr)
        state.fp32_batch = fp32_batch
    else:
        params, opt_state, counters = checkpoint.load(resume_from)
        state = TrainState.from_json(counters, params, opt_state)
        if state.seed != ctx.seed:
            raise StageError(f"{resume_from}: saved with seed {state.seed}, the run has seed {ctx.seed}")
        if state.fp32_batch != fp32_batch:
            tables = ("[pretrain]'s", "[pretrain.fp32]'s")
            then, now = tables[::-1] if state.fp32_batch else tables
            raise StageError(
                f"{resume_from}: trained at {then} batch and lr, and this machine's step would train at {now}: "
                "resume it on the kind of machine it started on, or set pretrain.precision = "
                f"{'fp32' if state.fp32_batch else 'bf16'!r}"
            )
        ctx.log.info("resume", checkpoint=str(resume_from), step=state.step, elapsed_s=state.elapsed_s)
    untrained = continued.untrained(state.init_head_loss, setup.model.vocab_size)
    resolved = Resolved.of(config, batch, setup.model, untrained)
    if resume_from is None:
        state.opt_state = model.optimizer_init(resolved.optimizer, state.params)
        state.full_start = None if resolved.warmup is not None else 0.0
    else:  # in the layout `optimizer_init` makes: a Muon checkpoint's all-zero second moments of old dropped
        state.opt_state = model.drop_unused(resolved.optimizer, state.opt_state)
    state.params = {k: v.to(setup.device) for k, v in state.params.items()}
    state.opt_state = {k: v.to(setup.device) for k, v in state.opt_state.items()}
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        MetricsLog(out_dir / "metrics.jsonl").truncate(state.step)
    return resolved, state


def _fresh(config: Config, setup: Setup, ctx: Context, asked_lr: float) -> TrainState:
    """The state before the first step, but its optimizer's (which `start` makes once the optimizer is
    resolved): `init`'s params (and its head's held-out loss, where measured), or the preset's random init;
    `asked_lr`: the peak lr asked for, named in a made head's warning."""
    from cram import model
    from cram.stages.pretraining.state import TrainState

    head_loss = None
    if config.init:
        found = continued.load(config.init, ctx)
        head_loss = _head_loss(config, setup, found, ctx)
        params = continued.params(config, ctx, found, head_loss, asked_lr)
    else:
        params = model.init(setup.model, ctx.seed)
    trained, kept = TrainState.split(params)
    return TrainState(seed=ctx.seed, params=trained, kept=kept, init_head_loss=head_loss)


def _head_loss(config: Config, setup: Setup, found: continued.Checkpoint, ctx: Context) -> float | None:
    """The held-out MLM loss of the checkpoint's own head on the first `JUDGED_BLOCKS` held-out blocks, in
    fp32 and eagerly, rank 0's on every rank; None where there is nothing to measure (no head of its own,
    no held-out block) or no step will use it (a zero budget)."""
    from cram.model.bert import shapes
    from cram.stages.pretraining.state import TrainState
    from cram.stages.pretraining.steps import val_loss
    from cram.stages.shared.collectives import all_gather
    from cram.stages.shared.precision import FP32

    if config.budget.tokens == 0 or not found.has_head or not len(setup.val):
        return None
    loss = None
    if ctx.is_main:
        trained, _ = TrainState.split({name: found.params[name] for name in shapes(found.cfg)})
        on_device: Params = {k: v.to(setup.device) for k, v in trained.items()}
        # The checkpoint as it is: without the switches whose parameters the run makes (`continued.switched`).
        own = {key: getattr(found.cfg, key) for key in continued.PARAM_SWITCHES}
        judged = dataclasses.replace(setup, model=dataclasses.replace(setup.model, **own), precision=FP32)
        loss = val_loss(judged, on_device, JUDGED_BLOCKS)
    return all_gather(loss, ctx.world_size)[0]
