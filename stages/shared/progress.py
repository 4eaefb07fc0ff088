"""Progress for people: bars on stderr, in a terminal only (logs and CI output stay plain), and the
clock of progress lines, which a log and a console that is not a terminal get instead."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, TypeVar

if TYPE_CHECKING:
    from rich.console import Console

T = TypeVar("T")


def track(items: Iterable[T], label: str, total: int, done: int = 0, console: Console | None = None) -> Iterator[T]:
    """Yield `items`, drawing a bar "label [====    ] 40%" of `done` + items so far out of `total`.

    A loop that runs in parts (epochs) passes the part's start as `done`, so the bar shows the
    whole loop. The bar is removed once the items are spent, or the loop is left early.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = console or Console(stderr=True)
    bar = Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    task = bar.add_task(label, total=total, completed=done)
    with bar:
        for item in items:
            yield item
            bar.advance(task)


class Every:
    """Due once every `seconds`, the first time `seconds` after it is made: when a long loop writes its
    next progress line, so that a run without a terminal (a log, CI) does not look hung."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.clock = seconds, clock
        self.last = clock()

    def due(self) -> bool:
        now = self.clock()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True
