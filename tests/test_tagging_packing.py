"""A fine-tune step's sentences packed into few rows (stages/tagging/packing.py): every window whole, in its own
document, at positions from 0; at most 8 row counts; and the packed step's loss and update equal to the step
on the same sentences each padded in a row of its own."""

import numpy as np
import pytest
import torch

from cram import model
from cram.model.tagger import IGNORE, init_tag_head, make_tag_step
from cram.stages.tagging.packing import MAX_SHAPES, Packing, shuffled_batches, step_shapes
from cram.stages.tagging.windows import Rows

pytestmark = pytest.mark.usefixtures("one_thread")

SPECIAL = {"pad": 0, "cls": 2, "sep": 3}
CFG = model.ModelConfig(
    vocab_size=60, hidden=32, layers=2, heads=4, intermediate=64, max_seq_len=64, post_norm=True, token_types=2
)


def sentences(lengths, seed=0) -> Rows:
    """Windows of the given lengths, [CLS] ... [SEP], every other position tagged."""
    gen = np.random.default_rng(seed)
    ids, labels = [], []
    for n in lengths:
        ids.append(np.array([2, *gen.integers(5, CFG.vocab_size, n - 2), 3]))
        tags = gen.integers(0, 5, n)
        tags[::2], tags[-1] = IGNORE, IGNORE
        labels.append(tags)
    return Rows(ids, labels, [np.zeros((0, 2), np.int64)] * len(lengths))


def test_each_window_lands_whole_in_its_own_document_at_positions_from_zero():
    rows = sentences([30, 12, 7, 25, 40, 5, 9, 33, 18, 3])
    packing = Packing.of(rows.lengths, 10, (16, 32, 64))
    assert (packing.width, packing.rows_step) == (64, 2)
    index = np.arange(10)
    arrays = packing.inputs(rows, index, SPECIAL, token_types=True)
    count = arrays["input_ids"].shape[0]
    assert arrays["input_ids"].shape == (count, 64) and count % 2 == 0 and count < 10
    fillers = int((arrays["document_ids"][:, 0] == len(index)).sum())  # [CLS] [SEP] rows, in a document of their own
    assert fillers < 2 and int(arrays["attention_mask"].sum()) == sum(rows.lengths) + 2 * fillers
    for n, i in enumerate(index):
        where = arrays["document_ids"] == n
        r = np.flatnonzero(where.any(1))
        assert len(r) == 1  # one window, one row, contiguous
        span = np.flatnonzero(where[r[0]])
        assert np.array_equal(span, np.arange(span[0], span[0] + rows.lengths[i]))
        assert np.array_equal(arrays["input_ids"][r[0], span], rows.ids[i])
        assert np.array_equal(arrays["labels"][r[0], span], rows.labels[i])
        assert np.array_equal(arrays["positions"][r[0], span], np.arange(rows.lengths[i]))
    assert (arrays["labels"][~arrays["attention_mask"]] == IGNORE).all()
    assert not arrays["token_type_ids"].any()


def test_a_run_takes_at_most_eight_row_counts_and_the_canary_sees_each():
    lengths = np.random.default_rng(3).integers(3, 60, size=2000)
    rows = sentences(lengths)
    packing = Packing.of(rows.lengths, 32, (32, 64))
    shapes = step_shapes(rows.lengths, packing, 32, 2, [0, 1])
    assert 1 <= len(shapes) <= MAX_SHAPES and all(count % packing.rows_step == 0 for count in shapes)
    taken = {
        packing.place(rows.lengths[index])[2]
        for seed in (0, 1)
        for batches in shuffled_batches(len(lengths), 32, 2, seed)
        for index in batches
    }
    assert taken == set(shapes)
    # the worst case, every window wider than half a row, still fits the ladder of row counts
    assert packing.place(np.full(32, 40))[2] == 32
    # a short last batch takes as many rows as a typical one: no graph of its own
    assert packing.place(np.array([5, 9]))[2] == packing.least_rows == min(shapes) > packing.rows_step
    first, again = shuffled_batches(100, 32, 2, 7), shuffled_batches(100, 32, 2, 7)
    assert all(np.array_equal(a, b) for ea, eb in zip(first, again) for a, b in zip(ea, eb))
    assert sorted(np.concatenate(first[0]).tolist()) == list(range(100))
    assert not np.array_equal(first[0][0], first[1][0])  # each epoch shuffled anew


def test_the_packed_step_is_the_step_on_each_sentence_alone():
    rows = sentences([30, 12, 7, 25, 40, 5, 9, 33], seed=1)
    index = np.arange(len(rows.ids))
    longest = int(rows.lengths.max())
    padded = {
        "input_ids": np.zeros((len(index), longest), np.int64),
        "attention_mask": np.zeros((len(index), longest), bool),
        "labels": np.full((len(index), longest), IGNORE, np.int64),
    }
    for row, i in enumerate(index):
        n = rows.lengths[i]
        padded["input_ids"][row, :n], padded["attention_mask"][row, :n] = rows.ids[i], True
        padded["labels"][row, :n] = rows.labels[i]
    packed = Packing.of(rows.lengths, 8, (64,)).inputs(rows, index, SPECIAL, token_types=False)
    assert packed["input_ids"].size <= 0.6 * padded["input_ids"].size
    params = {**model.init(CFG, seed=0), **init_tag_head(CFG, 5, seed=0)}
    step = make_tag_step(CFG, model.AdamW(eps=1e-6, weight_decay=0.0, clip_norm=0.0), model.Compilation(compile=False))
    outputs = []
    for arrays in (padded, packed):
        batch = {k: torch.from_numpy(v) for k, v in arrays.items()} | {"dropout": torch.tensor(0.0)}
        state = model.optimizer_init(model.AdamW(), params)
        outputs.append(step(dict(params), state, batch, torch.tensor(1e-3)))
    (alone, _, alone_metrics), (together, _, together_metrics) = outputs
    torch.testing.assert_close(together_metrics["loss"], alone_metrics["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(together_metrics["grad_norm"], alone_metrics["grad_norm"], rtol=1e-4, atol=1e-6)
    for name in alone:
        torch.testing.assert_close(together[name], alone[name], rtol=1e-4, atol=1e-6)
