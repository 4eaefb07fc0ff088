"""The contrastive step on 2 gloo ranks (spawned processes, CPU): every rank's documents are every rank's
candidates, with their gradients flowing back to the rank that embedded them, so the ranks train as one
process of their global batch does, and a hard negative is pushed away from its anchor, never toward it
(sentence-transformers PR #3453's gather trained anchors toward their hard negatives)."""

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from test_embedder import CFG, batch

from cram import model
from cram.model.embedder import embed, in_batch_loss, make_contrastive_step
from cram.model.step import Compilation

# eps=1e-6: with AdamW's 1e-12 the first update is sign(grad) * lr, and a rounding-level gradient may flip
# (tests/test_step.py's SMOOTH_OPT).
OPT = model.AdamW(lr=1e-3, eps=1e-6)
LR = torch.tensor(1e-3)
WORLD, PAIRS, STEPS = 2, 2, 3  # PAIRS per rank: a global batch of WORLD * PAIRS
# what each rank trains, and how: the global batches of each step, one graph (aot_eager) or eagerly
CASES = {
    "pairs-compiled": (False, Compilation(backend="aot_eager")),
    "pairs-eager": (False, Compilation(compile=False)),
    "negatives-compiled": (True, Compilation(backend="aot_eager")),
    "near-compiled": ("near", Compilation(backend="aot_eager")),
}


def global_batch(step: int, negatives: bool | str) -> dict[str, torch.Tensor]:
    """WORLD * PAIRS pairs as one process holds them: positives, then hard negatives. "near": the same
    batch at every step, each hard negative its anchor's own tokens with two changed, its positive random."""
    if negatives != "near":
        return batch(step, size=WORLD * PAIRS, negatives=negatives)
    out = batch(100, size=WORLD * PAIRS, negatives=True)
    size, query_len = WORLD * PAIRS, out["query_ids"].shape[1]
    near = out["doc_ids"][size:].clone()
    near[:, :query_len] = out["query_ids"]
    near[:, :2] = torch.randint(5, CFG.vocab_size, (size, 2), generator=torch.Generator().manual_seed(7))
    mask = torch.zeros_like(out["doc_mask"][size:])
    mask[:, :query_len] = out["query_mask"]
    doc_ids, doc_mask = torch.cat([out["doc_ids"][:size], near]), torch.cat([out["doc_mask"][:size], mask])
    return {**out, "doc_ids": doc_ids, "doc_mask": doc_mask}


DOC_KEYS = ("doc_ids", "doc_mask")


def shard(full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s PAIRS queries and their documents: its positives, then its hard negatives."""
    size = WORLD * PAIRS
    mine = slice(rank * PAIRS, (rank + 1) * PAIRS)
    blocks = len(full["doc_ids"]) // size
    docs = {k: torch.cat([full[k][b * size : (b + 1) * size][mine] for b in range(blocks)]) for k in DOC_KEYS}
    queries = {k: full[k][mine] for k in ("query_ids", "query_mask")}
    return {**queries, **docs, "dropout": full["dropout"]}


def train(step, negatives: bool | str, rank: int | None = None) -> dict[str, torch.Tensor]:
    params = model.init(CFG, seed=0)
    state = model.optimizer_init(model.AdamW(), params)
    for i in range(STEPS):
        full = global_batch(i, negatives)
        params, state, _ = step(params, state, full if rank is None else shard(full, rank), LR)
    return params


def _rank(rank: int, init_file: str, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    for name, (negatives, how) in CASES.items():
        step = make_contrastive_step(CFG, OPT, how, world_size=WORLD)
        torch.save(train(step, negatives, rank), Path(out_dir) / f"{name}-rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks_trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_rank, args=(str(out / "init"), str(out)), nprocs=WORLD)
    return out


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("near")])
def test_two_ranks_train_as_one_process_of_their_global_batch(ranks_trained, case):
    negatives, _ = CASES[case]
    expected = train(make_contrastive_step(CFG, OPT, Compilation(compile=False)), negatives)
    start = model.init(CFG, seed=0)
    assert max((expected[n] - start[n]).abs().max() for n in start) > 1e-3  # the steps moved the params
    for rank in range(WORLD):
        got = torch.load(ranks_trained / f"{case}-rank{rank}.pt")
        for name, p in expected.items():
            torch.testing.assert_close(got[name], p, rtol=0, atol=1e-5, msg=f"{case}, rank {rank}, {name}")


def test_ranks_push_each_hard_negative_away_from_its_anchor(ranks_trained):
    full = global_batch(0, "near")
    size = WORLD * PAIRS

    def scored(params):
        queries = embed(params, CFG, full["query_ids"], full["query_mask"])
        docs = embed(params, CFG, full["doc_ids"], full["doc_mask"])
        margin = (queries * docs[:size]).sum(-1) - (queries * docs[size:]).sum(-1)
        return float(in_batch_loss(queries, docs[:size], docs[size:])), margin

    loss_before, margin_before = scored(model.init(CFG, seed=0))
    assert (margin_before < 0).all()  # the anchors start nearer their hard negatives than their positives
    for rank in range(WORLD):
        loss_after, margin_after = scored(torch.load(ranks_trained / f"near-compiled-rank{rank}.pt"))
        assert loss_after < loss_before - 0.1, (loss_before, loss_after)
        assert (margin_after > margin_before).all(), (margin_before, margin_after)
