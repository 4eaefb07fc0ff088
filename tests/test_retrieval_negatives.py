"""n mined hard negatives a training pair (`negatives_per_pair`, with `hard_negatives = "mined"`): every pair
takes exactly n (random documents fill a pair with fewer survivors: mining.py), the contrastive batch holds
the positives then each negative column, the loss is InfoNCE over all of them (written out here), GradCache
trains as the whole batch does, and the compiled step makes no graph past the buckets."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from retrieval_sets import write_beir
from test_retrieval_task import CFG, SPECIAL, embedder, query_positives, task_of
from torch._dynamo.utils import counters

from cram import model
from cram.stages import StageError
from cram.stages.evaluating.config import Config
from cram.stages.retrieval import results
from cram.stages.retrieval.tuning import EmbeddingTuner, Making, epoch_batches
from cram.stages.shared.precision import FP32
from cram.stages.tasks.config import TaskConfig

pytestmark = pytest.mark.usefixtures("one_thread")
N = 3


def mined(tmp_path, n: int = N, **task):
    """The test set's task with `n` mined negatives a pair, mined by the untrained encoder (as the runner mines)."""
    config, loaded = task_of(
        write_beir(tmp_path / "set"), batch_size=4, hard_negatives="mined", negatives_per_pair=n, **task
    )
    return config, results.with_mined_negatives(loaded, embedder(config))


@pytest.mark.parametrize(
    "task, message",
    [
        ({"hard_negatives": "mined", "negatives_per_pair": 0}, r"negatives_per_pair: 0 must be in 1\.\.16"),
        ({"hard_negatives": "mined", "negatives_per_pair": 17}, r"negatives_per_pair: 17 must be in 1\.\.16"),
        ({"negatives_per_pair": 2}, 'negatives_per_pair: 2 needs hard_negatives = "mined"'),
    ],
)
def test_a_count_outside_its_range_or_without_mining_is_refused(task, message):
    with pytest.raises(ValueError, match=message):
        Config(tasks=[TaskConfig(kind="retrieval", name="t", path="x", **task)])


def test_every_pair_takes_n_distinct_negatives_none_a_positive_of_its_query(tmp_path):
    _, loaded = mined(tmp_path)
    task, data = loaded.task, loaded.data
    positives = query_positives(task.pairs)
    corpus = {doc.full_text for doc in task.corpus.values()}
    for pair in task.pairs:
        assert len(pair.negatives) == N and len(set(pair.negatives)) == N
        assert all(n in corpus and n.strip() not in positives[pair.query.strip()] for n in pair.negatives)
    assert data.negatives_per_pair == N and len(data.negatives[0]) == N * len(task.pairs)
    assert all(len(texts) == 2 + N for texts in data.texts)
    # the small set's queries have few BM25 candidates: random documents filled the rest, counted
    assert loaded.mining["random_fallback"] > 0


def test_negatives_that_leave_no_batch_without_a_text_twice_are_refused_before_any_seed(tmp_path):
    # 16 negatives a pair: 18 texts a pair, 72 in a batch of 4, from a corpus of 40 documents
    with pytest.raises(StageError, match=r"topics: with 16 mined negatives: 30 pairs do not fill one batch of 4"):
        mined(tmp_path, n=16)


def test_a_batch_with_n_negatives_has_the_loss_of_infonce_written_out_with_all_of_them(tmp_path):
    config, loaded = mined(tmp_path)
    tuner = embedder(config)
    index = epoch_batches(loaded, 0, 0, "test")[0]
    batch = tuner.batch(loaded, index, 0.0)
    assert batch["query_ids"].shape[0] == 4 and batch["doc_ids"].shape[0] == 4 * (1 + N)
    params = {k: v.clone() for k, v in tuner.params.items()}
    _, _, metrics = tuner.step(params, model.optimizer_init(model.AdamW(), params), batch, torch.tensor(0.0))
    # By hand: each text embedded on its own, each query against the batch's 4 positives and its 4 x N hard
    # negatives (sentence-transformers' MNRL with N negative columns), its own positive the answer.
    data = loaded.data
    rows = [i * N + k for i in index for k in range(N)]

    def embedded(texts: tuple, at: list[int]) -> torch.Tensor:
        return torch.from_numpy(tuner.embedded(tuner.params, *texts, index=at)).double()

    queries, positives = embedded(data.queries, index), embedded(data.positives, index)
    scores = 20.0 * queries @ torch.cat([positives, embedded(data.negatives, rows)]).T
    by_hand = (torch.logsumexp(scores, dim=1) - scores.diagonal()).mean().item()
    assert metrics["loss"].item() == pytest.approx(by_hand, rel=1e-5, abs=1e-6)
    first = 4 + torch.arange(4) * N  # each pair's first negative alone: what n = 1 would score
    one = torch.cat([scores[:, :4], scores[:, first]], dim=1)
    assert by_hand - (torch.logsumexp(one, dim=1) - scores.diagonal()).mean().item() > 0.05  # all n count


def test_a_mini_batch_trains_with_n_negatives_as_the_whole_batch_does(tmp_path):
    config, loaded = mined(tmp_path, epochs=2)
    trained = []
    for mini_batch in (None, 3):  # chunks of 3 cross pairs and their negative columns
        how = Making(FP32, False, "auto", "mean", mini_batch)
        tuner = EmbeddingTuner.make(config.tuning(), CFG, model.init(CFG, seed=0), SPECIAL, torch.device("cpu"), how)
        trained.append(tuner.train(loaded, seed=0, where="test", label="test"))
    (whole, whole_loss), (cached, cached_loss) = trained
    assert cached_loss == pytest.approx(whole_loss, rel=1e-4)
    for name in whole:
        torch.testing.assert_close(cached[name], whole[name], rtol=1e-4, atol=1e-5)


def test_the_compiled_step_with_n_negatives_makes_one_graph_a_document_bucket(tmp_path):
    torch._dynamo.reset()
    config, loaded = mined(tmp_path, epochs=2)
    config = dataclasses.replace(config, backend="aot_eager")
    tuner = embedder(config, compile=True)
    before = counters["stats"]["unique_graphs"]
    tuner.train(loaded, seed=0, where="test", label="test")
    tuner.train(loaded, seed=1, where="test", label="test")  # another seed, other batches: no graph more
    # the step's one graph per document bucket its batches pad to, and nothing else
    padded = {
        tuner.batch(loaded, index, 0.0)["doc_ids"].shape
        for seed in (0, 1)
        for epoch in (0, 1)
        for index in epoch_batches(loaded, seed, epoch, "test")
    }
    assert {rows for rows, _ in padded} == {4 * (1 + N)}
    assert counters["stats"]["unique_graphs"] - before == len(padded)
