"""The fine-tuning progress bar: drawn in a terminal, absent elsewhere, every item yielded."""

import io

from rich.console import Console

from cram.stages.shared.progress import track


def test_a_terminal_gets_a_bar_with_the_label_and_the_count():
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100)
    assert list(track(range(4), "sent seed 0", total=8, done=4, console=console)) == [0, 1, 2, 3]
    drawn = screen.getvalue()
    assert "sent seed 0" in drawn and "8/8" in drawn


def test_no_terminal_no_bar():
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=False)
    assert list(track(range(3), "sent seed 0", total=3, console=console)) == [0, 1, 2]
    assert screen.getvalue() == ""
