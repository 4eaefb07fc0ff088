"""A retrieval task through `cram run` on the real pipeline (a few-KB corpus, a tiny eager model): its
results beside BM25, its kept embedder folder exactly as the contract (embedders/<i>-<task>/seed-<s>/), its
dry-run description, and each bad input refused before any stage runs, in one line, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from retrieval_sets import write_beir, write_pairs
from test_bad_inputs import PIPELINE, TASK, cram, write_workspace

from cram.stages.evaluating.keeping import EMBEDDER_META

pytestmark = pytest.mark.usefixtures("one_thread")

RETRIEVAL = '{kind="retrieval", name="topics", path="beir", batch_size=8, seeds=2, epochs=1}'


def workspace(ws: Path, task: str = RETRIEVAL, keep: str = "best") -> None:
    write_workspace(ws)
    write_beir(ws / "beir")
    pipeline = PIPELINE.replace(f"tasks = [{TASK}]", f'tasks = [{task}]\nkeep = "{keep}"')
    (ws / "pipeline.toml").write_text(pipeline)


def test_a_retrieval_task_is_scored_beside_bm25_and_kept_as_an_embedder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    workspace(tmp_path)
    dry = cram("run", "pipeline.toml", "--dry-run")
    assert dry.exit_code == 0 and "topics 3 contrastive steps (1 epoch x 3 batches of 8 titles pairs" in dry.output
    result = cram("run", "pipeline.toml")
    assert result.exit_code == 0, result.output
    stage = tmp_path / "runs" / "base" / "evaluate"
    task = json.loads((stage / "results.json").read_text())["tasks"]["topics"]
    assert task["kind"] == "retrieval" and task["seeds"] == [0, 1] and task["pairs_source"] == "titles"
    assert (task["train_pairs"], task["queries_scored"], task["queries_left_out"], task["pairs_dropped"]) == (
        30,
        10,
        0,
        0,
    )
    assert set(task["median"]["test"]) == set(task["baseline"]["test"]) == {"ndcg@10", "recall@100", "mrr@10"}
    inspect = cram("inspect", "runs/base", "evaluate", "--lines", "0").output
    assert '"topics_ndcg@10"' in inspect and '"topics_baseline"' in inspect, inspect
    assert '"embedders"' in inspect and '"topics": "embedders/0-topics/seed-' in inspect, inspect

    (kept,) = (stage / "embedders" / "0-topics").iterdir()
    assert sorted(p.name for p in kept.iterdir()) == ["embedder.json", "model.json", "params.safetensors"]
    meta = json.loads((kept / EMBEDDER_META).read_text())
    # Too few training queries for a validation split: nothing is chosen, the first seed is kept, fine-tuned.
    assert task["kept"] == {"seed": 0, "encoder": "fine-tuned", "by": "none: no validation split"}
    assert kept.name == "seed-0" and meta["seed"] == 0 and meta["score"] == 0.0
    assert meta["scores"]["test"]["ndcg@10"] == task["scores"]["test"]["ndcg@10"][0]
    assert (meta["encoder"], meta["fusion"]) == ("fine-tuned", {"method": "convex", "weight": 0.5, "rrf_k": 60})
    assert set(meta) == {
        "kind", "task", "task_kind", "pooling", "normalize", "max_length", "query_max_length", "buckets",
        "tokenizer", "seed", "metric", "score", "scores", "params", "encoder", "fusion",
    }  # fmt: skip
    assert (meta["kind"], meta["task"], meta["task_kind"], meta["pooling"], meta["normalize"]) == (
        "embedder", "topics", "retrieval", "mean", True,
    )  # fmt: skip
    assert (meta["max_length"], meta["query_max_length"], meta["buckets"], meta["metric"]) == (16, 16, [16], "ndcg@10")
    assert meta["params"] == "params.safetensors" and set(meta["tokenizer"]) == {"stage", "key", "file", "special_ids"}
    model_json = tmp_path / "runs" / "base" / "pretrain" / "model.json"
    assert (kept / "model.json").read_bytes() == model_json.read_bytes()
    from safetensors import safe_open

    with safe_open(kept / "params.safetensors", "pt") as f:
        names = list(f.keys())
        assert {str(f.get_tensor(n).dtype) for n in names} == {"torch.float32"}
    assert names and not [n for n in names if n.startswith(("head.", "classifier."))]
    assert not [p for p in stage.iterdir() if p.name.startswith(".embeddings")]  # the scratch folders are gone


def _no_title_short_docs(ws: Path) -> None:
    lines = [json.loads(line) for line in (ws / "beir" / "corpus.jsonl").read_text().splitlines()]
    rows = [{"_id": r["_id"], "title": "", "text": " ".join(r["text"].split()[:5])} for r in lines]
    (ws / "beir" / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _append(path: str, text: str):
    def setup(ws: Path) -> None:
        with open(ws / path, "a") as f:
            f.write(text)

    return setup


def _pairs(negative: bool = False, drop: str = "", leak: bool = False, degenerate: bool = False):
    """A pairs file; `leak`: every pair's query a test query's text."""

    def setup(ws: Path) -> None:
        path = write_pairs(ws / "pairs.jsonl", negative=negative)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        if drop:
            rows[3].pop(drop)
        if degenerate:
            rows[3]["negative"] = rows[3]["positive"]
        if leak:
            test = json.loads((ws / "beir" / "queries.jsonl").read_text().splitlines()[0])["text"]
            rows = [{**row, "query": test} for row in rows]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    return setup


def _unjudged(ws: Path) -> None:
    path = ws / "beir" / "qrels" / "test.tsv"
    path.write_text(path.read_text().replace("\t1\n", "\t0\n"))


def _remove(path: str):
    return lambda ws: (ws / path).unlink()


WITH_PAIRS = RETRIEVAL.replace("}", ', pairs="pairs.jsonl"}')
BAD = [
    ("no corpus", _remove("beir/corpus.jsonl"), RETRIEVAL, "not a BEIR folder: no corpus.jsonl"),
    ("no test qrels", _remove("beir/qrels/test.tsv"), RETRIEVAL, "no qrels/test.tsv"),
    ("score not an integer", _append("beir/qrels/test.tsv", "q11\td11\thigh\n"), RETRIEVAL, "is not an integer"),
    ("qrels id unknown", _append("beir/qrels/test.tsv", "q11\tnowhere\t1\n"), RETRIEVAL, "not in corpus.jsonl"),
    ("pairs without positive", _pairs(drop="positive"), WITH_PAIRS, "record 4 has no 'positive'"),
    ("every pair leaks a test query", _pairs(leak=True), WITH_PAIRS, "no pairs are left to train on"),
    ("negative is positive", _pairs(negative=True, degenerate=True), WITH_PAIRS, "pairs.jsonl:4: record 4: its 'neg"),
    ("no test judgement above 0", _unjudged, RETRIEVAL, "qrels/test.tsv: every judgement scores 0 or less"),
    (
        "lone surrogate in the corpus",
        _append("beir/corpus.jsonl", '{"_id": "dx", "title": "t", "text": "a \\ud83d b"}\n'),
        RETRIEVAL,
        "corpus.jsonl: record 'dx': field 'text' holds a lone surrogate \\ud83d at character 2",
    ),
    (
        "lone surrogate in a query",
        _append("beir/queries.jsonl", '{"_id": "qx", "text": "\\udc00"}\n'),
        RETRIEVAL,
        "queries.jsonl: record 'qx': field 'text' holds a lone surrogate \\udc00",
    ),
    ("no pairs possible", _no_title_short_docs, RETRIEVAL, "evaluate.tasks[0]: no training pairs"),
    ("batch larger than pairs", lambda ws: None, RETRIEVAL.replace("batch_size=8", "batch_size=64"), "one batch of 64"),
    ("a classifier's setting", lambda ws: None, RETRIEVAL.replace("}", ', metrics=["accuracy"]}'), "metrics"),
    ("pooling unknown", lambda ws: None, RETRIEVAL.replace("}", ', pooling="max"}'), "tasks[0]"),
    ("no path", lambda ws: None, '{kind="retrieval", name="t"}', "path: a retrieval task needs a BEIR folder"),
    (
        "negatives a pair out of range",
        lambda ws: None,
        RETRIEVAL.replace("}", ', hard_negatives="mined", negatives_per_pair=20}'),
        "[evaluate] tasks[0]: negatives_per_pair: 20 must be in 1..16",
    ),
    (
        "negatives a pair unmined",
        lambda ws: None,
        RETRIEVAL.replace("}", ", negatives_per_pair=2}"),
        'negatives_per_pair: 2 needs hard_negatives = "mined"',
    ),
    (
        "identical ids not a bool",
        lambda ws: None,
        RETRIEVAL.replace("}", ', ignore_identical_ids="no"}'),
        "ignore_identical_ids",
    ),
]


@pytest.mark.parametrize("setup, task, message", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_retrieval_input_is_one_line_exit_2_before_any_stage_runs(tmp_path, monkeypatch, setup, task, message):
    monkeypatch.chdir(tmp_path)
    workspace(tmp_path, task)
    setup(tmp_path)
    for args in (["--dry-run"], []):  # found by the dry run too, where every task file is read in full
        result = cram("run", "pipeline.toml", *args)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
        assert not (tmp_path / "runs" / "base" / "tokenize").exists()
    shutil.rmtree(tmp_path / "beir")


def test_the_task_s_own_settings_reach_its_run_through_the_pipeline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = ', hard_negatives="mined", negatives_per_pair=2, ignore_identical_ids=false}'
    workspace(tmp_path, RETRIEVAL.replace("batch_size=8, seeds=2", "batch_size=4, seeds=1").replace("}", settings))
    result = cram("run", "pipeline.toml")
    assert result.exit_code == 0, result.output
    task = json.loads((tmp_path / "runs" / "base" / "evaluate" / "results.json").read_text())["tasks"]["topics"]
    assert task["ignore_identical_ids"] is False
    assert task["hard_negatives"]["source"] == "mined" and task["hard_negatives"]["per_pair"] == 2
    assert set(task["hard_negatives"]) == {"source", "per_pair", "false_negatives_dropped", "random_fallback"}


def test_a_compiled_retrieval_run_passes_the_canary_within_the_graph_limit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    workspace(tmp_path, RETRIEVAL.replace("seeds=2", "seeds=1"), keep="none")
    compiled = ("--set", "evaluate.compile=true", "--set", 'evaluate.backend="aot_eager"')
    result = cram("run", "pipeline.toml", *compiled)
    assert result.exit_code == 0, result.output  # past the graph limit the stage fails (fail_on_recompile_limit_hit)
    events = (tmp_path / "runs" / "base" / "logs" / "events.jsonl").read_text()
    canary = [json.loads(line) for line in events.splitlines() if '"canary"' in line]
    assert canary and canary[0]["max_relative_diff"] < 0.02, canary
    stage = tmp_path / "runs" / "base" / "evaluate"
    assert "embedders" not in json.loads((stage / "results.json").read_text())
    assert not (stage / "embedders").exists()


def test_the_held_out_documents_titles_are_searched_for_their_texts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    own = '{kind="heldout-retrieval", name="own", batch_size=4, max_length=16, epochs=1, seeds=1}'
    workspace(tmp_path, own, keep="none")
    result = cram("run", "pipeline.toml", "--set", "tokenize.heldout_fraction=0.5")
    assert result.exit_code == 0, result.output
    task = json.loads((tmp_path / "runs" / "base" / "evaluate" / "results.json").read_text())["tasks"]["own"]
    assert task["kind"] == "heldout-retrieval" and task["pairs_source"] == "titles"
    assert task["queries_scored"] == task["test_queries"] > 0 and task["queries_left_out"] == 0
    # every document's title is "doc <n>": BM25 cannot tell the documents apart by it, and scores it so
    assert 0 <= task["baseline"]["test"]["ndcg@10"] <= 1 and 0 <= task["median"]["test"]["ndcg@10"] <= 1


def test_the_default_retrieval_task_is_left_out_where_it_does_not_fit_the_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    workspace(tmp_path)
    pipeline = (tmp_path / "pipeline.toml").read_text()
    pipeline = pipeline.replace(f"tasks = [{RETRIEVAL}]\n", "").replace("buckets = [16]", "buckets = [16, 32, 64]")
    (tmp_path / "pipeline.toml").write_text(pipeline)
    unlabelled = ("--set", 'tokenize.corpus.label_field=""')
    dry = cram("run", "pipeline.toml", *unlabelled, "--dry-run")
    assert dry.exit_code == 0 and "fine-tunes" not in dry.output, dry.output
    result = cram("run", "pipeline.toml", *unlabelled)
    assert result.exit_code == 0, result.output
    events = (tmp_path / "runs" / "base" / "logs" / "events.jsonl").read_text()
    assert '"no retrieval task"' in events and "beyond the model's 16 positions" in events, events


def test_the_default_pipeline_describes_its_retrieval_task(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(Path(__file__).resolve().parents[1] / "pipeline.toml", tmp_path / "pipeline.toml")
    dry = cram("run", "pipeline.toml", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "retrieval contrastive steps known after tokenize (held-out titles against their texts" in dry.output
    left_out = cram("run", "pipeline.toml", "--dry-run", "--set", "tokenize.heldout_fraction=0")
    assert left_out.exit_code == 0 and "retrieval" not in left_out.output.split("evaluate:")[-1], left_out.output
