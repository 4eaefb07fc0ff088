"""What `transformers` calls things in the encoder families `model/hf.py` reads: the families' model
types, their weights' names for each of cram's parameters, and which weights are the masked-LM head, a
sequence classifier or BERT's pooler. Pure tables and string functions: no torch.

A family's checkpoint names its encoder under a prefix (`bert.`, `roberta.`, `model.`, `distilbert.`)
when it was saved with a head, and without it when it was saved as the base model (`BertModel`, a
sentence-transformers folder): `with_prefix` gives both the prefixed names.
"""

from __future__ import annotations

from typing import Any


class UnsupportedCheckpoint(ValueError):
    """A checkpoint cram cannot load, or a model transformers cannot hold; one line naming the file or field."""


# config.json's model_type -> the family whose names and layout it has.
FAMILY_OF = {
    "modernbert": "modernbert",
    "bert": "bert",
    "roberta": "roberta",
    "xlm-roberta": "roberta",
    "distilbert": "distilbert",
}
MODEL_TYPES = tuple(FAMILY_OF)
# Families cram cannot compute exactly, and why: refused naming the family rather than met as a missing weight.
UNSUPPORTED = {
    "deberta": "DeBERTa's disentangled relative attention",
    "deberta-v2": "DeBERTa's disentangled relative attention",
    "electra": "ELECTRA's embedding projection and generator head",
    "albert": "ALBERT's factorised embeddings and shared layers",
    "mpnet": "MPNet's relative position bias",
    "xlnet": "XLNet's relative attention",
    "funnel": "Funnel's pooled layers",
    "longformer": "Longformer's sliding and global attention",
}
PREFIX = {"modernbert": "model.", "bert": "bert.", "roberta": "roberta.", "distilbert": "distilbert."}
# The token embeddings' name under the prefix: what tells a base model's unprefixed weights.
_EMBEDDINGS = {
    "modernbert": "embeddings.tok_embeddings.weight",
    "bert": "embeddings.word_embeddings.weight",
    "roberta": "embeddings.word_embeddings.weight",
    "distilbert": "embeddings.word_embeddings.weight",
}
# Weights of a `...ForSequenceClassification` head (ModernBERT's has its own dense + norm, `head.`).
_CLASSIFIER = {
    "modernbert": ("classifier.", "head."),
    "bert": ("classifier.",),
    "roberta": ("classifier.",),
    "distilbert": ("pre_classifier.", "classifier."),
}
# Weights of BERT's pretraining checkpoints that the masked LM never reads: the next-sentence head.
HARMLESS = ("cls.seq_relationship.",)

# cram's parameter names -> transformers' ModernBertForMaskedLM names, applied in this order.
_MODERNBERT_RENAMES = (
    ("head.decoder", "decoder"),
    ("embed.tokens", "model.embeddings.tok_embeddings"),
    ("embed.norm", "model.embeddings.norm"),
    ("final_norm", "model.final_norm"),
    ("layers.", "model.layers."),
    ("attn.qkv", "attn.Wqkv"),
    ("attn.out", "attn.Wo"),
    ("ffn_norm", "mlp_norm"),
    ("ffn.up", "mlp.Wi"),
    ("ffn.down", "mlp.Wo"),
)
# cram's names -> BertForMaskedLM's; RoBERTa's differ in the prefix and the head (`_ROBERTA_HEAD`).
_BERT_RENAMES = (
    ("head.decoder.bias", "cls.predictions.bias"),
    ("head.dense", "cls.predictions.transform.dense"),
    ("head.norm", "cls.predictions.transform.LayerNorm"),
    ("embed.tokens", "bert.embeddings.word_embeddings"),
    ("embed.positions", "bert.embeddings.position_embeddings"),
    ("embed.types", "bert.embeddings.token_type_embeddings"),
    ("embed.norm", "bert.embeddings.LayerNorm"),
    ("pooler.", "bert.pooler."),
    ("layers.", "bert.encoder.layer."),
    ("attn.out", "attention.output.dense"),
    ("attn_norm", "attention.output.LayerNorm"),
    ("ffn.up", "intermediate.dense"),
    ("ffn.down", "output.dense"),
    ("ffn_norm", "output.LayerNorm"),
)
_ROBERTA_HEAD = {
    "cls.predictions.bias": "lm_head.bias",
    "cls.predictions.transform.dense": "lm_head.dense",
    "cls.predictions.transform.LayerNorm": "lm_head.layer_norm",
}
# cram's names -> DistilBertForMaskedLM's.
_DISTILBERT_RENAMES = (
    ("head.decoder.bias", "vocab_projector.bias"),
    ("head.dense", "vocab_transform"),
    ("head.norm", "vocab_layer_norm"),
    ("embed.tokens", "distilbert.embeddings.word_embeddings"),
    ("embed.positions", "distilbert.embeddings.position_embeddings"),
    ("embed.norm", "distilbert.embeddings.LayerNorm"),
    ("layers.", "distilbert.transformer.layer."),
    ("attn.out", "attention.out_lin"),
    ("attn_norm", "sa_layer_norm"),
    ("ffn.up", "ffn.lin1"),
    ("ffn.down", "ffn.lin2"),
    ("ffn_norm", "output_layer_norm"),
)
_QKV = {
    "modernbert": None,
    "bert": ("attention.self.query", "attention.self.key", "attention.self.value"),
    "roberta": ("attention.self.query", "attention.self.key", "attention.self.value"),
    "distilbert": ("attention.q_lin", "attention.k_lin", "attention.v_lin"),
}
_DECODER = {
    "modernbert": "decoder",
    "bert": "cls.predictions.decoder",
    "roberta": "lm_head.decoder",
    "distilbert": "vocab_projector",
}


def family_of(config: Any) -> str | None:
    """The family of a config.json's content; None for a model type cram does not read."""
    kind = config.get("model_type") if isinstance(config, dict) else None
    return FAMILY_OF.get(kind) if isinstance(kind, str) else None


def hf_names(name: str, family: str) -> list[str]:
    """transformers' names of cram's parameter `name`: three (query, key, value) for BERT's qkv."""
    renames = {"modernbert": _MODERNBERT_RENAMES, "distilbert": _DISTILBERT_RENAMES}.get(family, _BERT_RENAMES)
    for old, new in renames:
        name = name.replace(old, new)
    if family == "roberta":
        name = name.replace("bert.", "roberta.", 1) if name.startswith("bert.") else name
        name = next((name.replace(k, v) for k, v in _ROBERTA_HEAD.items() if name.startswith(k)), name)
    qkv = _QKV[family]
    if qkv is not None and ".attn.qkv." in name:
        return [name.replace("attn.qkv", part) for part in qkv]
    return [name]


def tied_pairs(family: str) -> dict[str, str]:
    """transformers' names of the decoder's tensors that repeat others -> cram's names of those others."""
    decoder = _DECODER[family]
    pairs = {decoder + ".weight": "embed.tokens.weight"}
    if family in ("bert", "roberta"):  # the others' decoder bias is the parameter itself
        pairs[decoder + ".bias"] = "head.decoder.bias"
    return pairs


def decoder_weight(family: str) -> str:
    return _DECODER[family] + ".weight"


def with_prefix(state: dict[str, Any], family: str) -> dict[str, Any]:
    """`state` with its encoder under the family's prefix: a base model's weights, saved without it,
    gain it; a checkpoint saved with a head keeps its names."""
    prefix = PREFIX[family]
    if prefix + _EMBEDDINGS[family] in state or _EMBEDDINGS[family] not in state:
        return state
    return {prefix + name: tensor for name, tensor in state.items()}


def classifier_weights(state: dict[str, Any], family: str) -> tuple[str, ...]:
    """The name prefixes of a sequence classifier's head in `state` (none when it has no classifier):
    weights a masked LM ignores."""
    return _CLASSIFIER[family] if any(name.startswith("classifier.") for name in state) else ()


def is_harmless(name: str) -> bool:
    """A weight the encoder never reads, whatever the family: the next-sentence head, stored ids."""
    return name.startswith(HARMLESS) or name.endswith((".position_ids", ".token_type_ids"))
