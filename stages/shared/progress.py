"""Progress for people: bars on stderr, in a terminal only (logs and CI output stay plain), and the
clock of progress lines, which a log and a console that is not a terminal get instead (`bar` writes
them itself where asked)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, TypeVar

if TYPE_CHECKING:
    from rich.console import Console

T = TypeVar("T")


def track(items: Iterable[T], label: str, total: int, done: int = 0, console: Console | None = None) -> Iterator[T]:
    """Yield `items`, drawing a bar "label [====    ] 40%" of `done` + items so far out of `total`.

    A loop that runs in parts (epochs) passes the part's start as `done`, so the bar shows the
    whole loop. The bar is removed once the items are spent, or the loop is left early.
    """
    with bar(label, total, done, console) as advance:
        for item in items:
            yield item
            advance(1)


@contextmanager
def bar(
    label: str, total: int, done: int = 0, console: Console | None = None, lines_every: float | None = None
) -> Iterator[Callable[[int], None]]:
    """`advance(n)`, which moves a bar "label [====    ] 40%" of `total` on by n, in a terminal; elsewhere
    nothing is drawn, and with `lines_every` a plain line "label: N/TOTAL" is written every that many
    seconds instead, so that a log does not look hung. The bar is removed when the block is left."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = console or Console(stderr=True)
    progress = Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    task = progress.add_task(label, total=total, completed=done)
    every = None if console.is_terminal or lines_every is None else Every(lines_every)
    count = done

    def advance(n: int) -> None:
        nonlocal count
        count += n
        progress.advance(task, n)
        if every is not None and every.due():
            console.print(f"{label}: {count:,}/{total:,}", markup=False, highlight=False, soft_wrap=True)

    with progress:
        yield advance


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
