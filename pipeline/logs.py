"""Logging: structlog events rendered for people on the console and as JSON lines in the run dir.

Records from the standard `logging` module (torch, datasets) go through the same two handlers, so
`logs/events.jsonl` holds everything that happened in a run, each line with its run and stage.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import structlog

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
        _installed.append(_handler(logging.StreamHandler(sys.stderr), structlog.dev.ConsoleRenderer()))
    if events_file is not None:
        events_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(events_file, encoding="utf-8")
        _installed.append(_handler(file_handler, structlog.processors.JSONRenderer()))
    for handler in _installed:
        root.addHandler(handler)
    root.setLevel(level)


def _handler(handler: logging.Handler, renderer: structlog.typing.Processor) -> logging.Handler:
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=_SHARED,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    return handler


def get(**bound: object) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger("cram").bind(**bound)
