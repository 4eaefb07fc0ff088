"""The contrastive loss equals InfoNCE written out by hand (and sentence-transformers' own, where it is
installed), with and without hard negatives; the batches never hold a text twice."""

import math
from collections import Counter

import pytest
import torch

from cram.model.embedder import in_batch_loss
from cram.stages import StageError
from cram.stages.retrieval.loss import distinct_batches


def by_hand(anchors: torch.Tensor, positives: torch.Tensor, negatives: torch.Tensor | None, scale: float):
    """-log softmax of each anchor's own positive among every candidate, cosines written out, averaged."""
    candidates = list(positives) + ([] if negatives is None else list(negatives))
    losses = []
    for i, a in enumerate(anchors):
        logits = [scale * (a @ c) / (a.norm() * c.norm()) for c in candidates]
        losses.append(torch.logsumexp(torch.stack(logits), 0) - logits[i])
    return torch.stack(losses).mean()


@pytest.mark.parametrize("hard_negatives", [False, True])
@pytest.mark.parametrize("scale", [20.0, 1.0])
def test_the_loss_and_its_gradient_equal_the_hand_written_one(hard_negatives, scale):
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(6, 16, generator=g, dtype=torch.float64) * 3 for _ in range(2 + hard_negatives)]
    mine = [x.clone().requires_grad_() for x in inputs]
    ref = [x.clone().requires_grad_() for x in inputs]
    loss = in_batch_loss(*mine, scale=scale)
    expected = by_hand(ref[0], ref[1], ref[2] if hard_negatives else None, scale)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    loss.backward()
    expected.backward()
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_a_hard_negative_makes_the_task_harder():
    anchors = torch.eye(4)
    positives = torch.eye(4) + 0.1
    assert in_batch_loss(anchors, positives, anchors.clone()) > in_batch_loss(anchors, positives) + math.log(1.5)


@pytest.mark.parametrize("hard_negatives", [False, True])
def test_the_loss_equals_sentence_transformers_multiple_negatives_ranking_loss(hard_negatives):
    pytest.importorskip("sentence_transformers")
    try:
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    except ImportError:  # before sentence-transformers 6
        from sentence_transformers.losses import MultipleNegativesRankingLoss
    g = torch.Generator().manual_seed(1)
    embeddings = [torch.randn(8, 32, generator=g) for _ in range(2 + hard_negatives)]
    theirs = MultipleNegativesRankingLoss(model=None).compute_loss_from_embeddings(embeddings, None)
    torch.testing.assert_close(in_batch_loss(*embeddings), theirs, rtol=1e-6, atol=1e-6)


def texts_of(pairs, batch):
    return [text for i in batch for text in pairs[i]]


def test_batches_never_hold_a_text_twice_and_use_each_pair_once():
    # Texts repeat across pairs and across roles: "q0" is a query and another pair's negative.
    pairs = [(f"q{i % 13}", f"p{i % 11}", f"q{(i + 5) % 13}") for i in range(60)]
    batches = distinct_batches(pairs, 4, seed=0, where="pairs")
    assert batches and all(len(b) == 4 for b in batches)
    for batch in batches:
        assert max(Counter(texts_of(pairs, batch)).values()) == 1, batch
    used = [i for b in batches for i in b]
    assert len(used) == len(set(used))
    assert distinct_batches(pairs, 4, seed=0, where="pairs") == batches
    assert distinct_batches(pairs, 4, seed=1, where="pairs") != batches


def test_distinct_pairs_fill_every_batch_but_the_last():
    pairs = [(f"q{i}", f"p{i}") for i in range(10)]
    batches = distinct_batches(pairs, 3, seed=0, where="pairs")
    assert len(batches) == 3 and len({i for b in batches for i in b}) == 9


def test_too_few_distinct_texts_for_one_batch_is_refused():
    pairs = [("same query", f"p{i}") for i in range(50)] + [("other", "p0")]
    with pytest.raises(StageError, match=r"pairs.jsonl: 51 pairs do not fill one batch of 3 without a text twice"):
        distinct_batches(pairs, 3, seed=0, where="pairs.jsonl")
