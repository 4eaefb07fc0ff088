"""The retrieval task's contrastive fine-tune and search (stages/retrieval/tuning.py), on a BEIR folder the
test writes, with a word-level tokenizer: a fine-tune beats the untrained encoder, the compiled steps make
no graph past the buckets, and the training pairs come from where the module says."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from retrieval_sets import FILLER, NAMES, TOPIC, topic, write_beir, write_pairs
from torch._dynamo.utils import counters

from cram import model
from cram.stages import StageError
from cram.stages.evaluating.config import Config
from cram.stages.retrieval import pairs, results, validation
from cram.stages.retrieval.tuning import (
    EmbeddingTuner,
    EmbeddingTuners,
    Making,
    RetrievalLoaded,
    embedder_graphs,
    epoch_batches,
)
from cram.stages.shared.precision import FP32
from cram.stages.shared.tokenizer import Tokenizer
from cram.stages.tasks.config import TaskConfig

pytestmark = pytest.mark.usefixtures("one_thread")

SPECIAL = {"pad": 0, "cls": 1, "sep": 2, "mask": 3, "unk": 4}
VOCAB = {w: i for i, w in enumerate([*SPECIAL, *FILLER, *TOPIC, *NAMES])}
CFG = model.ModelConfig(vocab_size=len(VOCAB), hidden=32, heads=2, layers=1, intermediate=64, max_seq_len=32)


def words(texts: list[str]) -> list[list[int]]:
    return [[VOCAB.get(w, SPECIAL["unk"]) for w in text.split()] for text in texts]


TOKENIZER = Tokenizer("tokenizers", Path("words"), len(VOCAB), SPECIAL, words)


def task_of(folder: Path, compile: bool = False, **task: object) -> tuple[Config, RetrievalLoaded]:
    entry = TaskConfig(kind="retrieval", name="topics", path=str(folder), **task)
    config = Config(tasks=[entry], buckets=(8, 16, 32), max_length=32, dropout=0.0, compile=compile)
    settings = config.settings(entry)
    task_ = results.load_task(entry, 0, None, settings)
    return config, results.loaded(entry, task_, TOKENIZER, SPECIAL, settings)


def embedder(config: Config, compile: bool = False) -> EmbeddingTuner:
    params = model.init(CFG, seed=0)
    how = Making(FP32, compile, "auto", "mean")
    return EmbeddingTuner.make(config.tuning(), CFG, params, SPECIAL, torch.device("cpu"), how)


def seed_runs(tuner: EmbeddingTuner, loaded: RetrievalLoaded, seeds, ctx, scratch: Path, keep=None) -> list[dict]:
    """Each seed fine-tuned and scored as the kind's runner runs it, beside the encoder as it was."""
    untuned = results.judged(tuner.runs(tuner.params, loaded, scratch), loaded)
    return [results.retrieve_seed(tuner, loaded, seed, results.SeedRun(ctx, scratch, untuned), keep) for seed in seeds]


def test_the_fine_tune_beats_the_untrained_encoder_and_bm25_scores_the_same_queries(tmp_path):
    folder = write_beir(tmp_path / "set")
    config, loaded = task_of(folder, epochs=10, lr=3e-3, batch_size=8)
    assert loaded.task.source == "titles" and len(loaded.task.pairs) == 30 and len(loaded.task.queries) == 10
    tuner = embedder(config)
    before = tuner.search(tuner.params, loaded, tmp_path).mean["ndcg@10"]
    params, loss = tuner.train(loaded, seed=0, where="test", label="test")
    after = tuner.search(params, loaded, tmp_path).mean["ndcg@10"]
    assert after > before + 0.3, (before, after, loss)
    assert list(tmp_path.iterdir()) == [folder]  # the scratch embeddings are gone
    # A query's names are in training documents' titles alone: BM25 finds those, not the answer.
    bm25 = results.bm25_scores(loaded.task)
    assert set(bm25.per_query) == set(loaded.task.queries) and bm25.mean["ndcg@10"] < after


def test_the_compiled_steps_make_no_graph_past_the_buckets(tmp_path):
    torch._dynamo.reset()
    folder = write_beir(tmp_path / "set")
    config, loaded = task_of(folder, compile=True, epochs=2, batch_size=8)
    config = dataclasses.replace(config, backend="aot_eager")
    tuner = embedder(config, compile=True)
    before = counters["stats"]["unique_graphs"]
    params, _ = tuner.train(loaded, seed=0, where="test", label="test")
    tuner.search(params, loaded, tmp_path)
    tuner.train(loaded, seed=1, where="test", label="test")  # another seed: no graph more
    # Queries pad to one length (8), documents to 16 or 32: the step's graph per document bucket, the
    # embedding's per bucket used (8 for the queries, 16 and 32 for the corpus).
    doc_buckets = {16 if n <= 16 else 32 for n in loaded.data.positives[1]}
    assert counters["stats"]["unique_graphs"] - before <= len(doc_buckets) + len(config.buckets)


def long_pairs(path: Path) -> Path:
    """write_pairs' pairs, two of them with a positive past 16 tokens: their batches pad to 32."""
    lines = write_pairs(path).read_text().splitlines()
    for k in (7, 21):
        record = json.loads(lines[k])
        record["positive"] += " " + " ".join(FILLER[:12])
        lines[k] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_canary_checks_every_graph_fine_tuning_and_search_run(tmp_path):
    torch._dynamo.reset()
    pairs_file = long_pairs(tmp_path / "pairs.jsonl")
    beir = write_beir(tmp_path / "set")
    config, loaded = task_of(beir, pairs=str(pairs_file), batch_size=8, seeds=2, query_max_length=8)
    config = dataclasses.replace(config, backend="aot_eager")
    graphs = embedder_graphs([loaded], config.tuning(), first_seed=0)
    # steps: documents of 16 and of 32 tokens (queries at 8); embeddings: the queries at 8, the corpus at 16
    # (untitled test answers) and 32 (a title and its text)
    assert sorted(g.name for g in graphs) == [
        "contrastive step, mean pooling, 8 pairs, queries 8, documents 16",
        "contrastive step, mean pooling, 8 pairs, queries 8, documents 32",
        "embedding, mean pooling, length 16",
        "embedding, mean pooling, length 32",
        "embedding, mean pooling, length 8",
    ]
    worst = embedder(config, compile=True).canary(embedder(config), graphs, 2, tolerance=0.02)
    assert worst.value < 1e-4


@pytest.mark.parametrize("graph", ["contrastive step", "embedding"])
def test_a_fault_in_a_later_bucket_is_found_and_named(tmp_path, graph):
    pairs_file = long_pairs(tmp_path / "pairs.jsonl")
    config, loaded = task_of(write_beir(tmp_path / "set"), pairs=str(pairs_file), batch_size=8, query_max_length=8)

    def make(how: Making) -> EmbeddingTuner:
        made = embedder(config, how.compile)
        if not how.compile:
            return made
        step, embed = made.step, made.embed

        def wrong_step(params, opt_state, batch, lr):
            params, opt_state, metrics = step(params, opt_state, batch, lr)
            if batch["doc_ids"].shape[1] == 32:
                metrics = {**metrics, "loss": metrics["loss"] * float("nan")}
            return params, opt_state, metrics

        def wrong_embed(params, batch):
            out = embed(params, batch)
            return out * float("nan") if batch["input_ids"].shape[1] == 32 else out

        faulty = {"step": wrong_step} if graph == "contrastive step" else {"embed": wrong_embed}
        return dataclasses.replace(made, **faulty)

    embedders = EmbeddingTuners(make, [loaded], compile=True, attention="auto")
    graphs = embedder_graphs([loaded], config.tuning(), first_seed=0)
    worst = embedders.check(FP32, graphs, steps=1, tolerance=0.02)
    assert worst.value == float("inf") and worst.graph.startswith(graph) and "32" in worst.graph, worst


def test_training_pairs_come_from_train_qrels_then_a_pairs_file_then_the_corpus(tmp_path):
    with_qrels = write_beir(tmp_path / "qrels", train_qrels=True)
    assert task_of(with_qrels, batch_size=8)[1].task.source == "qrels"
    file = write_pairs(tmp_path / "pairs.jsonl", negative=True)
    found = task_of(write_beir(tmp_path / "pairs"), pairs=str(file), batch_size=8)[1]
    assert found.task.source == "pairs" and found.data.negatives is not None
    untitled = task_of(write_beir(tmp_path / "cloze", titles=False), batch_size=8)[1].task
    assert untitled.source == "inverse-cloze" and len(untitled.pairs) == 30
    # Drawn from documents no test query finds relevant: no pair holds a test document's two topic words.
    answers = [set(topic(i).split()) for i in range(10)]
    assert not any(a <= set(f"{p.query} {p.positive}".split()) for p in untitled.pairs for a in answers)


def test_a_training_pair_whose_query_is_a_test_query_is_dropped_and_counted(tmp_path):
    folder, file = write_beir(tmp_path / "set"), write_pairs(tmp_path / "pairs.jsonl")
    rows = [json.loads(line) for line in file.read_text().splitlines()]
    rows[0]["query"] = json.loads((folder / "queries.jsonl").read_text().splitlines()[0])["text"] + " "
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = pairs.load_beir_task("t", str(folder), str(file), "evaluate.tasks[0]")
    assert task.pairs_dropped == 1 and len(task.pairs) == len(rows) - 1


def test_a_hard_negative_batch_has_the_loss_of_infonce_written_out_with_its_negatives(tmp_path):
    file = write_pairs(tmp_path / "pairs.jsonl", negative=True)
    config, loaded = task_of(write_beir(tmp_path / "set"), pairs=str(file), batch_size=8)
    tuner, index = embedder(config), list(range(8))
    batch = tuner.batch(loaded, index, 0.0)
    assert batch["query_ids"].shape[0] == 8 and batch["doc_ids"].shape[0] == 16
    params = {k: v.clone() for k, v in tuner.params.items()}
    _, _, metrics = tuner.step(params, model.optimizer_init(model.AdamW(), params), batch, torch.tensor(0.0))
    # By hand: each text embedded on its own by the search's embedding (unit vectors), then the cross-entropy
    # of 20 x cosine over the 8 positives and the 8 hard negatives, each query's own positive the answer.
    data = loaded.data

    def embedded(rows: tuple) -> torch.Tensor:
        return torch.from_numpy(tuner.embedded(tuner.params, *rows, index=index)).double()

    queries, candidates = embedded(data.queries), torch.cat([embedded(data.positives), embedded(data.negatives)])
    scores = 20.0 * queries @ candidates.T
    by_hand = (torch.logsumexp(scores, dim=1) - scores.diagonal()).mean().item()
    assert metrics["loss"].item() == pytest.approx(by_hand, rel=1e-5, abs=1e-6)
    without = (torch.logsumexp(scores[:, :8], dim=1) - scores.diagonal()).mean().item()
    assert by_hand - without > 0.05  # the negatives count: a loss without them would fail the check above


def test_held_out_documents_split_by_title_into_queries_and_pairs(tmp_path):
    import datasets

    titles = [topic(k, NAMES) for k in range(40)]
    texts = [f"{t} the a of and {i}" for i, t in enumerate(titles)]
    datasets.Dataset.from_dict({"text": texts, "title": titles, "label": [""] * 40}).save_to_disk(tmp_path / "h")
    task = pairs.load_heldout_task("retrieval", tmp_path / "h", 0.25)
    assert task.source == "titles" and len(task.queries) == 10 and len(task.pairs) == 30
    assert all(doc.title == "" for doc in task.corpus.values())  # the query is not in its document
    assert not set(task.queries.values()) & {p.query for p in task.pairs}
    again = pairs.load_heldout_task("retrieval", tmp_path / "h", 0.25)
    assert again == task  # split by title hash: the same every time
    untitled = {"text": [f"{t} the a of and in on at to is {i}" for i, t in enumerate(titles)], "title": [""] * 40}
    datasets.Dataset.from_dict(untitled).save_to_disk(tmp_path / "u")
    assert pairs.load_heldout_task("retrieval", tmp_path / "u", 0.25).source == "inverse-cloze"


def test_too_few_pairs_for_a_batch_is_refused_naming_the_task(tmp_path):
    with pytest.raises(StageError, match=r"evaluate.tasks\[0\] \(titles pairs\): 30 pairs do not fill one batch of 64"):
        task_of(write_beir(tmp_path / "set"), batch_size=64)


def test_results_json_entry_holds_what_the_issue_asks(tmp_path, make_ctx):
    config, loaded = task_of(write_beir(tmp_path / "set"), epochs=1, batch_size=8, seeds=2)
    tuner = embedder(config)
    ctx = make_ctx()
    runs = seed_runs(tuner, loaded, (0, 1), ctx, tmp_path)
    result = json.loads(json.dumps(results.retrieval_result(loaded, [0, 1], runs, ctx)))
    assert result["kind"] == "retrieval" and result["pairs_source"] == "titles" and result["train_pairs"] == 30
    assert result["queries_scored"] == 10 and result["queries_left_out"] == 0
    assert set(result["median"]["test"]) == {"ndcg@10", "recall@100", "mrr@10"}
    assert len(result["scores"]["test"]["ndcg@10"]) == 2 and set(result["baseline"]["test"]) == set(result["metrics"])
    assert "BM25" in result["baseline_method"] and "word split" in result["baseline_method"]


def test_queries_without_a_relevant_document_are_left_out_counted_and_said(tmp_path, make_ctx):
    from structlog.testing import capture_logs

    from cram.stages.shared.figures import is_number

    folder = write_beir(tmp_path / "set")
    with open(folder / "queries.jsonl", "a") as f:
        f.write(json.dumps({"_id": "unjudged", "text": "a query judged but with nothing relevant"}) + "\n")
    with open(folder / "qrels" / "test.tsv", "a") as f:
        f.write("unjudged\td0\t0\n")
    config, loaded = task_of(folder, epochs=1, batch_size=8)
    ctx = make_ctx()
    with capture_logs() as logs:
        runs = seed_runs(embedder(config), loaded, (0,), ctx, tmp_path)
        result = results.retrieval_result(loaded, [0], runs, ctx)
    assert (result["test_queries"], result["queries_scored"], result["queries_left_out"]) == (11, 10, 1)
    said = [e for e in logs if e["event"].startswith("test queries left out")]
    assert len(said) == 1 and (said[0]["left_out"], said[0]["scored"]) == (1, 10), logs

    def figures(value: object) -> list:
        if isinstance(value, dict):
            return [f for v in value.values() for f in figures(v)]
        if isinstance(value, list):
            return [f for v in value for f in figures(v)]
        return [value] if isinstance(value, float) else []

    # Every float of the entry is a figure (no NaN, no infinity): json.dumps would write NaN, which is no JSON.
    assert all(is_number(f) for f in figures(result)) and json.loads(json.dumps(result, allow_nan=False))


def test_keep_all_writes_every_seed_as_an_embedder_beside_the_classifiers(tmp_path):
    from cram.stages.evaluating.keeping import Keeper, kept_outputs

    config, loaded = task_of(write_beir(tmp_path / "set"), batch_size=8)
    (tmp_path / "model.json").write_text("{}")
    meta = results.embedder_meta(loaded, config.buckets, {"stage": "tokenize"})
    keeper = Keeper("all", tmp_path / "out", tmp_path / "model.json", {0: meta, 1: {"task": "sent", "kind": "custom"}})
    params = {"embed.tokens.weight": torch.ones(2, 2), "head.bias": torch.ones(2)}
    for seed, score in ((0, 0.4), (1, 0.6)):
        keeper.offer(0, seed, loaded.task, params, {"scores": {"selection": {"ndcg@10": score}}})
    keeper.offer(1, 0, loaded.task, {"classifier.weight": torch.ones(1)}, {"scores": {"selection": {"ndcg@10": 0.1}}})
    kept = keeper.finish([(0, 0), (0, 1), (1, 0)], {0: 1, 1: 2})
    assert kept_outputs(kept) == {
        "classifiers": {"sent": "classifiers/1-sent/seed-0"},
        "embedders": {"topics": "embedders/0-topics/seed-1"},
    }
    for seed in (0, 1):
        folder = tmp_path / "out" / "embedders" / "0-topics" / f"seed-{seed}"
        written = json.loads((folder / "embedder.json").read_text())
        assert written["seed"] == seed and written["task_kind"] == "retrieval" and written["metric"] == "ndcg@10"
        assert sorted(p.name for p in folder.iterdir()) == ["embedder.json", "model.json", "params.safetensors"]
    assert (tmp_path / "out" / "classifiers" / "1-sent" / "seed-0" / "classifier.json").is_file()


def test_eager_contrastive_batches_are_padded_to_their_longest_and_compiled_ones_to_buckets(tmp_path):
    pairs_file = long_pairs(tmp_path / "pairs.jsonl")
    config, loaded = task_of(write_beir(tmp_path / "set"), pairs=str(pairs_file), batch_size=8, query_max_length=8)
    index = epoch_batches(loaded, 0, 0, "test")[0]
    queries, positives = loaded.data.queries[1][index].max(), loaded.data.positives[1][index].max()
    eager, compiled = (
        embedder(config).batch(loaded, index, 0.0),
        embedder(config, compile=True).batch(loaded, index, 0.0),
    )
    assert eager["query_ids"].shape[1] == queries and eager["doc_ids"].shape[1] == positives
    assert compiled["query_ids"].shape[1] == 8 and compiled["doc_ids"].shape[1] in (16, 32)


def test_an_eager_contrastive_fine_tune_leaves_the_pretrained_encoder_as_it_was(tmp_path):
    config, loaded = task_of(write_beir(tmp_path / "set"), batch_size=8)
    eager = embedder(config)
    before = {k: v.clone() for k, v in eager.params.items()}
    first, _ = eager.train(loaded, seed=0, where="test", label="test")
    torch.testing.assert_close(eager.params, before, rtol=0, atol=0)
    again, _ = eager.train(loaded, seed=0, where="test", label="test")
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert not torch.equal(first["layers.0.attn.qkv.weight"], before["layers.0.attn.qkv.weight"])


def test_a_mini_batch_trains_as_the_whole_batch_does(tmp_path):
    # GradCache (model/grad_cache.py): the encoder embeds 3 rows at a time, the loss takes the batch of 8 whole.
    folder = write_beir(tmp_path / "set")
    trained = []
    for mini_batch in (None, 3):
        config, loaded = task_of(folder, batch_size=8, epochs=2, mini_batch_size=mini_batch)
        assert loaded.settings.mini_batch_size == mini_batch
        how = Making(FP32, False, "auto", "mean", mini_batch)
        tuner = EmbeddingTuner.make(config.tuning(), CFG, model.init(CFG, seed=0), SPECIAL, torch.device("cpu"), how)
        trained.append(tuner.train(loaded, seed=0, where="test", label="test"))
    (whole, whole_loss), (cached, cached_loss) = trained
    assert cached_loss == pytest.approx(whole_loss, rel=1e-4)
    for name in whole:
        torch.testing.assert_close(cached[name], whole[name], rtol=1e-4, atol=1e-5)


def test_a_mini_batch_below_one_is_refused():
    with pytest.raises(ValueError, match="mini_batch_size: 0 must be >= 1"):
        Config(tasks=[TaskConfig(kind="retrieval", name="t", path="x", mini_batch_size=0)])


def test_choices_are_made_on_a_validation_split_carved_from_the_training_queries(tmp_path, make_ctx, monkeypatch):
    monkeypatch.setattr(validation, "SHARE", 0.3)  # the small set's 30 queries: about 9 drawn
    monkeypatch.setattr(validation, "MIN_QUERIES", 3)
    config, loaded = task_of(write_beir(tmp_path / "set"), epochs=2, batch_size=8, seeds=2, lr=3e-3)
    held = loaded.task.validation
    assert held is not None and len(held.queries) + len(loaded.task.pairs) == 30
    assert not {p.query for p in loaded.task.pairs} & set(held.queries.values())
    offered = []
    runs = seed_runs(embedder(config), loaded, (0, 1), make_ctx(), tmp_path, keep=lambda p, run: offered.append(run))
    result = json.loads(json.dumps(results.retrieval_result(loaded, [0, 1], runs, make_ctx())))
    assert result["validation_queries"] == len(held.queries) and result["train_pairs"] == len(loaded.task.pairs)
    for run, offer in zip(runs, offered):
        # What a seed offers is kept by its validation score: the fine-tune's, or the start's where better.
        best = max(run["scores"]["validation"]["ndcg@10"], run["untuned"]["scores"]["validation"]["ndcg@10"])
        assert run["scores"]["selection"] == offer["scores"]["selection"] == {"ndcg@10": best}
        assert offer["meta"]["encoder"] == run["offers"] and run["selected_by"] == "validation"
        assert set(run["hybrid"]) == {"fusion", "test", "validation"}
    assert set(result["validation"]["median"]["validation"]) == set(result["metrics"])
    assert len(result["hybrid"]["fusion"]) == 2 and set(result["figures"]) == {"hybrid", "untuned"}
    assert result["kept"]["seed"] in (0, 1) and result["kept"]["by"] == "validation"


def test_without_a_validation_split_nothing_is_chosen(tmp_path, make_ctx):
    config, loaded = task_of(write_beir(tmp_path / "set"), epochs=1, batch_size=8, seeds=2)
    assert loaded.task.validation is None  # 30 queries draw fewer than MIN_QUERIES
    runs = seed_runs(embedder(config), loaded, (0, 1), make_ctx(), tmp_path)
    result = results.retrieval_result(loaded, [0, 1], runs, make_ctx())
    assert [r["scores"]["selection"] for r in runs] == [{"ndcg@10": 0.0}] * 2
    assert result["kept"] == {"seed": 0, "encoder": "fine-tuned", "by": "none: no validation split"}
    assert result["hybrid"]["fusion"] == [{"method": "convex", "weight": 0.5, "rrf_k": 60}] * 2


def query_positives(pairs) -> dict[str, set[str]]:
    """Every positive text each query (stripped) has among `pairs`: what mining may never take as its negative."""
    positives: dict[str, set[str]] = {}
    for pair in pairs:
        positives.setdefault(pair.query.strip(), set()).add(pair.positive.strip())
    return positives


def test_mined_hard_negatives_are_corpus_documents_none_a_positive_of_its_query(tmp_path, make_ctx):
    from cram.stages.retrieval.kind import RETRIEVAL
    from cram.stages.tasks.kind import Start

    config, loaded = task_of(write_beir(tmp_path / "set"), batch_size=8, epochs=1, hard_negatives="mined")
    assert loaded.settings.hard_negatives == "mined" and loaded.data.negatives is None
    start = Start(config.tuning(), CFG, model.init(CFG, seed=0), SPECIAL, torch.device("cpu"), "auto", 0, tmp_path)
    runner = RETRIEVAL.runner([loaded], start)
    mined = runner.mined["topics"]
    positives = query_positives(mined.task.pairs)
    corpus = {doc.full_text for doc in loaded.task.corpus.values()}
    assert all(len(p.negatives) == 1 for p in mined.task.pairs)
    for pair in mined.task.pairs:
        assert all(n in corpus and n.strip() not in positives[pair.query.strip()] for n in pair.negatives)
    assert len(mined.data.negatives[0]) == len(mined.task.pairs) and len(mined.data.texts[0]) == 3
    run = runner.run_seed(FP32, loaded, 0, make_ctx(), lambda params, record: None)
    assert set(run["mining"]) == {"false_negatives_dropped", "random_fallback"}
    result = RETRIEVAL.result(loaded, [0], [run], config.tuning(), make_ctx())
    assert result["hard_negatives"]["source"] == "mined"


def test_an_unknown_hard_negative_source_is_refused():
    with pytest.raises(ValueError, match="hard_negatives: 'bm25'"):
        Config(tasks=[TaskConfig(kind="retrieval", name="t", path="x", hard_negatives="bm25")])


def test_embedding_the_corpus_writes_a_progress_line_without_a_terminal(tmp_path, monkeypatch, capsys):
    from cram.stages.retrieval import tuning

    monkeypatch.setattr(tuning, "PROGRESS_EVERY_S", 0.0)  # a line after every batch
    config, loaded = task_of(write_beir(tmp_path / "set"), batch_size=8)
    tuner = embedder(dataclasses.replace(config, eval_batch_size=4))
    tuner.runs(tuner.params, loaded, tmp_path)
    documents = len(loaded.data.corpus[0])
    lines = [line for line in capsys.readouterr().err.splitlines() if "embedding the corpus" in line]
    assert lines[0] == f"topics: embedding the corpus: 4/{documents}" and lines[-1].endswith(
        f" {documents}/{documents}"
    )
