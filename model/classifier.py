"""A sequence classification / regression head on the encoder, and its compiled fine-tune and eval steps.

Pure functions over the same flat `dict[str, Tensor]` as the encoder: the head's tensors join the
pretrained ones under `classifier.`, so one AdamW state covers encoder and head. The head's kind
(`HEADS`) is one of transformers' sequence-classification heads, so that a fine-tuned classifier
exports exactly (`model/hf.py`):
    cramming    pool, dense (width: cramming's 1024) + tanh, dropout, out: cramming's GLUE head
    bert        the same at the hidden width: BERT's pooler and classifier
    roberta     dropout first, then as bert: RoBERTa's classification head
    modernbert  pool, dense + GELU + LayerNorm (biases as the encoder's), dropout, out: ModernBERT's

Shapes are static (`dynamic=False`): each padded batch shape compiles once, so the graph count is
bounded by the length buckets. The dropout rate is an input of the fine-tune step (`batch["dropout"]`),
so a compile canary at rate 0 and the fine-tune at its own rate share one graph.

Batches for the steps:
    input_ids       [B, S] int64
    attention_mask  [B, S] bool, True = real token (every row needs at least one)
    labels          [B] int64 class ids, or float32 targets (regression: one output, squared error)
    weights         [B] float32, 0 for rows that only pad the batch to its fixed size
    token_type_ids  [B, S] int64, optional: 1 for a pair's second text (models with a token-type table)
    dropout         [] float32, the fine-tune step's dropout rate (encoder and head)
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from cram.model.bert import INIT_STD, dropout, encode
from cram.model.config import Attention, ModelConfig
from cram.model.optimizers import OptimizerConfig
from cram.model.step import Compilation, autocast, compiled, make_tuning_step

# "pooler": the first token, through a head whose dense layer starts as the checkpoint's pooler (`pooler_head`).
Pooling = Literal["first", "mean", "pooler"]
POOLINGS: tuple[str, ...] = ("first", "mean", "pooler")
FIRST_TOKEN: tuple[str, ...] = ("first", "pooler")  # the poolings that read the first token alone
Head = Literal["cramming", "bert", "roberta", "modernbert"]
HEADS: tuple[str, ...] = ("cramming", "bert", "roberta", "modernbert")


def init_head_params(
    cfg: ModelConfig, num_outputs: int, seed: int, width: int | None = None, head: Head = "cramming"
) -> dict[str, Tensor]:
    """Fresh fp32 CPU head parameters: `num_outputs` classes, or 1 for regression. The cramming head's
    dense layer has `width` outputs (cramming: 1024; None: the hidden size); the others' the hidden size.
    ModernBERT's dense layer and norm have biases where the encoder's linear layers and norms do."""
    _check_head(head)
    gen = torch.Generator().manual_seed(seed)
    H = cfg.hidden
    W = (width or H) if head == "cramming" else H
    params = {"classifier.dense.weight": torch.randn(W, H, generator=gen) * INIT_STD}
    if head != "modernbert" or cfg.linear_bias:
        params["classifier.dense.bias"] = torch.zeros(W)
    if head == "modernbert":
        params["classifier.norm.weight"] = torch.ones(H)
        if cfg.norm_bias:
            params["classifier.norm.bias"] = torch.zeros(H)
    params["classifier.out.weight"] = torch.randn(num_outputs, W, generator=gen) * INIT_STD
    params["classifier.out.bias"] = torch.zeros(num_outputs)
    return params


def pooler_head(head: dict[str, Tensor], params: dict[str, Tensor]) -> dict[str, Tensor]:
    """`head` whose dense layer is the encoder's pooler (`pooler.dense.*`, BERT's dense + tanh over the
    first token), as transformers' BertForSequenceClassification starts; its dense width must be hidden."""
    return {
        **head,
        "classifier.dense.weight": params["pooler.dense.weight"].clone(),
        "classifier.dense.bias": params["pooler.dense.bias"].clone(),
    }


def pool(hidden: Tensor, attention_mask: Tensor, pooling: Pooling) -> Tensor:
    """[B, S, H] -> [B, H]: the first ([CLS]) token ("first", "pooler"), or the mean over real tokens."""
    if pooling in FIRST_TOKEN:
        return hidden[:, 0]
    weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)


def classify(
    params: dict[str, Tensor],
    cfg: ModelConfig,
    input_ids: Tensor,
    attention_mask: Tensor,
    pooling: Pooling = "first",
    attention: Attention = "auto",
    token_type_ids: Tensor | None = None,
    rate: float | Tensor | None = None,
    head: Head = "cramming",
) -> Tensor:
    """Logits [B, num_outputs] (fp32) of the head over the encoder; dropout at `rate` (None: `cfg.dropout`)
    applies in the encoder and in the head where its kind has dropout (cramming's fine-tuning).
    token_type_ids: [B, S], a pair's second text 1 (`encode`); None: every token type 0. A head that
    pools the first token runs the encoder's last layer for that token alone (`encode`'s `first_only`)."""
    rate = cfg.dropout if rate is None else rate
    hidden = encode(
        params,
        cfg,
        input_ids,
        attention_mask,
        attention=attention,
        token_type_ids=token_type_ids,
        dropout=rate,
        first_only=pooling in FIRST_TOKEN,
    )
    return head_logits(params, cfg, pool(hidden, attention_mask, pooling), head, rate)


def head_logits(
    params: dict[str, Tensor], cfg: ModelConfig, pooled: Tensor, head: Head = "cramming", rate: float | Tensor = 0.0
) -> Tensor:
    """[B, H] pooled -> logits [B, num_outputs] fp32, through the head of kind `head` (module docstring),
    with dropout at `rate`."""
    if head == "roberta":
        pooled = dropout(pooled, rate)
    x = F.linear(pooled, params["classifier.dense.weight"], params.get("classifier.dense.bias"))
    if head == "modernbert":
        norm = params["classifier.norm.weight"]
        x = F.layer_norm(F.gelu(x), norm.shape, norm, params.get("classifier.norm.bias"), cfg.norm_eps)
    else:
        x = torch.tanh(x)
    x = dropout(x, rate)
    return F.linear(x, params["classifier.out.weight"], params["classifier.out.bias"]).float()


def finetune_loss(logits: Tensor, labels: Tensor, weights: Tensor) -> Tensor:
    """Weighted mean cross-entropy (class ids) or squared error (float targets) over the real rows."""
    if labels.is_floating_point():
        per_row = (logits.squeeze(-1) - labels) ** 2
    else:
        per_row = F.cross_entropy(logits, labels, reduction="none")
    return (per_row * weights).sum() / weights.sum().clamp(min=1)


def make_finetune_step(
    cfg: ModelConfig,
    opt_cfg: OptimizerConfig,
    how: Compilation = Compilation(),
    *,
    pooling: Pooling = "first",
    head: Head = "cramming",
) -> Callable[..., tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]]:
    """step(params, opt_state, batch, lr: 0-dim tensor, donate=False) -> (params, opt_state, {"loss", "grad_norm"}).

    Forward, loss, gradient and the optimizer's update in one graph per batch shape; the dropout rate is
    `batch["dropout"]` where the batch has one, else `cfg.dropout`. `donate=True` says the caller owns
    `params` and `opt_state` and keeps only what the step returns: eager, the step then writes the new
    params and moments into the tensors given (`optimizer_update_`); compiled, it is the same graph either way.
    """
    _check_pooling(pooling)
    _check_head(head)

    def loss_fn(params: dict[str, Tensor], batch: dict[str, Tensor]) -> Tensor:
        ids, mask, types = batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids")
        with autocast(ids, how.autocast):
            rate = batch["dropout"] if "dropout" in batch else torch.tensor(cfg.dropout, device=ids.device)
            # A graph takes the rate as a tensor (one graph at every rate); eager takes it as a number,
            # for F.dropout's one op instead of a drawn uniform mask's five (`bert.dropout`).
            rate = rate if how.compile else float(rate)
            logits = classify(params, cfg, ids, mask, pooling, how.attention, types, rate, head)
        return finetune_loss(logits, batch["labels"], batch["weights"])

    return make_tuning_step(loss_fn, opt_cfg, how)


def make_classify_eval_step(
    cfg: ModelConfig,
    how: Compilation = Compilation(),
    *,
    pooling: Pooling = "first",
    head: Head = "cramming",
) -> Callable[[dict[str, Tensor], dict[str, Tensor]], Tensor]:
    """predict(params, batch) -> logits [B, num_outputs] fp32, without dropout; `labels`/`weights` are not
    needed."""
    _check_pooling(pooling)
    _check_head(head)

    # no_grad inside, not as a decorator: a decorated function is dynamo's shared `wrap_inline` frame, whose
    # graph cache every such step of the process would fill up to the recompile limit
    def predict(params, batch):
        with torch.no_grad(), autocast(batch["input_ids"], how.autocast):
            ids, mask, types = batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids")
            return classify(params, cfg, ids, mask, pooling, how.attention, types, 0.0, head)

    return compiled(predict, how)


def _check_pooling(pooling: str) -> None:
    if pooling not in POOLINGS:
        raise ValueError(f"pooling={pooling!r}: allowed {', '.join(POOLINGS)}")


def _check_head(head: str) -> None:
    if head not in HEADS:
        raise ValueError(f"head={head!r}: allowed {', '.join(HEADS)}")
