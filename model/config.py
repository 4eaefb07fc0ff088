"""The architecture of the encoder (one frozen dataclass and the named presets); the optimizers' settings are
`model/optimizers.py`'s.

Torch-free, so that the stages' configs can use these dataclasses without importing torch."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

POSITIONS = ("sinusoidal", "learned", "rope")
# Switches removed after they won no setting in every seed (issue 46), at the value that builds the model
# without them: what `from_json` accepts of them in a model.json written while they existed.
RETIRED = {"value_residual": False, "activation": "gelu"}


def misvalued_retired(data: Mapping[str, object], retired: Mapping[str, object]) -> str | None:
    """The first key of `data` that `retired` names at another value than its retired one (of its type too:
    `true` is not `1`), or None: a file that can be read without those keys only where there is none."""
    wrong = (
        key
        for key in data
        if key in retired and (data[key] != retired[key] or type(data[key]) is not type(retired[key]))
    )
    return next(wrong, None)


# How attention is computed, never what: "sdpa" is `F.scaled_dot_product_attention`, "written" the product
# written out (softmax(q k^T) v), "auto" SDPA on a GPU and the written-out product on a CPU. A runtime
# choice (`[run] attention`), not part of the architecture: no `ModelConfig` field, no cache key.
Attention = Literal["auto", "sdpa", "written"]
ATTENTIONS: tuple[str, ...] = ("auto", "sdpa", "written")


class ModelConfigError(ValueError):
    """A `model.json` that does not describe a ModelConfig; one line naming the file."""


@dataclass(frozen=True)
class ModelConfig:
    """A pre-norm, bias-free BERT encoder. The defaults are crammed-BERT (Geiping & Goldstein).

    `position="rope", head_transform=True, embedding_norm=True, first_attn_norm=False` gives the
    layer layout of `transformers`' ModernBERT (with `local_attention`, `global_every`, `local_rope_theta`
    and `decoder_bias` its local/global layers); `post_norm`, `linear_bias`, `norm_bias`, `decoder_bias`,
    `token_types`, `position="learned"` and `glu=False` give BERT's (and `position_offset` RoBERTa's).
    `model/hf.py` maps existing checkpoints onto these fields.
    """

    vocab_size: int = 32768
    hidden: int = 768
    layers: int = 16
    heads: int = 12
    intermediate: int = 3072  # GLU: the up-projection has this many outputs, split in two halves
    max_seq_len: int = 128
    position: Literal["sinusoidal", "learned", "rope"] = "sinusoidal"
    rope_theta: float = 10000.0
    position_scale: float | None = None  # sinusoidal: the learnable scale's start; None: 1/sqrt(hidden) (cramming)
    glu: bool = True  # GELU-GLU feed-forward; False: a plain GELU MLP
    head_transform: bool = False  # dense + GELU + norm before the tied decoder
    embedding_norm: bool = True
    first_attn_norm: bool = True  # False: the first block's attention reads the embeddings unnormalised
    norm_bias: bool = False  # True: every LayerNorm has a bias, zero at init (cramming's nn.LayerNorm)
    norm_eps: float = 1e-12
    pad_id: int = 0
    dropout: float = 0.0  # hidden, attention and embedding dropout: cramming fine-tunes with 0.1, pretrains without
    local_attention: int = 0  # > 0: local layers read keys within local_attention // 2 on each side (ModernBERT)
    global_every: int = 1  # with local_attention: layer i is global when i % global_every == 0 (ModernBERT: 3)
    local_rope_theta: float | None = None  # rope theta of the local layers; None: rope_theta
    linear_bias: bool = False  # every linear layer has a bias, zero at init (BERT)
    post_norm: bool = False  # BERT's post-LN blocks, norm(x + f(x)), and no final norm
    position_offset: int = 0  # learned positions: position p reads row p + offset (RoBERTa: pad_token_id + 1)
    token_types: int = 0  # rows of a token-type table added to the embeddings; every token reads row 0 (BERT: 2)
    decoder_bias: bool = False  # a bias over the vocabulary added to the tied decoder's logits
    # BERT's pooler (dense + tanh over the first token), kept from a checkpoint that brought one for
    # fine-tuning (`pooling = "pooler"`) and export; the masked LM never reads it, and pretraining leaves it as it is.
    pooler: bool = False
    # Past ModernBERT's layout (issue 46; docs/recipe.md, "Switches"): an RMSNorm with a learned weight on
    # each head's queries and keys before RoPE (OLMo-2, the GPT-2 speedrun); the attention and
    # feed-forward output projections zero at init (the speedrun).
    qk_norm: bool = False
    zero_init_out: bool = False

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden", "layers", "heads", "intermediate", "max_seq_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)}: must be a positive integer")
        if self.hidden % self.heads:
            raise ValueError(f"model.heads={self.heads}: must divide model.hidden={self.hidden}")
        if self.position not in POSITIONS:
            raise ValueError(f"model.position={self.position!r}: allowed {', '.join(POSITIONS)}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"model.heads={self.heads}: rope needs an even head size, got {self.head_dim}")
        if self.position == "sinusoidal" and self.hidden % 2:
            raise ValueError(f"model.hidden={self.hidden}: sinusoidal positions need an even hidden size")
        if self.glu and self.intermediate % 2:
            raise ValueError(f"model.intermediate={self.intermediate}: a GLU splits it in halves, so it must be even")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"model.pad_id={self.pad_id}: must be a token id below vocab_size={self.vocab_size}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.dropout={self.dropout}: must be in [0, 1)")
        if self.position_scale is not None and self.position_scale < 0:
            raise ValueError(f"model.position_scale={self.position_scale}: must be >= 0")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("model.norm_eps and model.rope_theta: must be positive")
        self._check_layouts()

    def _check_layouts(self) -> None:
        for key in ("local_attention", "position_offset", "token_types"):
            if getattr(self, key) < 0:
                raise ValueError(f"model.{key}={getattr(self, key)}: must be >= 0")
        if self.global_every < 1:
            raise ValueError(f"model.global_every={self.global_every}: must be a positive integer")
        if self.local_rope_theta is not None and self.local_rope_theta <= 0:
            raise ValueError(
                f"model.local_rope_theta={self.local_rope_theta}: must be positive, or None for rope_theta"
            )
        if self.position_offset and self.position != "learned":
            raise ValueError(f"model.position_offset={self.position_offset}: only learned positions have an offset")
        if self.post_norm and not self.first_attn_norm:
            raise ValueError("model.first_attn_norm=false: post_norm normalises after every block, so it must be true")

    @classmethod
    def from_json(cls, path: Path) -> ModelConfig:
        """The ModelConfig of a `model.json` (what pretrain writes: the fields as a JSON object).

        A field the file leaves out takes its default, so files written before the field existed still
        load; a `RETIRED` field loads at the value that builds the model without it, files written while it
        existed. A key that is no field is refused: the file describes a model this code cannot build, and
        dropping the key would build a different one. ModelConfigError names the file, and the key.
        """
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelConfigError(f"{path}: not a readable model config ({e})") from None
        if not isinstance(data, dict):
            raise ModelConfigError(f"{path}: not a readable model config (a JSON object of fields expected)")
        retired = misvalued_retired(data, RETIRED)
        if retired is not None:
            raise ModelConfigError(
                f"{path}: not a readable model config ({retired}={json.dumps(data[retired])}: a switch this "
                f"version no longer builds; only {retired}={json.dumps(RETIRED[retired])} loads)"
            )
        data = {key: value for key, value in data.items() if key not in RETIRED}
        names = {f.name for f in fields(cls)}
        unknown = [key for key in data if key not in names]
        if unknown:
            raise ModelConfigError(f"{path}: not a readable model config (unknown key {unknown[0]!r})")
        hints = typing.get_type_hints(cls)
        wrong = next((key for key, value in data.items() if not _is_of(value, hints[key])), None)
        if wrong is not None:
            raise ModelConfigError(
                f"{path}: not a readable model config ({wrong}={json.dumps(data[wrong])}; expected "
                f"{_describe(hints[wrong])})"
            )
        try:
            return cls(**data)
        except (TypeError, ValueError) as e:
            raise ModelConfigError(f"{path}: not a readable model config ({e})") from None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends within the local window rather than to the whole sequence."""
        return self.local_attention > 0 and layer % self.global_every != 0

    @property
    def ffn_inner(self) -> int:
        """Width of the feed-forward activation: what the down-projection reads."""
        return self.intermediate // 2 if self.glu else self.intermediate


def _is_of(value: object, hint: object) -> bool:
    """Whether a JSON value has the type of a ModelConfig field: int, float (an int too), bool, a Literal
    of strings, or one of those or None."""
    if typing.get_origin(hint) is typing.Literal:
        return value in typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_is_of(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if isinstance(value, bool):
        return hint is bool
    return isinstance(value, (int, float) if hint is float else hint)


def _describe(hint: object) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    return hint.__name__ if isinstance(hint, type) else str(hint)


# The layout of the presets: ModernBERT's, which learned fastest per token and per second of every
# layout measured at equal budgets (bench/README.md, quality); ModelConfig's defaults stay cramming's.
LAYOUT = dict(position="rope", head_transform=True, first_attn_norm=False)

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=4096, hidden=128, layers=2, heads=2, intermediate=512, **LAYOUT),
    "small": ModelConfig(hidden=256, layers=4, heads=4, intermediate=1024, **LAYOUT),
    "base": ModelConfig(**LAYOUT),
    "crammed-base": ModelConfig(),  # cramming's crammed-BERT as published
}
