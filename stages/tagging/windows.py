"""Words cut into sub-tokens and sentences into rows of at most `max_length` ids, each word's tag on its first
sub-token alone (the others left out of the loss, IGNORE), and a sentence too long for one row cut into
overlapping windows, each word predicted once, from the window where its first sub-token has the most context.

Word i is encoded as the text `" " + word` (the first as `word`): the ids the sentence's words joined by
spaces give, for a WordPiece, a sentencepiece and a byte-level tokenizer alike (a byte-level one reads the
space as the start of a word, as transformers' `is_split_into_words=True` gives it), so a text tagged later
encodes as the training words did.

    rows = windowed(tokenizer.encode(spaced(words)), counts, tags, special, max_length)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

IGNORE = -100  # a position outside the loss and the scores: [CLS], [SEP], padding, a word's later sub-tokens


@dataclass(frozen=True)
class Rows:
    """A split's sentences as rows: ids, per-position tag ids (IGNORE where no word's tag is read), and for
    each sentence's words the (row, position) their tag is read at, in word order."""

    ids: list[np.ndarray]
    labels: list[np.ndarray]
    reads: list[np.ndarray]  # per sentence: [words, 2] of (row, position)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(r) for r in self.ids])


def spaced(words: Sequence[str]) -> list[str]:
    """The texts a sentence's words are encoded as: each after a space but the first."""
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


def windows(n: int, budget: int) -> list[tuple[int, int]]:
    """[start, end) spans of at most `budget` positions covering 0..n: one where it fits, else windows that
    step by half the budget, the last ending at n."""
    if n <= budget:
        return [(0, n)]
    step = max(1, budget // 2)
    starts = list(range(0, n - budget, step)) + [n - budget]
    return [(s, s + budget) for s in starts]


def owner(position: int, spans: list[tuple[int, int]]) -> int:
    """The window that reads `position` with the most context: the largest distance to its nearer edge (a
    sentence's own start and end count as context, not as an edge), the first on ties."""
    n = spans[-1][1]

    def room(span: tuple[int, int]) -> int:
        start, end = span
        left = position - start if start > 0 else n
        right = end - 1 - position if end < n else n
        return min(left, right)

    inside = [i for i, s in enumerate(spans) if s[0] <= position < s[1]]
    return max(inside, key=lambda i: (room(spans[i]), -i))


def sentence_rows(
    pieces: Sequence[Sequence[int]], tags: Sequence[int] | None, special: dict[str, int], max_length: int
) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """One sentence (`pieces`: each word's sub-token ids, none empty; `tags`: its tag ids, None to predict) as
    rows of [CLS] window [SEP]: their ids, their labels and each word's (row, position)."""
    flat = [t for p in pieces for t in p]
    firsts = np.cumsum([0, *map(len, pieces)])[:-1]
    spans = windows(len(flat), max_length - 2)
    ids = [np.asarray([special["cls"], *flat[s:e], special["sep"]], dtype=np.int64) for s, e in spans]
    labels = [np.full(len(r), IGNORE, dtype=np.int64) for r in ids]
    reads = np.zeros((len(pieces), 2), dtype=np.int64)
    for word, first in enumerate(firsts):
        row = owner(first, spans)
        position = first - spans[row][0] + 1
        reads[word] = row, position
        if tags is not None:
            labels[row][position] = tags[word]
    return ids, labels, reads


def windowed(
    encoded: list[list[int]],
    counts: Sequence[int],
    tags: Sequence[Sequence[int]] | None,
    special: dict[str, int],
    max_length: int,
) -> Rows:
    """Every sentence's rows: `encoded` the ids of every word of every sentence in turn (`spaced`), `counts`
    each sentence's number of words, `tags` their tag ids (None: no labels). A word the tokenizer gives no
    ids (a lone control character) is read as the unknown token (else [MASK]): no word goes unpredicted."""
    stand_in = [special.get("unk", special["mask"])]
    encoded = [p if len(p) else stand_in for p in encoded]
    ids, labels, reads = [], [], []
    start = 0
    for s, count in enumerate(counts):
        rows, row_labels, row_reads = sentence_rows(
            encoded[start : start + count], None if tags is None else tags[s], special, max_length
        )
        row_reads[:, 0] += len(ids)
        ids += rows
        labels += row_labels
        reads.append(row_reads)
        start += count
    return Rows(ids, labels, reads)
