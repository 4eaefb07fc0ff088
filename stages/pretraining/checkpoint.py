"""Training checkpoints: `checkpoints/step-N/` with params and optimizer state as safetensors plus
`state.json` (counters, budget and data position), and `checksums.json`: the sha256 of each of the three.

A checkpoint is written into a temporary folder and renamed into place, so a folder named `step-N`
is always complete; what a killed write leaves behind is never read and is removed by the next save.
What happens to a complete one later (a full disk, a bad copy, an edit) is caught by its checksums:
`latest` passes over a checkpoint whose files do not match, with a warning naming the file, moves it
aside as `step-N.corrupt` (kept, never read again) and returns the newest intact one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cram.stages import StageError
from cram.stages.shared.files import content_hash
from cram.stages.shared.tensors import TensorFileError, read_tensors, write_tensors

if TYPE_CHECKING:
    from cram.stages.protocols import JSON, Log

PARAMS = "params.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
CHECKSUMS = "checksums.json"
_NAME = re.compile(r"step-(\d+)")
_TEMP_PREFIX = ".tmp-"


def save(root: Path, step: int, params: dict, opt_state: dict, state: dict[str, Any], keep: int) -> Path:
    """Write checkpoint `step` under `root`, then delete all but the newest `keep` ones."""
    final = root / f"step-{step}"
    tmp = root / f"{_TEMP_PREFIX}{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write_tensors(tmp / PARAMS, params)
    write_tensors(tmp / OPTIMIZER, opt_state)
    _write_json(tmp / STATE, state)
    _write_json(tmp / CHECKSUMS, {name: content_hash(tmp / name) for name in (PARAMS, OPTIMIZER, STATE)})
    if final.exists():  # the same step saved again (a resumed run that had nothing left to do)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(root, keep)
    return final


class CheckpointError(StageError):
    """A checkpoint file that is missing, unreadable or not what its checksum says; names the file."""


def latest(root: Path, log: Log | None = None) -> Path | None:
    """The newest complete checkpoint under `root` whose files match their checksums, or None.

    With `log`, each newer one that does not match is reported as a warning and moved aside."""
    for path in reversed(_complete(root)):
        try:
            verify(path)
            return path
        except CheckpointError as e:
            if log is not None:
                aside = path.with_name(f"{path.name}.corrupt")
                try:
                    os.replace(path, aside)  # another rank may have moved it already
                except OSError:
                    pass
                log.warning("corrupt checkpoint skipped", error=str(e), moved_to=str(aside))
    return None


def verify(path: Path) -> None:
    """Raise CheckpointError naming the first file of checkpoint `path` that is missing or does not
    match its checksum."""
    sums_path = path / CHECKSUMS
    try:
        sums = json.loads(sums_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{sums_path}: unreadable ({e})") from None
    for name in (PARAMS, OPTIMIZER, STATE):
        if not isinstance(sums, dict) or name not in sums:
            raise CheckpointError(f"{sums_path}: no checksum for {name}")
        if not (path / name).is_file():
            raise CheckpointError(f"{path / name}: missing")
        if content_hash(path / name) != sums[name]:
            raise CheckpointError(f"{path / name}: does not match its checksum in {CHECKSUMS} (truncated or changed)")


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """(params, optimizer state, state) of a checkpoint, tensors on the CPU; CheckpointError names
    a file that cannot be read."""
    try:
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / STATE}: unreadable ({e})") from None
    try:
        return read_tensors(path / PARAMS), read_tensors(path / OPTIMIZER), state
    except TensorFileError as e:
        raise CheckpointError(str(e)) from None


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


def _write_json(path: Path, obj: JSON) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
