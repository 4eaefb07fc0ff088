"""A special token typed in a text ("[SEP]", "[MASK]", "<s>", "</s>", "<mask>") is read alike by cram and by
the folders it exports, as transformers and sentence-transformers load them: text to a kept model of a
run whose tokenizer is cram's own sentencepiece model (tokenize makes the special pieces control symbols,
which sentencepiece never matches in a text), for a BPE and a unigram model; its token where the run
reused a tokenizer.json (WordPiece, byte-level BPE), as the `tokenizers` library reads it, in cram and in
the export alike. An encoder's export reads a typed [MASK] as the mask token: what fill-mask needs."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest
from test_bytelevel import byte_level_bpe, word_piece
from test_classifier_export import FAMILIES, corpus, sp_model, with_classifier  # noqa: F401 (a fixture)
from test_embed import vectors, with_embedder
from test_export import fake_run

from cram.pipeline.commands.export import export
from cram.stages import tokenize
from cram.stages.shared.tokenizer import load

transformers = pytest.importorskip("transformers")
sentence_transformers = pytest.importorskip("sentence_transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

TYPED = [
    "a [SEP] b [MASK] c",
    "[CLS] the cat [PAD] sat [UNK]",
    "<s> the dog </s> <mask> ran",
    "x[MASK]y [SEP][SEP]",
    "The cat sat on the mat.",
]


@pytest.fixture(scope="module")
def unigram_model(tmp_path_factory):
    """A unigram model whose alphabet holds every character of the special tokens, as one trained on
    real text does (fast_tokenizer._unigram_pieces says why it must)."""
    path = tmp_path_factory.mktemp("unigram") / "tokenizer.model"
    texts = itertools.chain(corpus(), ["Marks [like] these, <tags> and </tags>: SEP MASK CLS PAD UNK, a/b."] * 40)
    config = tokenize.Config(vocab_size=90, model_type="unigram")  # about as many pieces as the corpus gives
    path.write_bytes(tokenize.train_tokenizer(texts, config))
    return path


def cram_ids(tokenizer_file, texts: list[str]) -> list[list[int]]:
    """The ids cram embeds and classifies a text with: [CLS] its ids [SEP], uncut."""
    tokenizer = load(tokenizer_file)
    special = tokenizer.special_ids
    return [[special["cls"], *ids, special["sep"]] for ids in tokenizer.encode(texts)]


def embedder_run(tmp_path, tokenizer_file):
    """A run of a BERT-layout encoder sized to the tokenizer, keeping an embedding model, its tokenize
    stage's special ids the tokenizer's own."""
    tokenizer = load(tokenizer_file)
    cfg = dataclasses.replace(FAMILIES["bert"], vocab_size=max(tokenizer.vocab_size, FAMILIES["bert"].vocab_size))
    run, _ = fake_run(tmp_path, tokenizer_file, cfg=cfg)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stages"]["tokenize"]["outputs"]["special_ids"] = tokenizer.special_ids
    (run / "manifest.json").write_text(json.dumps(manifest))
    with_embedder(run, cfg)
    return run


def check_parity(tmp_path, run, tokenizer_file) -> list[list[int]]:
    """The sentence-transformers export of RUN's embedding model: its tokenizer's ids are cram's, and its
    vectors `cram embed`'s, on the typed texts; returns the ids."""
    folder = export(run, tmp_path / "st", fmt="sentence-transformers", task="search")
    ours = cram_ids(tokenizer_file, TYPED)
    exported = transformers.AutoTokenizer.from_pretrained(folder)
    assert [exported(text)["input_ids"] for text in TYPED] == ours
    model = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    assert np.abs(model.encode(TYPED, batch_size=2) - vectors(run, tmp_path, texts=TYPED)).max() < 1e-4
    return ours


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_a_kept_models_export_reads_typed_special_tokens_as_text_as_cram_does(
    tmp_path,
    sp_model,  # noqa: F811
    unigram_model,
    model_type,
):
    model_file = sp_model if model_type == "bpe" else unigram_model
    ids = check_parity(tmp_path, embedder_run(tmp_path, model_file), model_file)
    special = load(model_file).special_ids
    # Text: no special id inside a text's own ids (tokenize's control symbols never match a text).
    assert not {special["sep"], special["mask"], special["cls"]} & {i for row in ids for i in row[1:-1]}


def test_a_kept_classifiers_export_reads_them_as_text_and_an_encoders_as_tokens(tmp_path, sp_model):  # noqa: F811
    run, _ = fake_run(tmp_path, sp_model, cfg=FAMILIES["bert"])
    with_classifier(run, FAMILIES["bert"], "bert")
    classifier = transformers.AutoTokenizer.from_pretrained(export(run, tmp_path / "t", fmt="transformers", task="t"))
    assert [classifier(text)["input_ids"] for text in TYPED] == cram_ids(sp_model, TYPED)
    encoder = transformers.AutoTokenizer.from_pretrained(export(run, tmp_path / "mlm", fmt="transformers"))
    assert encoder("a [MASK] b", add_special_tokens=False)["input_ids"].count(encoder.mask_token_id) == 1


@pytest.mark.parametrize("make", [word_piece, byte_level_bpe])
def test_a_reused_tokenizer_json_reads_typed_special_tokens_as_tokens_in_cram_and_its_export(tmp_path, make):
    tokenizer_file = make(tmp_path / "tokenizer")
    ids = check_parity(tmp_path, embedder_run(tmp_path, tokenizer_file), tokenizer_file)
    mask = load(tokenizer_file).special_ids["mask"]
    assert mask in ids[0] + ids[2]  # "[MASK]" (WordPiece) or "<mask>" (byte-level): the token, both ways


OUTER = ["  Leading spaces", "Trailing spaces   ", "\tTabbed AND Upper\n", " x ", "Mixed Case Text"]


@pytest.mark.parametrize("make", [word_piece, byte_level_bpe])
def test_outer_whitespace_and_upper_case_embed_as_sentence_transformers_embeds_them(tmp_path, make):
    # sentence-transformers 6 embeds a text as given (2 to 5 stripped it first); a byte-level tokenizer reads
    # " x" and "x" apart, so cram embeds each text as given too, and `cram embed` and the export agree.
    tokenizer_file = make(tmp_path / "tokenizer")
    run = embedder_run(tmp_path, tokenizer_file)
    folder = export(run, tmp_path / "st", fmt="sentence-transformers", task="search")
    model = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    ours = vectors(run, tmp_path, texts=OUTER)
    assert np.abs(model.encode(OUTER, batch_size=2) - ours).max() < 1e-4
    stripped = vectors(run, tmp_path, texts=[t.strip() for t in OUTER], name="stripped.npy")
    differs = np.abs(ours - stripped).max() > 1e-3
    assert differs == (make is byte_level_bpe)  # WordPiece splits on whitespace: the outer spaces are nothing
