"""BEIR's identical-id rule as a retrieval task's setting (`ignore_identical_ids`, on by default as BEIR's
evaluator has it): on a set where a test query is also a corpus document (ArguAna, Quora), the document
with the query's own id is dropped from every scoring (BM25's baseline, the encoder as it was, each seed,
dense and hybrid) by default, and kept, ranked first, when the setting is false."""

from __future__ import annotations

import json

import pytest
from retrieval_sets import write_beir
from test_retrieval_task import embedder, seed_runs, task_of

from cram.stages.evaluating.config import Config
from cram.stages.retrieval import results
from cram.stages.retrieval.metrics import ranking, score_run
from cram.stages.retrieval.tuning import RetrievalLoaded
from cram.stages.tasks.config import TaskConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def with_query_as_document(folder):
    """The set with test query q0 also a corpus document of id "q0" and its text, which no query judges, and
    a document a0 that q0 finds relevant, its text and two filler words: second to "q0" for BM25."""
    query = json.loads((folder / "queries.jsonl").read_text().splitlines()[0])
    assert query["_id"] == "q0"
    with open(folder / "corpus.jsonl", "a") as f:
        f.write(json.dumps({"_id": "q0", "title": "", "text": query["text"]}) + "\n")
        f.write(json.dumps({"_id": "a0", "title": "", "text": query["text"] + " the of"}) + "\n")
    with open(folder / "qrels" / "test.tsv", "a") as f:
        f.write("q0\ta0\t1\n")
    return folder


def scored(tmp_path, make_ctx, **task) -> tuple[RetrievalLoaded, dict]:
    config, loaded = task_of(with_query_as_document(write_beir(tmp_path / "set")), epochs=1, batch_size=8, **task)
    assert ranking(loaded.lexical["test"]["q0"])[:2] == ["q0", "a0"]  # BM25 finds the query itself first
    ctx = make_ctx()
    runs = seed_runs(embedder(config), loaded, (0,), ctx, tmp_path)
    return loaded, results.retrieval_result(loaded, [0], runs, ctx)


def test_a_document_with_the_query_id_is_dropped_by_default_and_kept_when_asked(tmp_path, make_ctx):
    loaded, dropped = scored(tmp_path / "default", make_ctx)
    _, kept = scored(tmp_path / "kept", make_ctx, ignore_identical_ids=False)
    lexical, qrels = loaded.lexical["test"], loaded.task.qrels
    without = {q: {d: s for d, s in found.items() if d != q} for q, found in lexical.items()}
    assert dropped["ignore_identical_ids"] is True and kept["ignore_identical_ids"] is False
    # BM25's baseline: by default as if the document were not retrieved (a0 first for q0); kept, it takes
    # q0's first place and a0 the second.
    assert dropped["baseline"]["test"] == score_run(without, qrels, ignore_identical_ids=False).mean
    assert kept["baseline"]["test"] == score_run(lexical, qrels, ignore_identical_ids=False).mean
    assert kept["baseline"]["test"]["mrr@10"] == pytest.approx(dropped["baseline"]["test"]["mrr@10"] - 0.5 / 10)
    # The encoder embeds the query and its own text alike (cosine 1): first for q0 in every dense and
    # hybrid run when kept, so q0's answers drop a place in each of them.
    for part in (
        lambda r: r["untuned"]["scores"]["test"],
        lambda r: r["untuned"]["hybrid"]["test"],
        lambda r: {m: v[0] for m, v in r["scores"]["test"].items()},
        lambda r: {m: v[0] for m, v in r["hybrid"]["scores"]["test"].items()},
    ):
        assert part(kept)["ndcg@10"] < part(dropped)["ndcg@10"], (part(kept), part(dropped))


def test_the_setting_is_a_retrieval_task_s_alone():
    assert Config(tasks=[TaskConfig(kind="retrieval", name="t", path="x", ignore_identical_ids=False)])
    with pytest.raises(ValueError, match="ignore_identical_ids: only a retrieval task takes them"):
        Config(tasks=[TaskConfig(kind="heldout-topic", name="t", ignore_identical_ids=False)])
