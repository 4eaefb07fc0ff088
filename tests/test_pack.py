"""The pack stage on token datasets made in the tests: every token kept once and in order, the
split by document, the same bytes as a plain in-memory pack whatever the chunk size, determinism,
de-duplication, dtypes and bad input; and the data stages end to end on the default corpus through
`cram`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cram.stages import StageError, Upstream, pack
from cram.stages.data import scratch, token_map
from cram.stages.shared.runs import gather_runs
from cram.stages.shared.special import SPECIAL_IDS

REPO = Path(__file__).parent.parent


def make_tokens(tmp_path: Path, documents: list[list[int]], vocab_size: int = 1000, shards: int = 1) -> Upstream:
    """A finished tokenize stage holding `documents`."""
    import datasets

    folder = tmp_path / "tokenize"
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
    tokens = datasets.Dataset.from_dict({"input_ids": documents}, features=features)
    tokens.save_to_disk(str(folder / "tokens"), num_shards=shards)
    return Upstream(folder, {"tokens": "tokens", "vocab_size": vocab_size, "special_ids": SPECIAL_IDS})


def random_documents(n: int, seed: int = 0, vocab_size: int = 1000) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, vocab_size, size=rng.integers(1, 120)).tolist() for _ in range(n)]


def run(upstream: Upstream, tmp_path: Path, make_ctx, seed: int = 0, name: str = "pack", **kw):
    out = tmp_path / name
    out.mkdir()
    outputs = pack.run(pack.Config(**{"seq_len": 16, **kw}), {"tokenize": upstream}, out, make_ctx(seed=seed))
    return out, outputs


def pieces(flat: np.ndarray) -> list[list[int]]:
    """The stream cut after each [SEP], with [CLS] dropped: documents, the first and last maybe cut."""
    ends = np.flatnonzero(flat == SPECIAL_IDS["sep"])
    parts = np.split(flat, ends + 1)
    return [[t for t in p.tolist() if t not in (SPECIAL_IDS["cls"], SPECIAL_IDS["sep"])] for p in parts]


def test_every_token_once_in_order_within_its_document_and_split_by_document(tmp_path, make_ctx):
    docs = random_documents(200)
    out, outputs = run(make_tokens(tmp_path, docs), tmp_path, make_ctx, val_fraction=0.1)
    train = np.load(out / outputs["train"], mmap_mode="r")
    val = np.load(out / outputs["val"], mmap_mode="r")
    assert train.shape == (outputs["train_blocks"], 16) and val.shape == (outputs["val_blocks"], 16)
    assert train.dtype == np.uint16 and outputs["dtype"] == "uint16"

    index = {tuple(d): i for i, d in enumerate(docs)}
    found = {}
    for split, blocks in (("train", train), ("val", val)):
        flat = np.asarray(blocks).ravel()
        assert flat[0] == SPECIAL_IDS["cls"]  # a split starts with a whole document
        *whole, last = pieces(flat)
        for doc in whole:
            assert tuple(doc) not in found, "a document was packed twice"
            found[tuple(doc)] = split
        # Only the dropped remainder is missing: the last piece is the start of a document.
        assert any(d[: len(last)] == last for d in docs)
        found[("last", split)] = last
    whole_docs = [d for d in found if d[0] != "last"]
    assert all(d in index for d in whole_docs)
    assert len(whole_docs) >= len(docs) - 2  # at most one cut document per split
    assert outputs["val_documents"] == 20 and outputs["train_documents"] == 180
    assert outputs["tokens"] == sum(map(len, docs)) and outputs["documents"] == 200


def reference_pack(
    docs: list[list[int]], seed: int, seq_len: int, val_fraction: float, boundary: str, dedup: bool
) -> dict[str, bytes]:
    """The pack stage's rules written plainly, all in memory: the `.npy` bytes it must write."""
    import io

    keep, seen = [], set()
    for i, doc in enumerate(docs):
        if doc and not (dedup and tuple(doc) in seen):
            keep.append(i)
            seen.add(tuple(doc))
    order = np.array(keep)[np.random.default_rng(seed).permutation(len(keep))]
    prefix = [SPECIAL_IDS["cls"]] if boundary == "cls-sep" else []
    wrapped = [prefix + docs[i] + [SPECIAL_IDS["sep"]] for i in order]
    sizes = np.cumsum([len(w) for w in wrapped])
    n_val = max(1, round(val_fraction * len(order)))
    if sizes[n_val - 1] < seq_len:
        n_val = int(np.searchsorted(sizes, seq_len)) + 1
    files = {}
    for split, part in (("val", wrapped[:n_val]), ("train", wrapped[n_val:])):
        flat = np.array([t for w in part for t in w], dtype=np.uint16)
        buffer = io.BytesIO()
        np.save(buffer, flat[: len(flat) // seq_len * seq_len].reshape(-1, seq_len))
        files[split] = buffer.getvalue()
    return files


@pytest.mark.parametrize("in_place", [True, False], ids=["shards-in-place", "compact-copy"])
@pytest.mark.parametrize("long_documents", [1, 1 << 30], ids=["slice-copies", "index-gather"])
@pytest.mark.parametrize("chunk_tokens", [1, 37, 1 << 22])
def test_chunked_out_of_core_pack_writes_exactly_what_an_in_memory_pack_does(
    tmp_path, make_ctx, monkeypatch, chunk_tokens, long_documents, in_place
):
    monkeypatch.setattr(pack, "CHUNK_TOKENS", chunk_tokens)
    monkeypatch.setattr(pack, "LONG_DOCUMENTS", long_documents)  # each chunk copied either way
    if not in_place:  # as when the shards would outgrow the page cache
        monkeypatch.setattr(token_map, "memory_available", lambda: 0)
    if chunk_tokens < 100:
        monkeypatch.setattr(pack, "WRITTEN_BYTES", 64)  # the rows dropped from the page cache again and again
        # The per-document arrays built and read in blocks of 7 documents, de-duplication in 64 buckets.
        monkeypatch.setattr(scratch, "DOCUMENTS", 7)
        monkeypatch.setattr(scratch, "BUCKET_DOCUMENTS", 5)
    docs = random_documents(300, seed=3) + [[7, 8, 9]] * 3 + [[9, 8, 7], []] + random_documents(20, seed=3)
    upstream = make_tokens(tmp_path, docs, shards=3)
    for seed, boundary, dedup in ((0, "cls-sep", True), (5, "sep", False), (9, "cls-sep", False)):
        name = f"{seed}-{boundary}-{dedup}"
        out, outputs = run(
            upstream, tmp_path, make_ctx, seed=seed, name=name, boundary=boundary, dedup=dedup, val_fraction=0.05
        )
        expected = reference_pack(docs, seed, 16, 0.05, boundary, dedup)
        for split in ("train", "val"):
            assert (out / f"{split}.npy").read_bytes() == expected[split], (name, split)
        assert outputs["duplicates_removed"] == (22 if dedup else 0)  # 2 copies of [7, 8, 9], 20 repeated docs
        assert outputs["read_in_place"] is in_place
        assert sorted(p.name for p in out.iterdir()) == ["pack.json", "train.npy", "val.npy"]  # no scratch left


def test_shards_past_the_open_file_limit_are_read_from_a_compact_copy(tmp_path, make_ctx, monkeypatch):
    import resource

    docs = random_documents(80, seed=6)
    upstream = make_tokens(tmp_path, docs, shards=4)
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (5, 5))  # no room for 4 more open files
    out, outputs = run(upstream, tmp_path, make_ctx, val_fraction=0.05)
    expected = reference_pack(docs, 0, 16, 0.05, "cls-sep", True)
    assert [(out / f"{s}.npy").read_bytes() for s in ("train", "val")] == [expected["train"], expected["val"]]
    assert outputs["read_in_place"] is False


def test_a_soft_open_file_limit_is_raised_to_read_the_shards_in_place(tmp_path, make_ctx, monkeypatch):
    import resource

    raised = []
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (5, resource.RLIM_INFINITY))
    monkeypatch.setattr(resource, "setrlimit", lambda kind, limits: raised.append(limits))
    out, outputs = run(make_tokens(tmp_path, random_documents(80, seed=6), shards=4), tmp_path, make_ctx)
    assert outputs["read_in_place"] is True
    assert raised == [(4 + 256, resource.RLIM_INFINITY)]


def test_a_null_document_is_an_empty_one(tmp_path, make_ctx):
    docs = random_documents(60, seed=4)
    with_null = docs[:30] + [None] + docs[30:]
    out, outputs = run(make_tokens(tmp_path, with_null), tmp_path, make_ctx, val_fraction=0.05)
    expected = reference_pack(docs[:30] + [[]] + docs[30:], 0, 16, 0.05, "cls-sep", True)
    assert [(out / f"{s}.npy").read_bytes() for s in ("train", "val")] == [expected["train"], expected["val"]]
    assert outputs["documents"] == 61


@pytest.mark.parametrize("in_place", [True, False], ids=["shards-in-place", "compact-copy"])
def test_ids_under_a_null_list_are_skipped_where_the_batch_holds_them(tmp_path, make_ctx, monkeypatch, in_place):
    """Arrow lets a null list's offsets span ids that belong to no document, and keeps those ids in the
    file: pass two must find each later document where its batch put it, not where a count of ids says."""
    import pyarrow as pa

    from cram.stages.data import shards

    if not in_place:
        monkeypatch.setattr(token_map, "memory_available", lambda: 0)
    docs = random_documents(90, seed=7)
    folder, names, kept = tmp_path / "tokenize" / "tokens", [], []
    folder.mkdir(parents=True)
    for n, part in enumerate((docs[:40], docs[40:])):
        names.append(f"data-{n:05d}.arrow")
        with shards.ShardWriter(folder / names[-1], shards.TOKENS) as writer:
            for first in range(0, len(part), 15):
                batch = part[first : first + 15]
                values = [99, 98] + [t for d in batch for t in d]  # a null list's ids, then the documents'
                ends = np.cumsum([0, 2] + [len(d) for d in batch]).tolist()
                mask = pa.array([True] + [False] * len(batch))
                writer.write(
                    {"input_ids": pa.ListArray.from_arrays(pa.array(ends), pa.array(values, pa.int32()), mask=mask)}
                )
                kept += [[]] + batch
    shards.finish_folder(folder, names, shards.TOKENS)
    upstream = Upstream(tmp_path / "tokenize", {"tokens": "tokens", "vocab_size": 1000, "special_ids": SPECIAL_IDS})
    out, outputs = run(upstream, tmp_path, make_ctx, val_fraction=0.05)
    expected = reference_pack(kept, 0, 16, 0.05, "cls-sep", True)
    assert [(out / f"{s}.npy").read_bytes() for s in ("train", "val")] == [expected["train"], expected["val"]]
    assert outputs["read_in_place"] is in_place


@pytest.mark.parametrize("bad_id", [1000, -1])
def test_ids_beyond_the_vocab_are_a_stage_error(tmp_path, make_ctx, bad_id):
    upstream = make_tokens(tmp_path, random_documents(50) + [[5, bad_id]], vocab_size=1000)
    with pytest.raises(StageError, match=r"token ids outside \[0, vocab_size = 1000\).*re-run tokenize"):
        run(upstream, tmp_path, make_ctx)


def test_the_validation_split_is_at_least_one_block(tmp_path, make_ctx):
    upstream = make_tokens(tmp_path, random_documents(60))
    _, outputs = run(upstream, tmp_path, make_ctx, seq_len=256, val_fraction=0.01)
    assert outputs["val_blocks"] >= 1 and outputs["val_documents"] > 1  # 1% would be one document


def test_same_seed_same_bytes_other_seed_other_order(tmp_path, make_ctx):
    upstream = make_tokens(tmp_path, random_documents(100))
    a, _ = run(upstream, tmp_path, make_ctx, seed=1, name="a")
    b, _ = run(upstream, tmp_path, make_ctx, seed=1, name="b")
    c, _ = run(upstream, tmp_path, make_ctx, seed=2, name="c")
    for split in ("train.npy", "val.npy"):
        assert (a / split).read_bytes() == (b / split).read_bytes()
    assert (a / "train.npy").read_bytes() != (c / "train.npy").read_bytes()


def test_exact_duplicates_are_removed_but_not_lookalikes(tmp_path, make_ctx):
    # Two copies of a document, its reverse (the same multiset of ids: its hash collides) and an
    # empty document.
    docs = random_documents(50) + [[10, 11, 12], [10, 11, 12], [12, 11, 10], []]
    upstream = make_tokens(tmp_path, docs)
    _, deduped = run(upstream, tmp_path, make_ctx, name="dedup")
    assert deduped["duplicates_removed"] == 1
    assert deduped["train_documents"] + deduped["val_documents"] == 52
    _, kept = run(upstream, tmp_path, make_ctx, name="all", dedup=False)
    assert kept["duplicates_removed"] == 0
    assert kept["train_documents"] + kept["val_documents"] == 53  # the empty one adds nothing


def test_boundary_sep_only(tmp_path, make_ctx):
    docs = random_documents(40)
    out, outputs = run(make_tokens(tmp_path, docs), tmp_path, make_ctx, boundary="sep")
    flat = np.load(out / "train.npy").ravel()
    assert SPECIAL_IDS["cls"] not in flat
    assert (flat == SPECIAL_IDS["sep"]).sum() >= outputs["train_documents"] - 1


def test_dtype_follows_the_vocab_and_a_forced_uint16_must_fit(tmp_path, make_ctx):
    docs = [list(range(69_970, 70_000))] + random_documents(30)
    upstream = make_tokens(tmp_path, docs, vocab_size=70_000)
    out, outputs = run(upstream, tmp_path, make_ctx, dedup=False)
    assert outputs["dtype"] == "int32" and np.load(out / "train.npy").dtype == np.int32
    assert 69_999 in np.load(out / "train.npy") or 69_999 in np.load(out / "val.npy")
    with pytest.raises(StageError, match=r'pack.dtype: "uint16" holds ids below 65536, but vocab_size is 70000'):
        run(upstream, tmp_path, make_ctx, name="forced", dtype="uint16")


def test_a_corpus_too_small_for_a_block_is_a_stage_error(tmp_path, make_ctx):
    with pytest.raises(StageError, match=r"too few for one validation block and one training block"):
        run(make_tokens(tmp_path, [[5, 6, 7]] * 3 + [[8, 9]]), tmp_path, make_ctx, seq_len=64)


def test_bad_settings_name_their_key():
    with pytest.raises(ValueError, match=r"^seq_len: 4 is too short; it must be at least 8"):
        pack.Config(seq_len=4)
    with pytest.raises(ValueError, match=r"^val_fraction:"):
        pack.Config(val_fraction=0.0)


@pytest.mark.parametrize("block", [3, 1 << 18])
def test_the_shuffle_over_a_memory_map_is_numpys_permutation(tmp_path, monkeypatch, block):
    monkeypatch.setattr(scratch, "DOCUMENTS", block)
    docs = np.flatnonzero(np.random.default_rng(1).random(1000) < 0.7)  # ascending, with gaps
    order = scratch.shuffled(docs, 7, tmp_path)
    assert order.tolist() == docs[np.random.default_rng(7).permutation(len(docs))].tolist()
    assert scratch.shuffled(docs[:0], 7, tmp_path).tolist() == []


def test_documents_of_one_length_spread_over_the_dedup_buckets(tmp_path):
    rng = np.random.default_rng(0)
    lengths = np.full(20_000, 128)
    values = rng.integers(0, 2**32, size=int(lengths.sum()), dtype=np.uint64)
    keys = pack._document_hashes(values, lengths)
    counts = np.bincount(scratch.bucket_of(keys, 64), minlength=64)
    assert len(counts) == 64 and counts.max() < 2 * counts.mean()  # not all in one bucket


def test_gather_runs_matches_a_loop():
    starts, lengths = np.array([10, 0, 5, 3, 40]), np.array([3, 0, 2, 1, 4])
    expected = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
    assert gather_runs(starts, lengths).tolist() == expected.tolist()


@pytest.mark.slow
def test_tokenize_then_pack_on_the_default_corpus_through_cram(tmp_path, monkeypatch):
    """The issue's acceptance run: offline, `--only tokenize` then `--only pack`, then cache hits;
    and a bad input exits 2 with nothing marked done."""
    import json

    from typer.testing import CliRunner

    from cram.pipeline.commands import cli

    monkeypatch.chdir(tmp_path)
    root = f'run.root="{tmp_path / "runs"}"'

    def cram(*args: str, code: int = 0) -> str:
        result = CliRunner().invoke(cli.app, ["run", str(REPO / "pipeline.toml"), "--set", root, *args])
        assert result.exit_code == code, result.output
        return result.output

    cram("--only", "tokenize")
    cram("--only", "pack")
    manifest = json.loads((tmp_path / "runs/default/manifest.json").read_text())["stages"]
    tokens, packed = manifest["tokenize"]["outputs"], manifest["pack"]["outputs"]
    assert tokens["documents"] + tokens["heldout_documents"] == 10_033
    assert 1500 < tokens["heldout_documents"] < 2500
    train = np.load(tmp_path / "runs/default/pack" / packed["train"], mmap_mode="r")
    assert train.shape == (packed["train_blocks"], 128) and packed["train_blocks"] > 5000
    cram("--only", "tokenize")
    cram("--only", "pack")
    again = json.loads((tmp_path / "runs/default/manifest.json").read_text())["stages"]
    for stage in ("tokenize", "pack"):
        assert again[stage]["started"] == manifest[stage]["started"]  # not run again

    bad = ("--set", 'tokenize.corpus.file="data/nope.json"', "--set", 'run.name="bad"', "--only", "tokenize")
    assert "data/nope.json" in cram(*bad, code=2)
    assert not (tmp_path / "runs/bad").exists()  # refused before any stage ran (tokenize's `validate`)
