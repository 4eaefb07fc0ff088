"""The evaluate stage's held-out masked LM: pack's val blocks at each length, masked as pretrain masked
its own (`stages/shared/val_mlm.py`), in a compiled eval step per length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cram.stages import Context, StageError, Upstream
from cram.stages.finetuning.checks import check_position
from cram.stages.finetuning.config import MlmSettings

if TYPE_CHECKING:
    import numpy as np
    import torch

    from cram.model.config import ModelConfig
    from cram.stages.shared.blocks import Boundary
    from cram.stages.shared.precision import Precision


@dataclass(frozen=True)
class HeldOut:
    """How the held-out masked LM is measured: pack's val blocks at `lengths`, masked as pretrain masked,
    with evaluate's `settings` (the masks' seed, the batch size, compiling)."""

    path: Path  # pack's val.npy
    lengths: list[int]
    masking: dict  # a `Masking` as a dict; its rate: evaluate.mlm_mask_rate, or pretraining's
    special: dict[str, int]
    vocab_size: int  # the tokenizer's: random replacements are real tokens, not rows a model has past them
    documents: Boundary | None  # when pretrain attended within documents
    settings: MlmSettings

    @classmethod
    def of(cls, settings: MlmSettings, inputs: dict[str, Upstream]) -> HeldOut:
        from cram.stages.shared.blocks import boundary

        pretrain, pack, tokenize = inputs["pretrain"], inputs["pack"], inputs["tokenize"].outputs
        special = tokenize["special_ids"]
        trained = pretrain.outputs
        masking = trained["masking"]
        if settings.mask_rate:
            masking = {**masking, "rate": settings.mask_rate}
        if settings.corruption == "bert":
            masking = {**masking, "mask_token": 0.8, "random_token": 0.1}
        lengths = list(settings.lengths) or trained.get("seq_lens") or [int(pack.outputs["seq_len"])]
        documents = boundary(pack.outputs["boundary"], special) if trained.get("document_attention") else None
        return cls(pack.path("val"), lengths, masking, special, int(tokenize["vocab_size"]), documents, settings)


@dataclass(frozen=True)
class _Measured:
    """The model measured: its config, its params on `device`, and how it computes."""

    cfg: ModelConfig
    params: dict
    device: torch.device
    precision: Precision
    attention: str


def evaluate_mlm(
    held_out: HeldOut, cfg: ModelConfig, params: dict, device: torch.device, precision: Precision, ctx: Context
) -> dict:
    """Mean loss and accuracy over every masked token of the held-out blocks, masked as pretrain masks
    its held-out blocks (`stages/shared/val_mlm.py`), at each length of `held_out`: the first's figures,
    and every length's under `by_length`."""
    import numpy as np

    blocks = np.load(held_out.path, mmap_mode="r")
    if blocks.ndim != 2 or len(blocks) == 0:
        raise StageError(f"{held_out.path}: expected blocks [n, seq_len] with n > 0, got {list(blocks.shape)}")
    measured = _Measured(cfg, params, device, precision, ctx.attention)
    by_length = {length: _mlm_at(held_out, measured, blocks, length) for length in held_out.lengths}
    result = {**by_length[held_out.lengths[0]], "mask_rate": held_out.masking["rate"]}
    if len(by_length) > 1:
        result["by_length"] = {str(length): r for length, r in by_length.items()}
    ctx.log.info("mlm", **{k: v for k, v in result.items() if k != "by_length"})
    return result


def _mlm_at(held_out: HeldOut, measured: _Measured, blocks: np.ndarray, length: int) -> dict:
    """The held-out masked LM on blocks of `length`; StageError when the model or the data has no such block."""
    from cram import model
    from cram.stages.shared.blocks import blocks_of
    from cram.stages.shared.masking import Masking, mask_spec
    from cram.stages.shared.val_mlm import val_mlm

    began = time.perf_counter()
    cfg, params, config = measured.cfg, measured.params, held_out.settings
    precision, attention = measured.precision, measured.attention
    check_position(length, cfg.position, cfg.max_seq_len)
    at_length = blocks_of(blocks, length)
    if len(at_length) == 0:
        raise StageError(f"evaluate.mlm_lengths: {length}: pack's val ({blocks.size} tokens) holds no block that long")
    spec = mask_spec(Masking(**held_out.masking), held_out.special, held_out.vocab_size, length)
    # Its own compiled function per length: one graph each, never a recompile of another length's.
    how = model.Compilation(
        config.compile, config.backend, precision.autocast(), attention, precision.compile_options()
    )
    step = model.make_eval_step(cfg, how)
    # The last, shorter batch runs eagerly rather than compiling a second graph for one call.
    tail = model.make_eval_step(cfg, how.eager())
    result = val_mlm(
        step,
        params,
        at_length,
        spec,
        seed=config.seed,
        batch_size=config.batch_size,
        device=measured.device,
        tail=tail,
        documents=held_out.documents,
    )
    return {**result, "blocks": len(at_length), "time_s": round(time.perf_counter() - began, 3)}
