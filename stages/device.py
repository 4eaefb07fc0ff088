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
    """bf16 autocast (fp32 master weights) for "bf16", and for "auto" on CUDA and on CPUs with native
    bf16 instructions; None means fp32.

    On such a CPU bf16 autocast trained the tiny model 1.6-1.8x faster at the same held-out loss per
    token (bench/README.md, quality). On CUDA, the fp32 matmuls that remain use TF32, as cramming does."""
    import torch

    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    native = device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())
    if precision == "bf16" or (precision == "auto" and native):
        return torch.bfloat16
    return None


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slow."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:  # not Linux: no way to tell, so no autocast
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))
