"""The tokenize stage on small corpora written by the tests: round trip, special ids, the held-out
split kept out of the tokenizer and the tokens, normalisation options, and bad input."""

from __future__ import annotations

import dataclasses
import json
import random
from types import SimpleNamespace

import pytest

from cram.stages import StageError, tokenize
from cram.stages.data import readers
from cram.stages.data.source import CorpusConfig

SECRET = "quixotically"  # appears only in held-out documents


def words(rng: random.Random, n: int) -> list[str]:
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "do", "fi", "gu", "he"]
    vocab = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(300)]
    # Zipf-like frequencies, as in real text, so that BPE has frequent pairs to merge.
    return rng.choices(vocab, weights=[1 / (i + 1) for i in range(len(vocab))], k=n)


# The documents of `write_corpus` held out at heldout_fraction 0.2 (53 of 300, by a hash of the title),
# pinned: every store's held-out split rests on this mapping, so a change to it must be deliberate.
HELDOUT = frozenset(
    {0, 12, 13, 15, 16, 21, 24, 34, 44, 45, 57, 64, 67, 71, 82, 86, 98, 102, 107, 108, 112, 113, 115, 116, 118, 130}
    | {147, 150, 154, 159, 160, 167, 170, 174, 187, 190, 200, 206, 212, 215, 220, 222, 233, 234, 240, 244, 249}
    | {258, 276, 282, 286, 292, 299}
)


def held_out(record: dict) -> bool:
    """Whether a `write_corpus` record is held out at 0.2, from the pinned table."""
    return int(record["title"].removeprefix("Article ")) in HELDOUT


def write_corpus(path, n_docs: int = 300, seed: int = 0) -> list[dict]:
    """A JSON-lines corpus; the held-out documents (by title) carry SECRET many times."""
    rng = random.Random(seed)
    records = []
    for i in range(n_docs):
        title = f"Article {i}"
        text = " ".join(words(rng, rng.randint(20, 60))) + "."
        if i in HELDOUT:
            text = f"{SECRET} " * 20 + text
        records.append({"title": title, "body": text, "topic": ["Arts", "Science", "Uncategorized"][i % 3]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def config(path, **kw) -> tokenize.Config:
    corpus = CorpusConfig(kind="files", paths=(str(path),), format="jsonl", text_field="body", label_field="topic")
    return tokenize.Config(corpus=corpus, **{"vocab_size": 400, "heldout_fraction": 0.2, **kw})


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    return path, write_corpus(path)


def run(cfg, tmp_path, make_ctx, name="out"):
    out = tmp_path / name
    out.mkdir()
    return out, tokenize.run(cfg, {}, out, make_ctx())


def test_round_trip_special_ids_and_figures(corpus, tmp_path, make_ctx):
    import datasets
    import sentencepiece as spm

    path, records = corpus
    out, outputs = run(config(path), tmp_path, make_ctx)
    sp = spm.SentencePieceProcessor(model_file=str(out / outputs["tokenizer"]))
    assert sp.get_piece_size() == outputs["vocab_size"] == 400
    assert outputs["special_ids"] == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    assert [sp.id_to_piece(i) for i in range(5)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert 4 not in sp.encode("a [MASK] in the text stays text")

    tokens = datasets.load_from_disk(str(out / outputs["tokens"]))
    assert tokens.column_names == ["input_ids"]
    train_texts = [r["body"] for r in records if not held_out(r)]
    assert [sp.decode(ids) for ids in tokens["input_ids"]] == train_texts
    assert outputs["documents"] == len(train_texts)
    assert outputs["characters"] == sum(map(len, train_texts))
    assert outputs["total_tokens"] == sum(map(len, tokens["input_ids"]))
    assert outputs["tokens_per_char"] == pytest.approx(outputs["total_tokens"] / outputs["characters"], abs=1e-4)
    assert outputs["mb_per_s"] > 0 and outputs["seconds"] > 0


def test_a_document_is_held_out_by_its_title_or_else_its_text():
    for i in (0, 1, 12, 14, 299):
        assert tokenize.is_heldout(f"Article {i}", "any text", 0.2) == (i in HELDOUT)
        assert tokenize.is_heldout("", f"Article {i}", 0.2) == (i in HELDOUT)  # no title: the text decides
        assert tokenize.is_heldout(f"Article {i}", "any", 1.0) and not tokenize.is_heldout(f"Article {i}", "any", 0.0)


def test_heldout_documents_never_reach_the_tokenizer_or_the_tokens(corpus, tmp_path, make_ctx):
    import datasets
    import sentencepiece as spm

    path, records = corpus
    out, outputs = run(config(path), tmp_path, make_ctx)
    expected = [r for r in records if held_out(r)]
    assert len(expected) == 53
    heldout = datasets.load_from_disk(str(out / outputs["heldout"]))
    assert heldout["title"] == [r["title"] for r in expected]
    assert heldout["text"] == [r["body"] for r in expected]
    assert heldout["label"] == ["" if r["topic"] == "Uncategorized" else r["topic"] for r in expected]

    # SECRET is 40% of the held-out text: a tokenizer trained on it would surely have merged it.
    sp = spm.SentencePieceProcessor(model_file=str(out / outputs["tokenizer"]))
    assert not any("quix" in sp.id_to_piece(i) for i in range(sp.get_piece_size()))
    tokens = datasets.load_from_disk(str(out / outputs["tokens"]))
    assert not any(SECRET in sp.decode(ids) for ids in tokens["input_ids"])


def test_no_heldout_split_gives_none(corpus, tmp_path, make_ctx):
    path, records = corpus
    out, outputs = run(config(path, heldout_fraction=0.0), tmp_path, make_ctx)
    assert outputs["heldout"] is None and outputs["documents"] == len(records)
    assert not (out / "heldout").exists()


def test_lowercase_and_normalisation_are_applied_and_recorded(tmp_path, make_ctx):
    import sentencepiece as spm

    path = tmp_path / "corpus.jsonl"
    write_corpus(path)
    path.write_text(path.read_text().replace("ka", "KA"))
    out, outputs = run(config(path, lowercase=True, heldout_fraction=0.0), tmp_path, make_ctx)
    assert (outputs["lowercase"], outputs["normalization"]) == (True, "nmt_nfkc_cf")
    sp = spm.SentencePieceProcessor(model_file=str(out / outputs["tokenizer"]))
    assert sp.decode(sp.encode("KALO Mine")) == "kalo mine"


def test_unigram_and_two_processes_over_many_units_give_the_same_outputs_as_one(
    corpus, tmp_path, make_ctx, monkeypatch
):
    import datasets

    path, _ = corpus
    unigram = dict(model_type="unigram", vocab_size=200)
    one_dir, one = run(config(path, **unigram, num_proc=1), tmp_path, make_ctx, "one")
    monkeypatch.setattr(tokenize.corpus, "UNIT_BYTES", 8000)  # ~8 units, read and encoded by 2 processes
    monkeypatch.setattr(tokenize, "SHARD_BYTES", 1000)  # each unit's training text in several shards
    two_dir, two = run(config(path, **unigram, num_proc=2, batch_size=5), tmp_path, make_ctx, "two")
    assert len(list((two_dir / "tokens").glob("*.arrow"))) > 20 and two["num_proc"] == 2
    for output in ("tokens", "heldout"):
        a, b = (datasets.load_from_disk(str(d / output)) for d in (one_dir, two_dir))
        assert a.to_dict() == b.to_dict()
    assert (one_dir / "tokenizer.model").read_bytes() == (two_dir / "tokenizer.model").read_bytes()
    assert {k: v for k, v in one.items() if "seconds" not in k and k not in ("mb_per_s", "num_proc")} == {
        k: v for k, v in two.items() if "seconds" not in k and k not in ("mb_per_s", "num_proc")
    }
    assert not (two_dir / "scratch").exists()


def test_the_tokenizer_trains_on_a_bounded_sample_spread_over_the_corpus(tmp_path, monkeypatch):
    from cram.stages.data import shards

    paths = []
    for i in range(4):  # four shards of 100 documents, each naming its shard
        paths.append(tmp_path / f"text-{i}.arrow")
        with shards.ShardWriter(paths[-1], shards.TEXT) as writer:
            writer.write({"text": [f"shard{i} " * 10 + f"doc {j}" for j in range(100)]})
    characters = sum(len(f"shard{i} " * 10 + f"doc {j}") for i in range(4) for j in range(100))
    cfg = tokenize.Config(tokenizer_max_chars=characters // 4)
    lines = list(tokenize._training_lines(paths, characters, cfg))
    assert sum(map(len, lines)) <= characters // 4
    assert {line[:6] for line in lines} == {"shard0", "shard1", "shard2", "shard3"}
    everything = list(tokenize._training_lines(paths, characters, tokenize.Config()))
    assert len(everything) == 400  # under the bound: every document, in order
    assert everything[0].startswith("shard0") and everything[-1].endswith("doc 99")


@pytest.mark.parametrize("num_proc", [1, 2])
def test_bad_input_in_any_unit_is_one_stage_error_with_file_and_line(tmp_path, make_ctx, monkeypatch, num_proc):
    path = tmp_path / "corpus.jsonl"
    write_corpus(path)
    path.write_text(path.read_text() + '{"title": "cut", "body": "half a li')
    monkeypatch.setattr(tokenize.corpus, "UNIT_BYTES", 5000)
    with pytest.raises(StageError, match=r"corpus.jsonl:301: not valid JSON") as error:
        run(config(path, num_proc=num_proc), tmp_path, make_ctx)
    assert "\n" not in str(error.value)


def test_a_lone_surrogate_is_refused_naming_file_and_line_or_replaced_as_set(tmp_path, make_ctx, monkeypatch):
    path = tmp_path / "corpus.jsonl"
    write_corpus(path)
    lines = path.read_text().splitlines(keepends=True)
    lines[250] = json.dumps({"title": "emoji half", "body": "a smile \ud83d here"}) + "\n"  # JSON writes \ud83d
    path.write_text("".join(lines))
    monkeypatch.setattr(tokenize.corpus, "UNIT_BYTES", 5000)
    with pytest.raises(StageError) as refused:
        run(config(path), tmp_path, make_ctx)
    assert str(refused.value) == (
        f"{path}:251: field 'body' holds a lone surrogate \\ud83d at character 8 (half of a UTF-16 pair, from a "
        'JSON escape), which UTF-8 cannot encode; fix the file or set tokenize.corpus.encoding_errors = "replace"'
    )
    tokenize.validate(config(path), SimpleNamespace(stages={}))  # past the first bytes: found when read
    corpus = dataclasses.replace(config(path).corpus, encoding_errors="replace")
    out, outputs = run(dataclasses.replace(config(path), corpus=corpus), tmp_path, make_ctx, "replaced")
    assert outputs["documents"] + outputs["heldout_documents"] == 300


def test_a_lone_surrogate_in_the_first_bytes_fails_the_dry_run(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"title": "a", "body": "fine"}\n{"title": "b \\udc00", "body": "x"}\n')
    with pytest.raises(StageError, match=r"corpus.jsonl:2: field 'title' holds a lone surrogate \\udc00"):
        tokenize.validate(config(path), SimpleNamespace(stages={}))
    corpus = dataclasses.replace(config(path).corpus, encoding_errors="replace")
    tokenize.validate(dataclasses.replace(config(path), corpus=corpus), SimpleNamespace(stages={}))


def test_an_empty_corpus_is_a_stage_error(tmp_path, make_ctx):
    (tmp_path / "blank.txt").write_text("   \n\n\t\n")
    corpus = CorpusConfig(kind="files", paths=(str(tmp_path / "blank.txt"),), format="text")
    with pytest.raises(StageError, match=r"blank.txt: the corpus is empty"):
        run(tokenize.Config(corpus=corpus), tmp_path, make_ctx)


def test_long_lines_are_cut_for_tokenizer_training():
    line = " ".join(["word"] * 1000)  # 4,999 characters
    pieces = list(readers.cut_text(line, 2000))
    assert all(len(p) <= 2000 for p in pieces) and len(pieces) == 3
    assert " ".join(pieces) == line
    assert list(readers.cut_text("x" * 4500, 2000)) == ["x" * 2000, "x" * 2000, "x" * 500]


def test_a_corpus_too_small_for_the_vocab_is_a_stage_error(tmp_path, make_ctx):
    path = tmp_path / "tiny.jsonl"
    write_corpus(path, n_docs=5)
    with pytest.raises(StageError, match=r"tokenize.vocab_size: 4000 is too large for this corpus"):
        run(config(path, vocab_size=4000, heldout_fraction=0.0), tmp_path, make_ctx)


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"heldout_fraction": 1.0}, "heldout_fraction"),
        ({"vocab_size": 10}, "vocab_size"),
        ({"lowercase": True, "normalization": "identity"}, "lowercase"),
        ({"num_proc": 0}, "num_proc"),
    ],
)
def test_bad_settings_name_their_key(bad, key):
    with pytest.raises(ValueError, match=f"^{key}:"):
        tokenize.Config(**bad)
