"""The encoder as pure functions over a flat `dict[str, Tensor]` of parameters.

Parameter names (stable: checkpoints and exports rely on them). H = hidden, V = vocab_size,
I = intermediate, F = I // 2 with a GLU and I without, S = max_seq_len, T = token_types:

    embed.tokens.weight          [V, H]   also the tied decoder
    embed.types.weight           [T, H]   token_types > 0: a token adds its type's row (token_type_ids; none: 0)
    embed.positions.scale        [1]      position="sinusoidal": learnable scale, starts at position_scale
    embed.positions.weight       [O+S, H] position="learned" (O = position_offset): position p reads row p + O
    embed.norm.weight            [H]      embedding_norm
    layers.{i}.attn_norm.weight  [H]      absent in layer 0 when first_attn_norm is False; post_norm: after the residual
    layers.{i}.attn.qkv.weight   [3H, H]  rows: all query heads, then all keys, then all values
    layers.{i}.attn.qkv.bias     [3H]     linear_bias
    layers.{i}.attn.q_norm.weight [D]     qk_norm (D = H // heads): every head's queries share it
    layers.{i}.attn.k_norm.weight [D]     qk_norm: and its keys
    layers.{i}.attn.out.weight   [H, H]
    layers.{i}.attn.out.bias     [H]      linear_bias
    layers.{i}.ffn_norm.weight   [H]      post_norm: after the residual
    layers.{i}.ffn.up.weight     [I, H]   GLU: first half goes through GELU, second half is the gate
    layers.{i}.ffn.up.bias       [I]      linear_bias
    layers.{i}.ffn.down.weight   [H, F]
    layers.{i}.ffn.down.bias     [H]      linear_bias
    final_norm.weight            [H]      absent with post_norm
    head.dense.weight            [H, H]   head_transform
    head.dense.bias              [H]      head_transform and linear_bias
    head.norm.weight             [H]      head_transform
    head.decoder.bias            [V]      decoder_bias: added to the tied decoder's logits
    pooler.dense.weight          [H, H]   pooler: BERT's pooler, read by fine-tuning alone (`POOLER`)
    pooler.dense.bias            [H]      pooler
    <every norm>.bias            [H]      norm_bias: zero at init (cramming's nn.LayerNorm)

Biases are zero at init, tables and matrices normal(0.02), norm weights one; with `zero_init_out` the
attention and feed-forward output projections are zero (drawn, then zeroed: every other parameter is the
one the same seed gives without it). By default no linear layer has a bias and LayerNorms have one only
with `norm_bias` (ModernBERT: `norm_bias=False`).
RoPE rotates halves (`rotate_half`), as `transformers` does.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from cram.model.config import ATTENTIONS, Attention, ModelConfig

INIT_STD = 0.02  # cramming's and BERT's normal init for every matrix
# The output projections that `zero_init_out` starts at zero: each block adds nothing to the residual at first.
OUTPUTS = (".attn.out.weight", ".ffn.down.weight")
# BERT's pooler: kept from a checkpoint, never trained by the masked LM (pretraining carries it unchanged).
POOLER = ("pooler.dense.weight", "pooler.dense.bias")


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every parameter `init` makes, in its order."""
    H, V = cfg.hidden, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"embed.tokens.weight": (V, H)}

    def norm(name: str) -> None:
        out[name + ".weight"] = (H,)
        if cfg.norm_bias:
            out[name + ".bias"] = (H,)

    def linear(name: str, outputs: int, inputs: int) -> None:
        out[name + ".weight"] = (outputs, inputs)
        if cfg.linear_bias:
            out[name + ".bias"] = (outputs,)

    if cfg.token_types:
        out["embed.types.weight"] = (cfg.token_types, H)
    if cfg.position == "sinusoidal":
        out["embed.positions.scale"] = (1,)
    elif cfg.position == "learned":
        out["embed.positions.weight"] = (cfg.position_offset + cfg.max_seq_len, H)
    if cfg.embedding_norm:
        norm("embed.norm")
    for i in range(cfg.layers):
        p = f"layers.{i}."
        if i > 0 or cfg.first_attn_norm:
            norm(p + "attn_norm")
        linear(p + "attn.qkv", 3 * H, H)
        if cfg.qk_norm:
            out[p + "attn.q_norm.weight"] = out[p + "attn.k_norm.weight"] = (cfg.head_dim,)
        linear(p + "attn.out", H, H)
        norm(p + "ffn_norm")
        linear(p + "ffn.up", cfg.intermediate, H)
        linear(p + "ffn.down", H, cfg.ffn_inner)
    if not cfg.post_norm:
        norm("final_norm")
    if cfg.head_transform:
        linear("head.dense", H, H)
        norm("head.norm")
    if cfg.decoder_bias:
        out["head.decoder.bias"] = (V,)
    if cfg.pooler:
        out[POOLER[0]], out[POOLER[1]] = (H, H), (H,)
    return out


def init(cfg: ModelConfig, seed: int, names: list[str] | None = None) -> dict[str, Tensor]:
    """Fresh fp32 CPU parameters; the same seed always gives the same values. `names`: only these (a
    masked-LM head for a checkpoint without one), drawn in `shapes`' order from the seed."""
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in shapes(cfg).items():
        if names is not None and name not in names:
            continue
        if name == "embed.positions.scale":
            scale = 1.0 / math.sqrt(cfg.hidden) if cfg.position_scale is None else cfg.position_scale
            params[name] = torch.full(shape, scale)
        elif name.endswith(".bias"):
            params[name] = torch.zeros(shape)
        elif len(shape) == 1:  # a norm's weight
            params[name] = torch.ones(shape)
        else:
            params[name] = torch.randn(*shape, generator=gen) * INIT_STD
            if cfg.zero_init_out and name.endswith(OUTPUTS):
                params[name] = torch.zeros(shape)
    return params


def encode(
    params: dict[str, Tensor],
    cfg: ModelConfig,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
    attention: Attention = "auto",
    token_type_ids: Tensor | None = None,
    dropout: float | Tensor | None = None,
    first_only: bool = False,
    residual: torch.dtype | None = None,
    positions: Tensor | None = None,
) -> Tensor:
    """Hidden states [B, S, H] after the last norm. attention_mask: [B, S] bool, True = real token;
    document_ids: [B, S] integers, a query reads only keys of its own document (packed blocks);
    attention: how attention is computed (`attends_with`), never what it computes; token_type_ids:
    [B, S] rows of the token-type table (a pair's second text: 1), read only when the model has one
    (None: row 0 for every token); dropout: the rate (None: `cfg.dropout`), a 0-dim tensor for one
    graph at every rate (see `dropout`); first_only: [B, 1, H], the first token's alone; residual: the
    residual stream's dtype (None: what the ops give, fp32 under autocast; bf16 halves its traffic);
    positions: [B, S] each token's position (None: 0 to S - 1 in every row), so that texts packed into
    one row (`document_ids`) each start at 0 as they would alone."""
    S = input_ids.shape[1]
    rate = cfg.dropout if dropout is None else dropout
    x = _as(_embed(params, cfg, input_ids, token_type_ids, rate, positions), residual)
    rope = local_rope = None
    if cfg.position == "rope":
        rope = local_rope = _at(_rope_tables(S, cfg.head_dim, cfg.rope_theta, x.device), positions)
        theta = cfg.local_rope_theta
        if cfg.local_attention and theta is not None and theta != cfg.rope_theta:
            local_rope = _at(_rope_tables(S, cfg.head_dim, theta, x.device), positions)
    mask, local_mask = _masks(cfg, S, attention_mask, document_ids, x.device)
    full, local = _Attending(mask, rope, attention, rate), _Attending(local_mask, local_rope, attention, rate)
    for i in range(cfg.layers):
        p = f"layers.{i}."
        how = local if cfg.is_local(i) else full
        # A [CLS]-pooled head reads one token: the last layer needs every token's keys and values but
        # only that token's query, attention output and feed-forward (as sparse prediction in the MLM).
        queries = 1 if first_only and i == cfg.layers - 1 else None
        if cfg.post_norm:
            attended = _attention(params, p, cfg, x, how, queries)
            x = _as(_norm(x[:, :queries] + attended, params, p + "attn_norm", cfg), residual)
            x = _as(_norm(x + _feed_forward(params, p, cfg, x, rate), params, p + "ffn_norm", cfg), residual)
        else:
            h = _norm(x, params, p + "attn_norm", cfg) if i > 0 or cfg.first_attn_norm else x
            attended = _attention(params, p, cfg, h, how, queries)
            x = _as(x[:, :queries] + attended, residual)
            x = _as(x + _feed_forward(params, p, cfg, _norm(x, params, p + "ffn_norm", cfg), rate), residual)
    return x if cfg.post_norm else _norm(x, params, "final_norm", cfg)


def _as(x: Tensor, dtype: torch.dtype | None) -> Tensor:
    return x if dtype is None else x.to(dtype)


def _at(tables: tuple[Tensor, Tensor], positions: Tensor | None) -> tuple[Tensor, Tensor]:
    """Rotary tables [S, D] read at `positions`: [B, 1, S, D], broadcast over heads (None: as they are)."""
    if positions is None:
        return tables
    return tables[0][positions][:, None], tables[1][positions][:, None]


def _embed(
    params: dict[str, Tensor],
    cfg: ModelConfig,
    input_ids: Tensor,
    token_type_ids: Tensor | None,
    rate: float | Tensor,
    positions: Tensor | None,
) -> Tensor:
    S = input_ids.shape[1]
    x = F.embedding(input_ids, params["embed.tokens.weight"])
    if cfg.token_types and token_type_ids is None:
        x = x + params["embed.types.weight"][0]
    elif cfg.token_types:
        x = x + F.embedding(token_type_ids, params["embed.types.weight"])
    if cfg.position == "sinusoidal":
        table = _sinusoids(S, cfg.hidden, x.device)
        x = x + params["embed.positions.scale"] * (table if positions is None else table[positions])
    elif cfg.position == "learned":
        rows = params["embed.positions.weight"][cfg.position_offset : cfg.position_offset + S]
        x = x + (rows if positions is None else F.embedding(positions, rows))
    if cfg.embedding_norm:
        x = _norm(x, params, "embed.norm", cfg)
    return dropout(x, rate)


def _masks(
    cfg: ModelConfig, S: int, attention_mask: Tensor | None, document_ids: Tensor | None, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """Boolean masks of the global and the local layers, broadcast over [B, heads, S, S]: True where a
    query may read a key. None when every key may be read."""
    # Key-padding mask broadcast over heads and queries: a padded key is never attended to.
    mask = None if attention_mask is None else attention_mask[:, None, None, :]
    if document_ids is None and not cfg.local_attention:
        return mask, None
    position = torch.arange(S, device=device)
    # A query always reads itself: a padded query may find no readable key in its window or document,
    # and a softmax over nothing is NaN, which reaches real tokens through 0 * NaN in the next layer.
    itself = position[:, None] == position[None, :]
    if document_ids is not None:
        same = (document_ids[:, :, None] == document_ids[:, None, :])[:, None]
        mask = (same if mask is None else same & mask) | itself
    if not cfg.local_attention:
        return mask, None
    band = (position[:, None] - position[None, :]).abs() <= cfg.local_attention // 2
    return mask, band if mask is None else (band & mask) | itself


def mlm_logits(params: dict[str, Tensor], cfg: ModelConfig, hidden: Tensor) -> Tensor:
    """Vocabulary logits [..., V] of hidden states: the optional head transform, then the tied decoder."""
    if cfg.head_transform:
        hidden = _norm(F.gelu(_linear(hidden, params, "head.dense", cfg)), params, "head.norm", cfg)
    return F.linear(hidden, params["embed.tokens.weight"], params["head.decoder.bias"] if cfg.decoder_bias else None)


def mlm_loss(
    params: dict[str, Tensor],
    cfg: ModelConfig,
    batch: dict[str, Tensor],
    attention: Attention = "auto",
    fp32_logits: bool = True,
    residual: torch.dtype | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean cross-entropy over the K masked rows, and their top-1 accuracy.

    Sparse prediction: only the K rows named by `mlm_positions` (flat indices into B*S) reach the
    vocabulary projection, and K is fixed per batch, so every shape is static. Rows labelled -100 (a
    masking schedule below its peak rate) count in neither. Under autocast the logits are copied to fp32
    for the loss; `fp32_logits=False` reads them as they are instead (`cross_entropy_lean`). `residual`:
    the residual stream's dtype (`encode`).
    """
    ids, padding, documents = batch["input_ids"], batch.get("attention_mask"), batch.get("document_ids")
    hidden = encode(params, cfg, ids, padding, documents, attention, residual=residual)
    rows = hidden.flatten(0, 1).index_select(0, batch["mlm_positions"])
    logits = mlm_logits(params, cfg, rows)
    labels = batch["mlm_labels"]
    if not fp32_logits:
        loss = cross_entropy_lean(logits, labels)
    else:
        if logits.dtype in (torch.float16, torch.bfloat16):  # autocast: the softmax wants fp32
            logits = logits.float()
        loss = F.cross_entropy(logits, labels, ignore_index=-100)
    labelled = labels != -100
    accuracy = ((logits.argmax(dim=-1) == labels) & labelled).sum() / labelled.sum()  # a cast never moves the max
    return loss, {"accuracy": accuracy}


def cross_entropy_lean(logits: Tensor, labels: Tensor) -> Tensor:
    """`F.cross_entropy(logits.float(), labels, ignore_index=-100)` without fp32 log-probabilities
    [rows, V]: the log-normaliser is a reduction over the logits upcast as it reads them, and the label's
    logit one gathered entry, so a compiled step need write no fp32 tensor as large as the logits and its
    backward can recompute the softmax from the logits in their own dtype (at 8192 masked rows x 32768, 1 GiB
    of fp32 log-probabilities kept for the backward by `F.cross_entropy`; bench/README.md, "gpu profile",
    measures it). Both terms' gradients meet in fp32, then round once to the logits' dtype, as the default's."""
    labelled = labels != -100
    upcast = logits.float()
    log_normaliser = torch.logsumexp(upcast, dim=-1)
    picked = upcast.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1)
    return ((log_normaliser - picked) * labelled).sum() / labelled.sum()


def _norm(x: Tensor, params: dict[str, Tensor], name: str, cfg: ModelConfig) -> Tensor:
    bias = params[name + ".bias"] if cfg.norm_bias else None
    return F.layer_norm(x, (x.shape[-1],), params[name + ".weight"], bias, cfg.norm_eps)


def _linear(x: Tensor, params: dict[str, Tensor], name: str, cfg: ModelConfig) -> Tensor:
    return F.linear(x, params[name + ".weight"], params[name + ".bias"] if cfg.linear_bias else None)


class _Attending(NamedTuple):
    """What a layer attends with: a global layer's mask and rotary tables, or a local one's (its band)."""

    mask: Tensor | None
    rope: tuple[Tensor, Tensor] | None  # (cos, sin); None without rotary positions
    attention: Attention
    rate: float | Tensor  # dropout


def _attention(
    params: dict[str, Tensor], p: str, cfg: ModelConfig, x: Tensor, how: _Attending, queries: int | None = None
) -> Tensor:
    """Self-attention's output [B, S, H]; with `queries`, the output [B, queries, H] of the first `queries`
    tokens alone (reading every key)."""
    mask, rope, attention, rate = how
    B, S, H = x.shape
    if queries is None:
        qkv = _linear(x, params, p + "attn.qkv", cfg).view(B, S, 3, cfg.heads, cfg.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, S, head_dim]
    else:
        q, k, v = _first_queries(params, p, cfg, x, queries)
        if mask is not None and mask.shape[-2] == S:  # a mask per query (documents, a local band)
            mask = mask[..., :queries, :]
    if cfg.qk_norm:
        q, k = _head_norm(q, params, p + "attn.q_norm", cfg), _head_norm(k, params, p + "attn.k_norm", cfg)
    if rope is not None:
        cos, sin = rope
        q, k = _rotate(q, cos[..., : q.shape[2], :], sin[..., : q.shape[2], :]), _rotate(k, cos, sin)
    out = _attend(q, k, v, mask, rate, attention)
    return dropout(_linear(out.transpose(1, 2).reshape(B, -1, H), params, p + "attn.out", cfg), rate)


def _head_norm(x: Tensor, params: dict[str, Tensor], name: str, cfg: ModelConfig) -> Tensor:
    """RMSNorm over each head's vector [..., head_dim] (qk_norm); in the input's dtype under autocast."""
    return F.rms_norm(x, (x.shape[-1],), params[name + ".weight"], cfg.norm_eps).to(x.dtype)


def _first_queries(
    params: dict[str, Tensor], p: str, cfg: ModelConfig, x: Tensor, queries: int
) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, heads, queries, head_dim] of the first `queries` tokens, k and v of every token: the qkv
    projection's query rows only where they are read."""
    B, S, H = x.shape
    weight = params[p + "attn.qkv.weight"]
    bias = params[p + "attn.qkv.bias"] if cfg.linear_bias else None
    q = F.linear(x[:, :queries], weight[:H], None if bias is None else bias[:H])
    kv = F.linear(x, weight[H:], None if bias is None else bias[H:]).view(B, S, 2, cfg.heads, cfg.head_dim)
    k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)
    return q.view(B, queries, cfg.heads, cfg.head_dim).transpose(1, 2), k, v


def attends_with(attention: Attention, device: torch.device, grad: bool = True) -> str:
    """What `attention` means on `device`: "sdpa" (`F.scaled_dot_product_attention`) or "written" (the
    product written out); "auto" is SDPA on a GPU, and on a CPU the written-out product where a gradient is
    taken (`grad`) and SDPA where none is (embedding, prediction, held-out scores)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r}: allowed {', '.join(ATTENTIONS)}")
    if attention == "auto":
        return "written" if device.type == "cpu" and grad else "sdpa"
    return attention


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, rate: float | Tensor, attention: Attention) -> Tensor:
    """softmax(q k^T / sqrt(d)) v over [B, heads, S, head_dim]; `mask` (broadcast to [B, heads, S, S], as
    [B, 1, 1, S] for padding alone) is True where a key may be read. SDPA takes its dropout rate as a
    number: a rate given as a tensor attends with the written-out product, and so does a rate under a CPU's
    autocast, where SDPA's dropout fails in torch.func's backward (torch 2.13: "expected scalar type Float
    but found BFloat16"; tests/test_attention.py)."""
    if attends_with(attention, q.device, torch.is_grad_enabled()) == "sdpa" and not isinstance(rate, Tensor):
        if not (rate and q.device.type == "cpu" and torch.is_autocast_enabled("cpu")):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=rate)
    # On a CPU the written-out product is faster than SDPA's flash kernel, which tiles for long
    # sequences, where a gradient is taken: forward + backward at seq 128 profiled 3x faster compiled in
    # bf16 (the flash backward is slow in bf16), 1.3x in fp32, and faster eager too; the forward alone is
    # SDPA's (bench/README.md "attention where no gradient is taken"). On a GPU it is the fallback for an
    # SDPA kernel that fails under torch.func's gradients. Under autocast the scores stay in bf16: the
    # softmax kernels accumulate a bf16 input in fp32 (the probabilities equal a fp32 softmax's rounded to
    # bf16), and an fp32 copy of the [B, heads, S, S] scores and its casts cost an eager MiniLM step at 256
    # tokens a quarter of its time (bench/README.md "attention scores in bf16").
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))
    if mask is not None:
        scores = torch.where(mask, scores, float("-inf"))
    return torch.matmul(dropout(scores.softmax(dim=-1), rate), v)


def _feed_forward(params: dict[str, Tensor], p: str, cfg: ModelConfig, x: Tensor, rate: float | Tensor) -> Tensor:
    h = _linear(x, params, p + "ffn.up", cfg)
    if cfg.glu:
        h, gate = h.chunk(2, dim=-1)
        h = F.gelu(h) * gate
    else:
        h = F.gelu(h)
    return dropout(_linear(h, params, p + "ffn.down", cfg), rate)


def dropout(x: Tensor, rate: float | Tensor) -> Tensor:
    """cramming's fine-tuning dropout (embeddings, attention, outputs of attention and feed-forward).

    A number is the rate of `F.dropout`, or of `_cpu_dropout` eager on a CPU (none at 0). A 0-dim tensor is
    drawn from its own uniform mask, so one compiled graph serves every rate, 0 included (a compile canary
    against eager)."""
    if not isinstance(rate, Tensor):
        if not rate:
            return x
        return F.dropout(x, rate) if x.device.type != "cpu" or torch.compiler.is_compiling() else _cpu_dropout(x, rate)
    keep = torch.rand(x.shape, device=x.device) >= rate
    return x * keep.to(x.dtype) / (1 - rate).to(x.dtype)


def _cpu_dropout(x: Tensor, rate: float) -> Tensor:
    """Dropout with the kept positions read 16 random bits at a time from the generator's 64-bit words: the rate
    rounded to 1/65536, the kept scaled by 1 / (1 - that rate). F.dropout's bernoulli draws a 32-bit word an
    element, one after another where ATen does not hand it to MKL (an AMD EPYC here): the attention's dropout
    of an eager MiniLM step at 233 tokens took a quarter of it, and this draws it in half the time (bench/README.md
    "dropout on a CPU")."""
    n = x.numel()
    words = torch.empty(-(-n // 4), dtype=torch.int64).random_(-(2**63), None)  # every bit uniform
    bits = words.view(torch.int16)[:n].view(x.shape)
    threshold = min(round(rate * 65536) - 32768, 32767)  # P(bits < threshold): the rounded rate
    return torch.where(bits >= threshold, x * (65536 / (32768 - threshold)), 0)


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
