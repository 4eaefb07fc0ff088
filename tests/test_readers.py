"""What real corpora hold: lines far longer than a unit (read in time linear in the bytes, cut or
skipped and counted), byte-order marks, CSV/TSV files with quoted line breaks, formats told by the
extension, and a wrong format or a missing label field named before any stage runs."""

from __future__ import annotations

import io
import json
import re
from types import SimpleNamespace

import pytest

from cram.stages import StageError, evaluate, tokenize
from cram.stages.data import corpus, readers
from cram.stages.data.corpus import documents, units
from cram.stages.data.source import CorpusConfig
from cram.stages.evaluate import TaskConfig


def files(*paths, **kw) -> CorpusConfig:
    return CorpusConfig(kind="files", paths=tuple(str(p) for p in paths), **kw)


def read(config: CorpusConfig, tally: dict[str, int] | None = None) -> dict[str, list[str]]:
    columns: dict[str, list[str]] = {"text": [], "title": [], "label": []}
    for unit in units(config):
        for batch in documents(unit, config, batch_size=7, tally=tally):
            for name in columns:
                columns[name] += batch[name]
    return columns


@pytest.fixture
def bytes_read(monkeypatch) -> list[int]:
    """Every byte the corpus code reads from a corpus file, counted."""
    counted = [0]

    class Counting(io.FileIO):
        def read(self, size: int = -1) -> bytes:
            data = super().read(size)
            counted[0] += len(data)
            return data

    def counting_open(path):
        return Counting(path, "rb")

    monkeypatch.setattr(readers, "open_file", counting_open)
    return counted


@pytest.fixture
def small_limits(monkeypatch) -> int:
    """Units of 64 KiB and documents of at most 256 Ki characters: a few MB show what GBs would."""
    monkeypatch.setattr(corpus, "UNIT_BYTES", 64 << 10)
    monkeypatch.setattr(readers, "MAX_DOCUMENT_CHARS", 256 << 10)
    return 256 << 10


@pytest.mark.parametrize("text_unit", ["paragraph", "line"])
def test_a_line_far_longer_than_a_unit_is_cut_into_units_reading_each_byte_once(
    tmp_path, small_limits, bytes_read, text_unit
):
    words = " ".join(f"w{i % 977}" for i in range(600_000))  # ~3 MB on one line
    path = tmp_path / "long.txt"
    path.write_text(f"A short first line.\n\n{words}\n\nA short last line.\n")
    size = path.stat().st_size
    pieces = units(files(path, text_unit=text_unit))
    assert bytes_read[0] <= size + (8 << 10)  # each byte looked at once (the old search re-read 1 MiB a byte)
    assert len(pieces) >= 3 and all(u.stop - u.start <= 4 * small_limits + (1 << 20) for u in pieces)
    tally: dict[str, int] = {}
    docs = read(files(path, text_unit=text_unit), tally)["text"]
    assert docs[0] == "A short first line." and docs[-1] == "A short last line."
    assert all(len(d) <= small_limits for d in docs)
    assert " ".join(docs[1:-1]).split() == words.split()  # cut between words, nothing lost
    assert tally == {"documents_cut": len(docs) - 3, "records_skipped": 0}


def test_a_json_line_over_the_limit_is_skipped_and_counted_once(tmp_path, small_limits, bytes_read):
    huge = json.dumps({"extract": "x " * 2_000_000, "title": "huge"})  # 4 MB: cut into many units
    lines = [json.dumps({"extract": f"Doc {i}.", "title": str(i)}) for i in range(6)]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join([*lines[:3], huge, *lines[3:]]) + "\n")
    assert len(units(files(path))) >= 3 and bytes_read[0] <= path.stat().st_size + (8 << 10)
    tally: dict[str, int] = {}
    assert read(files(path), tally)["text"] == [f"Doc {i}." for i in range(6)]
    assert tally == {"documents_cut": 0, "records_skipped": 1}


def test_a_broken_long_json_line_is_refused_with_its_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"extract": "ok"}\n{"extract": "' + "x" * 3_000_000 + "\n")
    with pytest.raises(StageError, match=r"c.jsonl:2: not valid JSON"):
        read(files(path))


@pytest.mark.parametrize(
    "name, content, fmt",
    [
        ("a.txt", "First.\n\nSecond.\n", "auto"),
        ("a.jsonl", '{"extract": "First."}\n{"extract": "Second."}\n', "auto"),
        ("a.json", '[{"extract": "First."}, {"extract": "Second."}]', "auto"),
        ("a.csv", "extract,title\nFirst.,t1\nSecond.,t2\n", "auto"),
        ("a.tsv", "extract\ttitle\nFirst.\tt1\nSecond.\tt2\n", "auto"),
    ],
)
def test_a_utf8_byte_order_mark_is_dropped(tmp_path, name, content, fmt):
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + content.encode())
    cfg = files(path, format=fmt)
    tokenize.validate(tokenize.Config(corpus=cfg), SimpleNamespace(stages={}))
    assert read(cfg)["text"] == ["First.", "Second."]


def test_csv_and_tsv_by_column_name_with_quoted_line_breaks_cut_into_units(tmp_path, monkeypatch):
    rows = ["label,body,name,extra"] + [
        f'{"Uncategorized" if i % 4 == 0 else f"t{i % 3}"},"Doc {i} says ""hi"",\nthen more.",n{i},x' for i in range(60)
    ]
    path = tmp_path / "c.csv"
    path.write_text("\n".join(rows) + "\n")
    cfg = files(path, text_field="body", title_field="name", label_field="label")
    assert cfg.format == "csv"
    whole = read(cfg)
    assert whole["text"][1] == 'Doc 1 says "hi",\nthen more.' and len(whole["text"]) == 60
    assert whole["title"][1] == "n1" and whole["label"][:2] == ["", "t1"]
    monkeypatch.setattr(corpus, "UNIT_BYTES", 40)
    cut = units(cfg)
    assert len(cut) > 10 and read(cfg) == whole  # no cut inside a quoted field
    tsv = tmp_path / "c.tsv"
    tsv.write_text("body\tlabel\n" + "".join(f'"a\tb {i}"\tt{i}\n' for i in range(30)))
    assert read(files(tsv, text_field="body"))["text"][:2] == ["a\tb 0", "a\tb 1"]


@pytest.mark.parametrize(
    "content, message",
    [
        ("extract,title\nok,t\nnot,enough,fields,here\n", r"c.csv:3: 4 fields where the header has 2"),
        ('extract,title\nok,t\n"open,t\n', r"c.csv:3: unexpected end of data"),
        ("text,title\nok,t\n", r"c.csv: no text column 'extract' \(tokenize.corpus.text_field\); columns are: text"),
    ],
)
def test_bad_csv_names_the_file_and_line(tmp_path, content, message):
    (tmp_path / "c.csv").write_text(content)
    with pytest.raises(StageError, match=message) as error:
        read(files(tmp_path / "c.csv"))
    assert "\n" not in str(error.value)


def test_the_format_comes_from_the_extension(tmp_path):
    assert files("data/*.txt").format == "text" and files("a.md", "b.text").format == "text"
    assert files("x.ndjson").format == "jsonl" and files("x.parquet").format == "parquet"
    assert files("x.tsv").format == "tsv" and files("x.JSON").format == "json"
    assert files("no-extension").format == "auto" and files("a.txt", "b.jsonl").format == "auto"
    assert CorpusConfig().format == "json"  # the default package corpus, its cache key unchanged
    assert CorpusConfig(kind="hub", name="x").format == "json"
    (tmp_path / "a.txt").write_text("Plain text.\n")
    (tmp_path / "b.jsonl").write_text('{"extract": "A record."}\n')
    assert read(files(tmp_path / "*"))["text"] == ["Plain text.", "A record."]  # each file by its own


@pytest.mark.parametrize(
    "name, content, fmt, message",
    [
        (
            "a.txt",
            "The Tragedie of Hamlet\n",
            "json",
            'a.txt: not JSON (starts with "The Tragedie"); set tokenize.corpus.format = "text"',
        ),
        (
            "a.json",
            '{"extract": "x"}\n{"extract": "y"}\n',
            "csv",
            'not CSV (starts with "{"extract": "); set tokenize.corpus.format = "jsonl"',
        ),
        ("a.data", "[1, 2]", "jsonl", 'not JSON lines (starts with "[1, 2]"); set tokenize.corpus.format = "json"'),
        (
            "a.data",
            "extract,title\nx,y\n",
            "auto",
            'not JSON (starts with "extract,titl"); set tokenize.corpus.format = "csv"',
        ),
        ("a.data", "PAR1\x00\x01", "jsonl", 'set tokenize.corpus.format = "parquet"'),
    ],
)
def test_validate_names_the_format_a_file_looks_like(tmp_path, name, content, fmt, message):
    (tmp_path / name).write_text(content)
    config = tokenize.Config(corpus=files(tmp_path / name, format=fmt))
    with pytest.raises(StageError) as error:
        tokenize.validate(config, SimpleNamespace(stages={}))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_records_without_the_label_field_are_named_when_topics_are_classified(tmp_path):
    import datasets

    from cram.stages.finetuning import tasks

    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"extract": f"Doc {i}.", "category": "x"}) + "\n" for i in range(20)))
    topics = SimpleNamespace(stages={"evaluate": evaluate.Config(tasks=[TaskConfig(kind="heldout-topic")])})
    config = tokenize.Config(corpus=files(path))
    tokenize.validate(config, SimpleNamespace(stages={}))  # no topic task: labels are not needed
    with pytest.raises(StageError, match=r"c.jsonl: records without the label field 'topic' \(tokenize.corpus"):
        tokenize.validate(config, topics)
    tokenize.validate(tokenize.Config(corpus=files(path, label_field="category")), topics)
    csv_path = tmp_path / "c.csv"
    csv_path.write_text("extract,title\na,b\n")
    with pytest.raises(StageError, match=r"c.csv: records without the label field 'topic'"):
        tokenize.validate(tokenize.Config(corpus=files(csv_path)), topics)
    # Read later, held-out articles with no label at all say why, not "fewer than two topics".
    datasets.Dataset.from_dict({"text": ["a", "b"], "title": ["1", "2"], "label": ["", ""]}).save_to_disk(
        str(tmp_path / "held")
    )
    with pytest.raises(StageError, match=r"records without the label field: none of the 2 held-out"):
        tasks.load_topics("topic", tmp_path / "held", 0.2)


# ------------------------------------------------------------- the files tasks and `cram predict` read


def test_tsv_input_has_no_quoting_a_quote_is_text_and_never_joins_lines(tmp_path):
    from cram.stages.shared.taskfiles import iter_texts

    lines = ['"Quoted" at the start', 'a "b', "plain", '"open quote', 'end"']
    path = tmp_path / "in.tsv"
    path.write_text("text\n" + "".join(f"{line}\n" for line in lines))
    assert list(iter_texts(path, ["text"])) == [(line,) for line in lines]


def test_a_long_field_is_read_and_one_past_the_limit_is_named(tmp_path, default_csv_field_limit, monkeypatch):
    from cram.stages.shared import taskfiles

    long = "word " * 40_000  # 200,000 characters: past csv's default field limit
    for name in ("in.csv", "in.tsv"):
        path = tmp_path / name
        path.write_text(f"text\nshort\n{long}\n")
        assert list(taskfiles.iter_texts(path, ["text"])) == [("short",), (long.rstrip("\n"),)]
    monkeypatch.setattr(taskfiles, "MAX_FIELD_CHARS", 100_000)
    with pytest.raises(StageError) as refused:
        list(taskfiles.iter_texts(tmp_path / "in.csv", ["text"]))
    assert str(refused.value) == (
        f"{tmp_path / 'in.csv'}: record 2: field 'text' holds 200,000 characters, over the 100,000 a field may hold"
    )


def test_input_extensions_are_told_in_any_case(tmp_path):
    from cram.stages.shared.taskfiles import iter_texts

    (tmp_path / "x.CSV").write_text('text\n"a, b"\n')
    (tmp_path / "x.TSV").write_text('text\n"a\n')
    (tmp_path / "x.TXT").write_text("one\n\ntwo\n")
    (tmp_path / "x.JSONL").write_bytes(b'\xef\xbb\xbf{"text": "j"}\n')
    assert list(iter_texts(tmp_path / "x.CSV", ["text"])) == [("a, b",)]
    assert list(iter_texts(tmp_path / "x.TSV", ["text"])) == [('"a',)]
    assert list(iter_texts(tmp_path / "x.TXT", ["text"])) == [("one",), ("two",)]
    assert list(iter_texts(tmp_path / "x.JSONL", ["text"])) == [("j",)]


@pytest.mark.parametrize("value", ["3", "2.5", '{"a": 1}', '["x"]', "true", '"\\udc00 x"'])
def test_an_input_text_that_is_no_text_is_refused_naming_file_and_line(tmp_path, value):
    from cram.stages.shared.taskfiles import iter_texts

    path = tmp_path / "in.jsonl"
    path.write_text(f'{{"text": "fine"}}\n\n{{"text": {value}}}\n')
    with pytest.raises(StageError, match=rf"^{re.escape(str(path))}:3: record 2: (text )?field 'text' holds"):
        list(iter_texts(path, ["text"]))
