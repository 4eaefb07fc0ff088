"""The embedding model's pure functions: unit vectors pooled as asked, and the contrastive step compiled as
one graph per batch shape that trains as its eager self does and lowers the loss."""

import pytest
import torch
import torch.nn.functional as F

from cram import model
from cram.model.embedder import embed, in_batch_loss, make_contrastive_step, make_embed_step
from cram.model.step import Compilation

CFG = model.ModelConfig(vocab_size=64, hidden=32, heads=2, layers=2, intermediate=64, max_seq_len=32)


def batch(seed: int, size: int = 4, negatives: int = 0) -> dict[str, torch.Tensor]:
    """`size` pairs of random ids, each with `negatives` hard negatives (True: one)."""
    g = torch.Generator().manual_seed(seed)
    docs = size * (1 + int(negatives))
    query_mask = torch.ones(size, 8, dtype=torch.bool)
    query_mask[:, 6:] = False
    doc_mask = torch.ones(docs, 16, dtype=torch.bool)
    doc_mask[::2, 10:] = False
    return {
        "query_ids": torch.randint(5, 64, (size, 8), generator=g),
        "query_mask": query_mask,
        "doc_ids": torch.randint(5, 64, (docs, 16), generator=g),
        "doc_mask": doc_mask,
        "dropout": torch.tensor(0.0),
    }


def test_embeddings_are_unit_vectors_that_ignore_padding():
    params = model.init(CFG, seed=0)
    ids = torch.randint(5, 64, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[0, 6:] = False
    for pooling in ("mean", "first"):
        vectors = embed(params, CFG, ids, mask, pooling)
        torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(3))
        alone = embed(params, CFG, ids[:1, :6], mask[:1, :6], pooling)
        torch.testing.assert_close(vectors[:1], alone, rtol=1e-5, atol=1e-5)


def test_the_step_trains_its_loss_down_with_and_without_hard_negatives():
    for negatives in (False, True):
        step = make_contrastive_step(CFG, model.AdamW(lr=1e-3), Compilation(compile=False))
        params = model.init(CFG, seed=0)
        state, fixed = model.optimizer_init(model.AdamW(), params), batch(0, negatives=negatives)
        losses = []
        for _ in range(20):
            params, state, metrics = step(params, state, fixed, torch.tensor(1e-3))
            losses.append(float(metrics["loss"]))
        assert losses[-1] < losses[0] * 0.5, losses


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_the_compiled_step_is_one_graph_that_agrees_with_eager(autocast):
    torch._dynamo.reset()
    how = Compilation(backend="aot_eager", autocast=autocast)
    compiled_step = make_contrastive_step(CFG, model.AdamW(lr=1e-3), how)
    eager_step = make_contrastive_step(CFG, model.AdamW(lr=1e-3), how.eager())
    start = model.init(CFG, seed=1)
    states = [(start, model.optimizer_init(model.AdamW(), start)) for _ in range(2)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            out = [s(*states[k], batch(seed), torch.tensor(1e-3)) for k, s in enumerate((compiled_step, eager_step))]
            states = [(p, o) for p, o, _ in out]
            torch.testing.assert_close(out[0][2]["loss"], out[1][2]["loss"], rtol=1e-4, atol=1e-4)
    predict = make_embed_step(CFG, how)
    ids = batch(5)
    inputs = {"input_ids": ids["doc_ids"], "attention_mask": ids["doc_mask"]}
    torch.testing.assert_close(predict(states[0][0], inputs), make_embed_step(CFG, how.eager())(states[0][0], inputs))


def test_an_offset_picks_this_ranks_positives_among_gathered_ones():
    g = torch.Generator().manual_seed(3)
    anchors, positives = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g)
    scores = F.normalize(anchors, dim=-1) @ F.normalize(positives, dim=-1).T * 20
    torch.testing.assert_close(in_batch_loss(anchors, positives, offset=4), F.cross_entropy(scores, torch.arange(4, 8)))
