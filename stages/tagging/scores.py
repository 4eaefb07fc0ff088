"""Entity-level scores of tag sequences as conlleval and seqeval's default mode compute them: spans read from
IOB2 tags (an entity starts at B-, or at an I- that does not continue one of its type, and runs while I- of
its type follows), micro precision, recall and F1 over exact (type, start, end) spans, each type's, and the
accuracy of the tags themselves; beside them the two baselines, all-O and the dictionary (each training
word's most frequent tag), decoded into spans the same way."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

Span = tuple[str, int, int]  # (type, first word, last word + 1)


def spans(tags: Sequence[str]) -> list[Span]:
    """The entities of one sentence's tags (O, B-X, I-X), as conlleval reads them."""
    found, start, kind = [], None, None
    for i, tag in enumerate([*tags, "O"]):
        prefix, name = (tag[0], tag[2:]) if tag != "O" else ("O", None)
        if start is not None and (prefix != "I" or name != kind):
            found.append((kind, start, i))
            start = None
        if prefix == "B" or prefix == "I" and start is None:
            start, kind = i, name
    return found


def _prf(correct: int, predicted: int, gold: int) -> dict[str, float]:
    precision = correct / predicted if predicted else 0.0
    recall = correct / gold if gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def entity_scores(gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]]) -> dict:
    """`f1`, `precision`, `recall` (micro, over exact spans), `accuracy` (of the word tags) and `by_type`:
    each gold or predicted type's precision, recall, F1 and `support` (its gold entities)."""
    gold_spans = [(s, span) for s, tags in enumerate(gold) for span in spans(tags)]
    pred_spans = [(s, span) for s, tags in enumerate(predicted) for span in spans(tags)]
    hits = set(gold_spans) & set(pred_spans)
    words = sum(len(tags) for tags in gold)
    right = sum(g == p for gs, ps in zip(gold, predicted) for g, p in zip(gs, ps))
    scores: dict = {**_prf(len(hits), len(pred_spans), len(gold_spans)), "accuracy": right / words if words else 0.0}
    counts = {what: Counter(span[0] for _, span in found) for what, found in (("g", gold_spans), ("p", pred_spans))}
    correct = Counter(span[0] for _, span in hits)
    scores["by_type"] = {
        kind: {**_prf(correct[kind], counts["p"][kind], counts["g"][kind]), "support": counts["g"][kind]}
        for kind in sorted(set(counts["g"]) | set(counts["p"]))
    }
    return scores


def dictionary(words: Sequence[Sequence[str]], tags: Sequence[Sequence[str]]) -> dict[str, str]:
    """Each training word's most frequent tag (the first seen of the most frequent on ties): the NER analogue of
    BM25, what memorising the training set scores."""
    seen: dict[str, Counter] = {}
    for sentence, sentence_tags in zip(words, tags):
        for word, tag in zip(sentence, sentence_tags):
            seen.setdefault(word, Counter())[tag] += 1
    return {word: counts.most_common(1)[0][0] for word, counts in seen.items()}


def baselines(train: tuple[list[list[str]], list[list[str]]], words: list[list[str]], gold: list[list[str]]) -> dict:
    """The all-O tagger's scores and the dictionary's (`train`: the training words and tags; unseen words O)."""
    table = dictionary(*train)
    return {
        "all_o": entity_scores(gold, [["O"] * len(s) for s in words]),
        "dictionary": entity_scores(gold, [[table.get(w, "O") for w in s] for s in words]),
    }
