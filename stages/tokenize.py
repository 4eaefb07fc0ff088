"""Tokenize: read the corpus, hold out evaluation documents, train a sentencepiece tokenizer on the
remaining (training) documents and write every training document as token ids.

Held-out documents are chosen by a hash of their title (of their text when untitled), so the same
documents are held out whatever the seed or the tokenizer settings; their text never reaches the
tokenizer's training data or the `tokens` output that pretraining reads.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

from stages import Context, StageError, Upstream, corpus
from stages.corpus import CorpusConfig, read

NAME = "tokenize"
VERSION = "1"
UPSTREAM: tuple[str, ...] = ()
RESUMABLE = False

# Fixed ids, so the model and the evaluation can name them without reading the tokenizer.
SPECIAL_IDS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
_PIECES = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}


@dataclass(frozen=True)
class Config:
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    heldout_fraction: float = 0.2  # documents kept out of pretraining for evaluation; 0: none
    model_type: Literal["bpe", "unigram"] = "bpe"
    vocab_size: int = 8192
    lowercase: bool = False
    normalization: Literal["nmt_nfkc", "nfkc", "identity"] = "nmt_nfkc"  # sentencepiece's rules
    character_coverage: float = 0.9995  # the rarest characters beyond this share become [UNK]
    tokenizer_max_chars: int = 100_000_000  # the tokenizer trains on the first this many characters
    max_line_chars: int = 2000  # longer lines are cut before training: sentencepiece skips them
    num_proc: int = 1  # processes for encoding; each encodes its batches on all cores already
    batch_size: int = 1000  # documents per encoding call

    def __post_init__(self) -> None:
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction: {self.heldout_fraction} must be in [0, 1)")
        if not 8 + len(SPECIAL_IDS) <= self.vocab_size <= 1_000_000:
            raise ValueError(f"vocab_size: {self.vocab_size} must be between 13 and 1,000,000")
        if self.lowercase and self.normalization == "identity":
            raise ValueError('lowercase: needs normalization "nfkc" or "nmt_nfkc", not "identity"')
        if not 0.9 <= self.character_coverage <= 1.0:
            raise ValueError(f"character_coverage: {self.character_coverage} must be in [0.9, 1]")
        for key in ("tokenizer_max_chars", "max_line_chars", "num_proc", "batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: {getattr(self, key)} must be at least 1")


def run(config: Config, inputs: dict[str, Upstream], out_dir: Path, ctx: Context) -> dict[str, Any]:
    import datasets

    started = time.perf_counter()
    with _quiet_progress_bars():
        docs = read(config.corpus)
        train, heldout = split_heldout(docs, config.heldout_fraction)
        if len(train) == 0:
            raise StageError(f"tokenize.heldout_fraction: {config.heldout_fraction} leaves no training document")
        read_s = time.perf_counter() - started
        ctx.log.info("corpus read", documents=len(docs), heldout=len(heldout), seconds=round(read_s, 2))

        t0 = time.perf_counter()
        model = train_tokenizer(_training_lines(train, config), config)
        (out_dir / "tokenizer.model").write_bytes(model)
        train_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
        # The encoded shards go to a scratch folder inside out_dir rather than the datasets cache,
        # and only the final copy is kept.
        with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
            tokens = train.map(
                _Encoder(model, config.num_proc),
                batched=True,
                batch_size=config.batch_size,
                num_proc=config.num_proc if config.num_proc > 1 else None,
                remove_columns=train.column_names,
                features=features,
                cache_file_name=str(Path(scratch) / "tokens.arrow"),
            )
            encode_s = time.perf_counter() - t0
            tokens.save_to_disk(str(out_dir / "tokens"))
            n_tokens, n_unk = _count_tokens(tokens, SPECIAL_IDS["unk"])
        if len(heldout):
            heldout.save_to_disk(str(out_dir / "heldout"))
    characters, n_bytes = _text_size(train)
    seconds = time.perf_counter() - started
    outputs = {
        "tokenizer": "tokenizer.model",
        "tokens": "tokens",
        "heldout": "heldout" if len(heldout) else None,
        "vocab_size": config.vocab_size,
        "special_ids": dict(SPECIAL_IDS),
        "model_type": config.model_type,
        "normalization": _rule_name(config),
        "lowercase": config.lowercase,
        "documents": len(train),
        "heldout_documents": len(heldout),
        "characters": characters,
        "text_mb": round(n_bytes / 1e6, 3),
        "total_tokens": n_tokens,
        "tokens_per_char": round(n_tokens / max(characters, 1), 4),
        "unk_fraction": round(n_unk / max(n_tokens, 1), 6),
        "read_seconds": round(read_s, 3),
        "train_seconds": round(train_s, 3),
        "encode_seconds": round(encode_s, 3),
        "seconds": round(seconds, 3),
        "mb_per_s": round(n_bytes / 1e6 / encode_s, 2),  # encoding alone, the part that scales
    }
    ctx.log.info("tokenized", **{k: v for k, v in outputs.items() if isinstance(v, (int, float))})
    return outputs


def validate(config: Config, pipeline: Any) -> None:
    """Checked by the runner before any stage runs: the local corpus can be found."""
    unavailable = next((entry[1] for entry in corpus.fingerprint(config.corpus) if entry[0] == "unavailable"), None)
    if unavailable is not None:
        raise StageError(unavailable)


def fingerprint(config: Config) -> list[list[Any]]:
    """What the runner adds to this stage's key besides the config: the local corpus files' stats."""
    return corpus.fingerprint(config.corpus)


def is_heldout(title: str, text: str, fraction: float) -> bool:
    """Whether a document belongs to the held-out set: a hash of its title (its text when it has
    none) mapped to [0, 1), below `fraction`."""
    key = (title or text).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64 < fraction


def split_heldout(docs: Any, fraction: float) -> tuple[Any, Any]:
    """(training, held-out) documents."""

    def flags(batch: dict[str, list[str]]) -> list[bool]:
        return [is_heldout(title, text, fraction) for title, text in zip(batch["title"], batch["text"])]

    train = docs.filter(lambda batch: [not f for f in flags(batch)], batched=True)
    heldout = docs.filter(flags, batched=True)
    return train, heldout


def train_tokenizer(lines: Iterator[str], config: Config) -> bytes:
    """A sentencepiece model (its serialized bytes) with the special tokens at SPECIAL_IDS."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines,
            model_writer=model,
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            character_coverage=config.character_coverage,
            normalization_rule_name=_rule_name(config),
            # Bytes, not characters: a line of max_line_chars is never over the limit.
            max_sentence_length=4 * config.max_line_chars + 16,
            pad_id=SPECIAL_IDS["pad"],
            unk_id=SPECIAL_IDS["unk"],
            bos_id=SPECIAL_IDS["cls"],
            eos_id=SPECIAL_IDS["sep"],
            pad_piece=_PIECES["pad"],
            unk_piece=_PIECES["unk"],
            bos_piece=_PIECES["cls"],
            eos_piece=_PIECES["sep"],
            # A control symbol: the text "[MASK]" in a document stays text and never becomes id 4.
            control_symbols=[_PIECES["mask"]],
            num_threads=_cpus(),
            minloglevel=2,
        )
    except RuntimeError as e:
        too_high = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", str(e))
        if too_high:
            raise StageError(
                f"tokenize.vocab_size: {config.vocab_size} is too large for this corpus; "
                f"it supports at most {too_high.group(2)}: use a bigger corpus or a smaller vocab"
            ) from None
        raise
    return model.getvalue()


def _training_lines(train: Any, config: Config) -> Iterator[str]:
    """The training documents' lines, long ones cut at a space, up to tokenizer_max_chars."""
    budget = config.tokenizer_max_chars
    for batch in train.iter(batch_size=config.batch_size):
        for text in batch["text"]:
            for line in text.splitlines():
                for piece in _cut(line.strip(), config.max_line_chars):
                    yield piece
                    budget -= len(piece)
                    if budget <= 0:
                        return


def _cut(line: str, limit: int) -> Iterator[str]:
    while len(line) > limit:
        at = line.rfind(" ", limit // 2, limit + 1)
        at = at if at > 0 else limit
        yield line[:at]
        line = line[at:].lstrip()
    if line:
        yield line


def _rule_name(config: Config) -> str:
    # sentencepiece's "_cf" rules add case folding to NFKC: the tokenizer itself lowercases, so
    # whoever encodes text with it later gets the same normalisation for free.
    return config.normalization + ("_cf" if config.lowercase else "")


class _Encoder:
    """The `datasets.map` function: text -> input_ids. Holds the model as bytes so that it pickles
    to worker processes; each loads its own processor on first use."""

    def __init__(self, model: bytes, num_proc: int):
        self.model = model
        self.threads = max(1, _cpus() // num_proc)
        self._sp = None

    def __call__(self, batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        if self._sp is None:
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor(model_proto=self.model)
        return {"input_ids": self._sp.encode(batch["text"], num_threads=self.threads)}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_sp": None}


def _count_tokens(tokens: Any, unk_id: int) -> tuple[int, int]:
    import pyarrow.compute as pc

    ids = pc.list_flatten(tokens.data.column("input_ids"))
    return len(ids), int(pc.sum(pc.equal(ids, unk_id)).as_py() or 0)


def _text_size(docs: Any) -> tuple[int, int]:
    """(characters, UTF-8 bytes) of the documents' text."""
    import pyarrow.compute as pc

    characters = n_bytes = 0
    for batch in docs.with_format("arrow").iter(batch_size=10_000):
        text = batch["text"]
        characters += pc.sum(pc.utf8_length(text)).as_py() or 0
        n_bytes += pc.sum(pc.binary_length(text)).as_py() or 0
    return characters, n_bytes


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """No datasets progress bars inside the stage (the runner logs progress); the previous
    setting comes back afterwards."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()
