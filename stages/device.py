"""Where the torch stages run and in which precision: one answer for pretrain and evaluate."""

from __future__ import annotations

from typing import Any

from stages import StageError


def resolve(name: str) -> Any:
    """`run.device` as a `torch.device`: "auto" is CUDA when there is one, else the CPU."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise StageError(f"run.device: {name!r} but CUDA is not available here; use 'cpu' or 'auto'")
    if name == "cuda":  # under torchrun the runner has set this rank's device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def autocast_dtype(precision: str, device: Any) -> Any:
    """bf16 autocast (fp32 master weights) for "bf16", and for "auto" on CUDA; None means fp32.

    On CUDA, the fp32 matmuls that remain use TF32, as cramming does."""
    import torch

    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None
