"""Muon (Keller Jordan 2024; `torch.optim.Muon`) for the encoder's hidden matrices, as a pure function.

The step of one matrix W with gradient G and momentum buffer B (`exp_avg.<name>`, the AdamW state's
layout):

    B <- lerp(B, G, 1 - 0.95)                     momentum 0.95
    U <- lerp(G, B, 0.95)                          Nesterov
    O <- NS5(U)                                    5 Newton-Schulz iterations, coefficients (3.4445, -4.7750, 2.0315)
    W <- W * (1 - lr * weight_decay) - lr * 0.2 * sqrt(max(rows, cols)) * O

The lr rule is Moonlight's (Liu et al. 2025, "Muon is Scalable for LLM Training"; `torch.optim.Muon`'s
`adjust_lr_fn="match_rms_adamw"`): O has singular values near 1, so its entries' RMS is about
1 / sqrt(max(rows, cols)); scaled by 0.2 sqrt(max(rows, cols)) it matches the RMS of an AdamW update
(0.2 to 0.4, measured by Moonlight), so Muon shares AdamW's lr, schedule and weight decay: one
`optimizer.lr` drives both halves of the model.

Muon takes the hidden matrices: every layer's attention qkv and output projections and feed-forward
up and down projections. Embeddings, norms, the head transform and the tied decoder stay on AdamW
(their rows are looked up or read per token, not a map between hidden spaces). A fused weight is
orthogonalised as the matrices it stacks, each on its own: the qkv projection as its query, key and
value matrices (the speedrun's [3, H, H]), a GLU up-projection as its two halves. Newton-Schulz runs in
fp32 by default (compiled and eager agree to rounding); the reference runs it in bf16, which
`Compilation.bf16_newton_schulz` does on CUDA (tensor cores), to be measured there against fp32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

MOMENTUM = 0.95
NS_STEPS = 5
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
RMS_MATCH = 0.2  # Moonlight: Muon's update at AdamW's RMS
HIDDEN = (".attn.qkv.weight", ".attn.out.weight", ".ffn.up.weight", ".ffn.down.weight")


def takes(name: str) -> bool:
    """Whether Muon updates the parameter `name` (`model/bert.py`'s names): a layer's hidden matrix."""
    return name.startswith("layers.") and name.endswith(HIDDEN)


def stacked(name: str, shapes: Mapping[str, Sequence[int]]) -> int:
    """How many matrices the weight `name` stacks along its rows, from the params' `shapes`: 3 for qkv,
    2 for a GLU's up-projection (twice the rows its down-projection reads), 1 otherwise."""
    if name.endswith(".attn.qkv.weight"):
        return 3
    if name.endswith(".ffn.up.weight"):
        return shapes[name][0] // shapes[name.replace(".ffn.up.", ".ffn.down.")][1]
    return 1


def orthogonalise_flops(blocks: int, rows: int, cols: int) -> int:
    """Matmul FLOPs of `orthogonalise` over `blocks` matrices [rows, cols]: per iteration, with m the shorter
    side and n the longer, the Gram matrix (2 m m n), its square (2 m^3) and the product with x (2 m m n)."""
    m, n = min(rows, cols), max(rows, cols)
    return blocks * NS_STEPS * (4 * m * m * n + 2 * m**3)


def orthogonalise(update: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """NS5 of each matrix of `update` [..., rows, cols]: its singular values moved near 1 (into about
    [0.7, 1.2]; the quintic trades exactness for speed), its singular vectors kept. The iterations run in
    `dtype` (None: the update's), the result comes back in the update's."""
    a, b, c = NS_COEFFICIENTS
    wide = update.shape[-2] <= update.shape[-1]
    x = update if wide else update.mT  # the Gram matrix of the shorter side is the cheaper one
    x = x / torch.linalg.matrix_norm(x, keepdim=True).clamp(min=NS_EPS)  # spectral norm <= Frobenius norm = 1
    x = x.to(dtype or update.dtype).reshape(-1, *x.shape[-2:])
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        # b gram + c gram^2, then a x + that @ x: each a product with its sum in one op (addmm's form, as
        # the reference), which in bf16 rounds half as often as the products and sums apart
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x.to(update.dtype).view(*update.shape[:-2], *x.shape[-2:])
    return x if wide else x.mT


def muon_param(
    weight: Tensor, grad: Tensor, momentum: Tensor, blocks: int, lr: Tensor, weight_decay: float, bf16: bool = False
) -> tuple[Tensor, Tensor]:
    """(new weight, new momentum) of one hidden matrix that stacks `blocks` matrices along its rows;
    `bf16`: Newton-Schulz in bf16 where the weight is on CUDA (tensor cores), fp32 elsewhere."""
    momentum = torch.lerp(momentum, grad, 1 - MOMENTUM)
    nesterov = torch.lerp(grad, momentum, MOMENTUM)
    rows, cols = weight.shape[0] // blocks, weight.shape[1]
    dtype = torch.bfloat16 if bf16 and weight.is_cuda else None
    update = orthogonalise(nesterov.view(blocks, rows, cols), dtype).reshape_as(weight)
    scale = RMS_MATCH * math.sqrt(max(rows, cols))
    return weight * (1 - lr * weight_decay) - (lr * scale) * update, momentum
