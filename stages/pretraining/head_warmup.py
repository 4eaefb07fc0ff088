"""A fresh masked-LM head trained alone before the encoder it sits on (`pretrain.head_warmup`).

A checkpoint without its MLM head (a base model, a sentence-transformers folder) gets one made from the
run's seed (`continued.py`). Trained together with the encoder from the first step, the random head's early
gradients move a trained encoder for nothing: `transformers` measured on a released sentence encoder, the
task lost 6.7 points that way and nearly none with the head trained alone first (LP-FT, Kumar et al. 2022,
does the same for a classifier's head). bench/README.md "adapt": continuing all-MiniLM-L6-v2 without it lost
3 more points than with it, in each of 5 seeds; on a tiny cram encoder it made no difference.
So the run starts with the head's params alone (`head.*`; the tied decoder is the token embeddings,
frozen with the rest) at a constant `head_lr`, then trains the whole model with a fresh AdamW over the
rest of the budget, its lr schedule run from the start over that rest.

Which mode a step is in is a function of the training state (its tokens or the budget's progress, and
`TrainState.full_start`, set at the switch), so a resumed run switches where an uninterrupted one does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cram.model.config import ModelConfig
    from cram.stages.pretraining.state import TrainState


@dataclass(frozen=True)
class HeadWarmup:
    """Train `names` alone until `until` of the budget's progress (a fraction) or `tokens` tokens, at `lr`."""

    names: tuple[str, ...]
    lr: float
    until: float | None = None
    tokens: int | None = None

    def active(self, state: TrainState, spent: float) -> bool:
        if state.full_start is not None:
            return False
        return state.tokens_seen < self.tokens if self.tokens is not None else spent < self.until


def head_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The params of the masked-LM head alone (none for a tied decoder without transform or bias)."""
    from cram.model.bert import shapes

    return tuple(name for name in shapes(cfg) if name.startswith("head."))


def schedule_position(spent: float, full_start: float | None) -> float:
    """Where the lr schedule stands at `spent` of the budget: it starts when the whole model does."""
    if not full_start:
        return spent
    return (spent - full_start) / (1 - full_start) if full_start < 1 else 1.0
