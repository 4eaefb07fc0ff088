"""The positions of the model the evaluate stage fine-tunes, from the configs alone: those of the checkpoint
pretrain starts from, else pack's seq_len. Below both the checks (`checks.py`) and the config's linking
(`Config.linked`: a task's default length), which need them before any stage runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cram.stages.pretraining.config import Config as PretrainConfig

if TYPE_CHECKING:
    from cram.model.config import ModelConfig


def init_model(pretrain: PretrainConfig | None) -> ModelConfig | None:
    """The ModelConfig of pretrain's `init` checkpoint (`pretrain` is its Config), read from its headers;
    None without one, or for one its own `validate` refuses."""
    if pretrain is None or not pretrain.init:
        return None
    from cram.stages.shared import pretrained

    try:
        return pretrained.load(pretrained.locate(Path(pretrain.init)), shapes_only=True)[0]
    except pretrained.PretrainedError:
        return None


@dataclass(frozen=True)
class Positions:
    """How far a fine-tuning task's texts may pad, and what says so."""

    length: int
    source: str


def task_positions(pretrain: PretrainConfig | None, pack: Any) -> Positions | None:
    """The positions of the model evaluate fine-tunes: those of the checkpoint pretrain starts from, where
    it starts from one (a released encoder keeps its own, 512 for all-MiniLM-L6-v2, at whatever pack.seq_len
    it is continued), else pack's seq_len (None: no pack stage)."""
    cfg = init_model(pretrain)
    if cfg is not None:
        return Positions(cfg.max_seq_len, f"the {cfg.max_seq_len} positions of pretrain.init's checkpoint")
    return None if pack is None else Positions(pack.seq_len, f"pack.seq_len = {pack.seq_len}, the model's positions")
