"""The own-corpus examples of docs/corpus.md work: each `[tokenize.corpus]` table, put in place of the default
one in a copy of pipeline.toml, passes `cram run --dry-run` over a small file of its format, and is
read into the documents the file holds."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cram.pipeline.commands import cli
from cram.pipeline.config import tomllib
from cram.stages.data.corpus import documents, units
from cram.stages.data.source import CorpusConfig

REPO = Path(__file__).resolve().parents[1]


def examples() -> list[str]:
    text = (REPO / "docs" / "corpus.md").read_text(encoding="utf-8")
    section = text.split("## Your own corpus\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```toml\n(.*?)```", section, re.S)


def write_sample(corpus: dict, folder: Path) -> list[str]:
    """A small file of the example's format at its (first) path; the documents it holds."""
    path = folder / corpus["paths"][0].replace("*", "sample")
    path.parent.mkdir(parents=True, exist_ok=True)
    texts = [f"Document {i} is about thing {i % 3}." for i in range(12)]
    fields = [corpus.get("text_field", "extract"), corpus.get("title_field"), corpus.get("label_field")]
    records = [{fields[0]: t, fields[1]: f"title {i}", fields[2]: f"topic {i % 3}"} for i, t in enumerate(texts)]
    if path.suffix == ".txt":
        path.write_text("\n\n".join(texts) + "\n")
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(records)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    return texts


def test_the_corpus_page_has_an_example_a_format():
    suffixes = {Path(tomllib.loads(e)["tokenize"]["corpus"]["paths"][0]).suffix for e in examples()}
    assert suffixes == {".txt", ".jsonl", ".csv", ".parquet"}


@pytest.mark.parametrize("example", examples(), ids=lambda e: Path(re.search(r'paths = \["(.*?)"', e)[1]).suffix)
def test_each_own_corpus_example_passes_a_dry_run_and_reads(example, tmp_path, monkeypatch, plain_machine):
    monkeypatch.chdir(tmp_path)
    corpus = tomllib.loads(example)["tokenize"]["corpus"]
    texts = write_sample(corpus, tmp_path)
    pipeline = (REPO / "pipeline.toml").read_text()
    pipeline = re.sub(r"\[tokenize\.corpus\]\n(?:[^\[\n][^\n]*\n|\n)*", example + "\n", pipeline)
    (tmp_path / "own.toml").write_text(pipeline)
    args = ["run", "own.toml", "--dry-run", "--set", 'run.root="runs"']
    if corpus["paths"][0].endswith(".txt"):  # no labels: docs/corpus.md says to set evaluate.tasks = []
        args += ["--set", "evaluate.tasks=[]"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "runs").exists()
    config = CorpusConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in corpus.items()})
    read = [t for unit in units(config) for batch in documents(unit, config) for t in batch["text"]]
    assert read == texts
