"""A BEIR folder and a pairs file read into typed values, and each bad input the files can show refused
in one line naming the file and the id, record or line."""

import json
from pathlib import Path

import pytest

from cram.stages import StageError
from cram.stages.retrieval.beir import Pair, qrels_pairs, read_beir, read_pairs, without_leaks

CORPUS = [
    {"_id": "d1", "title": "Cats", "text": "Cats purr."},
    {"_id": "d2", "title": "", "text": "Dogs bark."},
    {"_id": 3, "text": "Birds sing."},  # an integer id and no title, as some BEIR sets have
]
QUERIES = [{"_id": "q1", "text": "what purrs"}, {"_id": "q2", "text": "what barks"}, {"_id": "q3", "text": "who sings"}]
TEST = "query-id\tcorpus-id\tscore\nq1\td1\t2\nq1\td2\t0\nq2\td2\t1\n"
TRAIN = "query-id\tcorpus-id\tscore\nq3\t3\t1\nq3\td1\t0\n"


def write_jsonl(path: Path, records: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def beir_folder(root: Path, corpus=CORPUS, queries=QUERIES, test=TEST, train=TRAIN) -> Path:
    (root / "qrels").mkdir(parents=True)
    write_jsonl(root / "corpus.jsonl", corpus)
    write_jsonl(root / "queries.jsonl", queries)
    (root / "qrels" / "test.tsv").write_text(test, encoding="utf-8")
    if train is not None:
        (root / "qrels" / "train.tsv").write_text(train, encoding="utf-8")
    return root


def test_a_beir_folder_reads_into_corpus_queries_and_qrels(tmp_path):
    beir = read_beir(beir_folder(tmp_path))
    assert list(beir.corpus) == ["d1", "d2", "3"]
    assert beir.corpus["d1"].full_text == "Cats Cats purr."
    assert beir.corpus["d2"].full_text == beir.corpus["d2"].text == "Dogs bark."
    assert beir.corpus["3"].title == ""
    assert beir.queries == {"q1": "what purrs", "q2": "what barks", "q3": "who sings"}
    assert beir.qrels == {"test": {"q1": {"d1": 2, "d2": 0}, "q2": {"d2": 1}}, "train": {"q3": {"3": 1, "d1": 0}}}
    # A judgement of 0 is no pair: only relevant documents train.
    assert qrels_pairs(beir) == (Pair("who sings", "Birds sing."),)


def test_a_byte_order_mark_opening_the_qrels_is_dropped(tmp_path):
    beir = read_beir(beir_folder(tmp_path, test="\ufeff" + TEST, train=None))
    assert beir.qrels["test"]["q1"] == {"d1": 2, "d2": 0}


@pytest.mark.parametrize("missing", ["corpus.jsonl", "queries.jsonl", "qrels/test.tsv"])
def test_a_folder_without_a_required_file_is_refused(tmp_path, missing):
    folder = beir_folder(tmp_path)
    (folder / missing).unlink()
    with pytest.raises(StageError, match=rf"{tmp_path}: not a BEIR folder: no {missing}$"):
        read_beir(folder)


BAD_FOLDERS = [
    (
        {"test": TEST + "q9\td1\t1\nq8\td1\t1\n"},
        r"qrels/test.tsv: 2 query ids not in queries.jsonl, the first 'q9'",
    ),
    ({"test": TEST + "q2\tnope\t1\n"}, r"qrels/test.tsv: 1 document id not in corpus.jsonl, the first 'nope'"),
    ({"train": TRAIN + "q1\tmissing\t1\n"}, r"qrels/train.tsv: 1 document id not in corpus.jsonl, the first 'missing'"),
    ({"test": TEST + "q2\td1\t0.5\n"}, r"qrels/test.tsv:5: score '0.5' is not an integer"),
    ({"test": TEST + "q2\td1\n"}, r"qrels/test.tsv:5: 2 fields; expected query-id, corpus-id, score"),
    ({"test": TEST + "q1\td1\t1\n"}, r"qrels/test.tsv:5: query 'q1' judges document 'd1' a second time"),
    ({"test": "q1\td1\t1\n"}, r"qrels/test.tsv: no header line"),
    ({"test": "query-id\tcorpus-id\tscore\n"}, r"qrels/test.tsv: no judgements"),
    # Judged, but nothing relevant: no test query could be scored (each metric would be 0 / 0, a NaN).
    (
        {"test": "query-id\tcorpus-id\tscore\nq1\td1\t0\nq2\td2\t0\nq2\td1\t-1\n"},
        r"qrels/test.tsv: every judgement scores 0 or less, so no query has a relevant document and no test query",
    ),
    ({"train": "query-id\tcorpus-id\tscore\nq3\t3\t0\n"}, r"qrels/train.tsv: every judgement .* no training pairs"),
    ({"corpus": [*CORPUS, {"_id": "d1", "text": "again"}]}, r"corpus.jsonl: 1 id given more than once, the first 'd1'"),
    ({"queries": [*QUERIES, {"_id": "q2", "text": "x"}]}, r"queries.jsonl: 1 id given more than once, the first 'q2'"),
    ({"corpus": [*CORPUS, {"_id": "d4", "title": " ", "text": ""}]}, r"corpus.jsonl: document 'd4' has an empty"),
    ({"queries": [*QUERIES, {"_id": "q4", "text": "  "}]}, r"queries.jsonl: query 'q4' has an empty text"),
    ({"queries": [*QUERIES, {"text": "no id"}]}, r"queries.jsonl: record 4 has no '_id'"),
    ({"corpus": [*CORPUS, {"_id": "d5", "title": "t"}]}, r"corpus.jsonl: record 'd5' has no 'text'$"),
    ({"corpus": [*CORPUS, {"_id": "d5", "text": 7}]}, r"corpus.jsonl: record 'd5': text field 'text' holds int 7"),
]


@pytest.mark.parametrize(("change", "message"), BAD_FOLDERS)
def test_each_bad_folder_is_refused_in_one_line_naming_file_and_id(tmp_path, change, message):
    with pytest.raises(StageError, match=message) as error:
        read_beir(beir_folder(tmp_path, **change))
    assert "\n" not in str(error.value)


def test_a_corpus_that_is_not_utf8_is_refused_naming_the_file(tmp_path):
    folder = beir_folder(tmp_path)
    (folder / "corpus.jsonl").write_bytes(b'{"_id": "d1", "text": "caf\xe9"}\n')
    with pytest.raises(StageError, match=r"corpus.jsonl: not UTF-8 text"):
        read_beir(folder)


def test_a_pairs_file_reads_with_and_without_negatives(tmp_path):
    write_jsonl(tmp_path / "p.jsonl", [{"query": "a", "positive": "b"}, {"query": "c", "positive": "d"}])
    assert read_pairs(tmp_path / "p.jsonl") == (Pair("a", "b"), Pair("c", "d"))
    write_jsonl(tmp_path / "n.jsonl", [{"query": "a", "positive": "b", "negative": "x"}])
    (pair,) = read_pairs(tmp_path / "n.jsonl")
    assert pair.texts == ("a", "b", "x")


BAD_PAIRS = [
    ([{"query": "a"}], r"p.jsonl: record 1 has no 'positive'"),
    ([{"query": "a", "positive": "b"}, {"positive": "b"}], r"p.jsonl: record 2 has no 'query'"),
    ([{"query": "a", "positive": ["b"]}], r"p.jsonl: record 1: text field 'positive' holds list \['b'\], not text"),
    ([{"query": "a", "positive": " "}], r"p.jsonl: record 1 has an empty 'positive'"),
    (
        [{"query": "a", "positive": "b", "negative": "c"}, {"query": "d", "positive": "e"}],
        r"p.jsonl: 1 of 2 records have a 'negative' \(record 2 has none\)",
    ),
    ([], r"p.jsonl: no pairs"),
    # Two texts of a record that are one text (whitespace at either end aside): named by line and record.
    (
        [{"query": "a", "positive": "b", "negative": "c"}, {"query": "d", "positive": "e", "negative": " e\n"}],
        r"p.jsonl:2: record 2: its 'negative' is the same text as its 'positive'; a pair's texts must differ",
    ),
    ([{"query": "a", "positive": "b"}, {"query": "same", "positive": "same"}], r"p.jsonl:2: .*'positive' .* 'query'"),
    ([{"query": "a", "positive": "b", "negative": "a"}], r"p.jsonl:1: record 1: its 'negative' .* its 'query'"),
]


@pytest.mark.parametrize(("records", "message"), BAD_PAIRS)
def test_each_bad_pairs_file_is_refused_naming_the_record(tmp_path, records, message):
    write_jsonl(tmp_path / "p.jsonl", records)
    with pytest.raises(StageError, match=message):
        read_pairs(tmp_path / "p.jsonl")


def test_a_pairs_line_that_is_not_json_names_its_line(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"query": "a", "positive": "b"}\n{"query": \n', encoding="utf-8")
    with pytest.raises(StageError, match=r"p.jsonl:2: not JSON"):
        read_pairs(tmp_path / "p.jsonl")


def test_training_pairs_holding_test_queries_are_dropped_and_counted(tmp_path):
    beir = read_beir(beir_folder(tmp_path))
    kept = (Pair("who sings", "Birds sing."),)  # q3 is a training query
    assert without_leaks(beir, kept) == (kept, 0)
    leaking = (Pair("what barks", "x"), Pair("what purrs ", "y"), Pair("what barks", "z"), Pair("other", "w"))
    assert without_leaks(beir, leaking) == ((Pair("other", "w"),), 3)
