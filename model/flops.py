"""FLOPs per token and peak FLOP/s, for model FLOP utilisation (MFU).

Convention (PaLM appendix B, torchtitan): a training token costs 6 FLOPs per non-embedding
parameter (forward 2, backward 4) plus 12·layers·hidden·seq for attention scores and values.
The tied decoder is not in that count: with sparse prediction only the masked fraction of the
tokens reaches it (and the head transform), so it adds 6·(hidden·vocab + head)·masked_fraction.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from cram.model import muon
from cram.model.config import ModelConfig
from cram.model.memory import parameters
from cram.model.optimizers import OptimizerConfig

# Dense bf16 tensor-core peaks from the vendors' data sheets, matched as substrings of
# torch.cuda.get_device_name(); first match wins, so the more specific names come first.
GPU_PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835e12),  # the PCIe card: lower clocks and power than the SXM module
    ("H200", 989e12),  # SXM
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("A6000", 154.85e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
)


def num_params(params: dict[str, Tensor]) -> int:
    return sum(p.numel() for p in params.values())


def flops_per_token(cfg: ModelConfig, masked_fraction: float, encoder_trained: bool = True) -> float:
    """Training FLOPs per token; `encoder_trained=False`: the head alone trains on a frozen encoder (a head
    warm-up), which runs the encoder forward only and the tied decoder's backward to its input alone."""
    counted = parameters(cfg)
    H, L, S = cfg.hidden, cfg.layers, cfg.max_seq_len
    decoder = H * cfg.vocab_size
    if not encoder_trained:
        return 2 * counted.encoder + 4 * L * H * S + (4 * decoder + 6 * counted.head) * masked_fraction
    return 6 * counted.encoder + 12 * L * H * S + 6 * (decoder + counted.head) * masked_fraction


def optimizer_flops(cfg: ModelConfig, opt_cfg: OptimizerConfig) -> float:
    """Matmul FLOPs of one optimizer step: Muon's Newton-Schulz over the hidden matrices; none for AdamW's
    kinds (their elementwise work is no matmul, as no norm or softmax is counted in the model's FLOPs)."""
    if not opt_cfg.orthogonalises_hidden:
        return 0.0
    from cram.model.bert import shapes

    sizes = shapes(cfg)
    total = 0
    for name, (rows, cols) in ((n, s) for n, s in sizes.items() if muon.takes(n)):
        blocks = muon.stacked(name, sizes)
        total += muon.orthogonalise_flops(blocks, rows // blocks, cols)
    return float(total)


@dataclass(frozen=True)
class Gemm:
    """`count` matrix products [batch, m, k] @ [batch, k, n] of a training step, named by what they compute."""

    name: str
    m: int
    k: int
    n: int
    batch: int = 1
    count: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.count * self.batch * self.m * self.k * self.n

    def gradients(self) -> tuple[Gemm, Gemm]:
        """The backward's two products: of the left operand, dC B^T ([m, n] @ [n, k]), and of the right,
        A^T dC ([k, m] @ [m, n])."""
        left = dataclasses.replace(self, name=f"{self.name} grad left", k=self.n, n=self.k)
        right = dataclasses.replace(self, name=f"{self.name} grad right", m=self.k, k=self.m)
        return left, right


def step_gemms(cfg: ModelConfig, batch: int, masked_per_seq: int) -> list[Gemm]:
    """Every matrix product of a training step of `batch` sequences of `cfg.max_seq_len` tokens with sparse
    prediction over `masked_per_seq` rows each, forward and backward. Their FLOPs are `flops_per_token`'s
    count less the norms' and biases' (6 per parameter of them)."""
    S, H, L, heads = cfg.max_seq_len, cfg.hidden, cfg.layers, cfg.heads
    T, M = batch * S, batch * masked_per_seq
    forward = [
        Gemm("qkv", T, H, 3 * H, count=L),
        Gemm("attention scores", S, cfg.head_dim, S, batch=batch * heads, count=L),
        Gemm("attention values", S, S, cfg.head_dim, batch=batch * heads, count=L),
        Gemm("attention out", T, H, H, count=L),
        Gemm("ffn up", T, H, cfg.intermediate, count=L),
        Gemm("ffn down", T, cfg.ffn_inner, H, count=L),
        *([Gemm("head dense", M, H, H)] if cfg.head_transform else []),
        Gemm("decoder", M, H, cfg.vocab_size),
    ]
    return [each for g in forward for each in (g, *g.gradients())]


def peak_flops(device: str | torch.device, dtype: torch.dtype | None = None) -> float:
    """Peak FLOP/s: the bf16 data-sheet figure of a known GPU, else a matmul measured now.

    On CPU the matmul is measured in `dtype` (the precision the step's matmuls run in; fp32 when None)
    on the threads torch uses: bf16 runs ~2.7x fp32 on a CPU with AVX512-BF16.
    """
    device = torch.device(device)
    if device.type == "cuda":
        peak = data_sheet_peak(torch.cuda.get_device_name(device))
        return peak if peak is not None else measure_matmul_flops(device, torch.bfloat16, size=8192)
    return measure_matmul_flops(device, dtype or torch.float32)


def data_sheet_peak(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU named `device_name` (`torch.cuda.get_device_name`); None if unknown."""
    return next((peak for key, peak in GPU_PEAK_BF16 if key in device_name), None)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 1024, repeats: int = 10) -> float:
    """Best FLOP/s of a square matmul, the usual stand-in for a device's attainable peak."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up kernels and allocator
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
