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
                           negatives per query (rows B..: every query's first, then every second, ...)
    dropout                [] float32, the rate (encoder); one graph at every rate
Under torchrun (`world_size` > 1) each rank embeds its own rows; the documents of every rank are
gathered into each rank's candidates with their gradients flowing back to the rank that embedded
them, and the gradients are averaged across ranks, so W ranks of B pairs train as one process of
W x B pairs does: the candidates in its order (every rank's positives, then every rank's hard negatives),
each rank's labels offset by rank x B. A single process (`world_size` 1) traces no collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from cram.model.bert import encode
from cram.model.classifier import pool
from cram.model.config import Attention, ModelConfig
from cram.model.optimizers import OptimizerConfig
from cram.model.step import Compilation, autocast, compiled, make_grad_all_reduce, make_tuning_step

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

EmbeddingPooling = Literal["mean", "first"]
EMBEDDING_POOLINGS: tuple[str, ...] = ("mean", "first")
SCALE = 20.0  # sentence-transformers' default: a temperature of 0.05 on cosine similarities

Params = dict[str, Tensor]
ContrastiveStep = Callable[..., tuple[Params, Params, dict[str, Tensor]]]
# (documents [B * (1 + n), H], B) -> (positives, hard negatives or None, where this rank's pairs start)
Candidates = Callable[[Tensor, int], tuple[Tensor, Tensor | None, int]]


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
    world_size: int = 1,
    group: ProcessGroup | None = None,
) -> ContrastiveStep:
    """step(params, opt_state, batch, lr: 0-dim tensor, donate=False) -> (params, opt_state, {"loss", "grad_norm"}).

    Both sides' forward, the loss, the gradient and the optimizer's update in one graph per pair of batch
    shapes (module docstring for the batch); `donate` as `step.make_tuning_step` says. With `world_size` > 1
    (ranks of `group`, default the whole world, already initialised) the candidates are every rank's
    documents and the gradients are averaged across ranks; "loss" is this rank's anchors' mean."""
    check_pooling(pooling)
    candidates = _gathered_candidates(world_size, group) if world_size > 1 else _local_candidates
    reduce = make_grad_all_reduce(world_size, group) if world_size > 1 else None

    def loss_fn(params: Params, batch: Params) -> Tensor:
        # A graph takes the rate as a tensor (one graph at every rate); eager takes it as a number, for
        # F.dropout's one op instead of a drawn uniform mask's five (`bert.dropout`).
        rate = batch["dropout"] if how.compile else float(batch["dropout"])
        with autocast(batch["query_ids"], how.autocast):
            queries = embed(params, cfg, batch["query_ids"], batch["query_mask"], pooling, how.attention, rate)
            docs = embed(params, cfg, batch["doc_ids"], batch["doc_mask"], pooling, how.attention, rate)
        positives, negatives, offset = candidates(docs, len(queries))
        return in_batch_loss(queries, positives, negatives, offset=offset)

    return make_tuning_step(loss_fn, opt_cfg, how, reduce_grads=reduce)


def _local_candidates(docs: Tensor, size: int) -> tuple[Tensor, Tensor | None, int]:
    return docs[:size], (docs[size:] if len(docs) > size else None), 0


def _gathered_candidates(world_size: int, group: ProcessGroup | None) -> Candidates:
    """Every rank's documents, ordered as one process of `world_size` x B pairs holds them: all ranks'
    positives, then all ranks' hard negatives (interleaving them per rank would point a label at another
    rank's hard negative: sentence-transformers PR #3453)."""
    import torch.distributed as dist

    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)

    def candidates(docs: Tensor, size: int) -> tuple[Tensor, Tensor | None, int]:
        everyone = _AllGather.apply(docs, group)  # [W * (1 + n) * B, H], rank-major
        width = docs.shape[-1]
        ordered = everyone.view(world_size, -1, size, width).transpose(0, 1).reshape(-1, width)
        total = world_size * size
        return ordered[:total], (ordered[total:] if len(ordered) > total else None), rank * size

    return candidates


class _AllGather(torch.autograd.Function):
    """All ranks' rows, rank-major; the backward sums every rank's gradient of this rank's rows back onto it
    (a reduce-scatter). torch's own autograd collectives lack the `setup_context` that `torch.func` needs."""

    @staticmethod
    def forward(rows: Tensor, group: ProcessGroup) -> Tensor:
        import torch.distributed._functional_collectives as funcol

        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # renamed in torch 2.13
        return funcol.wait_tensor(gather(rows, 0, group))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, grad: Tensor):
        import torch.distributed._functional_collectives as funcol

        scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor  # renamed in 2.13
        with torch.no_grad():  # torch.func differentiates with create_graph: not through this collective
            return funcol.wait_tensor(scatter(grad.contiguous(), "sum", 0, ctx.group)), None


def make_embed_step(
    cfg: ModelConfig, how: Compilation = Compilation(), *, pooling: EmbeddingPooling = "mean"
) -> Callable[[Params, Params], Tensor]:
    """embed(params, {"input_ids", "attention_mask"}) -> [B, H] fp32 unit vectors, without dropout; one
    graph per batch shape."""
    check_pooling(pooling)

    def embed_step(params, batch):  # no_grad inside, not as a decorator: as model/classifier.py's predict
        with torch.no_grad(), autocast(batch["input_ids"], how.autocast):
            return embed(params, cfg, batch["input_ids"], batch["attention_mask"], pooling, how.attention)

    return compiled(embed_step, how)


def check_pooling(pooling: str) -> None:
    if pooling not in EMBEDDING_POOLINGS:
        raise ValueError(f"pooling={pooling!r}: allowed {', '.join(EMBEDDING_POOLINGS)}")
