"""Texts packed into one row (model/bert.py `encode` with document_ids and positions) are encoded as each
would be alone: every family's positions (learned with and without an offset, sinusoidal, rotary with a
local band and its own theta) restart at each text."""

import dataclasses

import pytest
import torch

from cram import model
from cram.model.bert import encode

pytestmark = pytest.mark.usefixtures("one_thread")

BERT = model.ModelConfig(
    vocab_size=50, hidden=32, layers=2, heads=4, intermediate=64, max_seq_len=40, post_norm=True, token_types=2
)
FAMILIES = {
    "learned": dataclasses.replace(BERT, position="learned"),
    "learned-offset": dataclasses.replace(BERT, position="learned", position_offset=2),
    "sinusoidal": dataclasses.replace(BERT, position="sinusoidal"),
    "rope-local": model.ModelConfig(
        vocab_size=50,
        hidden=32,
        layers=3,
        heads=4,
        intermediate=64,
        max_seq_len=40,
        position="rope",
        local_attention=4,
        global_every=3,
        local_rope_theta=1000.0,
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_texts_packed_in_a_row_are_encoded_as_each_alone(family):
    cfg = FAMILIES[family]
    params = model.init(cfg, seed=0)
    gen = torch.Generator().manual_seed(1)
    texts = [torch.randint(5, cfg.vocab_size, (n,), generator=gen) for n in (9, 5, 13)]
    alone = [encode(params, cfg, t[None], torch.ones(1, len(t), dtype=torch.bool), dropout=0.0)[0] for t in texts]
    length = sum(len(t) for t in texts) + 3  # padding after the last text
    ids = torch.zeros(1, length, dtype=torch.long)
    documents = torch.full((1, length), -1)
    positions = torch.zeros(1, length, dtype=torch.long)
    start = 0
    for n, t in enumerate(texts):
        ids[0, start : start + len(t)], documents[0, start : start + len(t)] = t, n
        positions[0, start : start + len(t)] = torch.arange(len(t))
        start += len(t)
    mask = documents >= 0
    packed = encode(params, cfg, ids, mask, documents, dropout=0.0, positions=positions)[0]
    start = 0
    for t, expected in zip(texts, alone):
        torch.testing.assert_close(packed[start : start + len(t)], expected, atol=2e-5, rtol=1e-4)
        start += len(t)
    assert not torch.allclose(packed[len(texts[0]) : len(texts[0]) + len(texts[1])], alone[0][: len(texts[1])])
