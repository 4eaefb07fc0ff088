"""Logging: structlog events rendered for people on the console and as JSON lines in the run dir.

Records from the standard `logging` module (torch, datasets) go through the same two handlers, so
`logs/events.jsonl` holds everything that happened in a run, each line with its run and stage; the
console shows other libraries' warnings and errors only, not their INFO chatter (matplotlib's
"generated new fontManager" in the middle of a one-line error).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import structlog

from cram.pipeline.errors import CramError

_SHARED = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=False),
]
_installed: list[logging.Handler] = []


def configure(events_file: Path | None = None, console: bool = True, level: int = logging.INFO) -> None:
    """(Re)install the console and JSON-lines handlers on the root logger."""
    structlog.configure(
        processors=[*_SHARED, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    for handler in _installed:
        root.removeHandler(handler)
        handler.close()
    _installed.clear()
    if console:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        console_handler = _handler(_CurrentStderr(), _for_people, renderer)
        console_handler.addFilter(_ours_or_warning)
        _installed.append(console_handler)
    if events_file is not None:
        _refuse_dangling_link(events_file.parent)
        events_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(events_file, encoding="utf-8")
        _installed.append(
            _handler(file_handler, structlog.processors.format_exc_info, structlog.processors.JSONRenderer())
        )
    for handler in _installed:
        root.addHandler(handler)
    root.setLevel(level)


def _ours_or_warning(record: logging.LogRecord) -> bool:
    """Console filter: cram's own records at any level, other loggers' from WARNING on."""
    ours = record.name == "cram" or record.name.startswith("cram.")
    return ours or record.levelno >= logging.WARNING


def _refuse_dangling_link(folder: Path) -> None:
    """A link to nothing on the way to `folder` (a runs root moved away) would fail its mkdir with a bare
    "File exists": name the link and where it points instead."""
    link = next((p for p in (folder, *folder.parents) if p.is_symlink() and not p.exists()), None)
    if link is not None:
        raise CramError(
            f"{link}: a link to {os.readlink(link)}, which does not exist; create that folder or remove the link"
        )


class _CurrentStderr(logging.StreamHandler):
    """Writes to `sys.stderr` as it is at each record: a live progress bar replaces it to keep its
    own line below the log lines, and a handler holding the original stream would write through it."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def _handler(handler: logging.Handler, *processors: structlog.typing.Processor) -> logging.Handler:
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=_SHARED,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *processors],
        )
    )
    return handler


def _for_people(logger: object, method: str, event: dict) -> dict:
    """Console lines: the time of day only, no run name (it is in the title), and no tracebacks
    (they go to the events file; the console gets the one-line error)."""
    event.pop("run", None)
    event.pop("exc_info", None)
    if isinstance(event.get("timestamp"), str):
        event["timestamp"] = event["timestamp"][11:19]
    return event


def get(**bound: object) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger("cram").bind(**bound)


def tail(events_file: Path, stage: str, n: int) -> list[str]:
    """The last `n` events of `stage` in a run's events file, one line each."""
    if n == 0 or not events_file.is_file():
        return []
    shown = []
    for line in events_file.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(event, dict) or event.get("stage") != stage:  # a line not written by cram
            continue
        rest = {k: v for k, v in event.items() if k not in ("event", "timestamp", "level", "stage", "run", "logger")}
        extras = " ".join(f"{k}={v}" for k, v in rest.items())
        shown.append(f"{event.get('timestamp', '')} {str(event.get('level', '')):7} {event.get('event', '')} {extras}")
    return shown[-n:]
