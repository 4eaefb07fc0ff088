"""The pipeline config: one TOML file, a `[run]` section and a section per stage.

Each stage section is validated against the stage's frozen `Config` dataclass: unknown keys name the
closest valid key, wrong types name the expected type and the value. `--set a.b=VALUE` overrides go
through the same validation. The resolved config is written back as TOML (`to_toml`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from cram.model.config import Attention, misvalued_retired
from cram.stages import protocols
from cram.stages.shared import loggers as stage_loggers

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

T = TypeVar("T")


class ConfigError(Exception):
    """A bad config file, section, key or value; the message says which and what is allowed."""


MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class RunConfig:
    name: str = "default"
    seed: int = 0
    root: str = "runs"  # relative paths are taken from the current directory
    device: str = "auto"  # "auto", "cpu", "cuda" or "cuda:N"
    loggers: tuple[str, ...] = ()  # experiment loggers besides metrics.jsonl: "tensorboard", "wandb"
    # How attention is computed, not what (no stage key holds it): "auto" is SDPA on a GPU and the product
    # written out on a CPU; "written" everywhere is the way round an SDPA kernel that fails under torch.func.
    attention: Attention = "auto"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"device: {self.device!r} is not one of auto, cpu, cuda, cuda:N (N a device index)")
        # numpy and torch take seeds up to 2**64 - 1, torch's manual_seed down to -2**63: a seed in
        # [0, 2**63 - 1] is one every stage accepts, with room for evaluate's seed + k.
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed: {self.seed} must be in [0, 2**63 - 1]")
        if not self.root.strip():
            raise ValueError(f"root: {self.root!r} must name a folder for the runs, e.g. 'runs'")
        stage_loggers.check(self.loggers)


@dataclass(frozen=True)
class PipelineConfig:
    run: RunConfig
    stages: dict[str, Any]  # stage name -> its validated Config instance

    def to_dict(self) -> dict[str, Any]:
        return {"run": as_plain(self.run), **{n: as_plain(c) for n, c in self.stages.items()}}


def load(
    path: str | Path, config_classes: dict[str, type], overrides: list[str] = (), flag: str | None = None
) -> PipelineConfig:
    """Read `path`, apply `--set` overrides, and validate every section. `flag` names the overrides in
    errors (default: `--set 'ITEM'`)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(
            f"{path}: a directory; give the pipeline's TOML file, e.g. {path / 'pipeline.toml'}"
        ) from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    # Validate the file alone first, so an error names the file rather than an override.
    config = _validate(raw, config_classes, str(path))
    if not overrides:
        return config
    for item in overrides:
        _apply_override(raw, item, config_classes, flag or f"--set {item!r}")
    return _validate(raw, config_classes, flag or "--set")


def parse(text: str, config_classes: dict[str, type], source: str = "<string>") -> PipelineConfig:
    return _validate(tomllib.loads(text), config_classes, source)


def _validate(raw: dict[str, Any], config_classes: dict[str, type], source: str) -> PipelineConfig:
    sections = {"run": RunConfig, **config_classes}
    for name in raw:
        if name not in sections:
            raise ConfigError(f"{source}: unknown section [{name}]{_did_you_mean(name, sections)}")
    built = {name: build(cls, raw.get(name, {}), name, source) for name, cls in sections.items()}
    # A section may take a default from another's: tokenize's tokenizer from pretrain's checkpoint.
    built = {name: protocols.linked(section, built) for name, section in built.items()}
    run = built.pop("run")
    return PipelineConfig(run=run, stages=built)


def build(cls: type[T], data: object, where: str, source: str) -> T:
    """Make the dataclass `cls` from the TOML table `data`, found at `[where]` in `source`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: [{where}] must be a table, got {data!r}")
    cls, data = _of_kind(cls, data, where, source)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    data = _without_retired(cls, data, where, source)
    for key in data:
        if key not in fields:
            raise ConfigError(
                f"{source}: [{where}] unknown key '{key}'{_did_you_mean(key, fields)} (valid keys: {', '.join(fields)})"
            )
    values = {key: _convert(hints[key], value, f"{where}.{key}", source) for key, value in data.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: [{where}] {e}") from None


def _of_kind(cls: type[T], data: dict[str, Any], where: str, source: str) -> tuple[type[T], dict[str, Any]]:
    """A config that comes in kinds, a class each (model/optimizers.py's optimizers: a class with `kind_class`),
    is read by the class its table's `kind` names (or its default kind's); the table less `kind`. Any other
    class reads the table as it is."""
    kind_class = getattr(cls, "kind_class", None)
    if kind_class is None:
        return cls, data
    try:
        chosen = kind_class(data.get("kind"))
    except ValueError as e:
        raise ConfigError(f"{source}: [{where}] {e}") from None
    return chosen, {key: value for key, value in data.items() if key != "kind"}


def _without_retired(cls: type, data: dict[str, Any], where: str, source: str) -> dict[str, Any]:
    """`data` less the keys `cls.RETIRED` names (a setting removed, mapped to the value that computes what
    the code computes without it), so that a config saved while it existed still reads: a run folder's
    config.toml, which `cram resume` reads back. Any other value of one is refused: dropping it would run
    something else than the file says."""
    retired: Mapping[str, object] = getattr(cls, "RETIRED", {})
    key = misvalued_retired(data, retired)
    if key is not None:
        raise ConfigError(
            f"{source}: [{where}] {key} = {json.dumps(data[key], default=str)}: a setting this version no longer "
            f"has; only {key} = {json.dumps(retired[key])} (what every run now does) is read, or leave it out"
        )
    return {key: value for key, value in data.items() if key not in retired}


def _convert(tp: object, value: object, key: str, source: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    # TOML reads nan and inf as numbers; no setting means either, and a nan lr would cost a whole run.
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: {key}: {value!r} is not allowed; expected a finite number")
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key, source)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        allowed = ", ".join(repr(a) for a in args)
        raise ConfigError(f"{source}: {key}: {value!r} is not allowed; choose one of {allowed}")
    if origin in (typing.Union, types.UnionType):
        for arm in (a for a in args if a is not type(None)):
            try:
                return _convert(arm, value, key, source)
            except ConfigError:
                pass
        raise ConfigError(f"{source}: {key}: expected {_type_name(tp)}, got {value!r}")
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key}: expected {_type_name(tp)}, got {value!r}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ConfigError(f"{source}: {key}: expected {_type_name(tp)}, got {value!r}")
            return tuple(_convert(a, v, f"{key}[{i}]", source) for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_convert(item, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a table, got {value!r}")
        return {k: _convert(args[1] if args else Any, v, f"{key}.{k}", source) for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and type(value) is tp:
        return value
    raise ConfigError(f"{source}: {key}: expected {_type_name(tp)}, got {value!r}")


def _type_name(tp: object) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    if origin in (tuple, list):
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if dataclasses.is_dataclass(tp):
        return "a table"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def _apply_override(raw: dict[str, Any], item: str, config_classes: dict[str, type], flag: str) -> None:
    dotted, sep, text = item.partition("=")
    parts = dotted.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError(f"{flag}: expected section.key=value, e.g. --set pretrain.optimizer.lr=5e-4")
    sections = ["run", *config_classes]
    if parts[0] not in sections:
        raise ConfigError(f"{flag}: unknown section [{parts[0]}]{_did_you_mean(parts[0], sections)}")
    table = raw
    for part in parts[:-1]:
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{flag}: '{part}' is a value, not a table")
    table[parts[-1]] = parse_value(text.strip())


def parse_value(text: str) -> Any:
    """A TOML value (`5e-4`, `true`, `[1, 2]`, `"x"`), or the text itself when it is not one."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def as_plain(obj: object) -> Any:
    """Dataclasses, tuples and paths as JSON/TOML-ready dicts, lists and strings."""
    if dataclasses.is_dataclass(obj):
        return {f.name: as_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): as_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def canonical_json(obj: object) -> str:
    return json.dumps(as_plain(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(obj: object) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def to_toml(tables: dict[str, Any]) -> str:
    """Write nested dicts as TOML. `None` values are left out: TOML has no null, and leaving a key
    out gives its default back when the file is read again."""
    lines: list[str] = []
    for name, table in tables.items():
        _emit_table(lines, [name], table, array=False)
    return "\n".join(lines).strip() + "\n"


def _emit_table(lines: list[str], path: list[str], table: dict[str, Any], array: bool) -> None:
    header = ".".join(_toml_key(p) for p in path)
    lines.append(f"\n[[{header}]]" if array else f"\n[{header}]")
    nested = []
    for key, value in table.items():
        if value is None:
            continue
        if isinstance(value, dict) or _is_table_array(value):
            nested.append((key, value))
        else:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in nested:
        if isinstance(value, dict):
            _emit_table(lines, path + [key], value, array=False)
        else:
            for item in value:
                _emit_table(lines, path + [key], item, array=True)


def _is_table_array(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")
