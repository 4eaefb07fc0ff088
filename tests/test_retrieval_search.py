"""Exact top-k search over embeddings on disk, a chunk at a time: the result equals the unchunked top-k
for any chunk size, ties included, in fp32 and fp16."""

import numpy as np
import pytest

from cram.stages.retrieval.search import Embeddings, normalised, top_k, write_embeddings
from cram.stages.shared.files import temp_path


def unchunked(queries: np.ndarray, corpus: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference: every score at once, sorted whole (stable, so equal scores by lower index)."""
    scores = queries.astype(np.float32) @ corpus.astype(np.float32).T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, 1), order


def written(tmp_path, corpus: np.ndarray, dtype: str, batch: int = 97) -> Embeddings:
    path = tmp_path / "corpus.npy"
    write_embeddings(path, (corpus[i : i + batch] for i in range(0, len(corpus), batch)), len(corpus), dtype)
    return Embeddings.open(path)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("chunk_rows", [64, 333, 5000])
def test_a_corpus_larger_than_the_chunk_gives_the_unchunked_top_k(tmp_path, dtype, chunk_rows):
    rng = np.random.default_rng(0)
    corpus = normalised(rng.standard_normal((1000, 24)))
    queries = normalised(rng.standard_normal((300, 24)))  # more than one query batch
    embeddings = written(tmp_path, corpus, dtype)
    assert (embeddings.rows, embeddings.dim, embeddings.dtype) == (1000, 24, np.dtype(dtype))
    on_disk = np.load(tmp_path / "corpus.npy")
    np.testing.assert_allclose(on_disk, corpus, atol=1e-3 if dtype == "float16" else 1e-6)
    scores, index = top_k(queries, embeddings, 100, chunk_rows=chunk_rows)
    want_scores, want_index = unchunked(queries, on_disk, 100)
    np.testing.assert_array_equal(index, want_index)
    np.testing.assert_allclose(scores, want_scores, rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunk_rows", [11, 333, 5000])
def test_ties_across_chunks_and_the_kth_place_keep_the_lower_index(tmp_path, chunk_rows):
    # 400 copies of 5 distinct unit rows: every score ties 400 ways, and the ties straddle chunk edges and
    # k. Every value is a small dyadic fraction, so each dot product is exact in any summation order.
    rows = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0.5, 0.5, 0.5, 0.5], [-0.5, 0.5, -0.5, 0.5]])
    corpus = np.tile(rows, (400, 1)).astype(np.float32)
    queries = np.random.default_rng(1).integers(-8, 9, (7, 4)).astype(np.float32) / 8
    embeddings = written(tmp_path, corpus, "float32", batch=130)
    for k in (3, 8, 17, 200):
        scores, index = top_k(queries, embeddings, k, chunk_rows=chunk_rows)
        want_scores, want_index = unchunked(queries, corpus, k)
        np.testing.assert_array_equal(index, want_index)
        np.testing.assert_array_equal(scores, want_scores)


def test_k_past_the_corpus_returns_every_row_and_vectors_are_normalised(tmp_path):
    rng = np.random.default_rng(2)
    corpus = rng.standard_normal((10, 4)) * 5  # write_embeddings normalises
    embeddings = written(tmp_path, corpus, "float32", batch=4)
    assert np.linalg.norm(np.load(tmp_path / "corpus.npy"), axis=1) == pytest.approx(np.ones(10), abs=1e-6)
    scores, index = top_k(normalised(corpus[:2]), embeddings, 50, chunk_rows=3)
    assert index.shape == (2, 10) and index[:, 0].tolist() == [0, 1]
    assert scores[:, 0] == pytest.approx([1.0, 1.0], abs=1e-6)


def test_a_write_that_does_not_deliver_its_rows_leaves_no_file(tmp_path):
    with pytest.raises(ValueError, match="3 rows written of the 5 announced"):
        write_embeddings(tmp_path / "e.npy", iter([np.ones((3, 2))]), 5)
    assert list(tmp_path.iterdir()) == []


def test_writing_holds_one_batch_at_a_time(tmp_path):
    seen = []

    def batches():
        for i in range(5):
            seen.append(i)
            yield np.full((2, 3), i + 1.0)
            # The batch yielded has been appended before the next one is asked for, and nothing past it:
            # the file grows with what is written, never a sparse file of the whole output.
            offset = Embeddings.open(temp_path(tmp_path / "e.npy")).offset
            assert temp_path(tmp_path / "e.npy").stat().st_size == offset + 2 * (i + 1) * 3 * 2  # float16

    write_embeddings(tmp_path / "e.npy", batches(), 10)
    assert seen == [0, 1, 2, 3, 4]
    assert np.load(tmp_path / "e.npy")[:, 0] == pytest.approx(np.full(10, 3**-0.5), abs=1e-3)
