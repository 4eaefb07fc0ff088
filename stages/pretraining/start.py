"""Where pretraining starts: the newest checkpoint of an interrupted run, `init`'s checkpoint (with a
masked-LM head made where it has none), or the preset's random init; the head warm-up that a made head
gets (`head_warmup.py`), and the peak lr that continuing a checkpoint trains at. `config` is pretrain's Config.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cram.stages import Context, StageError
from cram.stages.pretraining import head_warmup
from cram.stages.pretraining.setup import Setup, locate_init
from cram.stages.shared import pretrained

if TYPE_CHECKING:
    from cram.model.config import ModelConfig
    from cram.stages.pretraining.state import Params, TrainState

# Peak lrs of continuing a checkpoint on its task's text, as measured (bench/README.md, "adapt"). A masked-LM
# encoder 128 wide gained most at 1.5e-3 (+15.0 and +16.2 points over not continuing, own head and headless;
# 5e-4 within the seeds' spread); wider ones get that rate times 128 / hidden, as peak lrs shrink with width
# (2.5e-4 at 768, between TAPT's 1e-4 for RoBERTa-base and BioClinical ModernBERT's 3e-4). A sentence
# encoder gained at no rate tried and lost nothing beyond the spread at 3.3e-5 (all-MiniLM-L6-v2: +0.4;
# 1e-4: -4.0).
MASKED_LM_LR = 1.5e-3
MASKED_LM_LR_WIDTH = 128
SENTENCE_ENCODER_LR = 1e-4 / 3


def start(config: Any, setup: Setup, out_dir: Path, ctx: Context) -> TrainState:
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
        params = _pretrained_params(config, ctx) if config.init else model.init(setup.model, ctx.seed)
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


def made_head(config: Any) -> list[str]:
    """The masked-LM head's parameters that `init`'s checkpoint lacks and the stage makes (from the files'
    headers); none without a checkpoint."""
    from cram.model.hf import missing_head

    if not config.init:
        return []
    try:
        cfg, params = pretrained.load(locate_init(config), shapes_only=True)
    except pretrained.PretrainedError as e:
        raise StageError(f"pretrain.init: {e}") from None
    return missing_head(cfg, params)


def warmup_setting(config: Any) -> float:
    """`head_warmup` as it runs: "auto" resolved against the checkpoint's head (`head_warmup.resolved`)."""
    made = made_head(config) if config.init and config.head_warmup == "auto" else []
    return head_warmup.resolved(config.head_warmup, bool(config.init), made, config.budget.tokens == 0)


def warmup_of(config: Any, cfg: ModelConfig) -> head_warmup.HeadWarmup | None:
    """The head warm-up this run takes, None for none; its lr is `head_lr`, or the optimizer's peak."""
    return head_warmup.of(warmup_setting(config), head_warmup.head_names(cfg), config.head_lr or config.optimizer.lr)


def peak_lr(config: Any) -> float:
    """The peak lr the run trains at: `optimizer.lr`, except in a run that continues `init`'s checkpoint.
    There a number given as `init_lr` is the peak, and `init_lr = "auto"` caps optimizer.lr at the
    checkpoint's continuation rate (`continuation_lr`): a rate for training from scratch, such as the
    default pipeline's, would overwrite what the checkpoint learned. A zero budget trains nothing: as given."""
    if not config.init or config.budget.tokens == 0:
        return config.optimizer.lr
    if config.init_lr != "auto":
        return config.init_lr
    found = locate_init(config)
    try:
        cfg = pretrained.architecture(found)
    except pretrained.PretrainedError as e:
        raise StageError(f"pretrain.init: {e}") from None
    return min(config.optimizer.lr, continuation_lr(found, cfg))


def resolved(config: Any) -> Any:
    """`config` with `optimizer.lr` the peak lr the run trains at (`peak_lr`) and `init_lr` "auto" (left out
    of the key): a continued run keeps its key where the cap leaves its lr as it was."""
    optimizer = dataclasses.replace(config.optimizer, lr=peak_lr(config))
    return dataclasses.replace(config, optimizer=optimizer, init_lr="auto")


def continuation_lr(found: pretrained.Pretrained, cfg: ModelConfig) -> float:
    """The measured peak lr of continuing the checkpoint `found` (of architecture `cfg`) with masked LM."""
    if found.sentence:
        return SENTENCE_ENCODER_LR
    return MASKED_LM_LR * min(1.0, MASKED_LM_LR_WIDTH / cfg.hidden)


def check_init_settings(config: Any) -> None:
    """The settings of continuing `init`'s checkpoint, refused without one whether or not pretrain runs
    (a config check, not the store's): ValueError naming the key."""
    if config.init:
        return
    if config.init_lr != "auto":
        raise ValueError(
            f"init_lr: {config.init_lr} is the peak lr of continuing `pretrain.init`'s checkpoint, and the run "
            "has no init: set pretrain.optimizer.lr instead, or pretrain.init"
        )
    if config.head_warmup != "auto" and config.head_warmup:
        raise ValueError(
            f"head_warmup: {config.head_warmup} warms up the masked-LM head of `pretrain.init`'s checkpoint, and the "
            "run has no init (a random init trains head and encoder together): set pretrain.init, or head_warmup = 0"
        )


def check_head_warmup(config: Any, cfg: ModelConfig, pack: Any) -> None:
    """A head warm-up needs a head of the model's own to train, and a budget longer than itself (a token
    budget, or a step budget's most tokens); without `init`, `check_init_settings` refused it."""
    given, value = config.head_warmup, warmup_setting(config)
    if not value:
        return
    if not head_warmup.head_names(cfg):
        raise StageError(
            f"pretrain.head_warmup: {given}, but the model has no masked-LM head params of its own (its decoder "
            "is the tied token embeddings, with no transform or bias): set head_warmup = 0"
        )
    budget, seq_len = config.budget, getattr(pack, "seq_len", 0)
    most = [budget.tokens] if budget.tokens is not None else []
    if budget.steps is not None and seq_len:
        most.append(budget.steps * config.batch_size * seq_len)
    if value >= 1 and most and value >= min(most):
        raise StageError(
            f"pretrain.head_warmup: {int(value)} tokens is not shorter than the budget ({min(most)} tokens at most): "
            "give fewer tokens or a fraction of the budget below 1"
        )


def _pretrained_params(config: Any, ctx: Context) -> Params:
    """The checkpoint's params, with a masked-LM head made from the run's seed where it has none (a base
    model, a sequence classifier): the decoder is tied to the token embeddings as transformers ties it,
    the head's transform, norm and bias start fresh, and one warning names them (none for a zero budget,
    which trains nothing)."""
    import time

    from cram import model
    from cram.model.bert import shapes
    from cram.model.hf import missing_head

    started = time.perf_counter()
    found = locate_init(config)
    try:
        cfg, params = pretrained.load(found)
    except pretrained.PretrainedError as e:
        raise StageError(f"pretrain.init: {e}") from None
    ctx.log.info("init", checkpoint=str(found.folder), kind=found.kind, seconds=round(time.perf_counter() - started, 2))
    made = missing_head(cfg, params)
    if made and config.budget.tokens != 0 and ctx.is_main:
        how = (
            "they train alone, the encoder frozen, for pretrain.head_warmup, then with it"
            if warmup_setting(config)
            else "they train with the encoder from the first step (pretrain.head_warmup = 0)"
        )
        ctx.log.warning(
            f"pretrain.init: {found.folder} has no masked-LM head; initialised {', '.join(made)} from the run's "
            f"seed (the decoder is tied to the token embeddings); {how}"
        )
    made_params = model.init(cfg, ctx.seed, names=made)
    return {name: params[name] if name in params else made_params[name] for name in shapes(cfg)}
