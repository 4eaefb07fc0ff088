"""The given-tokenizer path's ids are the `tokenizers` library's own: `Tokenizer.encode_arrays` against
`encode_batch(..., add_special_tokens=False)` on mixed text, for byte-level BPE (the fast encoder) and
WordPiece (the library's path), each built here with `tokenizers` (no hub)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cram.stages.shared import bytelevel, tokenizer

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
WORDS = "the cat sat on a mat while it's raining they'll we've I'm you'd don't 1984 3.14 $5".split()
ODD = [
    "café naïve Ærøskøbing",  # precomposed
    "cafe\u0301 nai\u0308ve",  # decomposed: NFC changes them
    "日本語のテキスト、中文。",
    "emoji 🙂🚀 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 beyond the plane",
    "Ελληνικά Русский العربية עברית हिन्दी",
    "tabs\tand\u00a0nbsp\u2009thin\u3000ideographic\u200bzero-width",
    "  leading and trailing spaces   ",
    "line one\nline two\n\nline four\r\nwindows",
    "a <mask> inside and <s> too",
    "punctuation!!! ...??? --- ''' \"quoted\" (brackets) [x] {y}",
    "digits ١٢٣ ٤٥ and ½ ⅓ Ⅻ",
    "x'S O'Neil 'tis 'LL",
]


def mixed_texts(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = ["", " ", "\n", "\n\n"]
    for _ in range(n):
        texts.append(" ".join(rng.choice(WORDS + ODD) for _ in range(rng.randint(1, 30))))
    texts.append(" ".join(rng.choice(WORDS + ODD) for _ in range(20_000)))  # a long document
    return texts


def byte_level_bpe(folder: Path, normalizer: str | None = None, prefix_space: bool = False) -> Path:
    """RoBERTa/ModernBERT style: ByteLevel pre-tokenizer, BPE, optionally NFC (as ModernBERT)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if normalizer == "NFC":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(mixed_texts(200, seed=1), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def word_piece(folder: Path) -> Path:
    """BERT style: BertNormalizer, BertPreTokenizer, WordPiece."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials)
    tok.train_from_iterator(mixed_texts(200, seed=1), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def library_ids(file: Path, texts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    return [e.ids for e in Tokenizer.from_file(str(file)).encode_batch(texts, add_special_tokens=False)]


def as_lists(offsets, values) -> list[list[int]]:
    return [values[offsets[i] : offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]


@pytest.mark.parametrize(
    "make",
    [
        byte_level_bpe,
        lambda d: byte_level_bpe(d, normalizer="NFC"),
        lambda d: byte_level_bpe(d, prefix_space=True),
        word_piece,
    ],
    ids=["bpe", "bpe-nfc", "bpe-prefix-space", "wordpiece"],
)
def test_encode_arrays_gives_the_librarys_ids_on_mixed_text(make, tmp_path):
    file = make(tmp_path / "tok")
    texts = mixed_texts()
    loaded = tokenizer.load(file)
    for start in range(0, len(texts), 64):  # batches, so later ones meet words cached by earlier ones
        batch = texts[start : start + 64]
        offsets, values = loaded.encode_arrays(batch)
        assert str(values.dtype) == "int32" and len(offsets) == len(batch) + 1
        assert as_lists(offsets, values) == library_ids(file, batch)
    assert loaded.encode(texts[:50]) == library_ids(file, texts[:50])


def test_only_a_plain_byte_level_bpe_takes_the_fast_encoder(tmp_path):
    from tokenizers import Tokenizer

    bpe = byte_level_bpe(tmp_path / "bpe")
    assert bytelevel.ByteLevelEncoder.of(bpe, Tokenizer.from_file(str(bpe))) is not None
    wordpiece = word_piece(tmp_path / "wp")
    assert bytelevel.ByteLevelEncoder.of(wordpiece, Tokenizer.from_file(str(wordpiece))) is None


def test_characters_the_probe_finds_different_go_to_the_library(tmp_path, monkeypatch):
    """Were Python's whitespace not the library's (no-break space left out here), the probe finds the
    characters concerned and texts holding them are encoded by the library: still the same ids."""
    from tokenizers import Tokenizer

    monkeypatch.setattr(bytelevel, "_SPACES", bytelevel._SPACES.replace("\xa0", ""))
    file = byte_level_bpe(tmp_path / "bpe")
    encoder = bytelevel.ByteLevelEncoder.of(file, Tokenizer.from_file(str(file)))
    assert encoder._unsure("a\xa0b") and not encoder._unsure("café")
    texts = ["a\xa0b c", "plain words", "x \xa0 y", "café"]
    assert as_lists(*encoder.encode(texts)) == library_ids(file, texts)
