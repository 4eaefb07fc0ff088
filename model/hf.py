"""The one mapping between cram's parameters and `transformers`' checkpoints, both ways.

    cfg, params = from_transformers(json.loads(config_text), load_file(weights), where="ckpt/")
    config, state = to_transformers(cfg, params, special_ids)      # config.json and model.safetensors
    config, state = classifier_to_transformers(cfg, params, special_ids, pooling, labels)  # a fine-tuned one
    config, state = base_to_transformers(cfg, params, special_ids)  # the encoder alone (an embedding model)

Four families: ModernBERT (`ModernBertForMaskedLM`: pre-norm, rope, GLU, local/global layers), BERT
(`BertForMaskedLM`: post-norm, learned positions, biases), RoBERTa (`RobertaForMaskedLM`, also
XLM-RoBERTa: BERT with positions offset by `pad_token_id + 1`) and, read only, DistilBERT (BERT without
token types). Each is read as its masked LM, its base model (`BertModel`, with or without the `bert.`
prefix) or its sequence classifier; the names are in `hf_families.py`, the configs' fields in
`hf_config.py`. A fine-tuned classifier exports as ModernBERT's, BERT's or RoBERTa's
`...ForSequenceClassification` (`classifier_blockers` says when its head cannot), an embedding model
as the family's base model (`BertModel`: what a sentence-transformers folder holds). A feature cram cannot
compute exactly is refused with `UnsupportedCheckpoint`, one line naming the config key or weight. Only
torch and json: reading and writing the files is the caller's job, and `transformers` is never imported.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from torch import Tensor

from cram.model.bert import POOLER, shapes
from cram.model.classifier import FIRST_TOKEN
from cram.model.config import ModelConfig
from cram.model.hf_config import checked_config, fields_of
from cram.model.hf_families import (
    FAMILY_OF,
    MODEL_TYPES,
    PREFIX,
    UNSUPPORTED,
    UnsupportedCheckpoint,
    classifier_weights,
    decoder_weight,
    family_of,
    hf_names,
    is_harmless,
    tied_pairs,
    with_prefix,
)

# What a ModernBERT layer stack needs of cram's ModelConfig; the other fields map whatever their value.
MODERNBERT_LAYOUT = {
    "position": "rope",
    "head_transform": True,
    "first_attn_norm": False,
    "glu": True,
    "embedding_norm": True,
    "token_types": 0,
}
# What BERT's needs (with post_norm); missing biases and token types are written as zeros, which add nothing.
BERT_LAYOUT = {
    "position": "learned",
    "head_transform": True,
    "glu": False,
    "embedding_norm": True,
    "local_attention": 0,
}
# What both need: neither family has a norm of the queries and keys.
SWITCHES_OFF = {"qk_norm": False}


def from_transformers(
    config: dict[str, Any], state: dict[str, Tensor], where: str
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(ModelConfig, fp32 params) of a transformers checkpoint's config.json and weights; `where` names
    its folder in messages. A masked LM, a base model (its weights with or without the family's prefix)
    or a sequence classifier, whose classifier is ignored. One without a masked-LM head gives params
    without cram's `head.` tensors (`missing_head` names them, `bert.init(cfg, seed, names)` makes them);
    BERT's pooler, where the checkpoint has one, is kept (`cfg.pooler`)."""
    config = checked_config(config, where)
    family = _family(config, where)
    state = with_prefix(_legacy_names(state), family)
    ignored = classifier_weights(state, family)
    fields = fields_of(config, family, where)
    fields["pooler"] = family in ("bert", "roberta") and PREFIX[family] + POOLER[0] in state
    try:
        cfg = ModelConfig(**fields)
    except ValueError as e:
        raise UnsupportedCheckpoint(f"{where}/config.json: {e}") from None
    return cfg, _read_state(cfg, family, config, state, where, ignored)


def missing_head(cfg: ModelConfig, params: dict[str, Tensor]) -> list[str]:
    """The parameters of `cfg`'s masked-LM head that `params` (of `from_transformers`) lack."""
    return [name for name in shapes(cfg) if name not in params]


def _family(config: dict[str, Any], where: str) -> str:
    kind = config.get("model_type")
    family = FAMILY_OF.get(kind)
    if family is None:
        why = f" ({UNSUPPORTED[kind]}: a family cram cannot compute exactly)" if kind in UNSUPPORTED else ""
        raise UnsupportedCheckpoint(
            f"{where}/config.json: model_type={kind!r}{why}; cram reads {', '.join(MODEL_TYPES)}"
        )
    return family


def to_transformers(cfg: ModelConfig, params: dict[str, Tensor], special_ids: dict[str, int]) -> tuple[dict, dict]:
    """config.json (a dict) and the state dict of `cfg`'s model for transformers: ModernBERT's layout,
    or with `post_norm` BERT's (RoBERTa's when positions are offset). special_ids: at least cls and sep."""
    blockers = transformers_blockers(cfg)
    if blockers:
        raise UnsupportedCheckpoint(
            f"the model does not map onto transformers' {layout(cfg)}; set {', '.join(blockers)}"
        )
    ids = {
        "pad_token_id": cfg.pad_id,
        "bos_token_id": special_ids["cls"],
        "eos_token_id": special_ids["sep"],
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    if cfg.post_norm:
        # BERT's layers always have biases and a type table: zeros where cram has none compute the same.
        full = dataclasses.replace(
            cfg, linear_bias=True, norm_bias=True, decoder_bias=True, token_types=max(1, cfg.token_types)
        )
        family = "roberta" if cfg.position_offset else "bert"
        config = {**_bert_config(full, family), **ids}
    else:
        full, family = cfg, "modernbert"
        config = {
            **_modernbert_config(cfg),
            **ids,
            "cls_token_id": special_ids["cls"],
            "sep_token_id": special_ids["sep"],
        }
    state, own = {}, shapes(cfg)
    for name, shape in shapes(full).items():
        tensor = params[name] if name in own else torch.zeros(shape)
        sources = hf_names(name, family)
        for source, part in zip(sources, tensor.chunk(len(sources))):
            state[source] = part.contiguous()
    return config, state


# The classifier head (model/classifier.py HEADS) of each family's ...ForSequenceClassification.
FAMILY_HEADS = {"ModernBERT": "modernbert", "BERT": "bert", "RoBERTa": "roberta"}
# The masked-LM head's tensors in each family's state dict: a classifier has none of them.
_MLM_HEAD = {"modernbert": ("head.", "decoder."), "bert": ("cls.",), "roberta": ("lm_head.",)}


def family_head(cfg: ModelConfig) -> str | None:
    """The classifier head kind of the transformers family `cfg` maps onto; None where it maps onto none."""
    return None if transformers_blockers(cfg) else FAMILY_HEADS[layout(cfg)]


def classifier_blockers(cfg: ModelConfig, head: str, width: int, pooling: str) -> list[str]:
    """`evaluate.key=value` for every evaluate setting that must change before a classifier with this
    head (kind, the cramming head's `width`, `pooling`) maps onto `layout(cfg)`'s ...ForSequenceClassification.
    In eval mode BERT's and RoBERTa's heads are the cramming head at the hidden width (dense + tanh on
    the first token); ModernBERT's is its own (dense, GELU, LayerNorm; first-token or mean pooling)."""
    wanted = FAMILY_HEADS[layout(cfg)]
    blockers = []
    if wanted == "modernbert" and head != "modernbert" or wanted != "modernbert" and head == "modernbert":
        blockers.append(f'evaluate.head="{wanted}"')
    elif head == "cramming" and width not in (0, cfg.hidden):
        blockers.append(f"evaluate.head_width=0 (the hidden size {cfg.hidden}, not {width})")
    if wanted != "modernbert" and pooling not in FIRST_TOKEN:  # "pooler" is BERT's own dense over the first token
        blockers.append('evaluate.pooling="first"')
    return blockers


def classifier_to_transformers(
    cfg: ModelConfig,
    params: dict[str, Tensor],
    special_ids: dict[str, int],
    pooling: str,
    labels: list[str],
) -> tuple[dict, dict]:
    """config.json and state dict of a fine-tuned classifier (encoder and `classifier.` head params) as
    `layout(cfg)`'s ...ForSequenceClassification; `labels` are the class names in id order, empty for a
    regression (one output). The caller checks `classifier_blockers` first."""
    family = FAMILY_HEADS[layout(cfg)]
    # The masked-LM head is no part of a classifier: zeros stand in for it and are dropped again.
    mlm = {name: torch.zeros(shape) for name, shape in shapes(cfg).items() if name.startswith("head.")}
    config, state = to_transformers(cfg, {**mlm, **params}, special_ids)
    state = {k: v for k, v in state.items() if not k.startswith(_MLM_HEAD[family])}
    names = {
        "bert": {"dense": "bert.pooler.dense", "out": "classifier"},
        "roberta": {"dense": "classifier.dense", "out": "classifier.out_proj"},
        "modernbert": {"dense": "head.dense", "norm": "head.norm", "out": "classifier"},
    }[family]
    for name, tensor in params.items():
        if name.startswith("classifier."):
            part, kind = name.removeprefix("classifier.").split(".")
            state[f"{names[part]}.{kind}"] = tensor.contiguous()
    arch = {"bert": "BertForSequenceClassification", "roberta": "RobertaForSequenceClassification"}
    config["architectures"] = [arch.get(family, "ModernBertForSequenceClassification")]
    config["num_labels"] = len(labels) or 1
    config["problem_type"] = "single_label_classification" if labels else "regression"
    if labels:
        config["id2label"] = {str(i): name for i, name in enumerate(labels)}
        config["label2id"] = {name: i for i, name in enumerate(labels)}
    if family == "modernbert":
        config.update(classifier_pooling="cls" if pooling in FIRST_TOKEN else "mean", classifier_dropout=0.0)
    return config, state


# Each family's base model: the encoder without a head, its weights without the family's prefix.
_BASE_MODELS = {"modernbert": "ModernBertModel", "bert": "BertModel", "roberta": "RobertaModel"}


def base_to_transformers(cfg: ModelConfig, params: dict[str, Tensor], special_ids: dict[str, int]) -> tuple[dict, dict]:
    """config.json and state dict of `cfg`'s encoder alone (`params` without a head) as `layout(cfg)`'s base
    model. BERT's and RoBERTa's base models hold a pooler, which an embedding never reads: zeros where cram
    has none, so that transformers finds every weight it expects rather than drawing random ones."""
    family = FAMILY_HEADS[layout(cfg)]
    mlm = {name: torch.zeros(shape) for name, shape in shapes(cfg).items() if name.startswith("head.")}
    config, state = to_transformers(cfg, {**mlm, **params}, special_ids)
    state = {k.removeprefix(PREFIX[family]): v for k, v in state.items() if not k.startswith(_MLM_HEAD[family])}
    if family != "modernbert" and not cfg.pooler:
        state[POOLER[0]], state[POOLER[1]] = torch.zeros(cfg.hidden, cfg.hidden), torch.zeros(cfg.hidden)
    config["architectures"] = [_BASE_MODELS[family]]
    return config, state


def layout(cfg: ModelConfig) -> str:
    """The transformers architecture `cfg` exports as."""
    if not cfg.post_norm:
        return "ModernBERT"
    return "RoBERTa" if cfg.position_offset else "BERT"


def transformers_blockers(cfg: ModelConfig) -> list[str]:
    """`key=value` for every ModelConfig field that must change before the model maps onto transformers
    (ModernBERT's layout, or BERT's with post_norm)."""
    wanted = dict(BERT_LAYOUT) if cfg.post_norm else dict(MODERNBERT_LAYOUT)
    if cfg.position_offset and cfg.position_offset != cfg.pad_id + 1:
        wanted["position_offset"] = cfg.pad_id + 1  # transformers' RoBERTa offsets positions by pad_token_id + 1
    wanted.update(SWITCHES_OFF)
    return [f"pretrain.model.{k}={json.dumps(v)}" for k, v in wanted.items() if getattr(cfg, k) != v]


def _legacy_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Old BERT checkpoints name LayerNorm parameters gamma and beta; transformers renames them too."""
    renamed = {}
    for name, tensor in state.items():
        if name.endswith(".gamma") or name.endswith(".beta"):
            name = name.rsplit(".", 1)[0] + (".weight" if name.endswith(".gamma") else ".bias")
        renamed[name] = tensor
    return renamed


def _read_state(
    cfg: ModelConfig,
    family: str,
    config: dict[str, Any],
    state: dict[str, Tensor],
    where: str,
    ignored: tuple[str, ...],
) -> dict[str, Tensor]:
    """cram's params of `state`, with the masked-LM head where the checkpoint is a masked LM (it has the
    head's dense layer); `ignored`: name prefixes of weights that are read past (a sequence classifier's,
    whose checkpoint never gives a masked-LM head)."""
    head = not ignored and hf_names("head.dense.weight", family)[0] in state
    params, used = {}, set()
    for name, shape in shapes(cfg).items():
        if name.startswith("head.") and not head:
            continue
        sources = hf_names(name, family)
        missing = next((s for s in sources if s not in state), None)
        if missing is not None:
            raise UnsupportedCheckpoint(f"{where}: the weights lack {missing} (cram's {name})")
        integer = next((s for s in sources if not state[s].is_floating_point()), None)
        if integer is not None:
            dtype = str(state[integer].dtype).removeprefix("torch.")
            raise UnsupportedCheckpoint(f"{where}: {integer} holds {dtype} values; weights must be floating point")
        tensor = torch.cat([state[s] for s in sources]) if len(sources) > 1 else state[sources[0]]
        if tuple(tensor.shape) != shape:
            raise UnsupportedCheckpoint(
                f"{where}: {sources[0]} has shape {tuple(tensor.shape)}; config.json makes it {shape}"
            )
        params[name] = tensor.float().contiguous()
        used.update(sources)
    if head:
        used.update(_tied_decoder(family, config, state, params, where))
    extra = next((k for k in state if k not in used and not is_harmless(k) and not k.startswith(ignored)), None)
    if extra is not None:
        raise UnsupportedCheckpoint(
            f"{where}: weight {extra} has no place in cram's {family} model; cram reads the encoder, its "
            "masked-LM head and BERT's pooler"
        )
    return params


def values_compared(config: Any, names: set[str]) -> set[str]:
    """Of a checkpoint's tensor `names`, those whose values `from_transformers` compares: the tied
    decoder's copies it holds and the tensors they repeat. A check from the files' headers reads these
    alone. Empty for a config that `from_transformers` refuses (it says why)."""
    family = family_of(config)
    if family is None:
        return set()
    needed: set[str] = set()
    for copy, tied in tied_pairs(family).items():
        if copy in names:
            needed.update({copy, *hf_names(tied, family)})
    return needed


def _tied_decoder(
    family: str, config: dict[str, Any], state: dict[str, Tensor], params: dict[str, Tensor], where: str
) -> list[str]:
    """The names of the decoder's weight and bias copies, once they are known to repeat the tied ones."""
    decoder = decoder_weight(family)
    copies = {copy: params[tied] for copy, tied in tied_pairs(family).items()}
    tied = config.get("tie_word_embeddings", True)
    if not tied and decoder not in state:
        raise UnsupportedCheckpoint(f"{where}: tie_word_embeddings=false and the weights lack {decoder}")
    for name, expected in copies.items():
        # A check from the files' headers reads these tensors' values (`values_compared`).
        if name in state and not torch.equal(state[name].float(), expected):
            raise UnsupportedCheckpoint(
                f"{where}/config.json: tie_word_embeddings={json.dumps(tied)} and {name} differs from the "
                "tied tensor; cram ties the decoder to the token embeddings (true)"
            )
    return list(copies)


def _modernbert_config(cfg: ModelConfig) -> dict[str, Any]:
    local_theta = cfg.local_rope_theta or cfg.rope_theta
    every = cfg.global_every if cfg.local_attention else 1
    kinds = ["sliding_attention" if cfg.is_local(i) else "full_attention" for i in range(cfg.layers)]
    return {
        "architectures": ["ModernBertForMaskedLM"],
        "model_type": "modernbert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate // 2,  # transformers counts one half of the GLU's up-projection
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_activation": "gelu",
        "classifier_activation": "gelu",
        "norm_eps": cfg.norm_eps,
        "norm_bias": cfg.norm_bias,
        "attention_bias": cfg.linear_bias,
        "mlp_bias": cfg.linear_bias,
        "classifier_bias": cfg.linear_bias,
        "decoder_bias": cfg.decoder_bias,
        "local_attention": cfg.local_attention or 128,  # transformers' default where no layer is local
        "layer_types": kinds,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        # The older spelling too, for transformers releases before layer_types.
        "global_attn_every_n_layers": every,
        "global_rope_theta": cfg.rope_theta,
        "local_rope_theta": local_theta,
        "embedding_dropout": cfg.dropout,
        "attention_dropout": cfg.dropout,
        "mlp_dropout": cfg.dropout,
    }


def _bert_config(cfg: ModelConfig, family: str) -> dict[str, Any]:
    return {
        "architectures": ["RobertaForMaskedLM" if family == "roberta" else "BertForMaskedLM"],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "max_position_embeddings": cfg.position_offset + cfg.max_seq_len,
        "type_vocab_size": cfg.token_types,
        "hidden_act": "gelu",
        "layer_norm_eps": cfg.norm_eps,
        "position_embedding_type": "absolute",
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.dropout,
    }
