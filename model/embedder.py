"""Sentence embeddings from the encoder, and their compiled contrastive fine-tune.

Pure functions over the encoder's own `dict[str, Tensor]`: an embedding model has no head, only a
pooling (`pool`: the mean over real tokens, the first token) and an L2 normalisation, so that its
dot products are cosine similarities and a search is a matrix product.

The loss is InfoNCE with in-batch negatives, as sentence-transformers' MultipleNegativesRankingLoss
computes it (cosine similarity times a scale of 20, cross-entropy over the batch's candidates), so a
model trained here reads against every retrieval model trained there.

Batches for the contrastive step (every row real: the batches are drawn full):
    query_ids, query_mask  [B, Sq] int64 / bool: the queries (anchors)
    doc_ids, doc_mask      [B * (1 + n), Sd]: each query's positive (rows 0..B-1), then n hard
                           negatives per query (rows B.., n = 0 or 1)
    dropout                [] float32, the rate (encoder); one graph at every rate
Under torchrun (`world_size` > 1) each rank embeds its own rows; the documents of every rank are
gathered into each rank's candidates with their gradients flowing back to the rank that embedded
them, and the gradients are averaged across ranks, so W ranks of B pairs train as one process of
W x B pairs does.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from cram.model.bert import encode
from cram.model.classifier import pool
from cram.model.config import Attention, ModelConfig, OptimizerConfig
from cram.model.step import EAGER, Compilation, autocast, compiled, detached_params, make_apply_step

EmbeddingPooling = Literal["mean", "first"]
EMBEDDING_POOLINGS: tuple[str, ...] = ("mean", "first")
SCALE = 20.0  # sentence-transformers' default: a temperature of 0.05 on cosine similarities

Params = dict[str, Tensor]
ContrastiveStep = Callable[[Params, Params, Params, Tensor], tuple[Params, Params, dict[str, Tensor]]]


def embed(
    params: Params,
    cfg: ModelConfig,
    input_ids: Tensor,
    attention_mask: Tensor,
    pooling: EmbeddingPooling = "mean",
    attention: Attention = "auto",
    rate: float | Tensor = 0.0,
) -> Tensor:
    """[B, S] ids -> [B, H] fp32 unit vectors: the encoder's last hidden states pooled over the real
    tokens ("mean") or the first token's ("first"), normalised; dropout at `rate`."""
    hidden = encode(params, cfg, input_ids, attention_mask, attention=attention, dropout=rate)
    return F.normalize(pool(hidden, attention_mask, pooling).float(), dim=-1)


def in_batch_loss(
    anchors: Tensor, positives: Tensor, negatives: Tensor | None = None, scale: float = SCALE, offset: int = 0
) -> Tensor:
    """The mean cross-entropy of each anchor (row i) picking positive `offset + i` among the positives,
    then the hard negatives as further columns, by cosine similarity times `scale`. `offset`: where this
    rank's pairs start among positives gathered from every rank."""
    candidates = positives if negatives is None else torch.cat([positives, negatives])
    scores = F.normalize(anchors, dim=-1) @ F.normalize(candidates, dim=-1).T * scale
    labels = torch.arange(len(anchors), device=anchors.device) + offset
    return F.cross_entropy(scores, labels)


def make_contrastive_step(
    cfg: ModelConfig,
    opt_cfg: OptimizerConfig,
    how: Compilation = Compilation(),
    *,
    pooling: EmbeddingPooling = "mean",
) -> ContrastiveStep:
    """step(params, opt_state, batch, lr: 0-dim tensor) -> (params, opt_state, {"loss", "grad_norm"}).

    Both sides' forward, the loss, the gradient and the AdamW update in one graph per pair of batch
    shapes (module docstring for the batch)."""
    _check_pooling(pooling)
    apply = make_apply_step(opt_cfg, EAGER)

    def loss_fn(params: Params, batch: Params) -> Tensor:
        rate = batch["dropout"]
        with autocast(batch["query_ids"], how.autocast):
            queries = embed(params, cfg, batch["query_ids"], batch["query_mask"], pooling, how.attention, rate)
            docs = embed(params, cfg, batch["doc_ids"], batch["doc_mask"], pooling, how.attention, rate)
        size = len(queries)
        return in_batch_loss(queries, docs[:size], docs[size:] if len(docs) > size else None)

    def step(params, opt_state, batch, lr):
        grads, loss = torch.func.grad_and_value(loss_fn)(params, batch)
        one = torch.ones((), device=lr.device)
        params, opt_state, metrics = apply(params, opt_state, grads, one, lr)
        return params, opt_state, {**metrics, "loss": loss.detach()}

    return detached_params(compiled(step, how))


def make_embed_step(
    cfg: ModelConfig, how: Compilation = Compilation(), *, pooling: EmbeddingPooling = "mean"
) -> Callable[[Params, Params], Tensor]:
    """embed(params, {"input_ids", "attention_mask"}) -> [B, H] fp32 unit vectors, without dropout; one
    graph per batch shape."""
    _check_pooling(pooling)

    @torch.no_grad()
    def embed_step(params, batch):
        with autocast(batch["input_ids"], how.autocast):
            return embed(params, cfg, batch["input_ids"], batch["attention_mask"], pooling, how.attention)

    return compiled(embed_step, how)


def _check_pooling(pooling: str) -> None:
    if pooling not in EMBEDDING_POOLINGS:
        raise ValueError(f"pooling={pooling!r}: allowed {', '.join(EMBEDDING_POOLINGS)}")
