"""The evaluate stage's held-out masked LM: pack's val blocks at each length, masked as pretrain masked
its own (`stages/shared/val_mlm.py`), in a compiled eval step per length. `config` is evaluate's Config.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cram.stages import Context, StageError, Upstream
from cram.stages.finetuning.checks import check_position


@dataclass(frozen=True)
class HeldOut:
    """How the held-out masked LM is measured: pack's val blocks at `lengths`, masked as pretrain masked."""

    path: Path  # pack's val.npy
    lengths: list[int]
    masking: dict  # a `Masking` as a dict; its rate: evaluate.mlm_mask_rate, or pretraining's
    special: dict[str, int]
    vocab_size: int  # the tokenizer's: random replacements are real tokens, not rows a model has past them
    documents: Any  # a `blocks.Boundary` when pretrain attended within documents, else None

    @classmethod
    def of(cls, config: Any, inputs: dict[str, Upstream]) -> HeldOut:
        from cram.stages.shared.blocks import boundary

        pretrain, pack, tokenize = inputs["pretrain"], inputs["pack"], inputs["tokenize"].outputs
        special = tokenize["special_ids"]
        trained = pretrain.outputs
        masking = trained["masking"]
        if config.mlm_mask_rate:
            masking = {**masking, "rate": config.mlm_mask_rate}
        if config.mlm_corruption == "bert":
            masking = {**masking, "mask_token": 0.8, "random_token": 0.1}
        lengths = list(config.mlm_lengths) or trained.get("seq_lens") or [int(pack.outputs["seq_len"])]
        documents = boundary(pack.outputs["boundary"], special) if trained.get("document_attention") else None
        return cls(pack.path("val"), lengths, masking, special, int(tokenize["vocab_size"]), documents)


def evaluate_mlm(config: Any, cfg, params, held_out: HeldOut, device, precision, ctx: Context) -> dict:
    """Mean loss and accuracy over every masked token of the held-out blocks, masked as pretrain masks
    its held-out blocks (`stages/shared/val_mlm.py`), at each length of `held_out`: the first's figures,
    and every length's under `by_length`."""
    import numpy as np

    blocks = np.load(held_out.path, mmap_mode="r")
    if blocks.ndim != 2 or len(blocks) == 0:
        raise StageError(f"{held_out.path}: expected blocks [n, seq_len] with n > 0, got {list(blocks.shape)}")
    by_length = {
        length: _mlm_at(config, cfg, params, blocks, length, held_out, device, precision, ctx.attention)
        for length in held_out.lengths
    }
    result = {**by_length[held_out.lengths[0]], "mask_rate": held_out.masking["rate"]}
    if len(by_length) > 1:
        result["by_length"] = {str(length): r for length, r in by_length.items()}
    ctx.log.info("mlm", **{k: v for k, v in result.items() if k != "by_length"})
    return result


def _mlm_at(
    config: Any, cfg, params, blocks, length: int, held_out: HeldOut, device, precision, attention: str
) -> dict:
    """The held-out masked LM on blocks of `length`; StageError when the model or the data has no such block."""
    from cram import model
    from cram.stages.shared.blocks import blocks_of
    from cram.stages.shared.masking import Masking, mask_spec
    from cram.stages.shared.val_mlm import val_mlm

    began = time.perf_counter()
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
        seed=config.mlm_seed,
        batch_size=config.mlm_batch_size,
        device=device,
        tail=tail,
        documents=held_out.documents,
    )
    return {**result, "blocks": len(at_length), "time_s": round(time.perf_counter() - began, 3)}
