"""The one reader of a tokenizer file, for every stage: a `tokenizers` tokenizer.json (as `transformers`
saves it) or a sentencepiece .model (cram's own), with its vocabulary size and special token ids.

Special ids come from the token names in the folder's tokenizer_config.json / special_tokens_map.json
when it has them, else from the usual names (BERT's "[CLS]", RoBERTa's "<s>", ...) in the vocabulary.
cram's own sentencepiece models name theirs "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]" (SPECIAL_IDS).
`transformers` is never needed: the `tokenizers` library reads tokenizer.json alone.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

ROLES = ("pad", "unk", "cls", "sep", "mask")
REQUIRED = ("pad", "cls", "sep", "mask")  # what pack and the masked-LM objective need; unk is optional
KNOWN_NAMES = {
    "pad": ("[PAD]", "<pad>"),
    "unk": ("[UNK]", "<unk>"),
    "cls": ("[CLS]", "<s>"),
    "sep": ("[SEP]", "</s>"),
    "mask": ("[MASK]", "<mask>"),
}
FILE_NAMES = ("tokenizer.json", "tokenizer.model")  # in a folder, the first one found is the tokenizer
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


class TokenizerError(ValueError):
    """A tokenizer that cannot be read or lacks a special token: one line naming the path and the problem."""


@dataclass(frozen=True)
class Tokenizer:
    kind: Literal["tokenizers", "sentencepiece"]
    file: Path  # the tokenizer file itself (a stage copies it, and the config files beside it)
    vocab_size: int
    special_ids: dict[str, int]
    _encode: Callable[[list[str]], list[list[int]]]

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, without special tokens (pack adds [CLS]/[SEP], fine-tuning its own)."""
        return self._encode(texts)

    def encode_arrays(self, texts: list[str]) -> tuple[Any, Any]:
        """The same ids as numpy arrays (offsets int64, ids int32): text i's are ids[offsets[i]:offsets[i + 1]].
        A byte-level BPE gives them without a Python object per token (`bytelevel`)."""
        fast = _byte_level(self.file) if self.kind == "tokenizers" else None
        if fast is not None:
            return fast(texts)
        import itertools

        import numpy as np

        lists = self._encode(texts)
        offsets = np.zeros(len(lists) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, lists), np.int64, len(lists)), out=offsets[1:])
        return offsets, np.fromiter(itertools.chain.from_iterable(lists), np.int32, int(offsets[-1]))


def load(path: Path) -> Tokenizer:
    """The tokenizer at `path`: a tokenizer.json, a sentencepiece .model, or a folder holding either."""
    file = _find_file(Path(path))
    if file.suffix == ".json":
        kind, vocab, vocab_size, encode = _read_tokenizers(file)
    else:
        kind, vocab, vocab_size, encode = _read_sentencepiece(file)
    special = _special_ids(file, vocab)
    return Tokenizer(kind, file, vocab_size, special, encode)


def _byte_level(file: Path) -> Callable[[list[str]], tuple[Any, Any]] | None:
    """The fast exact encoder of a byte-level BPE tokenizer.json (None for any other), built when first
    used, once per process and file version: its probe of the Unicode tables takes a few seconds."""
    stat = file.stat()
    encoder = _byte_level_encoder(str(file.resolve()), stat.st_size, stat.st_mtime_ns)
    return None if encoder is None else encoder.encode


@functools.lru_cache(maxsize=2)
def _byte_level_encoder(path: str, size: int, mtime_ns: int) -> Any:
    from cram.stages.shared.bytelevel import ByteLevelEncoder

    return ByteLevelEncoder.of(Path(path), _library(Path(path)))


def files(path: Path) -> list[Path]:
    """The tokenizer file at `path` (the file, or the one a folder holds), then the config files beside
    it: what a copy of the tokenizer takes, and what its content is. Reads no file."""
    file = _find_file(Path(path))
    return [file, *(file.parent / name for name in CONFIG_FILES if (file.parent / name).is_file())]


def in_folder(folder: Path) -> Path | None:
    """The tokenizer file `folder` holds (FILE_NAMES, in that order), or None."""
    return next((folder / name for name in FILE_NAMES if (folder / name).is_file()), None)


def _find_file(path: Path) -> Path:
    if path.is_dir():
        found = in_folder(path)
        if found is None:
            raise TokenizerError(f"{path}: the folder holds neither tokenizer.json nor tokenizer.model")
        return found
    if not path.is_file():
        raise TokenizerError(f"{path}: no such file or folder")
    if path.suffix not in (".json", ".model"):
        raise TokenizerError(f"{path}: not a tokenizer file (a tokenizer.json or a sentencepiece .model)")
    return path


def _library(file: Path) -> Any:
    """The `tokenizers` library's tokenizer of `file`, encoding whole documents."""
    from tokenizers import Tokenizer as RustTokenizer

    try:
        tokenizer = RustTokenizer.from_file(str(file))
    except Exception as e:  # the Rust reader raises a bare Exception with serde's message
        raise TokenizerError(f"{file}: not a readable tokenizer.json ({_first_line(e)})") from None
    # A saved tokenizer.json may carry truncation (to 512 tokens, say) or padding: whole documents are wanted.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _read_tokenizers(file: Path) -> tuple[str, Callable[[str], int | None], int, Callable]:
    tokenizer = _library(file)
    # Ids past the vocabulary's count (a gap before an added token) would be out of the model's range.
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)

    # Without the offsets (tokenizers >= 0.21): the same ids, 7% faster for a WordPiece here (bench/README.md).
    batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in batch(texts, add_special_tokens=False)]

    return "tokenizers", tokenizer.token_to_id, vocab_size, encode


def _read_sentencepiece(file: Path) -> tuple[str, Callable[[str], int | None], int, Callable]:
    import sentencepiece as spm

    try:
        # One thread: the stages run a process per core.
        sp = spm.SentencePieceProcessor(model_file=str(file), num_threads=1)
    except (RuntimeError, OSError) as e:
        raise TokenizerError(f"{file}: not a readable sentencepiece model ({_first_line(e)})") from None

    def piece_id(piece: str) -> int | None:
        # piece_to_id gives the unknown id for a piece the model lacks: only a round trip tells.
        i = sp.piece_to_id(piece)
        return i if sp.id_to_piece(i) == piece else None

    return "sentencepiece", piece_id, sp.get_piece_size(), sp.encode


def _special_ids(file: Path, vocab: Callable[[str], int | None]) -> dict[str, int]:
    """Each role's id: the name the config files give it, else the first known name in the vocabulary."""
    configured = _configured_names(file)
    special = {}
    for role in ROLES:
        names = (configured[role],) if role in configured else KNOWN_NAMES[role]
        found = next((vocab(name) for name in names if vocab(name) is not None), None)
        if found is not None:
            special[role] = found
        elif role in REQUIRED:
            looked_for = " or ".join(repr(n) for n in names)
            raise TokenizerError(f"{file}: no {role} token ({looked_for} is not in its vocabulary)")
    return special


def _configured_names(file: Path) -> dict[str, str]:
    """The special token names of the config files beside `file` ({role}_token), the map's last."""
    names: dict[str, str] = {}
    for name in CONFIG_FILES:
        path = file.parent / name
        if not path.is_file():
            continue
        try:
            table: Any = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TokenizerError(f"{path}: not readable JSON ({_first_line(e)})") from None
        for role in ROLES:
            value = table.get(f"{role}_token") if isinstance(table, dict) else None
            # transformers writes a name, or an AddedToken as a dict with its "content".
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str) and value:
                names[role] = value
    return names


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
