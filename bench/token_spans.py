"""What a user reading a tagger's export with transformers gets: entity F1 over character spans (type, start,
end) of `pipeline("token-classification", aggregation_strategy=...)` on a CoNLL file's sentences (words joined
by spaces, the gold entities' spans in that text), per aggregation strategy.

    python bench/token_spans.py EXPORT CONLL [--strategies first,simple]

EXPORT: a `cram export --format transformers` folder of a tagger; CONLL: a file `read_file` reads (choose on
the dev file, never the test). The word-level F1 cram's evaluate stage reports reads each word's first
sub-token as the training words cut the text; the pipeline cuts the raw text itself (a `@name` is two words to
it) and, with "simple", reads every sub-token's own tag.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cram.stages.tagging.reading import read_file
from cram.stages.tagging.scores import spans

Span = tuple[str, int, int]


def gold_spans(words: list[str], tags: list[str]) -> tuple[str, set[Span]]:
    """The sentence's text (its words joined by spaces) and its entities' (type, start, end) in it."""
    starts = []
    for i, word in enumerate(words):
        starts.append(starts[-1] + len(words[i - 1]) + 1 if i else 0)
    found = {(kind, starts[first], starts[end - 1] + len(words[end - 1])) for kind, first, end in spans(tags)}
    return " ".join(words), found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", type=Path)
    parser.add_argument("conll", type=Path)
    parser.add_argument("--strategies", default="first,simple")
    args = parser.parse_args()
    from transformers import pipeline

    sentences = read_file(args.conll)
    texts, gold = zip(*(gold_spans(list(w), list(t)) for w, t in zip(sentences.words, sentences.tags)))
    for strategy in args.strategies.split(","):
        tagger = pipeline("token-classification", model=str(args.export), aggregation_strategy=strategy, device="cpu")
        hits, found, right = sum(map(len, gold)), 0, 0
        for truth, predicted in zip(gold, tagger(list(texts))):
            mine = {(e["entity_group"], e["start"], e["end"]) for e in predicted}
            found, right = found + len(mine), right + len(mine & truth)
        f1 = 2 * right / (found + hits) if found + hits else 0.0
        print(f"{strategy}: entity F1 {f1:.4f} ({right} right of {found} found, {hits} in the gold)", flush=True)


if __name__ == "__main__":
    main()
