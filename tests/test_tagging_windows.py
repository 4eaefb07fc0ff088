"""Words into sub-tokens and rows (stages/tagging/windows.py): the tag on each word's first sub-token alone,
for WordPiece, sentencepiece and byte-level tokenizers; a sentence longer than max_length cut into
overlapping windows with every word read exactly once, from the window where it has the most context."""

import numpy as np
import pytest
from test_export import MODERNBERT, corpus
from test_tokenizer import SENTENCES, roberta_style

from cram.stages import tokenize
from cram.stages.shared import tokenizer as tokenizers
from cram.stages.tagging.windows import IGNORE, owner, spaced, windowed, windows

WORDS = ["Her", "Fish", "sat", "quietly", "on", "the", "sofa", "while", "it", "was", "raining", "happily", "."]


def wordpiece(folder, lowercase: bool = False, vocab_size: int = 90):
    """A small WordPiece tokenizer (BERT's pre-tokenizer, cased or not) that splits words into sub-tokens,
    saved by transformers as a BERT checkpoint's folder holds one."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(SENTENCES, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials))
    names = dict(unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")
    PreTrainedTokenizerFast(tokenizer_object=tok, **names).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizers_of_three_kinds(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    sp = root / "sp" / "tokenizer.model"
    sp.parent.mkdir()
    sp.write_bytes(tokenize.train_tokenizer(corpus(), tokenize.Config(vocab_size=MODERNBERT.vocab_size)))
    folders = {
        "wordpiece": wordpiece(root / "bert"),
        "bytelevel": roberta_style(root / "roberta"),
        "sentencepiece": sp,
    }
    return {kind: tokenizers.load(path) for kind, path in folders.items()}


@pytest.mark.parametrize("kind", ["wordpiece", "bytelevel", "sentencepiece"])
def test_words_encode_as_their_sentence_and_the_tag_sits_on_each_first_sub_token(tokenizers_of_three_kinds, kind):
    tok = tokenizers_of_three_kinds[kind]
    pieces = tok.encode(spaced(WORDS))
    # the words, each encoded alone (a space before all but the first), are the sentence's ids
    assert [t for p in pieces for t in p] == tok.encode([" ".join(WORDS)])[0]
    assert any(len(p) > 1 for p in pieces)  # some word is split, or the test proves nothing
    tags = list(range(1, len(WORDS) + 1))
    rows = windowed(pieces, [len(WORDS)], [tags], tok.special_ids, max_length=64)
    assert len(rows.ids) == 1
    ids, labels = rows.ids[0], rows.labels[0]
    assert ids[0] == tok.special_ids["cls"] and ids[-1] == tok.special_ids["sep"]
    firsts = 1 + np.cumsum([0, *map(len, pieces)])[:-1]
    assert labels[firsts].tolist() == tags
    assert np.count_nonzero(labels != IGNORE) == len(WORDS)  # later sub-tokens, [CLS] and [SEP] are left out
    assert rows.reads[0].tolist() == [[0, int(f)] for f in firsts]


def test_windows_cover_every_position_and_step_by_half_the_budget():
    assert windows(5, 8) == [(0, 5)]
    assert windows(20, 8) == [(0, 8), (4, 12), (8, 16), (12, 20)]
    assert windows(21, 8) == [(0, 8), (4, 12), (8, 16), (12, 20), (13, 21)]
    # a position is read where it has the most room on its nearer edge; the text's own ends are no edges
    spans = windows(20, 8)
    assert owner(0, spans) == 0 and owner(19, spans) == 3
    assert owner(6, spans) == 1  # in (0, 8) it has 1 token on its right, in (4, 12) 2 on its left and 5 right


@pytest.mark.parametrize("max_length", [5, 6, 9, 16])
def test_a_long_sentence_is_windowed_and_every_word_read_exactly_once(tokenizers_of_three_kinds, max_length):
    tok = tokenizers_of_three_kinds["wordpiece"]
    words = WORDS * 4
    pieces = tok.encode(spaced(words))
    tags = [i % 7 for i in range(len(words))]
    short = windowed(pieces[:3], [3], [tags[:3]], tok.special_ids, max_length)  # a second sentence after it
    rows = windowed(pieces + pieces[:3], [len(words), 3], [tags, tags[:3]], tok.special_ids, max_length)
    assert len(rows.ids) > 2 and all(len(r) <= max_length for r in rows.ids)
    reads = rows.reads[0]
    assert len(reads) == len(words) and len({tuple(r) for r in reads}) == len(words)
    # each word's tag is read where its first sub-token is, and trained there alone: no word twice, none lost
    flat = [t for p in pieces for t in p]
    firsts = np.cumsum([0, *map(len, pieces)])[:-1]
    for word, (row, position) in enumerate(reads):
        assert rows.ids[row][position] == flat[firsts[word]]
        assert rows.labels[row][position] == tags[word]
    assert sum(
        int(np.count_nonzero(labels != IGNORE)) for labels in rows.labels[: len(rows.ids) - len(short.ids)]
    ) == len(words)
    assert rows.reads[1][:, 0].min() == len(rows.ids) - len(short.ids)


def test_a_word_the_tokenizer_gives_no_ids_is_read_as_unknown(tokenizers_of_three_kinds):
    tok = tokenizers_of_three_kinds["wordpiece"]
    pieces = tok.encode(spaced(["the", "\u200b", "cat"]))
    assert pieces[1] == []
    rows = windowed(pieces, [3], [[0, 1, 0]], tok.special_ids, 16)
    assert rows.ids[0][2] == tok.special_ids["unk"] and rows.labels[0][2] == 1
