"""What the evaluate stage checks before it fine-tunes, from the configs alone: each task's lengths and
what its kind checks (its files, a held-out task that tokenize's settings leave without documents), and the
lengths and masking rate against the model that pretrain's config makes. `config` is evaluate's Config; `pretrain`,
`tokenize` and `pack` are those stages' Configs, None where the pipeline has no such stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from cram.stages import StageError
from cram.stages.evaluating import kinds
from cram.stages.evaluating.config import Config
from cram.stages.evaluating.positions import Positions, init_model
from cram.stages.kept.batches import bucket
from cram.stages.pretraining.config import Config as PretrainConfig
from cram.stages.shared.masking import masked_per_sequence

if TYPE_CHECKING:
    from cram.model.config import ModelConfig
    from cram.stages import Upstream
    from cram.stages.tasks.config import TaskConfig
    from cram.stages.tasks.kind import TokenizeSettings


def check_against_the_model(config: Config, pretrain: PretrainConfig | None, pack_seq_len: int) -> None:
    """What `run` checks against the model, from the configs: the fine-tuning lengths and the held-out
    masked LM's (`check_lengths`, `check_position`) within the model's positions, each held-out
    length at a masking rate that masks a token of it. The model is the one pretrain's config makes
    (`pretrain` is its Config), or its `init`'s checkpoint, read from its headers."""
    phases = pretrain.phases if pretrain is not None else ()
    trained = list(dict.fromkeys(p.seq_len for p in phases)) or [pack_seq_len]
    lengths = (list(config.mlm_lengths) or trained) if config.mlm else []
    rate = config.mlm_mask_rate or (pretrain.masking.rate if pretrain is not None else 0.0)
    key = "evaluate.mlm_mask_rate" if config.mlm_mask_rate else "pretrain.masking.rate"
    for length in lengths:
        if rate:
            masked_per_sequence(rate, length, key if not config.mlm_lengths else f"{key} (at evaluate.mlm_lengths)")
    positions = _positions(pretrain, max(trained))
    if positions is not None:
        check_lengths(config, positions[1])
        for length in lengths:
            check_position(length, *positions)


def check_position(length: int, position: str, max_seq_len: int) -> None:
    """Learned and sinusoidal positions end at the longest length trained; rope's do not."""
    if length > max_seq_len and position != "rope":
        raise StageError(f"evaluate.mlm_lengths: {length} is beyond the model's {max_seq_len} {position} positions")


def _positions(pretrain: PretrainConfig | None, longest: int) -> tuple[str, int] | None:
    """(position kind, positions) of the model pretrain's config makes, trained at `longest` at most;
    None when its config cannot tell (its own `validate` says why)."""
    from cram.model.config import PRESETS

    if pretrain is None:
        return None
    if pretrain.init:
        cfg = init_model(pretrain)
        return None if cfg is None else (cfg.position, cfg.max_seq_len)
    preset = PRESETS.get(pretrain.model.preset)
    position = pretrain.model.position or (preset.position if preset is not None else None)
    return None if position is None else (position, longest)


def check_pooler(config: Config, cfg: ModelConfig | None, where: str = "pretrain.init's checkpoint") -> None:
    """`pooling = "pooler"` needs a model with a pooler (`cfg`, None: one with none) and a head as wide as it."""
    if cfg is None or not cfg.pooler:
        raise StageError(
            f'evaluate.pooling: "pooler" starts the head from the checkpoint\'s pooler, and {where} has none '
            '(only BERT and RoBERTa checkpoints bring pooler.dense); use "first" or "mean"'
        )
    if config.head_width not in (0, cfg.hidden):
        raise StageError(
            f'evaluate.head_width: {config.head_width}, but pooling = "pooler" starts the head\'s dense layer '
            f"from the checkpoint's {cfg.hidden} x {cfg.hidden} pooler; set 0 (the hidden size)"
        )


def check_task(config: Config, task: TaskConfig, index: int, gap: str | None, positions: Positions | None) -> None:
    """Task `index` of `config`: its padded length within the model's `positions` (None: unknown), and what
    its kind checks (`Kind.check`: its local files, read in full; for a held-out task, why tokenize leaves it
    no documents: `gap`, `task_gap`'s; None: it does not)."""
    where = f"evaluate.tasks[{index}]"
    max_length = config.task_settings(task).max_length
    if positions is not None and bucket(max_length, config.buckets) > positions.length:
        raise StageError(
            f"{where}: max_length {max_length} pads to {bucket(max_length, config.buckets)}, beyond {positions.source}"
        )
    kinds.of(task.kind).check(task, index, config.settings(task), gap)


def task_gap(tokenize: TokenizeSettings, config: Config, positions: int | None) -> Callable[[TaskConfig], str | None]:
    """Why tokenize's settings (its Config) leave a held-out task no documents, or its lengths pad beyond the
    model's `positions` (None: unknown), as its kind says (`Kind.plan_gap`); None when they do not."""

    def gap(task: TaskConfig) -> str | None:
        return kinds.of(task.kind).plan_gap(task, config.settings(task), tokenize, config.buckets, positions)

    return gap


def check_lengths(config: Config, max_seq_len: int) -> None:
    """Each task's padded lengths (its max_length and its kind's others, `Kind.lengths`) within the model's
    `max_seq_len` positions."""
    for i, task_cfg in enumerate(config.tasks):
        settings = config.settings(task_cfg)
        for name in ("max_length", *kinds.of(task_cfg.kind).lengths):
            length = getattr(settings, name)
            if bucket(length, config.buckets) > max_seq_len:
                key = name if getattr(task_cfg, name) is None else f"tasks[{i}].{name}"
                raise StageError(
                    f"evaluate.{key}: {length} pads to {bucket(length, config.buckets)}, "
                    f"beyond the model's {max_seq_len} positions"
                )


def heldout_gap(tokenize: Upstream, config: Config, positions: int) -> Callable[[TaskConfig], str | None]:
    """Why tokenize's outputs give a default task nothing, as its kind says (`Kind.gap`): a held-out-topic task
    no labelled articles, a held-out-retrieval task no documents, or too few for one batch of pairs, or
    lengths beyond the model's `positions`; None when they do not."""

    def gap(task: TaskConfig) -> str | None:
        return kinds.of(task.kind).gap(task, config.settings(task), tokenize, config.buckets, positions)

    return gap
