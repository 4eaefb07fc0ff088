"""How much device memory a training step needs, estimated from the config alone (no torch), so that
a model or microbatch that cannot fit is refused before any stage runs rather than after hours.

The estimate is rough on purpose, a bound for refusing absurd settings, not a planner. In bytes, with
P parameters, N = microbatch x seq_len tokens, `a` bytes per activation (4 in fp32, 2 under bf16 autocast):

- parameters, AdamW's two moments and the gradients, all fp32: 16 P;
- the larger of
  - one microbatch's activations kept for the backward pass, per layer: a·N·(11·hidden + 2·intermediate)
    (the residual stream, the norms' outputs, q, k, v and rotated q and k, the attention output, the
    feed-forward's up-projection and its activated product) plus the attention probabilities,
    4·microbatch·heads·seq_len² (fp32; flash attention on CUDA keeps none, so there it is a margin);
    plus the embeddings' 3·a·N·hidden and the masked rows' logits, 12·rows·vocab (fp32: the logits, their
    log-softmax and its gradient); under autocast also the bf16 copies of the weights, 2 P;
  - the optimizer update's new parameters and moments, written beside the old ones: 12 P.

Against the measured peak of an eager step on the tiny preset (`tests/test_memory.py`, fp32 and bf16,
1 to 4 layers) it is 0.63 to 0.73 of it: `torch.func`'s eager backward keeps some tensors twice, which the
formula does not count, and a compiled step keeps fewer. Low rather than high, so that a refusal is sure.
"""

from __future__ import annotations

from dataclasses import dataclass

from cram.model.config import ModelConfig

STATE_BYTES_PER_PARAM = 16  # fp32 params, AdamW's exp_avg and exp_avg_sq, gradients
UPDATE_BYTES_PER_PARAM = 12  # the update's new params and moments, beside the old ones
LOGIT_BYTES = 12  # per masked row and vocabulary entry: fp32 logits, log-softmax, gradient


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a training step needs at its peak, by part."""

    state: int  # parameters, optimizer moments and gradients
    activations: int  # one microbatch's, kept for the backward pass
    update: int  # the optimizer update's new parameters and moments

    @property
    def total(self) -> int:
        """The state, and then either the activations (forward and backward) or the update's copies."""
        return self.state + max(self.activations, self.update)


@dataclass(frozen=True)
class Parameters:
    """How many parameters `model.init(cfg)` makes (`model/bert.py` lists them), by part: the token
    embeddings (and the token-type table), the positions, the encoder (its layers and norms) and the head
    (the transform before the tied decoder, and the decoder's bias), and a checkpoint's pooler, which the
    masked LM never reads (no FLOPs)."""

    embedding: int
    positions: int
    encoder: int
    head: int
    pooler: int = 0

    @property
    def total(self) -> int:
        return self.embedding + self.positions + self.encoder + self.head + self.pooler


def parameters(cfg: ModelConfig) -> Parameters:
    H, norm = cfg.hidden, cfg.hidden * (2 if cfg.norm_bias else 1)
    bias = 1 if cfg.linear_bias else 0
    per_layer = 3 * H * H + H * H + cfg.intermediate * H + H * cfg.ffn_inner + 2 * norm  # qkv, out, up, down, norms
    per_layer += bias * (3 * H + H + cfg.intermediate + H)
    per_layer += 2 * cfg.head_dim if cfg.qk_norm else 0
    encoder = cfg.layers * per_layer + (0 if cfg.post_norm else norm)  # and the final norm
    encoder -= 0 if cfg.first_attn_norm else norm
    encoder += norm if cfg.embedding_norm else 0
    head = (H * H + bias * H + norm if cfg.head_transform else 0) + (cfg.vocab_size if cfg.decoder_bias else 0)
    return Parameters(
        embedding=(cfg.vocab_size + cfg.token_types) * H,
        positions={"sinusoidal": 1, "learned": (cfg.position_offset + cfg.max_seq_len) * H}.get(cfg.position, 0),
        encoder=encoder,
        head=head,
        pooler=H * H + H if cfg.pooler else 0,
    )


def parameter_count(cfg: ModelConfig) -> int:
    """The number of parameters `model.init(cfg)` makes."""
    return parameters(cfg).total


def training_memory(cfg: ModelConfig, microbatch: int, masked_rows: int, autocast: bool) -> MemoryEstimate:
    """The peak bytes of one training step of `cfg` on `microbatch` sequences of `cfg.max_seq_len`
    tokens, `masked_rows` of which (in all) reach the vocabulary; `autocast`: bf16 activations."""
    params = parameter_count(cfg)
    act = 2 if autocast else 4
    tokens, H, S = microbatch * cfg.max_seq_len, cfg.hidden, cfg.max_seq_len
    per_layer = act * tokens * (11 * H + 2 * cfg.intermediate) + 4 * microbatch * cfg.heads * S * S
    activations = cfg.layers * per_layer + 3 * act * tokens * H + LOGIT_BYTES * masked_rows * cfg.vocab_size
    activations += 2 * params if autocast else 0
    return MemoryEstimate(STATE_BYTES_PER_PARAM * params, activations, UPDATE_BYTES_PER_PARAM * params)
