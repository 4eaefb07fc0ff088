"""GradCache: the contrastive loss over the whole batch with the encoder run a chunk at a time gives the
uncached step's loss and gradients (with one or several hard negatives a pair, a last chunk smaller than the
others, a chunk across a pair's negatives, dropout replayed), compiled as eagerly, one graph per chunk shape,
and trains as the uncached step does.

Tolerance: both sides compute the same fp32 terms; only the order of the sums differs (the gradient of a
param is a sum over chunks here, over the batch there), so they agree to a few ulps of the largest
gradient: 1e-5 of it, relative, with room for a few hundred additions."""

import pytest
import torch
from test_embedder import CFG, batch

from cram import model
from cram.model.embedder import embed, in_batch_loss, make_contrastive_step
from cram.model.grad_cache import make_cached_contrastive_step, make_cached_grads
from cram.model.step import Compilation

EAGER = Compilation(compile=False)


def uncached_grads(params, fixed, chunk=None):
    """The batch's loss and gradient as one piece; with `chunk`, dropout drawn chunk by chunk in the order
    GradCache draws it (queries, then documents), so the masks are the same."""
    rate = float(fixed["dropout"])

    def embedded(p, ids, mask):
        pieces = zip(ids.split(chunk or len(ids)), mask.split(chunk or len(ids)))
        return torch.cat([embed(p, CFG, i, m, "mean", "auto", rate) for i, m in pieces])

    def loss(p):
        queries = embedded(p, fixed["query_ids"], fixed["query_mask"])
        docs = embedded(p, fixed["doc_ids"], fixed["doc_mask"])
        size = len(queries)
        return in_batch_loss(queries, docs[:size], docs[size:] if len(docs) > size else None)

    grads, value = torch.func.grad_and_value(loss)(params)
    return value, grads


def assert_same_grads(got, want):
    scale = max(g.abs().max() for g in want.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5 * float(scale), msg=name)


@pytest.mark.parametrize("negatives, chunk", [(0, 2), (1, 3), (1, 1), (0, 64), (3, 4), (3, 7)])
def test_the_cached_gradient_is_the_uncached_one(negatives, chunk):
    params, fixed = model.init(CFG, seed=0), batch(0, size=5, negatives=negatives)
    loss, grads = make_cached_grads(CFG, EAGER, chunk=chunk)(params, fixed)
    want_loss, want = uncached_grads(params, fixed)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert_same_grads(grads, want)


def test_dropout_draws_the_same_masks_when_a_chunk_runs_again():
    params, fixed = model.init(CFG, seed=0), {**batch(1, size=4, negatives=True), "dropout": torch.tensor(0.3)}
    torch.manual_seed(7)
    loss, grads = make_cached_grads(CFG, EAGER, chunk=2)(params, fixed)
    torch.manual_seed(7)
    want_loss, want = uncached_grads(params, fixed, chunk=2)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert_same_grads(grads, want)
    torch.manual_seed(7)
    other = make_cached_grads(CFG, EAGER, chunk=2)(params, fixed)[1]
    assert_same_grads(other, grads)  # the same seed: the same step
    without = uncached_grads(params, {**fixed, "dropout": torch.tensor(0.0)})[1]
    assert any(not torch.equal(grads[name], without[name]) for name in grads)  # dropout was on


def test_the_compiled_cached_gradient_is_the_eager_one_in_one_graph_per_chunk_shape():
    torch._dynamo.reset()
    params, fixed = model.init(CFG, seed=2), batch(2, size=4, negatives=True)
    how = Compilation(backend="aot_eager")
    grads_of = make_cached_grads(CFG, how, chunk=3)  # chunks of 3 and 1: two shapes each side
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    loss, grads = grads_of(params, fixed)
    # queries in chunks of 3 and 1, documents of 3, 3 and 2: 4 shapes forward, 4 backward, the loss 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 9
    again = grads_of(params, batch(3, size=4, negatives=True))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 9  # the same shapes: no new graph
    want_loss, want = make_cached_grads(CFG, EAGER, chunk=3)(params, fixed)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    assert_same_grads(grads, want)
    assert torch.isfinite(again[0])


def test_the_cached_step_trains_as_the_uncached_step_does():
    opt = model.AdamW(lr=1e-3)
    steps = [make_contrastive_step(CFG, opt, EAGER), make_cached_contrastive_step(CFG, opt, EAGER, chunk=2)]
    start = model.init(CFG, seed=4)
    states = [(start, model.optimizer_init(model.AdamW(), start)) for _ in steps]
    for seed in range(3):
        out = [
            step(*states[k], batch(seed, size=4, negatives=True), torch.tensor(1e-3)) for k, step in enumerate(steps)
        ]
        states = [(p, o) for p, o, _ in out]
        torch.testing.assert_close(out[1][2]["loss"], out[0][2]["loss"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[1][2]["grad_norm"], out[0][2]["grad_norm"], rtol=1e-5, atol=1e-6)
    for name in start:
        torch.testing.assert_close(states[1][0][name], states[0][0][name], rtol=1e-4, atol=1e-5)


def test_a_chunk_below_one_is_refused():
    with pytest.raises(ValueError, match="chunk=0: must be at least 1"):
        make_cached_grads(CFG, EAGER, chunk=0)
