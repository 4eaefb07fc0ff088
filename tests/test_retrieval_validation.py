"""The validation split carved from a retrieval task's training pairs: drawn by a hash of the query (the same
every run), every pair of a drawn query with it, positives found in the corpus by text or added beside it,
none where too few queries are drawn or too few pairs are left; and the choices made on it (choosing.py)."""

from cram.stages.retrieval import validation
from cram.stages.retrieval.beir import Document, Pair
from cram.stages.retrieval.choosing import Judged, offers_untuned, selection
from cram.stages.retrieval.fusion import Fusion

CORPUS = {f"d{i}": Document(f"d{i}", "", f"document number {i}") for i in range(200)}
PAIRS = tuple(Pair(f"query {i}", f"document number {i}") for i in range(150)) + tuple(
    Pair(f"query {i}", f"a text outside the corpus {i}") for i in range(150, 300)
)


def test_the_split_is_the_same_every_time_and_holds_whole_queries():
    train, held = validation.carve(PAIRS, CORPUS, batch_size=8)
    again = validation.carve(PAIRS, CORPUS, batch_size=8)
    assert held == again[1] and train == again[0]
    assert validation.MIN_QUERIES <= len(held.queries) <= 0.2 * 300 and len(train) + len(held.queries) == 300
    assert not {p.query for p in train} & set(held.queries.values())
    for query, text in held.queries.items():
        (doc,) = held.qrels[query]
        n = int(text.split()[1])
        if n < 150:
            assert doc == f"d{n}" and doc not in held.documents  # found in the corpus by its text
        else:
            assert held.documents[doc].text == f"a text outside the corpus {n}" and doc not in CORPUS


def test_a_query_with_two_positives_is_judged_on_both():
    pairs = PAIRS + tuple(Pair(p.query, "document number 199") for p in PAIRS[:150])
    _, held = validation.carve(pairs, CORPUS, batch_size=8)
    two = [q for q, judged in held.qrels.items() if int(held.queries[q].split()[1]) < 150]
    assert two and all(len(held.qrels[q]) == 2 for q in two)


def test_too_few_queries_or_pairs_left_give_no_split():
    assert validation.carve(PAIRS[:40], CORPUS, batch_size=8) == (PAIRS[:40], None)
    assert validation.carve(PAIRS, CORPUS, batch_size=200)[1] is None  # the rest would fill one batch


def judged(validation_score):
    dense = {"test": {"ndcg@10": 0.9}} | (
        {} if validation_score is None else {"validation": {"ndcg@10": validation_score}}
    )
    return Judged(dense, Fusion(), {})


def test_a_seed_offers_the_start_only_where_it_is_better_on_validation():
    assert not offers_untuned(judged(0.6), judged(0.5)) and selection(judged(0.6), judged(0.5)) == {"ndcg@10": 0.6}
    assert offers_untuned(judged(0.4), judged(0.5)) and selection(judged(0.4), judged(0.5)) == {"ndcg@10": 0.5}
    assert not offers_untuned(judged(0.5), judged(0.5))  # a tie keeps the fine-tune
    assert not offers_untuned(judged(None), judged(None)) and selection(judged(None), judged(None)) == {"ndcg@10": 0.0}


def test_held_out_titles_split_by_their_own_hash_still_draw_a_validation_share():
    # pairs.load_heldout_task puts the lowest 20% of sha1(title) in the test: the training titles are the rest.
    import hashlib

    titles = sorted((f"Title {i}" for i in range(2000)), key=lambda t: hashlib.sha1(t.encode()).hexdigest())[400:]
    pairs = tuple(Pair(t, f"text of {t}") for t in titles)
    _, held = validation.carve(pairs, {}, batch_size=32)
    assert held is not None and 0.07 * len(pairs) < len(held.queries) < 0.13 * len(pairs)
