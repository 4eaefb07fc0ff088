"""The one format of cram's parameter files (`params.safetensors`, checkpoints): safetensors with the
dict's key order in its metadata, written atomically."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cram.stages import StageError
from cram.stages.shared.files import atomic

_ORDER = "cram.order"  # safetensors metadata key: the dict's key order (the format sorts names)


class TensorFileError(StageError):
    """A tensor file that is missing or cannot be read; names the file."""


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Save `tensors` (any device) as safetensors at `path`, atomically and durably."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    with atomic(path) as tmp:
        save_file(cpu, str(tmp), metadata={_ORDER: json.dumps(list(cpu))})


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of `path` in the order they were written: the steps iterate over dicts (the
    global gradient norm sums in that order), so bit-identical resumes need the same order back.
    TensorFileError names a file that is missing or cannot be read."""
    try:
        with safe_open(str(path), framework="pt") as f:
            names = json.loads((f.metadata() or {}).get(_ORDER, "null")) or list(f.keys())
            return {name: f.get_tensor(name) for name in names}
    except Exception as e:  # safetensors raises its own SafetensorError, or OSError, or a JSON error
        raise TensorFileError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding NaN or inf, or None: trained on or evaluated,
    such a weight makes every loss NaN."""
    return next((n for n, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
