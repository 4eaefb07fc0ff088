"""Training checkpoints: `checkpoints/step-N/` with params and optimizer state as safetensors plus
`state.json` (counters, budget and data position).

A checkpoint is written into a temporary folder and renamed into place, so a folder named `step-N`
is always complete; what a killed write leaves behind is never read and is removed by the next save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PARAMS = "params.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
_NAME = re.compile(r"step-(\d+)")
_TEMP_PREFIX = ".tmp-"
_ORDER = "cram.order"  # safetensors metadata key: the dict's key order (the format sorts names)


def save(root: Path, step: int, params: dict, opt_state: dict, state: dict[str, Any], keep: int) -> Path:
    """Write checkpoint `step` under `root`, then delete all but the newest `keep` ones."""
    final = root / f"step-{step}"
    tmp = root / f"{_TEMP_PREFIX}{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write_tensors(tmp / PARAMS, params)
    write_tensors(tmp / OPTIMIZER, opt_state)
    with open(tmp / STATE, "w", encoding="utf-8") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # the same step saved again (a resumed run that had nothing left to do)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(root, keep)
    return final


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = _complete(root)
    return found[-1] if found else None


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """(params, optimizer state, state) of a checkpoint, tensors on the CPU."""
    state = json.loads((path / STATE).read_text(encoding="utf-8"))
    return read_tensors(path / PARAMS), read_tensors(path / OPTIMIZER), state


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Save `tensors` (any device) as safetensors at `path`, atomically and durably."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(cpu, str(tmp), metadata={_ORDER: json.dumps(list(cpu))})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of `path` in the order they were written: the steps iterate over dicts (the
    global gradient norm sums in that order), so bit-identical resumes need the same order back."""
    with safe_open(str(path), framework="pt") as f:
        names = json.loads((f.metadata() or {}).get(_ORDER, "null")) or list(f.keys())
        return {name: f.get_tensor(name) for name in names}


def _complete(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    steps = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(steps)]


def _prune(root: Path, keep: int) -> None:
    for old in _complete(root)[:-keep]:
        shutil.rmtree(old)
    for leftover in root.glob(f"{_TEMP_PREFIX}*"):
        shutil.rmtree(leftover)
