"""Where the torch stages run and in which precision: one answer for pretrain and evaluate."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from cram.stages import StageError

if TYPE_CHECKING:
    import torch


def resolve(name: str) -> torch.device:
    """`run.device` as a `torch.device`: "auto" is CUDA when there is one, else the CPU. Under torchrun,
    "cuda" is this rank's GPU, `cuda:LOCAL_RANK`, read from the environment rather than from the current
    device: planning resolves it before the runner has called `set_device`."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise StageError(f"run.device: {name!r} but CUDA is not available here; use 'cpu' or 'auto'")
    if name == "cuda":
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def check(name: str) -> None:
    """Raise StageError when `run.device` names CUDA and there is none, or a CUDA device index this
    machine lacks; torch is imported only then, so that validating a config that asks for no GPU stays cheap."""
    if name.startswith("cuda"):
        device = resolve(name)
        import torch

        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise StageError(
                f"run.device: {name!r} but this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}"
            )


# Backends every torch this project admits registers; another name is looked up in dynamo's registry,
# whose import costs seconds.
BUILT_IN_BACKENDS = frozenset({"inductor", "aot_eager", "eager", "cudagraphs"})


def check_backend(backend: str, key: str) -> None:
    """Raise StageError when `backend` is no `torch.compile` backend (those of
    `torch._dynamo.list_backends`, debugging ones such as "aot_eager" included); nothing is compiled."""
    if backend in BUILT_IN_BACKENDS:
        return
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise StageError(f"{key}: {backend!r} is not a torch.compile backend; choose one of {', '.join(known)}")


def memory_bytes(device: torch.device) -> int:
    """The total memory of `device` (a `torch.device`): the GPU's on CUDA, the machine's RAM otherwise."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast (fp32 master weights) for "bf16", and for "auto" on CUDA and on CPUs with native
    bf16 arithmetic (AVX512-BF16 or AMX); None means fp32.

    On such a CPU the tiny step trained 1.85x the tokens/s of fp32 with no significant loss per token
    (bench/README.md, precision); elsewhere bf16 is emulated and slower, so "auto" keeps fp32.
    On CUDA, the fp32 matmuls that remain use TF32, as cramming does, where the precision allows it:
    "fp32" computes in fp32 (`use_tf32`)."""
    import torch

    if device.type == "cuda":
        use_tf32(precision != "fp32")
    native = device.type == "cuda" or (device.type == "cpu" and native_cpu_bf16())
    if precision == "bf16" or (precision == "auto" and native):
        return torch.bfloat16
    return None


def use_tf32(allowed: bool = True) -> None:
    """fp32 matmuls and convolutions on CUDA in TF32 where `allowed`, else in full fp32 (IEEE): TF32 keeps
    10 bits of mantissa, so a caller that asked for fp32 (`--precision fp32`, "as sentence-transformers,
    1e-4") would get vectors 1e-3 apart. The setting is process-wide, so it is set either way: an earlier
    caller's TF32 does not leak into an fp32 one. Through `fp32_precision` where torch has it (2.9 on):
    torch 2.11 deprecates the legacy `allow_tf32` flags, and a process that sets both raises in inductor."""
    import torch

    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "tf32" if allowed else "ieee"
        torch.backends.cudnn.conv.fp32_precision = "tf32" if allowed else "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = allowed
        torch.backends.cudnn.allow_tf32 = allowed


def native_cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX tiles)."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's own probes, private
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`. On CUDA the copy goes through pinned memory and does not block: a
    pageable copy would wait for the GPU to drain its queue, a host sync on every step."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
