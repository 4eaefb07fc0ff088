"""Where pretraining starts: the newest checkpoint of an interrupted run, `init`'s checkpoint (with a
masked-LM head made where it has none: `continued.py`), or the preset's random init.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cram.stages import Context, StageError
from cram.stages.pretraining import continued
from cram.stages.pretraining.config import Config
from cram.stages.pretraining.setup import Setup

if TYPE_CHECKING:
    from cram.stages.pretraining.state import TrainState


def start(config: Config, setup: Setup, out_dir: Path, ctx: Context) -> TrainState:
    """The state of the newest checkpoint (the one rank 0 sees, on every rank), or a fresh one (the init's,
    which a checkpoint would only repeat), on the device. Rank 0's metrics.jsonl loses the lines written
    after that state (a killed run's), all of them on a fresh start."""
    from cram import model
    from cram.stages.pretraining import checkpoint
    from cram.stages.pretraining.state import TrainState
    from cram.stages.pretraining.telemetry import MetricsLog
    from cram.stages.shared.collectives import agree_on

    resume_from = agree_on(checkpoint.latest(out_dir / "checkpoints", ctx.log), ctx.world_size)
    if resume_from is None:
        params = continued.params(config, ctx) if config.init else model.init(setup.model, ctx.seed)
        trained, kept = TrainState.split(params)
        state = TrainState(seed=ctx.seed, params=trained, opt_state=model.adamw_init(trained), kept=kept)
        state.full_start = None if setup.warmup is not None else 0.0
    else:
        params, opt_state, counters = checkpoint.load(resume_from)
        state = TrainState.from_json(counters, params, opt_state)
        if state.seed != ctx.seed:
            raise StageError(f"{resume_from}: saved with seed {state.seed}, the run has seed {ctx.seed}")
        ctx.log.info("resume", checkpoint=str(resume_from), step=state.step, elapsed_s=state.elapsed_s)
    state.params = {k: v.to(setup.device) for k, v in state.params.items()}
    state.opt_state = {k: v.to(setup.device) for k, v in state.opt_state.items()}
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        MetricsLog(out_dir / "metrics.jsonl").truncate(state.step)
    return state
