"""Entity scores (stages/tagging/scores.py) equal to seqeval's default mode (conlleval's reading) on random tag
sequences, malformed ones included, and the two baselines."""

import random

import pytest

from cram.stages.tagging.scores import baselines, dictionary, entity_scores, spans

TAGS = ["O", "O", "O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-creative-work", "I-creative-work"]


def test_spans_read_as_conlleval_reads_them():
    assert spans(["B-PER", "I-PER", "O", "B-LOC"]) == [("PER", 0, 2), ("LOC", 3, 4)]
    assert spans(["I-PER", "I-PER", "I-LOC", "B-LOC", "I-LOC"]) == [("PER", 0, 2), ("LOC", 2, 3), ("LOC", 3, 5)]
    assert spans(["O", "O"]) == [] and spans([]) == []


def test_scores_equal_seqeval_on_random_sequences_malformed_ones_included():
    seqeval = pytest.importorskip("seqeval.metrics")
    rng = random.Random(0)
    for trial in range(100):
        lengths = [rng.randint(1, 12) for _ in range(rng.randint(1, 6))]
        gold = [[rng.choice(TAGS) for _ in range(n)] for n in lengths]
        predicted = [[rng.choice(TAGS) for _ in range(n)] for n in lengths]
        ours = entity_scores(gold, predicted)
        assert ours["f1"] == pytest.approx(seqeval.f1_score(gold, predicted, zero_division=0)), trial
        assert ours["precision"] == pytest.approx(seqeval.precision_score(gold, predicted, zero_division=0))
        assert ours["recall"] == pytest.approx(seqeval.recall_score(gold, predicted, zero_division=0))
        assert ours["accuracy"] == pytest.approx(seqeval.accuracy_score(gold, predicted))
        report = seqeval.classification_report(gold, predicted, output_dict=True, zero_division=0)
        for kind, values in ours["by_type"].items():
            if values["support"]:  # seqeval's report lists the gold types
                assert values["f1"] == pytest.approx(report[kind]["f1-score"]), (trial, kind)
                assert values["support"] == report[kind]["support"]


def test_the_baselines_all_o_and_the_dictionary():
    train_words = [["Ann", "met", "Bob", "in", "Rome"], ["Bob", "left"], ["Bob", "Rome"]]
    train_tags = [["B-PER", "O", "B-PER", "O", "B-LOC"], ["B-PER", "O"], ["O", "B-LOC"]]
    assert dictionary(train_words, train_tags) == {
        "Ann": "B-PER",
        "met": "O",
        "Bob": "B-PER",
        "in": "O",
        "Rome": "B-LOC",
        "left": "O",
    }
    words = [["Bob", "saw", "Rome"], ["Eve", "in", "Rome"]]
    gold = [["B-PER", "O", "B-LOC"], ["B-PER", "O", "B-LOC"]]
    found = baselines((train_words, train_tags), words, gold)
    assert found["all_o"]["f1"] == 0 and found["all_o"]["accuracy"] == pytest.approx(2 / 6)
    # 3 of 4 entities found (Eve is unseen: O), none wrong
    assert found["dictionary"]["precision"] == 1 and found["dictionary"]["recall"] == 0.75
    assert found["dictionary"]["by_type"]["PER"]["recall"] == 0.5
