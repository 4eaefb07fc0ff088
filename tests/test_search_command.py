"""`cram search`: hits as `cram embed`'s vectors and BM25 give them (dense, bm25, and their fusion, the
default); the corpus index built once, reused while the corpus and model are unchanged, built anew when
the corpus changes, never left half-built; ids from the records; bad options one line, exit 2."""

import json

import numpy as np
import pytest
from test_classifier_export import sp_model  # noqa: F401 (a fixture)
from test_embed import EAGER, embedder_run

from cram.pipeline.commands.embed import embed
from cram.stages.kept import searching
from cram.stages.kept.embedding import Request
from cram.stages.retrieval import bm25
from cram.stages.retrieval.fusion import Fusion, fuse

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = [
    "The cat sat on the mat all day.",
    "Dogs bark at the postman.",
    "A quick brown fox jumps over the lazy dog.",
    "Stock markets fell sharply on Monday.",
    "The mat was red and the cat was black.",
    "Rain is expected over the weekend.",
    "Cats and dogs can live together.",
]
QUERIES = ["where did the cat sit", "weather this weekend", "markets"]


@pytest.fixture
def run(tmp_path, sp_model):  # noqa: F811
    return embedder_run(tmp_path, sp_model)


@pytest.fixture
def files(tmp_path):
    corpus, queries = tmp_path / "docs.txt", tmp_path / "queries.txt"
    corpus.write_text("\n".join(DOCS) + "\n")
    queries.write_text("\n".join(QUERIES) + "\n")
    return corpus, queries


def invoke(run, corpus, queries, out, *args):
    from typer.testing import CliRunner

    from cram.pipeline.commands import cli

    command = ["search", str(run), str(queries), "--corpus", str(corpus), "--out", str(out), "--precision", "fp32"]
    return CliRunner().invoke(cli.app, [*command, "--cache", str(out.parent / "cache"), *map(str, args)])


def hits(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def expected_runs(run, tmp_path, corpus, queries):
    """Each query's dense run (cosine over `cram embed`'s fp32 vectors) and BM25 run, by corpus row."""
    docs, found = tmp_path / "d.npy", tmp_path / "q.npy"
    embed(run, [corpus], docs, request=Request(precision="fp32"), settings=EAGER)
    embed(run, [queries], found, request=Request(precision="fp32", query=True), settings=EAGER)
    cosine = np.load(found) @ np.load(docs).T
    index = bm25.index(DOCS)
    lexical = [dict(zip(*(a.tolist() for a in bm25.search(index, q, 100)))) for q in QUERIES]
    return [dict(enumerate(row.tolist())) for row in cosine], lexical


def best(run, k):
    return sorted(run, key=lambda doc: (-run[doc], doc))[:k]


def test_each_mode_ranks_as_embed_and_bm25_do(tmp_path, run, files):
    corpus, queries = files
    dense, lexical = expected_runs(run, tmp_path, corpus, queries)
    for mode, expected in [
        ("dense", dense),
        ("bm25", lexical),
        ("hybrid", [fuse(d, lx, Fusion()) for d, lx in zip(dense, lexical)]),
    ]:
        out = tmp_path / f"{mode}.jsonl"
        result = invoke(run, corpus, queries, out, "--mode", mode, "--top-k", 3)
        assert result.exit_code == 0, result.output
        found = hits(out)
        assert [h["query"] for h in found] == [0, 1, 2]
        for record, want in zip(found, expected):
            assert [int(h["id"]) for h in record["hits"]] == best(want, 3), (mode, record)
            scores = [h["score"] for h in record["hits"]]
            assert scores == pytest.approx([want[d] for d in best(want, 3)], abs=2e-3)  # fp16 embeddings on disk


def test_the_index_is_built_once_and_built_anew_when_the_corpus_changes(tmp_path, run, files, monkeypatch):
    corpus, queries = files
    first = invoke(run, corpus, queries, tmp_path / "a.jsonl")
    assert first.exit_code == 0 and "index built" in first.output, first.output
    monkeypatch.setattr(searching, "_build", lambda *a: pytest.fail("the index was built again"))
    again = invoke(run, corpus, queries, tmp_path / "b.jsonl")
    assert again.exit_code == 0 and "index reused" in again.output, again.output
    assert hits(tmp_path / "a.jsonl") == hits(tmp_path / "b.jsonl")
    monkeypatch.undo()
    corpus.write_text("\n".join(DOCS[:3]) + "\n")
    changed = invoke(run, corpus, queries, tmp_path / "c.jsonl", "--mode", "bm25")
    assert changed.exit_code == 0 and "over 3 documents" in changed.output and "index built" in changed.output
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_a_failed_build_leaves_no_entry_and_no_temporary_folder(tmp_path, run, files, monkeypatch):
    corpus, queries = files

    def broken(texts):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bm25, "index", broken)
    result = invoke(run, corpus, queries, tmp_path / "a.jsonl")
    assert result.exit_code != 0 and "No space left on device" in result.output, result.output
    assert list((tmp_path / "cache").iterdir()) == [] and not (tmp_path / "a.jsonl").exists()


def test_ids_come_from_the_records(tmp_path, run):
    corpus, queries = tmp_path / "docs.jsonl", tmp_path / "q.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"doc-{i}", "body": t}) + "\n" for i, t in enumerate(DOCS)))
    queries.write_text("".join(json.dumps({"qid": f"q{i}", "text": t}) + "\n" for i, t in enumerate(QUERIES)))
    out = tmp_path / "hits.jsonl"
    args = ("--field", "body", "--id-field", "_id", "--query-id-field", "qid", "--mode", "bm25", "--top-k", 1)
    result = invoke(run, corpus, queries, out, *args)
    assert result.exit_code == 0, result.output
    assert hits(out) == [
        {"query": "q0", "hits": [{"id": "doc-0", "score": pytest.approx(hits(out)[0]["hits"][0]["score"])}]},
        {"query": "q1", "hits": [{"id": "doc-5", "score": pytest.approx(hits(out)[1]["hits"][0]["score"])}]},
        {"query": "q2", "hits": [{"id": "doc-3", "score": pytest.approx(hits(out)[2]["hits"][0]["score"])}]},
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (("--mode", "sparse"), "--mode: 'sparse' is not one of hybrid, dense, bm25"),
        (("--weight", 1.5), "--weight: 1.5 must be in [0, 1]"),
        (("--fusion", "max"), "--fusion: 'max' is not one of convex, rrf"),
        (("--top-k", 0), "--top-k: 0 must be at least 1"),
    ],
)
def test_bad_options_are_one_line_exit_2_and_write_nothing(tmp_path, run, files, args, message):
    corpus, queries = files
    out = tmp_path / "hits.jsonl"
    result = invoke(run, corpus, queries, out, *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not out.exists()


def test_a_corpus_record_without_the_field_is_named(tmp_path, run, files):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"text": "one"}\n{"body": "two"}\n')
    result = invoke(run, corpus, files[1], tmp_path / "hits.jsonl")
    assert result.exit_code == 2 and "docs.jsonl" in result.output and "record 2" in result.output, result.output
    assert not (tmp_path / "cache").exists() and not (tmp_path / "hits.jsonl").exists()


def test_an_output_that_is_not_json_lines_is_refused(tmp_path, run, files):
    corpus, queries = files
    result = invoke(run, corpus, queries, tmp_path / "hits.npy")
    assert result.exit_code == 2 and ".npy" in result.output, result.output


def test_hybrid_takes_the_fusion_the_model_was_kept_with():
    from types import SimpleNamespace

    def kept(meta):
        return SimpleNamespace(embedder=SimpleNamespace(meta=meta))

    assert searching.model_fusion(kept({"fusion": {"method": "rrf", "weight": 0.5, "rrf_k": 30}})) == Fusion(
        "rrf", 0.5, 30
    )
    assert searching.model_fusion(kept({})) == Fusion()
