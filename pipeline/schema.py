"""The manifest's records as types: a stage's record (`StageRecord`) and each of its tries (`Try`).

`manifest.json` = `{"schema": SCHEMA, "run": name, "stages": {stage: record}}`; a store entry's marker
holds the record of the run that made it. The field names are the dataclasses' own: they are written and
read from `dataclasses.fields`, nowhere else. A manifest without `schema` was written before it (schema 1,
cram up to c0db683): the same fields, read the same way. `from_json` refuses a field of the wrong type,
naming it and its value, so no command meets a value it cannot use.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

SCHEMA = 2  # 2: the number itself; 1 (no "schema" key): c0db683 and before, the same records

# running: under way, or its process was killed (it could not say); failed and interrupted: ended early.
Status = Literal["running", "done", "failed", "interrupted"]
TryStatus = Literal["done", "failed", "interrupted", "killed"]  # killed: a try whose process ended without a word


_WHEN_SET = {"when_set": True}  # a field's metadata: left out of the JSON while None


class SchemaError(ValueError):
    """A record field of the wrong type: the message names it (`stages.NAME.FIELD`) and its value."""


@dataclass(frozen=True)
class Try:
    """One try at a stage's key, closed: when it started and ended, how long it took, how it ended."""

    started: str | None = None
    ended: str | None = None
    duration_s: float | None = None
    status: TryStatus = "done"


@dataclass(frozen=True)
class StageRecord:
    """A stage's entry in the manifest (see docs/architecture.md, "The manifest")."""

    key: str | None = None  # the cache key this record is about
    config_hash: str | None = None  # digest of VERSION, the keyed config and the seed ("config changed")
    inputs_hash: str | None = None  # digest of the stage's fingerprint: what it read outside the run
    upstream_keys: dict[str, str] = field(default_factory=dict)  # the upstream keys it was made from
    version: str | None = None  # the stage's VERSION
    status: Status = "running"
    started: str | None = None  # ISO times with the zone
    ended: str | None = None
    duration_s: float | None = None  # every try at this key added up
    attempts: tuple[Try, ...] = ()  # each try at this key, this one last once closed
    outputs: dict[str, Any] = field(default_factory=dict)  # what `run` returned: relative paths and figures
    error: str | None = None  # a failed or interrupted try's one line
    pid: int | None = None  # the process computing it (None once done)
    host: str | None = None
    git_commit: str | None = None
    versions: dict[str, str] = field(default_factory=dict)  # python, torch, numpy, ... that made it
    # Written only when set: when its entry was linked from the store (the rest: the run that made it) ...
    reused: str | None = field(default=None, metadata=_WHEN_SET)
    # ... and an unfinished try at another key, kept beside this done result.
    attempt: StageRecord | None = field(default=None, metadata=_WHEN_SET)

    def to_json(self) -> dict[str, Any]:
        return _plain(self)

    @classmethod
    def from_json(cls, data: Any, where: str) -> StageRecord:
        """The record `data` (a manifest's `stages.NAME`, found at `where`); SchemaError naming a bad field."""
        return _read(cls, data, where)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        fields = dataclasses.fields(value)
        return {
            f.name: _plain(getattr(value, f.name))
            for f in fields
            if not (f.metadata.get("when_set") and getattr(value, f.name) is None)
        }
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


_NULL = type(None)
# What JSON may hold for each field type, and how the error says it.
_ALLOWED: dict[Any, tuple[tuple[type, ...], str]] = {
    str | None: ((str, _NULL), "a string or null"),
    float | None: ((int, float, _NULL), "a number or null"),
    int | None: ((int, _NULL), "an integer or null"),
    Status: ((str,), "a string"),
    TryStatus: ((str,), "a string"),
    dict[str, str]: ((dict, _NULL), "an object or null"),
    dict[str, Any]: ((dict, _NULL), "an object or null"),
    tuple[Try, ...]: ((list,), "a list"),
    StageRecord | None: ((dict, _NULL), "an object or null"),
}


def _read(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise SchemaError(f"{where}: expected an object, got {_shown(data)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            values[f.name] = _value(hints[f.name], data[f.name], f"{where}.{f.name}")
    return cls(**values)


def _value(tp: Any, value: Any, where: str) -> Any:
    allowed, expected = _ALLOWED[tp]
    if not isinstance(value, allowed) or isinstance(value, bool):
        raise SchemaError(f"{where}: expected {expected}, got {_shown(value)}")
    if typing.get_origin(tp) is Literal and value not in typing.get_args(tp):
        raise SchemaError(f"{where}: expected one of {', '.join(typing.get_args(tp))}, got {_shown(value)}")
    if tp == dict[str, str] and not all(isinstance(v, str) for v in (value or {}).values()):
        raise SchemaError(f"{where}: expected strings by name, got {_shown(value)}")
    if tp == tuple[Try, ...]:
        return tuple(_read(Try, a, f"{where}[{i}]") for i, a in enumerate(value))
    if tp == StageRecord | None:
        return None if value is None else _read(StageRecord, value, where)
    if isinstance(value, dict) or value is None and allowed[0] is dict:
        return dict(value or {})
    return value


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
