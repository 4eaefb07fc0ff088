"""The encoder as pure functions over a flat `dict[str, Tensor]` of parameters.

Parameter names (stable: checkpoints and exports rely on them). H = hidden, V = vocab_size,
I = intermediate, F = I // 2 with a GLU and I without:

    embed.tokens.weight          [V, H]   also the tied decoder
    embed.positions.scale        [1]      position="sinusoidal": learnable scale, starts at position_scale
    embed.positions.weight       [S, H]   position="learned" (S = max_seq_len)
    embed.norm.weight            [H]      embedding_norm
    layers.{i}.attn_norm.weight  [H]      absent in layer 0 when first_attn_norm is False
    layers.{i}.attn.qkv.weight   [3H, H]  rows: all query heads, then all keys, then all values
    layers.{i}.attn.out.weight   [H, H]
    layers.{i}.ffn_norm.weight   [H]
    layers.{i}.ffn.up.weight     [I, H]   GLU: first half is GELU-activated, second half is the gate
    layers.{i}.ffn.down.weight   [H, F]
    final_norm.weight            [H]
    head.dense.weight            [H, H]   head_transform
    head.norm.weight             [H]      head_transform
    <every norm>.bias            [H]      norm_bias: zero at init (cramming's nn.LayerNorm)

No linear layer has a bias; LayerNorms have one only with `norm_bias` (ModernBERT: `norm_bias=False`).
RoPE rotates halves (`rotate_half`), as `transformers` does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from cram.model.config import ModelConfig

INIT_STD = 0.02  # cramming's and BERT's normal init for every matrix


def init(cfg: ModelConfig, seed: int) -> dict[str, Tensor]:
    """Fresh fp32 CPU parameters; the same seed always gives the same values."""
    gen = torch.Generator().manual_seed(seed)
    H = cfg.hidden

    def normal(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen) * INIT_STD

    params = {"embed.tokens.weight": normal(cfg.vocab_size, H)}

    def norm(name: str) -> None:
        params[name + ".weight"] = torch.ones(H)
        if cfg.norm_bias:
            params[name + ".bias"] = torch.zeros(H)

    if cfg.position == "sinusoidal":
        scale = 1.0 / math.sqrt(H) if cfg.position_scale is None else cfg.position_scale
        params["embed.positions.scale"] = torch.full((1,), scale)
    elif cfg.position == "learned":
        params["embed.positions.weight"] = normal(cfg.max_seq_len, H)
    if cfg.embedding_norm:
        norm("embed.norm")
    for i in range(cfg.layers):
        p = f"layers.{i}."
        if i > 0 or cfg.first_attn_norm:
            norm(p + "attn_norm")
        params[p + "attn.qkv.weight"] = normal(3 * H, H)
        params[p + "attn.out.weight"] = normal(H, H)
        norm(p + "ffn_norm")
        params[p + "ffn.up.weight"] = normal(cfg.intermediate, H)
        params[p + "ffn.down.weight"] = normal(H, cfg.ffn_inner)
    norm("final_norm")
    if cfg.head_transform:
        params["head.dense.weight"] = normal(H, H)
        norm("head.norm")
    return params


def encode(
    params: dict[str, Tensor], cfg: ModelConfig, input_ids: Tensor, attention_mask: Tensor | None = None
) -> Tensor:
    """Hidden states [B, S, H] after the final norm. attention_mask: [B, S] bool, True = real token."""
    S = input_ids.shape[1]
    x = F.embedding(input_ids, params["embed.tokens.weight"])
    if cfg.position == "sinusoidal":
        x = x + params["embed.positions.scale"] * _sinusoids(S, cfg.hidden, x.device)
    elif cfg.position == "learned":
        x = x + params["embed.positions.weight"][:S]
    rope = _rope_tables(S, cfg.head_dim, cfg.rope_theta, x.device) if cfg.position == "rope" else None
    if cfg.embedding_norm:
        x = _norm(x, params, "embed.norm", cfg)
    x = _dropout(x, cfg)
    # Key-padding mask broadcast over heads and queries: a padded key is never attended to.
    mask = None if attention_mask is None else attention_mask[:, None, None, :]
    for i in range(cfg.layers):
        p = f"layers.{i}."
        h = _norm(x, params, p + "attn_norm", cfg) if i > 0 or cfg.first_attn_norm else x
        x = x + _attention(params, p, cfg, h, mask, rope)
        x = x + _feed_forward(params, p, cfg, _norm(x, params, p + "ffn_norm", cfg))
    return _norm(x, params, "final_norm", cfg)


def mlm_logits(params: dict[str, Tensor], cfg: ModelConfig, hidden: Tensor) -> Tensor:
    """Vocabulary logits [..., V] of hidden states: the optional head transform, then the tied decoder."""
    if cfg.head_transform:
        hidden = _norm(F.gelu(F.linear(hidden, params["head.dense.weight"])), params, "head.norm", cfg)
    return F.linear(hidden, params["embed.tokens.weight"])


def mlm_loss(params: dict[str, Tensor], cfg: ModelConfig, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean cross-entropy over the K masked rows, and their top-1 accuracy.

    Sparse prediction: only the K rows named by `mlm_positions` (flat indices into B*S) reach the
    vocabulary projection, and K is fixed per batch, so every shape is static. Rows labelled -100 (a
    masking schedule below its peak rate) count in neither.
    """
    hidden = encode(params, cfg, batch["input_ids"], batch.get("attention_mask"))
    rows = hidden.flatten(0, 1).index_select(0, batch["mlm_positions"])
    logits = mlm_logits(params, cfg, rows)
    if logits.dtype in (torch.float16, torch.bfloat16):  # autocast: the softmax wants fp32
        logits = logits.float()
    labels = batch["mlm_labels"]
    loss = F.cross_entropy(logits, labels, ignore_index=-100)
    labelled = labels != -100
    accuracy = ((logits.argmax(dim=-1) == labels) & labelled).sum() / labelled.sum()
    return loss, {"accuracy": accuracy}


def _norm(x: Tensor, params: dict[str, Tensor], name: str, cfg: ModelConfig) -> Tensor:
    bias = params[name + ".bias"] if cfg.norm_bias else None
    return F.layer_norm(x, (x.shape[-1],), params[name + ".weight"], bias, cfg.norm_eps)


def _attention(
    params: dict[str, Tensor],
    p: str,
    cfg: ModelConfig,
    x: Tensor,
    mask: Tensor | None,
    rope: tuple[Tensor, Tensor] | None,
) -> Tensor:
    B, S, H = x.shape
    qkv = F.linear(x, params[p + "attn.qkv.weight"]).view(B, S, 3, cfg.heads, cfg.head_dim)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, S, head_dim]
    if rope is not None:
        q, k = _rotate(q, *rope), _rotate(k, *rope)
    out = _attend(q, k, v, mask, cfg.dropout)
    return _dropout(F.linear(out.transpose(1, 2).reshape(B, S, H), params[p + "attn.out.weight"]), cfg)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float) -> Tensor:
    """softmax(q k^T / sqrt(d)) v over [B, heads, S, head_dim]; `mask` [B, 1, 1, S] is True where a key may be read."""
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
    # On a CPU the written-out product is faster than SDPA's flash kernel, which tiles for long
    # sequences: forward + backward at seq 128 profiled 3x faster compiled in bf16 (the flash
    # backward is slow in bf16), 1.3x in fp32, and faster eager too. Under autocast the softmax runs in fp32.
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = F.dropout(scores.softmax(dim=-1), dropout) if dropout else scores.softmax(dim=-1)
    return torch.matmul(probs.to(v.dtype), v)


def _feed_forward(params: dict[str, Tensor], p: str, cfg: ModelConfig, x: Tensor) -> Tensor:
    h = F.linear(x, params[p + "ffn.up.weight"])
    if cfg.glu:
        h, gate = h.chunk(2, dim=-1)
        h = F.gelu(h) * gate
    else:
        h = F.gelu(h)
    return _dropout(F.linear(h, params[p + "ffn.down.weight"]), cfg)


def _dropout(x: Tensor, cfg: ModelConfig) -> Tensor:
    """cramming's fine-tuning dropout (embeddings, attention output, feed-forward output); none when 0."""
    return F.dropout(x, cfg.dropout) if cfg.dropout else x


def _sinusoids(length: int, dim: int, device: torch.device) -> Tensor:
    """Interleaved sin/cos table [length, dim] of "Attention is all you need" (cramming's layout)."""
    position = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    angle = position * freq
    return torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(1)


# An opaque op: inlined into its consumers, the tables' cos and sin were recomputed for every
# element of q and k, forward and backward (profiled: 6% of the fp32 CPU step, compiled).
@torch.library.custom_op("cram::rope_tables", mutates_args=())
def _rope_tables(length: int, head_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angle = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv_freq
    angle = torch.cat((angle, angle), dim=-1)
    return angle.cos(), angle.sin()


@_rope_tables.register_fake
def _(length: int, head_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    return torch.empty(length, head_dim, device=device), torch.empty(length, head_dim, device=device)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)
