"""An existing encoder to start from (`[pretrain] init = PATH`): where its config, weights and tokenizer
are, what of them enters a cache key, and its params as cram's model reads them.

PATH is one of:
- a `transformers` model folder: `config.json` and `model.safetensors` (or the shards that
  `model.safetensors.index.json` lists) of a ModernBERT, BERT, RoBERTa / XLM-R or DistilBERT masked LM,
  base model or sequence classifier (`model/hf.py`); its tokenizer is the `tokenizer.json` beside them;
- a sentence-transformers folder (`modules.json`): the transformer at its root or in the sub-folder its
  Transformer module names, and the pooling of its Pooling module's `config.json` (`pooling`: mean
  tokens as "mean", the CLS token as "first"), in the spellings of sentence-transformers 2 to 5
  (`sentence_transformers.models.Pooling`, `pooling_mode_mean_tokens: true`) and of 6
  (`sentence_transformers.sentence_transformer.modules.pooling.Pooling`, `pooling_mode: "mean"`);
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
from cram.stages.shared.store_entry import stored_damage
from cram.stages.shared.tokenizer import in_folder as tokenizer_in

if TYPE_CHECKING:
    from torch import Tensor

_SHARD_INDEX = "model.safetensors.index.json"
_MODULES = "modules.json"  # a sentence-transformers folder
_ST = "sentence_transformers."
_FAMILY_MODULES = ("BERT", "RoBERTa", "DistilBERT", "XLMRoBERTa", "ALBERT", "CamemBERT", "XLNet", "T5")
# A Pooling module's modes as evaluate's `pooling` names them, in sentence-transformers 2 to 5's spelling
# (a flag each) and 6's (`pooling_mode`, a name or a list of them); other modes (max, weighted mean) have none.
POOLING_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "first"}
_POOLING_NAMES = {"mean": "mean", "cls": "first"}
POOLINGS_READ = 'pooling_mode "mean" or "cls" (pooling_mode_mean_tokens or pooling_mode_cls_token)'


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
    pooling: str | None = None  # a sentence-transformers folder's pooling, "mean" or "first"; None: none said
    sentence: bool = False  # a sentence-transformers folder: an encoder trained for embeddings, not masked LM
    modules: tuple[str, ...] = ()  # a sentence-transformers folder's modules, by class name, in order
    pooled_prompt: bool = True  # its Pooling module's include_prompt: a prompt's tokens are pooled with the text's


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
    if (path / _MODULES).is_file():
        return _sentence_transformers(path)
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


def architecture(found: Pretrained) -> ModelConfig:
    """The checkpoint's ModelConfig: a cram one's from its `model.json` alone (its weights neither read nor
    hashed), a transformers one's from its config and the weights' headers (`load(shapes_only=True)`)."""
    if found.kind == "cram":
        return _cram_config(found)
    return load(found, shapes_only=True)[0]


def load(found: Pretrained, shapes_only: bool = False) -> tuple[ModelConfig, dict[str, Tensor]]:
    """The checkpoint's ModelConfig and fp32 params under cram's names. `shapes_only`: meta tensors
    read from the files' headers alone (of their dtype), to check a checkpoint in a moment whatever its
    size; only the tensors whose values a check compares (a tied decoder's copy) are read. Without it,
    every parameter must hold finite values."""
    from cram.model.hf import UnsupportedCheckpoint, from_transformers, values_compared

    _check_stored(found)
    headers = {path: _header(path) for path in found.weights}
    if found.kind == "cram":
        cfg = _cram_config(found)
        params = _read_weights(headers, set() if shapes_only else None)
        _check_cram_params(found, cfg, params)
    else:
        try:
            config = json.loads(found.config_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PretrainedError(f"{found.config_file}: not a readable config ({e})") from None
        try:
            names = {name for header in headers.values() for name in header}
            state = _read_weights(headers, values_compared(config, names) if shapes_only else None)
            cfg, params = from_transformers(config, state, str(found.folder))
        except UnsupportedCheckpoint as e:
            raise PretrainedError(str(e)) from None
    if not shapes_only:
        _check_finite(found, params)
    return cfg, params


def _cram_config(found: Pretrained) -> ModelConfig:
    try:
        return ModelConfig.from_json(found.config_file)
    except ModelConfigError as e:
        raise PretrainedError(str(e)) from None


def _check_stored(found: Pretrained) -> None:
    """A run's pretrain and tokenize folders (stage-store entries) must hold the bytes they recorded: a
    file damaged in place, even with its size and time kept, is refused before anything is read from it."""
    for path in (found.config_file, *found.weights, *([found.tokenizer] if found.tokenizer else [])):
        if (damage := stored_damage(path)) is not None:
            raise PretrainedError(f"{damage}; `cram run` in that run computes it again")


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


def _sentence_transformers(root: Path) -> Pretrained:
    """The transformer module of a sentence-transformers folder, its tokenizer (the module's, else the
    root's) and the pooling of its Pooling module."""
    modules = _read_json(root / _MODULES)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise PretrainedError(f"{root / _MODULES}: not a list of modules")
    kinds = tuple(sentence_module(m.get("type")) for m in modules)
    paths = {kind: m.get("path", "") for kind, m in zip(kinds, modules)}
    transformer = paths.get("Transformer")
    if not isinstance(transformer, str):
        raise PretrainedError(f"{root / _MODULES}: no sentence_transformers Transformer module; cram reads that one")
    folder = root / transformer
    if not (folder / "config.json").is_file():
        raise PretrainedError(f"{root / _MODULES}: its Transformer module's folder {folder} has no config.json")
    found = _transformers(folder)
    pooling, pooled_prompt = None, True
    if isinstance(paths.get("Pooling"), str):
        settings = _read_json(root / paths["Pooling"] / "config.json")
        pooling = sentence_pooling(settings)
        pooled_prompt = not isinstance(settings, dict) or settings.get("include_prompt", True) is not False
    tokenizer = found.tokenizer or tokenizer_in(root)
    names = tuple(kind or "?" for kind in kinds)
    return Pretrained(
        folder, "transformers", found.config_file, found.weights, tokenizer, pooling, True, names, pooled_prompt
    )


def sentence_module(kind: object) -> str | None:
    """The class name a modules.json `type` names, where it is one of sentence-transformers' own: the last
    part of `sentence_transformers.models.Pooling` (2 to 5) or of
    `sentence_transformers.sentence_transformer.modules.pooling.Pooling` (6). The earliest versions'
    per-family classes (`sentence_transformers.models.BERT` in a `0_BERT/` folder) are the Transformer
    module's forerunners: a transformers model folder, read the same way."""
    if not isinstance(kind, str) or not kind.startswith(_ST):
        return None
    name = kind.rsplit(".", 1)[-1]
    return "Transformer" if name in _FAMILY_MODULES else name


def sentence_pooling(settings: object) -> str | None:
    """A Pooling module's config.json as evaluate's `pooling` names it, "mean" or "first", in either
    spelling (`POOLINGS_READ`); None for any other mode, several at once, or none."""
    if not isinstance(settings, dict):
        return None
    if "pooling_mode" in settings:
        mode = settings["pooling_mode"]
        names = mode if isinstance(mode, list) else [mode]
        modes = [_POOLING_NAMES.get(name) if isinstance(name, str) else None for name in names]
    else:
        modes = [mode for key, mode in POOLING_FLAGS.items() if settings.get(key) is True]
        others = [key for key, value in settings.items() if key.startswith("pooling_mode_") and value is True]
        if set(others) - set(POOLING_FLAGS):
            modes.append(None)  # a mode cram does not compute, beside one it does
    return modes[0] if len(modes) == 1 else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PretrainedError(f"{path}: not readable JSON ({e})") from None


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


# safetensors' dtype names and torch's, for the meta tensors of a check from the headers.
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def _header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (safetensors dtype, shape)} of a safetensors file, from its JSON header alone, in
    name order (safetensors' own `keys()` order, which the params keep)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= _MAX_HEADER:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
        tensors = {name: (t["dtype"], list(t["shape"])) for name, t in sorted(header.items()) if name != "__metadata__"}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise PretrainedError(f"{path}: not a readable safetensors file ({e})") from None
    unknown = next(((name, dtype) for name, (dtype, _) in tensors.items() if dtype not in _DTYPES), None)
    if unknown is not None:
        raise PretrainedError(f"{path}: tensor {unknown[0]} has dtype {unknown[1]}, which torch does not read")
    return tensors


def _read_weights(headers: dict[Path, dict[str, tuple[str, list[int]]]], meta: set[str] | None) -> dict[str, Any]:
    """Every tensor of the files, floats as fp32; with `meta` (a set of names to read all the same) meta
    tensors of the headers' shapes and dtypes."""
    import torch
    from safetensors import SafetensorError, safe_open

    state: dict[str, Any] = {}
    for path, header in headers.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for name, (dtype, shape) in header.items():
                    if meta is not None and name not in meta:
                        state[name] = torch.empty(shape, dtype=getattr(torch, _DTYPES[dtype]), device="meta")
                    else:
                        tensor = f.get_tensor(name)
                        state[name] = tensor.float() if tensor.is_floating_point() else tensor
        except (OSError, SafetensorError) as e:
            raise PretrainedError(f"{path}: not a readable safetensors file ({e})") from None
    return state


def _check_finite(found: Pretrained, params: dict[str, Tensor]) -> None:
    from cram.stages.shared.tensors import nonfinite

    if (bad := nonfinite(params)) is not None:
        cram = found.kind == "cram"
        where, name = (found.weights[0], bad) if cram else (found.folder, f"the weights of cram's {bad}")
        raise PretrainedError(f"{where}: {name} holds NaN or inf values; nothing can be learned from them")


def _check_cram_params(found: Pretrained, cfg: ModelConfig, state: dict[str, Any]) -> None:
    """The params are the ones `model.json` describes: the same names and shapes as a fresh init."""
    from cram.model.bert import shapes

    expected = shapes(cfg)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    wrong = [n for n in sorted(expected) if n in state and tuple(state[n].shape) != expected[n]]
    where = found.weights[0]
    integer = next((n for n in expected if n in state and not state[n].is_floating_point()), None)
    if integer is not None:
        raise PretrainedError(
            f"{where}: {integer} holds {str(state[integer].dtype).removeprefix('torch.')} values; "
            "weights must be floating point"
        )
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
