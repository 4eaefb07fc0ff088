"""config.json of a transformers encoder read as cram's ModelConfig fields, for each family
`model/hf.py` reads: every key checked for its JSON type, each feature cram cannot compute exactly
refused naming its key (`UnsupportedCheckpoint`). No torch.
"""

from __future__ import annotations

import json
from typing import Any

from cram.model.hf_families import UnsupportedCheckpoint


def fields_of(config: dict[str, Any], family: str, where: str) -> dict[str, Any]:
    """ModelConfig's fields for a checked config.json (`checked_config`) of `family`."""
    if family == "modernbert":
        return _modernbert_fields(config, where)
    if family == "distilbert":
        return _distilbert_fields(config, where)
    return _bert_fields(config, family, where)


# The JSON type of every config.json key this module reads: a value of another type is refused by name
# rather than met as a traceback (or, for a bool, read by its truth). A null is read as the key left out.
_NUMBER = (int, float)
_KEY_TYPES: dict[str, type | tuple[type, ...]] = {
    **dict.fromkeys(
        (
            "model_type",
            "position_embedding_type",
            "hidden_act",
            "hidden_activation",
            "classifier_activation",
            "activation",
        ),
        str,
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
            "dim",
            "n_layers",
            "n_heads",
            "hidden_dim",
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


def checked_config(config: Any, where: str) -> dict[str, Any]:
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


# BERT's and DistilBERT's layer layout: post-norm blocks, learned positions, biases everywhere, a GELU MLP.
_POST_NORM_LAYERS = dict(
    position="learned",
    glu=False,
    head_transform=True,
    embedding_norm=True,
    first_attn_norm=True,
    post_norm=True,
    norm_bias=True,
    linear_bias=True,
    decoder_bias=True,
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
        **_POST_NORM_LAYERS,
        position_offset=offset,
        token_types=config.get("type_vocab_size", 1 if family == "roberta" else 2),
        norm_eps=config.get("layer_norm_eps", 1e-12),
        pad_id=pad,
    )


def _distilbert_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """DistilBERT is BERT's post-norm layout without token types; its sinusoidal positions
    (`sinusoidal_pos_embds`) are fixed values stored in the position table, which read as learned ones."""
    _refuse_common(config, where, activation_keys=("activation",))
    return dict(
        vocab_size=config.get("vocab_size"),
        hidden=config.get("dim", 768),
        layers=config.get("n_layers", 6),
        heads=config.get("n_heads", 12),
        intermediate=config.get("hidden_dim", 3072),
        max_seq_len=config.get("max_position_embeddings", 512),
        **_POST_NORM_LAYERS,
        norm_eps=1e-12,  # DistilBERT's LayerNorms fix it
        pad_id=config.get("pad_token_id", 0),
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
