"""Small retrieval sets the retrieval task's tests write: a BEIR folder whose queries name two topics and
whose relevant documents hide the topics' own words among filler words, so that an encoder must learn
from the titles (which name the topics as queries do) which words a name stands for: an untrained one
cannot, and BM25 finds the titled training documents instead."""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPIC = [f"topic{i}" for i in range(14)]  # x0..x9 as topic0..topic9, y0..y3 as topic10..topic13
NAMES = [f"name{i}" for i in range(14)]  # what titles and queries call them
FILLER = "the a of and in on at to is was it as by for with from this that".split()


def topic(k: int, words: list[str] = TOPIC) -> str:
    """Document k's two topic words: x_i y_j, each (i, j) of 10 x 4 once (`words=NAMES`: their names, as
    titles and queries give them). The first 10 documents, the test answers, take j = -i mod 4, so that
    each of their words is in training documents too."""
    cells = [(i, -i % 4) for i in range(10)]
    cells += [(i, j) for j in range(4) for i in range(10) if (i, j) not in cells]
    i, j = cells[k % 40]
    return f"{words[i]} {words[10 + j]}"


def doc_text(k: int, rng: random.Random) -> str:
    """The filler words in one order for every document, its two topic words at places drawn by `rng`:
    only the topic words tell documents apart (no filler pattern to memorise)."""
    words = FILLER[:12]
    for word in topic(k).split():
        at = rng.randrange(len(words) + 1)
        words = [*words[:at], word, *words[at:]]
    return " ".join(words)


def write_beir(
    folder: Path, documents: int = 40, tests: int = 10, train_qrels: bool = False, titles: bool = True
) -> Path:
    """A BEIR folder: documents 0..tests-1 are the test queries' answers (untitled), the others carry
    their topic words as a title where `titles`; qrels/train.tsv judges those where `train_qrels`."""
    rng = random.Random(0)
    (folder / "qrels").mkdir(parents=True)
    with open(folder / "corpus.jsonl", "w") as f:
        for i in range(documents):
            title = topic(i, NAMES) if titles and i >= tests else ""
            f.write(json.dumps({"_id": f"d{i}", "title": title, "text": doc_text(i, rng)}) + "\n")
    with open(folder / "queries.jsonl", "w") as f:
        for i in range(documents):
            f.write(json.dumps({"_id": f"q{i}", "text": topic(i, NAMES)}) + "\n")
    header = "query-id\tcorpus-id\tscore\n"
    (folder / "qrels" / "test.tsv").write_text(header + "".join(f"q{i}\td{i}\t1\n" for i in range(tests)))
    if train_qrels:
        rows = "".join(f"q{i}\td{i}\t1\n" for i in range(tests, documents))
        (folder / "qrels" / "train.tsv").write_text(header + rows)
    return folder


def write_pairs(path: Path, count: int = 30, negative: bool = False) -> Path:
    rng = random.Random(1)
    with open(path, "w") as f:
        for i in range(10, 10 + count):
            record = {"query": topic(i, NAMES), "positive": doc_text(i, rng)}
            if negative:
                record["negative"] = doc_text(i + 1, rng)
            f.write(json.dumps(record) + "\n")
    return path
