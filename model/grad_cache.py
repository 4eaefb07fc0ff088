"""The contrastive step of model/embedder.py for batches larger than memory holds: GradCache (Gao et al.
2021; sentence-transformers' CachedMultipleNegativesRankingLoss). The loss sees the whole batch; the
encoder runs `chunk` rows at a time.

1. Every chunk of queries, then of documents, embedded without gradients; the RNG state before each is
   kept, so dropout draws the same masks when the chunk runs again.
2. The loss over the whole batch's embeddings and its gradient with respect to them: [rows, H] is all the
   batch holds at once.
3. Each chunk embedded again, its params' gradient the vector-Jacobian product of its embeddings with
   their gradient from 2, summed over the chunks.
4. The summed gradient clipped and applied by AdamW (model/step.make_apply_step), as the uncached step
   applies its own.
The gradient is the uncached step's, up to the order of float sums; memory is one chunk's activations
plus the batch's embeddings, whatever the batch. 1, 2 and 3 are each one graph per chunk shape.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from cram.model.config import ModelConfig
from cram.model.embedder import ContrastiveStep, EmbeddingPooling, Params, check_pooling, embed, in_batch_loss
from cram.model.optimizers import OptimizerConfig
from cram.model.step import Compilation, autocast, compiled, detached_params, make_apply_step

CachedGrads = Callable[[Params, Params], tuple[Tensor, Params]]


def make_cached_contrastive_step(
    cfg: ModelConfig,
    opt_cfg: OptimizerConfig,
    how: Compilation = Compilation(),
    *,
    pooling: EmbeddingPooling = "mean",
    chunk: int = 32,
) -> ContrastiveStep:
    """step(params, opt_state, batch, lr: 0-dim tensor) -> (params, opt_state, {"loss", "grad_norm"}), for
    the batches model/embedder.py describes, the encoder run `chunk` rows at a time."""
    grads_of = make_cached_grads(cfg, how, pooling=pooling, chunk=chunk)
    apply = make_apply_step(opt_cfg, how)
    one = torch.ones(())

    def step(params: Params, opt_state: Params, batch: Params, lr: Tensor, donate: bool = False):
        loss, grads = grads_of(params, batch)
        params, opt_state, metrics = apply(params, opt_state, grads, one, lr)
        return params, opt_state, {"grad_norm": metrics["grad_norm"], "loss": loss}

    return step


def make_cached_grads(
    cfg: ModelConfig, how: Compilation = Compilation(), *, pooling: EmbeddingPooling = "mean", chunk: int = 32
) -> CachedGrads:
    """grads(params, batch) -> (the batch's InfoNCE loss, its gradient over every param), by GradCache."""
    check_pooling(pooling)
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: must be at least 1")

    def embedded(params: Params, ids: Tensor, mask: Tensor, rate: float | Tensor) -> Tensor:
        with autocast(ids, how.autocast):
            return embed(params, cfg, ids, mask, pooling, how.attention, rate)

    def chunk_grads(params: Params, ids: Tensor, mask: Tensor, rate: float | Tensor, upstream: Tensor) -> Params:
        return torch.func.grad(lambda p: (embedded(p, ids, mask, rate) * upstream).sum())(params)

    def loss_and_embedding_grads(queries: Tensor, docs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        def loss(q: Tensor, d: Tensor) -> Tensor:
            size = len(q)
            return in_batch_loss(q, d[:size], d[size:] if len(d) > size else None)

        (query_grads, doc_grads), value = torch.func.grad_and_value(loss, argnums=(0, 1))(queries, docs)
        return value, query_grads, doc_grads

    forward, backward = compiled(embedded, how), compiled(chunk_grads, how)
    loss_grads = compiled(loss_and_embedding_grads, how)

    def grads(params: Params, batch: Params) -> tuple[Tensor, Params]:
        # A graph takes the rate as a tensor (one graph at every rate); eager takes it as a number.
        rate = batch["dropout"] if how.compile else float(batch["dropout"])
        pieces = _chunks(batch["query_ids"], batch["query_mask"], chunk) + _chunks(
            batch["doc_ids"], batch["doc_mask"], chunk
        )
        states, embeddings = [], []
        for ids, mask in pieces:
            states.append(_rng_state(ids.device))
            embeddings.append(forward(params, ids, mask, rate))
        after = _rng_state(batch["query_ids"].device)
        queries = len(_chunks(batch["query_ids"], batch["query_mask"], chunk))
        loss, query_grads, doc_grads = loss_grads(torch.cat(embeddings[:queries]), torch.cat(embeddings[queries:]))
        upstream = query_grads.split(chunk) + doc_grads.split(chunk)
        total: Params = {}
        for (ids, mask), state, up in zip(pieces, states, upstream):
            _set_rng_state(state)
            micro = backward(params, ids, mask, rate, up)
            total = micro if not total else {name: total[name] + g for name, g in micro.items()}
        _set_rng_state(after)
        return loss.detach(), total

    return detached_params(grads)


def _chunks(ids: Tensor, mask: Tensor, size: int) -> list[tuple[Tensor, Tensor]]:
    return list(zip(ids.split(size), mask.split(size)))


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple[Tensor, Tensor | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
