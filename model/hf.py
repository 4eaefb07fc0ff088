"""The one mapping between cram's parameters and `transformers`' masked-LM checkpoints, both ways.

    cfg, params = from_transformers(json.loads(config_text), load_file(weights), where="ckpt/")
    config, state = to_transformers(cfg, params, special_ids)      # config.json and model.safetensors
    config, state = classifier_to_transformers(cfg, params, special_ids, pooling, labels)  # a fine-tuned one

Three families: ModernBERT (`ModernBertForMaskedLM`: pre-norm, rope, GLU, local/global layers), BERT
(`BertForMaskedLM`: post-norm, learned positions, biases) and RoBERTa (`RobertaForMaskedLM`, also
XLM-RoBERTa: BERT with positions offset by `pad_token_id + 1`); a fine-tuned classifier exports as
each family's `...ForSequenceClassification` (`classifier_blockers` says when its head cannot). A
feature cram cannot compute exactly is refused with `UnsupportedCheckpoint`, one line naming the
config key or weight. Only torch and json: reading and writing the files is the caller's job, and
`transformers` is never imported.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from torch import Tensor

from cram.model.bert import shapes
from cram.model.config import ModelConfig


class UnsupportedCheckpoint(ValueError):
    """A checkpoint cram cannot load, or a model transformers cannot hold; one line naming the file or field."""


MODEL_TYPES = ("modernbert", "bert", "roberta", "xlm-roberta")
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
_DECODER = {"modernbert": "decoder", "bert": "cls.predictions.decoder", "roberta": "lm_head.decoder"}
# Weights a checkpoint may hold that the masked LM never reads: BERT's pooler and next-sentence head.
_HARMLESS = ("bert.pooler.", "roberta.pooler.", "cls.seq_relationship.")


# The JSON type of every config.json key this module reads: a value of another type is refused by name
# rather than met as a traceback (or, for a bool, read by its truth). A null is read as the key left out.
_NUMBER = (int, float)
_KEY_TYPES: dict[str, type | tuple[type, ...]] = {
    **dict.fromkeys(
        ("model_type", "position_embedding_type", "hidden_act", "hidden_activation", "classifier_activation"), str
    ),
    **dict.fromkeys(
        (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "local_attention",
            "global_attn_every_n_layers",
            "pad_token_id",
            "type_vocab_size",
        ),
        int,
    ),
    **dict.fromkeys(("norm_eps", "layer_norm_eps", "global_rope_theta", "local_rope_theta"), _NUMBER),
    **dict.fromkeys(
        (
            "attention_bias",
            "mlp_bias",
            "classifier_bias",
            "norm_bias",
            "decoder_bias",
            "tie_word_embeddings",
            "is_decoder",
            "add_cross_attention",
        ),
        bool,
    ),
    "layer_types": list,
    "rope_parameters": dict,
    "rope_scaling": dict,
}
_TYPE_NAMES = {str: "a string", int: "an integer", _NUMBER: "a number", bool: "true or false", list: "a list"}


def _checked_config(config: Any, where: str) -> dict[str, Any]:
    """A config.json's content as this module reads it: a JSON object whose keys hold values of their
    type (`_KEY_TYPES`), nulls dropped. UnsupportedCheckpoint names the file and the key otherwise."""
    if not isinstance(config, dict):
        raise UnsupportedCheckpoint(f"{where}/config.json: a JSON {type(config).__name__}, not an object of settings")
    config = {key: value for key, value in config.items() if value is not None}
    for key, kind in _KEY_TYPES.items():
        value = config.get(key)
        wrong_bool = isinstance(value, bool) and kind is not bool
        if key in config and (wrong_bool or not isinstance(value, kind)):
            expected = _TYPE_NAMES.get(kind, "an object")
            raise UnsupportedCheckpoint(f"{where}/config.json: {key}={json.dumps(value)}; expected {expected}")
    return config


def from_transformers(
    config: dict[str, Any], state: dict[str, Tensor], where: str
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(ModelConfig, fp32 params) of a transformers masked LM's config.json and weights; `where` names
    its folder in messages."""
    config = _checked_config(config, where)
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise UnsupportedCheckpoint(f"{where}/config.json: model_type={kind!r}; cram reads {', '.join(MODEL_TYPES)}")
    family = "roberta" if kind == "xlm-roberta" else kind
    fields = _modernbert_fields(config, where) if family == "modernbert" else _bert_fields(config, family, where)
    try:
        cfg = ModelConfig(**fields)
    except ValueError as e:
        raise UnsupportedCheckpoint(f"{where}/config.json: {e}") from None
    return cfg, _read_state(cfg, family, config, _legacy_names(state), where)


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
        sources = _hf_names(name, family)
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
    if wanted != "modernbert" and pooling != "first":
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
        config.update(classifier_pooling="cls" if pooling == "first" else "mean", classifier_dropout=0.0)
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
    return [f"pretrain.model.{k}={json.dumps(v)}" for k, v in wanted.items() if getattr(cfg, k) != v]


def _modernbert_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    _refuse_common(config, where, activation_keys=("hidden_activation", "classifier_activation"))
    biases = {key: bool(config.get(key, False)) for key in ("attention_bias", "mlp_bias", "classifier_bias")}
    if len(set(biases.values())) > 1:
        raise UnsupportedCheckpoint(
            f"{where}/config.json: attention_bias, mlp_bias and classifier_bias are {biases}; cram has biases "
            "in every linear layer or in none, so they must be equal"
        )
    layers = config.get("num_hidden_layers", 22)
    global_every = _global_every(config, layers, where)
    theta, local_theta = _rope_thetas(config, where)
    local = global_every > 1 and layers > 1
    window = config.get("local_attention", 128)
    if local and window < 1:
        raise UnsupportedCheckpoint(
            f"{where}/config.json: local_attention={window} with sliding layers; cram reads >= 1"
        )
    return dict(
        _common_fields(config),
        intermediate=2 * config.get("intermediate_size", 1152),  # transformers counts one GLU half
        max_seq_len=config.get("max_position_embeddings", 8192),
        position="rope",
        rope_theta=theta,
        local_rope_theta=local_theta if local and local_theta != theta else None,
        local_attention=window if local else 0,
        global_every=global_every if local else 1,
        glu=True,
        head_transform=True,
        embedding_norm=True,
        first_attn_norm=False,
        norm_bias=bool(config.get("norm_bias", False)),
        norm_eps=config.get("norm_eps", 1e-5),
        pad_id=config.get("pad_token_id", 50283),
        linear_bias=biases["attention_bias"],
        decoder_bias=bool(config.get("decoder_bias", True)),
    )


def _bert_fields(config: dict[str, Any], family: str, where: str) -> dict[str, Any]:
    _refuse_common(config, where, activation_keys=("hidden_act",))
    kind = config.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise UnsupportedCheckpoint(f"{where}/config.json: position_embedding_type={kind!r}; cram reads 'absolute'")
    pad = config.get("pad_token_id", 1 if family == "roberta" else 0)
    offset = pad + 1 if family == "roberta" else 0  # RoBERTa's position p reads row p + pad_token_id + 1
    return dict(
        _common_fields(config),
        intermediate=config.get("intermediate_size", 3072),
        max_seq_len=config.get("max_position_embeddings", 512) - offset,
        position="learned",
        position_offset=offset,
        token_types=config.get("type_vocab_size", 1 if family == "roberta" else 2),
        glu=False,
        head_transform=True,
        embedding_norm=True,
        first_attn_norm=True,
        post_norm=True,
        norm_bias=True,
        linear_bias=True,
        decoder_bias=True,
        norm_eps=config.get("layer_norm_eps", 1e-12),
        pad_id=pad,
    )


def _common_fields(config: dict[str, Any]) -> dict[str, Any]:
    return dict(
        vocab_size=config.get("vocab_size"),
        hidden=config.get("hidden_size", 768),
        layers=config.get("num_hidden_layers", 12),
        heads=config.get("num_attention_heads", 12),
    )


def _refuse_common(config: dict[str, Any], where: str, activation_keys: tuple[str, ...]) -> None:
    """UnsupportedCheckpoint for the features no family of cram's computes."""
    for key in activation_keys:
        if config.get(key, "gelu") != "gelu":
            raise UnsupportedCheckpoint(f"{where}/config.json: {key}={config[key]!r}; cram computes 'gelu' only")
    for key in ("is_decoder", "add_cross_attention"):
        if config.get(key):
            raise UnsupportedCheckpoint(f"{where}/config.json: {key}=true; cram reads encoders only (false)")
    if "vocab_size" not in config:
        raise UnsupportedCheckpoint(f"{where}/config.json: no vocab_size")


def _global_every(config: dict[str, Any], layers: int, where: str) -> int:
    """N of ModernBERT's pattern "layer i is global when i % N == 0", from either spelling of the config."""
    types = config.get("layer_types")
    if types is None:  # the older spelling; transformers' default is 3
        return int(config.get("global_attn_every_n_layers", 3))
    allowed = ("full_attention", "sliding_attention")
    is_global = [t == "full_attention" for t in types]
    if len(types) == layers and all(t in allowed for t in types):
        for every in range(1, layers + 1):
            if is_global == [i % every == 0 for i in range(layers)]:
                return every
    raise UnsupportedCheckpoint(
        f"{where}/config.json: layer_types={types}; cram reads {layers} entries, 'full_attention' in every "
        "N-th layer from layer 0 and 'sliding_attention' in the others"
    )


def _rope_thetas(config: dict[str, Any], where: str) -> tuple[float, float]:
    """(global, local) rope theta of a ModernBERT config, new spelling (`rope_parameters`) or old."""
    if config.get("rope_scaling"):
        raise UnsupportedCheckpoint(f"{where}/config.json: rope_scaling is set; cram reads unscaled rope (none)")
    rope = config.get("rope_parameters") or {}
    theta = {"full_attention": config.get("global_rope_theta", 160_000.0)}
    theta["sliding_attention"] = config.get("local_rope_theta", 10_000.0)
    for kind in theta:
        params = rope.get(kind) or {}
        value = params.get("rope_theta", theta[kind]) if isinstance(params, dict) else None
        if not isinstance(value, _NUMBER) or isinstance(value, bool):
            raise UnsupportedCheckpoint(
                f"{where}/config.json: rope_parameters.{kind}={json.dumps(params)}; expected an object with a "
                "number rope_theta"
            )
        if params.get("rope_type", "default") != "default":
            raise UnsupportedCheckpoint(
                f"{where}/config.json: rope_parameters.{kind}.rope_type={params['rope_type']!r}; cram reads 'default'"
            )
        theta[kind] = float(value)
    return theta["full_attention"], theta["sliding_attention"]


def _legacy_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Old BERT checkpoints name LayerNorm parameters gamma and beta; transformers renames them too."""
    renamed = {}
    for name, tensor in state.items():
        if name.endswith(".gamma") or name.endswith(".beta"):
            name = name.rsplit(".", 1)[0] + (".weight" if name.endswith(".gamma") else ".bias")
        renamed[name] = tensor
    return renamed


def _read_state(
    cfg: ModelConfig, family: str, config: dict[str, Any], state: dict[str, Tensor], where: str
) -> dict[str, Tensor]:
    params, used = {}, set()
    for name, shape in shapes(cfg).items():
        sources = _hf_names(name, family)
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
    used.update(_tied_decoder(family, config, state, params, where))
    extra = next((k for k in state if k not in used and not _harmless(k)), None)
    if extra is not None:
        raise UnsupportedCheckpoint(
            f"{where}: weight {extra} has no place in cram's {family} model; cram reads a masked LM"
        )
    return params


def values_compared(config: Any, names: set[str]) -> set[str]:
    """Of a checkpoint's tensor `names`, those whose values `from_transformers` compares: the tied
    decoder's copies it holds and the tensors they repeat. A check from the files' headers reads these
    alone. Empty for a config that `from_transformers` refuses (it says why)."""
    if not isinstance(config, dict) or config.get("model_type") not in MODEL_TYPES:
        return set()
    family = "roberta" if config["model_type"] == "xlm-roberta" else config["model_type"]
    needed: set[str] = set()
    for copy, tied in _tied_pairs(family).items():
        if copy in names:
            needed.update({copy, *_hf_names(tied, family)})
    return needed


def _tied_pairs(family: str) -> dict[str, str]:
    """transformers' names of the decoder's tensors -> cram's names of the tensors they are tied to."""
    decoder = _DECODER[family]
    pairs = {decoder + ".weight": "embed.tokens.weight"}
    if family != "modernbert":
        pairs[decoder + ".bias"] = "head.decoder.bias"
    return pairs


def _tied_decoder(
    family: str, config: dict[str, Any], state: dict[str, Tensor], params: dict[str, Tensor], where: str
) -> list[str]:
    """The names of the decoder's weight and bias copies, once they are known to repeat the tied ones."""
    decoder = _DECODER[family]
    copies = {copy: params[tied] for copy, tied in _tied_pairs(family).items()}
    tied = config.get("tie_word_embeddings", True)
    if not tied and decoder + ".weight" not in state:
        raise UnsupportedCheckpoint(f"{where}: tie_word_embeddings=false and the weights lack {decoder}.weight")
    for name, expected in copies.items():
        # A check from the files' headers reads these tensors' values (`values_compared`).
        if name in state and not torch.equal(state[name].float(), expected):
            raise UnsupportedCheckpoint(
                f"{where}/config.json: tie_word_embeddings={json.dumps(tied)} and {name} differs from the "
                "tied tensor; cram ties the decoder to the token embeddings (true)"
            )
    return list(copies)


def _harmless(name: str) -> bool:
    return name.startswith(_HARMLESS) or name.endswith((".position_ids", ".token_type_ids"))


def _hf_names(name: str, family: str) -> list[str]:
    """transformers' names of cram's parameter `name`: three (query, key, value) for BERT's qkv."""
    if family == "modernbert":
        for old, new in _MODERNBERT_RENAMES:
            name = name.replace(old, new)
        return [name]
    for old, new in _BERT_RENAMES:
        name = name.replace(old, new)
    if family == "roberta":
        name = name.replace("bert.", "roberta.", 1) if name.startswith("bert.") else name
        name = next((name.replace(k, v) for k, v in _ROBERTA_HEAD.items() if name.startswith(k)), name)
    if ".attn.qkv." in name:
        return [name.replace("attn.qkv", f"attention.self.{part}") for part in ("query", "key", "value")]
    return [name]


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
