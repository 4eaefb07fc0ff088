"""A token-classification head on the encoder's per-token hidden states, its compiled fine-tune and eval steps,
and the fine-tuned tagger as transformers' ...ForTokenClassification.

Pure functions over the encoder's flat `dict[str, Tensor]`: the head's tensors join it under `classifier.`,
so one AdamW state covers both. The head's kind is its transformers family's, so that a tagger exports
exactly (`tagger_to_transformers`):
    linear      dropout, out: BertForTokenClassification's and RobertaForTokenClassification's
    modernbert  dense + GELU + LayerNorm (biases as the encoder's), dropout, out: ModernBertForTokenClassification's

Batches for the steps:
    input_ids       [B, S] int64
    attention_mask  [B, S] bool, True = real token (every row needs at least one)
    labels          [B, S] int64 tag ids; IGNORE (-100) where no tag is read: special tokens, padding, a word's
                    later sub-tokens and filler rows
    token_type_ids  [B, S] int64, optional (models with a token-type table: all 0)
    document_ids    [B, S] int64, optional: texts packed into one row, each reading only its own tokens
    positions       [B, S] int64, optional with document_ids: each token's position in its own text
    dropout         [] float32, the fine-tune step's dropout rate (encoder and head)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from cram.model.bert import INIT_STD, dropout, encode
from cram.model.config import Attention, ModelConfig
from cram.model.optimizers import OptimizerConfig
from cram.model.step import Compilation, autocast, compiled, make_tuning_step

TagHead = Literal["linear", "modernbert"]
TAG_HEADS: tuple[str, ...] = ("linear", "modernbert")
IGNORE = -100
INPUTS: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids", "document_ids", "positions")


def init_tag_head(cfg: ModelConfig, num_labels: int, seed: int, head: TagHead = "linear") -> dict[str, Tensor]:
    """Fresh fp32 CPU head parameters for `num_labels` tags; ModernBERT's dense layer and norm have biases where
    the encoder's linear layers and norms do."""
    _check_head(head)
    gen = torch.Generator().manual_seed(seed)
    H = cfg.hidden
    params = {}
    if head == "modernbert":
        params["classifier.dense.weight"] = torch.randn(H, H, generator=gen) * INIT_STD
        if cfg.linear_bias:
            params["classifier.dense.bias"] = torch.zeros(H)
        params["classifier.norm.weight"] = torch.ones(H)
        if cfg.norm_bias:
            params["classifier.norm.bias"] = torch.zeros(H)
    params["classifier.out.weight"] = torch.randn(num_labels, H, generator=gen) * INIT_STD
    params["classifier.out.bias"] = torch.zeros(num_labels)
    return params


def tag(
    params: dict[str, Tensor],
    cfg: ModelConfig,
    inputs: Mapping[str, Tensor],
    attention: Attention = "auto",
    rate: float | Tensor | None = None,
    head: TagHead = "linear",
) -> Tensor:
    """Logits [B, S, num_labels] (fp32) of every position of `inputs` (a batch's INPUTS: input_ids and
    attention_mask, the others where it has them); dropout at `rate` (None: `cfg.dropout`) in the encoder and
    before the head's output layer."""
    rate = cfg.dropout if rate is None else rate
    x = encode(
        params,
        cfg,
        inputs["input_ids"],
        inputs["attention_mask"],
        inputs.get("document_ids"),
        attention,
        inputs.get("token_type_ids"),
        rate,
        positions=inputs.get("positions"),
    )
    if head == "modernbert":
        x = F.linear(x, params["classifier.dense.weight"], params.get("classifier.dense.bias"))
        norm = params["classifier.norm.weight"]
        x = F.layer_norm(F.gelu(x), norm.shape, norm, params.get("classifier.norm.bias"), cfg.norm_eps)
    x = dropout(x, rate)
    return F.linear(x, params["classifier.out.weight"], params["classifier.out.bias"]).float()


def tag_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy over the positions whose tag is read (labels != IGNORE); 0 where none is."""
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return total / (labels != IGNORE).sum().clamp(min=1)


def make_tag_step(
    cfg: ModelConfig, opt_cfg: OptimizerConfig, how: Compilation = Compilation(), *, head: TagHead = "linear"
) -> Callable[..., tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]]:
    """step(params, opt_state, batch, lr: 0-dim tensor, donate=False) -> (params, opt_state, {"loss", "grad_norm"}):
    forward, loss, gradient and AdamW update in one graph per batch shape (`make_tuning_step`); the dropout rate
    is `batch["dropout"]` where the batch has one, else `cfg.dropout`."""
    _check_head(head)

    def loss_fn(params: dict[str, Tensor], batch: dict[str, Tensor]) -> Tensor:
        ids = batch["input_ids"]
        with autocast(ids, how.autocast):
            rate = batch["dropout"] if "dropout" in batch else torch.tensor(cfg.dropout, device=ids.device)
            # a graph takes the rate as a tensor (one graph at every rate), eager as a number (`bert.dropout`)
            rate = rate if how.compile else float(rate)
            logits = tag(params, cfg, batch, how.attention, rate, head)
        return tag_loss(logits, batch["labels"])

    return make_tuning_step(loss_fn, opt_cfg, how)


def make_tag_eval_step(
    cfg: ModelConfig, how: Compilation = Compilation(), *, head: TagHead = "linear"
) -> Callable[[dict[str, Tensor], dict[str, Tensor]], Tensor]:
    """predict(params, batch) -> logits [B, S, num_labels] fp32, without dropout; `labels` is not needed."""
    _check_head(head)

    # no_grad inside, not as a decorator: a decorated function is dynamo's shared `wrap_inline` frame
    def predict(params, batch):
        with torch.no_grad(), autocast(batch["input_ids"], how.autocast):
            return tag(params, cfg, batch, how.attention, 0.0, head)

    return compiled(predict, how)


def _check_head(head: str) -> None:
    if head not in TAG_HEADS:
        raise ValueError(f"head={head!r}: allowed {', '.join(TAG_HEADS)}")


def tag_head_of(cfg: ModelConfig) -> TagHead:
    """The head of the transformers family `cfg` exports as: ModernBERT's own, else the linear layer of BERT's
    and RoBERTa's (and of a model transformers cannot hold, which exports to cram's format alone)."""
    from cram.model.hf import family_head

    return "modernbert" if family_head(cfg) == "modernbert" else "linear"


def tagger_to_transformers(
    cfg: ModelConfig, params: dict[str, Tensor], special_ids: dict[str, int], labels: list[str]
) -> tuple[dict, dict]:
    """config.json and state dict of a fine-tuned tagger (encoder and `classifier.` head params, the head
    `tag_head_of(cfg)`) as its family's ...ForTokenClassification, `labels` the tag names in id order. The
    caller checks `hf.transformers_blockers` first."""
    from cram.model import hf
    from cram.model.bert import shapes

    family = hf.FAMILY_HEADS[hf.layout(cfg)]
    encoder = {k: v for k, v in params.items() if not k.startswith("classifier.")}
    # the masked-LM head and a pooler are no part of a token classifier: zeros stand in for the head, and both
    # are dropped from the state
    mlm = {name: torch.zeros(shape) for name, shape in shapes(cfg).items() if name.startswith("head.")}
    config, state = hf.to_transformers(cfg, {**mlm, **encoder}, special_ids)
    prefix = hf.PREFIX[family]
    state = {k: v for k, v in state.items() if k.startswith(prefix) and ".pooler." not in k}
    names = {"dense": "head.dense", "norm": "head.norm", "out": "classifier"}
    for name, tensor in params.items():
        if name.startswith("classifier."):
            part, kind = name.removeprefix("classifier.").split(".")
            state[f"{names[part]}.{kind}"] = tensor.contiguous()
    arch = {"bert": "BertForTokenClassification", "roberta": "RobertaForTokenClassification"}
    config["architectures"] = [arch.get(family, "ModernBertForTokenClassification")]
    config["num_labels"] = len(labels)
    config["id2label"] = {str(i): name for i, name in enumerate(labels)}
    config["label2id"] = {name: i for i, name in enumerate(labels)}
    config.update(classifier_dropout=0.0)
    return config, state
