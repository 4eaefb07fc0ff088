"""The fast tokenizer (`tokenizers`' tokenizer.json) of an export to transformers: built from cram's
sentencepiece model, or the run's own tokenizer.json; either way its post-processor lays out a text
or a pair as cram fine-tunes on it ([CLS] a [SEP] b [SEP], the second text and its [SEP] segment 1).

A special token typed in a text ("[SEP]", "[MASK]") is text to cram's sentencepiece models (tokenize
makes them control symbols). The fast tokenizer of an encoder reads it as the token, what fill-mask
needs; that of a kept model (`typed_special=False`) reads it as text, so that its predictions and
vectors are cram's (`SPLIT_SPECIAL`). A run's own tokenizer.json is left as it is: cram encodes with
it as the `tokenizers` library does, a typed special token its id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cram.stages.kept.folder import KeptError

# tokenizer_config.json's setting by which transformers (and sentence-transformers through it) reads a
# typed special token as text; tokenizer.json has no place for it.
SPLIT_SPECIAL = {"split_special_tokens": True}


def fast_tokenizer(sp_model: Path, special_ids: dict[str, int], typed_special: bool = True) -> Any:
    """A `tokenizers.Tokenizer` that encodes like the sentencepiece model, wrapped in [CLS] ... [SEP].

    Built from the model's own pieces, scores and normaliser (the approach of transformers'
    `SpmConverter`): BPE merges ranked by the score of the merged piece, or the unigram pieces with
    their scores. `typed_special`: the special pieces typed in a text ("[MASK]") become their ids, as
    added tokens, unlike sentencepiece; else they stay text, as sentencepiece reads them.
    """
    try:
        from sentencepiece import sentencepiece_model_pb2
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
        from tokenizers.models import BPE, Unigram
    except ImportError as e:
        raise KeptError(
            f"--format transformers needs tokenizers and protobuf ({e}): pip install -e '.[export]'"
        ) from None

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(sp_model.read_bytes())
    pieces = [(p.piece, p.score) for p in proto.pieces]
    unk = proto.trainer_spec.unk_piece
    if proto.trainer_spec.model_type == proto.trainer_spec.BPE:
        normal = {p.piece: (p.score, i) for i, p in enumerate(proto.pieces) if p.type == p.NORMAL}
        ranked = sorted(
            (-score, i, token[:cut], token[cut:])
            for token, (score, i) in normal.items()
            for cut in range(1, len(token))
            if token[:cut] in normal and token[cut:] in normal
        )
        merges = [(left, right) for _, _, left, right in ranked]
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
        tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True))
    elif proto.trainer_spec.model_type == proto.trainer_spec.UNIGRAM:
        tokenizer = Tokenizer(Unigram(_unigram_pieces(proto), unk_id=proto.trainer_spec.unk_id))
    else:
        raise KeptError(f"{sp_model}: a sentencepiece {proto.trainer_spec.model_type} model; only bpe and unigram map")

    spec = proto.normalizer_spec
    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:  # spaces only: sentencepiece leaves other whitespace to the charsmap
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    if spec.add_dummy_prefix:
        # Metaspace adds no prefix to a text already starting with "▁"; sentencepiece always does.
        steps.append(normalizers.Replace(Regex(r"\A▁"), "▁▁"))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=False)

    names = {role: pieces[i][0] for role, i in special_ids.items()}
    if typed_special:
        tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in names.values()])
    tokenizer.post_processor = post_processor(special_ids, names)
    return tokenizer


def _unigram_pieces(proto: Any) -> list[tuple[str, float]]:
    """The unigram model's pieces and scores, a piece sentencepiece never cuts a text into (a control
    symbol, the unknown piece: score 0, the best there is) scored below any run of normal pieces that
    spells it, so that the `tokenizers` model, which knows no piece types, does not pick it either. Not
    where a character of it is outside the model's alphabet: sentencepiece gives that character the
    unknown piece, which the `tokenizers` model scores below its lowest piece, so the whole piece wins
    there. A model trained on real text knows "[", "]", "<", ">" and the letters of the names."""
    normal = [p.score for p in proto.pieces if p.type == p.NORMAL]
    never = 100 * min(min(normal, default=-1.0), -1.0)
    return [(p.piece, p.score if p.type in (p.NORMAL, p.USER_DEFINED) else never) for p in proto.pieces]


def post_processor(special_ids: dict[str, int], names: dict[str, str]) -> Any:
    """[CLS] $A [SEP], and for a pair [CLS] $A [SEP] $B [SEP] with $B and its [SEP] as segment 1: the
    layout evaluate fine-tunes on and `cram predict` reads."""
    from tokenizers import processors

    cls, sep = names["cls"], names["sep"]
    return processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, special_ids["cls"]), (sep, special_ids["sep"])],
    )


def read_json(path: Path, special_ids: dict[str, int], layout: bool = True) -> Any:
    """A tokenizers tokenizer.json, its post-processor set to cram's layout (`post_processor`) unless
    `layout` is False."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise KeptError(f"--format transformers needs tokenizers ({e}): pip install -e '.[export]'") from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own untyped Exception for a file it cannot parse
        raise KeptError(f"{path}: not a readable tokenizer.json ({str(e).splitlines()[0]})") from None
    if layout:
        names = {role: tokenizer.id_to_token(i) for role, i in special_ids.items()}
        tokenizer.post_processor = post_processor(special_ids, names)
    return tokenizer


def kept_tokenizer(path: Path, special_ids: dict[str, int]) -> Any:
    """The fast tokenizer of a kept model's export, from the run's tokenizer file: cram's sentencepiece model
    converted (a typed special token read as text), or the run's tokenizer.json with cram's layout."""
    if path.suffix == ".json":
        return read_json(path, special_ids)
    return fast_tokenizer(path, special_ids, typed_special=False)
