"""Hybrid retrieval's fusion of a dense and a BM25 run, worked out by hand."""

import pytest

from cram.stages.retrieval.fusion import Fusion, fuse, min_max

DENSE = {"a": 0.9, "b": 0.5, "c": 0.1}
LEXICAL = {"b": 12.0, "d": 8.0, "a": 4.0}


def test_min_max_maps_the_best_to_one_and_the_worst_just_above_a_missing_documents_zero():
    assert min_max(DENSE) == pytest.approx({"a": 1.0, "b": 0.5, "c": 0.0}, abs=1e-5) and min_max(DENSE)["c"] > 0
    assert min_max({"x": 3.0, "y": 3.0}) == {"x": 1.0, "y": 1.0}
    assert min_max({}) == {}


def test_convex_mix_counts_a_document_one_run_missed_as_zero_there():
    fused = fuse(DENSE, LEXICAL, Fusion("convex", weight=0.5))
    # lexical normalised: b 1, d 0.5, a 0 (just above).
    assert fused == pytest.approx({"a": 0.5, "b": 0.75, "c": 0.0, "d": 0.25}, abs=1e-5)
    whole = fuse(DENSE, LEXICAL, Fusion("convex", weight=1.0))
    assert whole == pytest.approx({"a": 1, "b": 0.5, "c": 0, "d": 0}, abs=1e-5)
    alone = fuse(DENSE, LEXICAL, Fusion("convex", weight=0.0))
    assert alone == pytest.approx({"a": 0, "b": 1, "c": 0, "d": 0.5}, abs=1e-5)


def test_at_weight_zero_bm25s_worst_hit_still_ranks_above_what_only_the_dense_run_found():
    dense = {f"x{i}": 1 - i / 100 for i in range(50)}
    fused = fuse(dense, {"a": 9.0, "b": 2.0}, Fusion("convex", weight=0.0))
    assert sorted(fused, key=lambda doc: -fused[doc])[:2] == ["a", "b"]


def test_rrf_sums_reciprocal_ranks():
    fused = fuse(DENSE, LEXICAL, Fusion("rrf", rrf_k=60))
    assert fused == pytest.approx({"a": 1 / 61 + 1 / 63, "b": 1 / 62 + 1 / 61, "c": 1 / 63, "d": 1 / 62})
    # Only the order matters: scaling one run changes nothing.
    assert fuse({k: 100 * v for k, v in DENSE.items()}, LEXICAL, Fusion("rrf")) == pytest.approx(fused)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"method": "sum"}, "method: 'sum' is not one of convex, rrf"),
        ({"weight": 1.5}, "weight: 1.5"),
        ({"rrf_k": 0}, "rrf_k: 0"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Fusion(**kwargs)
