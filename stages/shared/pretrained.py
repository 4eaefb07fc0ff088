"""An existing encoder to start from (`[pretrain] init = PATH`): where its config, weights and tokenizer
are, what of them enters a cache key, and its params as cram's model reads them.

PATH is one of:
- a `transformers` model folder: `config.json` and `model.safetensors` (or the shards that
  `model.safetensors.index.json` lists) of a ModernBertForMaskedLM, BertForMaskedLM or
  RobertaForMaskedLM; its tokenizer is the `tokenizer.json` beside them;
- a cram export (`cram export RUN --to DIR`) or a finished pretrain stage folder: `model.json` and
  `params.safetensors`, with `tokenizer.json` or `tokenizer.model` beside them in an export;
- a run directory: its `pretrain/` folder, and the tokenizer of its `tokenize/` folder.

    found = locate(Path("ModernBERT-base"))
    cfg, params = load(found)                  # fp32 CPU tensors under cram's parameter names
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cram.model.config import ModelConfig, ModelConfigError
from cram.stages.shared.files import known_hash
from cram.stages.shared.tokenizer import in_folder as tokenizer_in

if TYPE_CHECKING:
    from torch import Tensor

_SHARD_INDEX = "model.safetensors.index.json"


class PretrainedError(ValueError):
    """A PATH that holds no usable checkpoint, or one the model cannot express; one line."""


@dataclass(frozen=True)
class Pretrained:
    """Where a checkpoint's files are."""

    folder: Path  # the folder holding the config and the weights
    kind: Literal["transformers", "cram"]
    config_file: Path  # config.json or model.json
    weights: tuple[Path, ...]  # safetensors files
    tokenizer: Path | None  # its tokenizer file, when it has one


def locate(path: Path) -> Pretrained:
    """The checkpoint at `path` (see the module's docstring); PretrainedError when it is none of them."""
    path = path.expanduser()
    if not path.is_dir():
        raise PretrainedError(f"{path}: no such folder")
    if (path / "pretrain" / "model.json").is_file():  # a run directory
        found = _cram(path / "pretrain")
        return Pretrained(found.folder, "cram", found.config_file, found.weights, tokenizer_in(path / "tokenize"))
    if (path / "model.json").is_file():
        return _cram(path)
    if (path / "config.json").is_file():
        return _transformers(path)
    raise PretrainedError(
        f"{path}: neither a transformers model folder (config.json + model.safetensors), a cram export or "
        "pretrain folder (model.json + params.safetensors), nor a run directory (pretrain/model.json)"
    )


def fingerprint(found: Pretrained) -> list[list[str]]:
    """[file name, sha256] of the config and every weights file: what a stage started from it depends on.
    The contents, not the paths: the same checkpoint copied elsewhere keeps the key. Hashed through the
    planner's cache (`files.hashes_from`): a checkpoint that did not change is not read again."""
    return [[f.name, known_hash(f)] for f in (found.config_file, *found.weights)]


def load(found: Pretrained, shapes_only: bool = False) -> tuple[ModelConfig, dict[str, Tensor]]:
    """The checkpoint's ModelConfig and fp32 params under cram's names. `shapes_only`: meta tensors
    read from the files' headers alone, to check a checkpoint in a moment whatever its size."""
    from cram.model.hf import UnsupportedCheckpoint, from_transformers

    state = _read_weights(found.weights, shapes_only)
    if found.kind == "cram":
        try:
            cfg = ModelConfig.from_json(found.config_file)
        except ModelConfigError as e:
            raise PretrainedError(str(e)) from None
        _check_cram_params(found, cfg, state)
        return cfg, state
    try:
        config = json.loads(found.config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PretrainedError(f"{found.config_file}: not a readable config ({e})") from None
    try:
        return from_transformers(config, state, str(found.folder))
    except UnsupportedCheckpoint as e:
        raise PretrainedError(str(e)) from None


def _cram(folder: Path) -> Pretrained:
    weights = folder / "params.safetensors"
    if not weights.is_file():
        raise PretrainedError(f"{folder}: model.json without params.safetensors")
    return Pretrained(folder, "cram", folder / "model.json", (weights,), tokenizer_in(folder))


def _transformers(folder: Path) -> Pretrained:
    if (folder / "model.safetensors").is_file():
        weights = (folder / "model.safetensors",)
    elif (folder / _SHARD_INDEX).is_file():
        weights = _shards(folder)
    else:
        other = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = (
            f" (it has {other[0]}: only safetensors weights are read; save with `save_pretrained`, whose "
            "default is safetensors)"
            if other
            else ""
        )
        raise PretrainedError(f"{folder}: config.json without model.safetensors{hint}")
    return Pretrained(folder, "transformers", folder / "config.json", weights, tokenizer_in(folder))


def _shards(folder: Path) -> tuple[Path, ...]:
    try:
        index = json.loads((folder / _SHARD_INDEX).read_text(encoding="utf-8"))
        names = sorted(set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise PretrainedError(f"{folder / _SHARD_INDEX}: not a readable shard index ({e})") from None
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise PretrainedError(f"{folder}: {_SHARD_INDEX} names {missing[0]}, which is not there")
    return tuple(folder / n for n in names)


def _read_weights(files: tuple[Path, ...], shapes_only: bool) -> dict[str, Any]:
    import torch
    from safetensors import SafetensorError, safe_open

    state: dict[str, Any] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if shapes_only:
                        state[name] = torch.empty(f.get_slice(name).get_shape(), device="meta")
                    else:
                        tensor = f.get_tensor(name)
                        state[name] = tensor.float() if tensor.is_floating_point() else tensor
        except (OSError, SafetensorError) as e:
            raise PretrainedError(f"{path}: not a readable safetensors file ({e})") from None
    return state


def _check_cram_params(found: Pretrained, cfg: ModelConfig, state: dict[str, Any]) -> None:
    """The params are the ones `model.json` describes: the same names and shapes as a fresh init."""
    from cram.model.bert import shapes

    expected = shapes(cfg)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    wrong = [n for n in sorted(expected) if n in state and tuple(state[n].shape) != expected[n]]
    where = found.weights[0]
    if missing:
        raise PretrainedError(f"{where}: no parameter {missing[0]}, which {found.config_file.name} needs")
    if extra:
        raise PretrainedError(
            f"{where}: parameter {extra[0]} is no part of the model {found.config_file.name} describes"
        )
    if wrong:
        name = wrong[0]
        raise PretrainedError(
            f"{where}: {name} has shape {list(state[name].shape)}; {found.config_file.name} says {list(expected[name])}"
        )
