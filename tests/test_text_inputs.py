"""One reader, strict, for every text input (stages/shared/taskfiles.py): CSV whose quoting is malformed is
refused naming the file and the record's line, never read as merged rows; plain text and JSON lines end a
line only at \\n or \\r\\n, so a stray \\r splits nothing; and every text, a BEIR corpus's and a pairs file's
too, is checked the same way (a lone surrogate, a length past the limit)."""

import json

import pytest

from cram.stages import StageError
from cram.stages.retrieval.beir import read_beir, read_pairs
from cram.stages.shared import taskfiles
from cram.stages.shared.taskfiles import iter_texts, read_rows

# The battery's case: 5 lines of text, which csv without `strict` read as 3 texts, exit 0.
MALFORMED = 'text\n"Quoted" start of a line\nplain line two\n"unbalanced quote line three\nline four\nline five\n'


def test_malformed_csv_quoting_is_refused_naming_the_file_and_the_records_line(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text(MALFORMED)
    with pytest.raises(StageError, match=r"in.csv:2: record 1: ',' expected after '\"'") as error:
        list(iter_texts(path, ["text"]))
    assert "\n" not in str(error.value)
    # A quote opened and never closed: the record starts at line 3, the file ends inside it.
    path.write_text('text,label\nfine,0\n"unbalanced, 1\nline four,0\nline five,1\n')
    with pytest.raises(StageError, match=r"in.csv:3: record 2: unexpected end of data"):
        read_rows(path, ["text"], "label")


def test_well_formed_csv_keeps_quoted_commas_new_lines_doubled_quotes_and_bare_quotes(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text('text\n"a, b"\n"two\nlines"\n"say ""hi"""\nhe said "no" twice\n')
    assert list(iter_texts(path, ["text"])) == [("a, b",), ("two\nlines",), ('say "hi"',), ('he said "no" twice',)]


def test_a_stray_carriage_return_splits_no_line_of_text_or_json_lines(tmp_path):
    text = tmp_path / "in.txt"
    text.write_bytes(b"one\r\ntwo with a stray \r inside\r\nthree\n")
    assert list(iter_texts(text, ["text"])) == [("one",), ("two with a stray \r inside",), ("three",)]
    lines = tmp_path / "in.jsonl"
    lines.write_bytes(b'{"text": "a"}\r\n{"text": "b",\r "label": 1}\n{"text": "c"}\n')
    assert list(iter_texts(lines, ["text"])) == [("a",), ("b",), ("c",)]
    # The line of a record after one with a stray \r is still its line in an editor.
    lines.write_bytes(b'{"text": "a",\r "x": 1}\n{"text": 5}\n')
    with pytest.raises(StageError, match=r"in.jsonl:2: record 2: text field 'text' holds int 5"):
        list(iter_texts(lines, ["text"]))


def write_beir(folder, corpus_text="Cats purr.", query_text="what purrs"):
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text(json.dumps({"_id": "d1", "title": "Cats", "text": corpus_text}) + "\n")
    (folder / "queries.jsonl").write_text(json.dumps({"_id": "q1", "text": query_text}) + "\n")
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    return folder


@pytest.mark.parametrize("where", ["corpus", "queries"])
def test_beir_text_is_checked_as_a_task_files_text_is(tmp_path, where, monkeypatch):
    surrogate = "cat \ud83d purrs"  # json.dumps writes it as the escape "\ud83d"
    folder = write_beir(tmp_path / "lone", **{f"{'corpus' if where == 'corpus' else 'query'}_text": surrogate})
    file = f"{where}.jsonl"
    record = "'d1'" if where == "corpus" else "'q1'"
    with pytest.raises(StageError, match=rf"{file}: record {record}: field 'text' holds a lone surrogate \\ud83d"):
        read_beir(folder)
    monkeypatch.setattr(taskfiles, "MAX_FIELD_CHARS", 15)
    with pytest.raises(StageError, match=rf"{file}: record {record}: field 'text' holds 20 characters, over the 15"):
        read_beir(write_beir(tmp_path / "long", **{"corpus_text" if where == "corpus" else "query_text": "x" * 20}))


def test_a_pairs_files_text_is_checked_as_a_task_files_text_is(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"query": "a", "positive": "b \udc00"}) + "\n")
    with pytest.raises(StageError, match=r"p.jsonl: record 1: field 'positive' holds a lone surrogate \\udc00"):
        read_pairs(path)


def test_a_glue_tsvs_text_is_checked_as_every_text_is(tmp_path, monkeypatch):
    path = tmp_path / "train.tsv"
    path.write_text('sentence\tlabel\na "quoted" cat\t1\n' + "x" * 20 + "\t0\n")
    monkeypatch.setattr(taskfiles, "MAX_FIELD_CHARS", 15)
    with pytest.raises(StageError, match=r"train.tsv:3: field 'sentence' holds 20 characters, over the 15"):
        taskfiles.read_tsv(path, ("sentence",), "label")
    monkeypatch.undo()
    assert taskfiles.read_tsv(path, ("sentence",), "label") == ([('a "quoted" cat',), ("x" * 20,)], ["1", "0"])
    path.write_bytes(b"sentence\tlabel\ncaf\xe9\t1\n")
    with pytest.raises(StageError, match=r"train.tsv: not UTF-8 text"):
        taskfiles.read_tsv(path, ("sentence",), "label")
