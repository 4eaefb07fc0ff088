"""What the readers of records share, the corpus's (`data/readers.py`) and the task files'
(`shared/taskfiles.py`): the byte-order mark a file may open with, csv's field limit, how a field's
value is told to be text, and the characters UTF-8 cannot encode."""

from __future__ import annotations

import csv
import re

BOM = "\ufeff"
# A JSON string escape can name half of a UTF-16 surrogate pair alone ("\ud83d"): Python's str holds it,
# and nothing downstream can encode it (UTF-8, arrow, a tokenizer). Only JSON makes one: decoded bytes never do.
_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"


def raise_csv_field_limit() -> None:
    """csv's field limit raised from 128 KiB: a long text is a valid field. The setting is per process,
    and only raises a limit; a reader checks its fields' lengths against its own."""
    csv.field_size_limit(2**31 - 1)


def not_text(value: object, field: str) -> str | None:
    """Why `value` of a text field is no text (a number, a list, a record), or None: a text is read as
    what it says, never as a stringified `12345` or `['a']`."""
    if value is None or isinstance(value, str):
        return None
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return f"text field '{field}' holds {type(value).__name__} {shown}, not text"


def unencodable(text: str) -> int | None:
    """The index of the first character of `text` UTF-8 cannot encode (a lone surrogate), or None."""
    found = _SURROGATE.search(text)
    return None if found is None else found.start()


def unencodable_problem(text: str, field: str) -> str | None:
    """Why `text` of `field` cannot be encoded, naming the character and where it is, or None."""
    at = unencodable(text)
    if at is None:
        return None
    return (
        f"field '{field}' holds a lone surrogate \\u{ord(text[at]):04x} at character {at:,} "
        "(half of a UTF-16 pair, from a JSON escape), which UTF-8 cannot encode"
    )


def replace_unencodable(text: str) -> str:
    """`text` with each character UTF-8 cannot encode replaced by U+FFFD."""
    return _SURROGATE.sub(REPLACEMENT, text)


def may_escape_surrogates(line: str) -> bool:
    """Whether a raw JSON line may decode to a lone surrogate: only a \\u escape makes one (a quick
    test that spares the decoded record's check on almost every line)."""
    return "\\u" in line
