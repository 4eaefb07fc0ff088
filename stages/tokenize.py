"""Tokenize: read the corpus, hold out evaluation documents, train a sentencepiece tokenizer on the
remaining (training) documents, or reuse an existing one (`tokenizer`), and write every training
document as token ids.

Held-out documents are chosen by a hash of their title (of their text when untitled), so the same
documents are held out whatever the seed or the tokenizer settings; their text never reaches the
tokenizer's training data or the `tokens` output that pretraining reads.

With `task_text`, the training rows of the pipeline's evaluate tasks are documents too (`data/tasktext.py`),
beside the corpus or instead of it. They are training documents only: none is held out, so the held-out
masked-LM loss measures the corpus alone, the same documents with task text or without.

Three passes, each streaming and each but the second spread over `num_proc` processes, one corpus
unit (`corpus.units`) at a time: read (standardise, split off the held-out documents, count) into
shards of training text; train the tokenizer on a sample of at most `tokenizer_max_chars` (or copy
the given one); encode each text shard into a shard of the `tokens` folder. Memory stays at a few
units per process whatever the corpus size; the `tokens` and `heldout` outputs are ordinary
`datasets` folders.
"""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

from cram.stages import Context, Pipeline, StageConfig, StageError, Upstream, section
from cram.stages.data import corpus, readers, shards, sniff, tasktext
from cram.stages.data.source import CorpusConfig
from cram.stages.evaluating.config import Config as EvaluateConfig
from cram.stages.pretraining.config import Config as PretrainConfig
from cram.stages.shared import pretrained
from cram.stages.shared.files import atomic, content_hash
from cram.stages.shared.special import SPECIAL_IDS
from cram.stages.shared.tokenizer import Tokenizer, TokenizerError
from cram.stages.shared.tokenizer import files as tokenizer_files
from cram.stages.shared.tokenizer import load as load_tokenizer

NAME = "tokenize"
VERSION = "2"
UPSTREAM: tuple[str, ...] = ()
RESUMABLE = False
# How many processes and how big their batches: the outputs are the same bytes either way (tested), so
# a run on a machine with more cores, or with `num_proc` changed, reuses what is tokenized.
# Nor is where a given tokenizer lies: its files' contents are in the key (`fingerprint`), so a moved copy
# keeps it.
NOT_IN_KEY = ("num_proc", "batch_size", "tokenizer")
# Added after the key was fixed: at its default it tokenizes what tokenize did before.
NEW_OPTIONS = ("task_text", "task_files")

# What only trains a tokenizer: with one given, its key holds them at their defaults (`key_config`).
TRAINING_FIELDS = (
    "model_type",
    "vocab_size",
    "lowercase",
    "normalization",
    "character_coverage",
    "tokenizer_max_chars",
    "max_line_chars",
)

# The names of the special pieces in the tokenizers cram trains, at the fixed ids SPECIAL_IDS.
_PIECES = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
_MAX_PROCS = 8  # beyond this, reading the corpus, not encoding, is what limits a machine
SHARD_BYTES = 16 << 20  # training text per shard of the encoding pass (and of the `tokens` output)


@dataclass(frozen=True)
class Config:
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    heldout_fraction: float = 0.2  # documents kept out of pretraining for evaluation; 0: none
    # An existing tokenizer to encode with instead of training one: a tokenizer.json or a folder holding
    # one (as transformers saves it), or a sentencepiece .model. Given one, the fields below that only
    # train a tokenizer (model_type through max_line_chars) are ignored: its vocabulary is what it is.
    tokenizer: str = ""
    model_type: Literal["bpe", "unigram"] = "bpe"
    vocab_size: int = 8192
    lowercase: bool = False
    normalization: Literal["nmt_nfkc", "nfkc", "identity"] = "nmt_nfkc"  # sentencepiece's rules
    character_coverage: float = 0.9995  # the rarest characters beyond this share become [UNK]
    # The tokenizer trains on at most this many characters: all training documents when they fit,
    # else a random sample spread over the corpus (sentencepiece holds its input in memory: ~5 bytes a character).
    tokenizer_max_chars: int = 100_000_000
    max_line_chars: int = 2000  # longer lines are cut before training: sentencepiece skips them
    num_proc: int | None = None  # processes (cores) reading and encoding; None: the machine's cores, at most 8
    batch_size: int = 1000  # documents per encoding call
    # Task-adaptive pretraining: the text of the training files of [[evaluate.tasks]] of kind "custom"
    # or "glue" (a local folder; not the hub), labels dropped, as training documents. "add": beside the
    # corpus; "only": instead of it (no corpus is read, so none is held out); "none": not read. Never a
    # task's test or validation file. A row is a document, a pair's two texts joined by a newline; task
    # documents are never held out. "heldout-topic" tasks classify the held-out corpus documents and have
    # no training file of their own: they give none.
    task_text: Literal["none", "add", "only"] = "none"
    # Filled from [[evaluate.tasks]] (`linked`), not by hand: what is written here is replaced.
    task_files: tuple[tasktext.TaskFile, ...] = ()

    def linked(self, sections: Mapping[str, StageConfig]) -> Config:
        """Left empty, `tokenizer` is the tokenizer of `pretrain.init`'s checkpoint, when it holds one: a
        tokenizer trained anew would not match the checkpoint's embeddings. (A checkpoint that cannot be
        found is left to pretrain's `validate` to name.) `task_files` are evaluate's tasks with a
        training file when `task_text` is on, none when it is off: they are in the key (`NEW_OPTIONS`)."""
        evaluate = section(sections, "evaluate", EvaluateConfig)
        pretrain = section(sections, "pretrain", PretrainConfig)
        tasks = evaluate.tasks if evaluate is not None and self.task_text != "none" else ()
        linked = dataclasses.replace(self, task_files=tasktext.of_tasks(tasks))
        init = pretrain.init if pretrain is not None else ""
        if self.tokenizer or not init:
            return linked
        try:
            found = pretrained.locate(Path(init)).tokenizer
        except pretrained.PretrainedError:
            return linked
        return linked if found is None else dataclasses.replace(linked, tokenizer=str(found))

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
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"{key}: {getattr(self, key)} must be at least 1")


def key_config(config: Config) -> Config:
    """The config as the cache key sees it. With a tokenizer given, the fields that would train one are
    ignored: they are keyed at their defaults, so changing one re-tokenizes nothing, and a store filled
    before they were left out (with them at their defaults, as a given tokenizer leaves them) keeps
    its keys. With `task_text = "only"` the corpus is not read: it is keyed at its default."""
    if config.task_text == "only":
        config = dataclasses.replace(config, corpus=CorpusConfig())
    if not config.tokenizer:
        return config
    defaults = Config()
    return dataclasses.replace(config, **{name: getattr(defaults, name) for name in TRAINING_FIELDS})


def run(config: Config, inputs: dict[str, Upstream], out_dir: Path, ctx: Context) -> dict[str, Any]:
    started = time.perf_counter()
    num_proc = config.num_proc or min(_cpus(), _MAX_PROCS)
    scratch = out_dir / "scratch"  # the training documents' text, between the read and the encoding
    totals, text_shards, has_heldout = _read_corpus(config, out_dir, scratch, num_proc)
    read_s = time.perf_counter() - started
    if totals["documents_cut"] or totals["records_skipped"]:
        cut, skipped, limit = totals["documents_cut"], totals["records_skipped"], readers.MAX_DOCUMENT_CHARS
        ctx.log.warning("documents over the size limit", cut=cut, skipped=skipped, limit_chars=limit)
    ctx.log.info(
        "corpus read",
        documents=totals["documents"],
        task_documents=totals["task_documents"],
        heldout=totals["heldout"],
        units=totals["units"],
        num_proc=num_proc,
        seconds=round(read_s, 2),
    )

    t0 = time.perf_counter()
    tokenizer = _make_tokenizer(config, out_dir, text_shards, totals["characters"])
    train_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    jobs = [(text, out_dir / "tokens" / f"data-{i:05d}.arrow", tokenizer.file) for i, text in enumerate(text_shards)]
    counts = _parallel(_encode_shard, jobs, num_proc)
    shards.finish_folder(out_dir / "tokens", [tokens.name for _, tokens, _ in jobs], shards.TOKENS)
    encode_s = time.perf_counter() - t0
    shutil.rmtree(scratch)
    n_tokens, n_unk = sum(c[0] for c in counts), sum(c[1] for c in counts)
    seconds = time.perf_counter() - started
    outputs = {
        "tokenizer": tokenizer.file.name,
        "tokens": "tokens",
        "heldout": "heldout" if has_heldout else None,
        "vocab_size": tokenizer.vocab_size,
        "special_ids": tokenizer.special_ids,
        **_tokenizer_settings(config),
        "documents": totals["documents"],
        "heldout_documents": totals["heldout"],
        "task_documents": totals["task_documents"],  # of them, from the evaluate tasks' training files
        "characters": totals["characters"],
        "documents_cut": totals["documents_cut"],  # text over readers.MAX_DOCUMENT_CHARS, in pieces
        "records_skipped": totals["records_skipped"],  # records over it
        "text_mb": round(totals["bytes"] / 1e6, 3),
        "total_tokens": n_tokens,
        "tokens_per_char": round(n_tokens / max(totals["characters"], 1), 4),
        "unk_fraction": round(n_unk / max(n_tokens, 1), 6),
        "num_proc": num_proc,
        "read_seconds": round(read_s, 3),
        "train_seconds": round(train_s, 3),  # training the tokenizer, or copying the given one
        "encode_seconds": round(encode_s, 3),
        "seconds": round(seconds, 3),
        "mb_per_s": round(totals["bytes"] / 1e6 / encode_s, 2),  # encoding alone, the part that scales
    }
    ctx.log.info("tokenized", **{k: v for k, v in outputs.items() if isinstance(v, (int, float))})
    return outputs


def _make_tokenizer(config: Config, out_dir: Path, text_shards: list[Path], characters: int) -> Tokenizer:
    """The tokenizer of this run, in `out_dir`: the given one copied there, or one trained on the text."""
    if config.tokenizer:
        return _copy_tokenizer(_given_tokenizer(config), out_dir)
    model = train_tokenizer(_training_lines(text_shards, characters, config), config)
    with atomic(out_dir / "tokenizer.model") as tmp:
        tmp.write_bytes(model)
    return load_tokenizer(out_dir / "tokenizer.model")


def _given_tokenizer(config: Config) -> Tokenizer:
    """`config.tokenizer` loaded; StageError naming the key when it cannot be read or lacks a role."""
    try:
        return load_tokenizer(Path(os.path.expanduser(config.tokenizer)))
    except TokenizerError as e:
        raise StageError(f"tokenize.tokenizer: {e}") from None


def _copy_tokenizer(source: Tokenizer, out_dir: Path) -> Tokenizer:
    """The tokenizer file, under its usual name, and its config files copied into `out_dir`: the run
    keeps what it was encoded with even if the source changes, and later stages read it from there."""
    name = "tokenizer.json" if source.kind == "tokenizers" else "tokenizer.model"
    file, *config_files = tokenizer_files(source.file)
    for src, dst in [(file, out_dir / name), *((f, out_dir / f.name) for f in config_files)]:
        with atomic(dst) as tmp:
            shutil.copyfile(src, tmp)
    return load_tokenizer(out_dir / name)


def _tokenizer_settings(config: Config) -> dict[str, Any]:
    """How the tokenizer was made. An imported one was made elsewhere: its own model and normalisation
    (in its file) apply, and whether it lowercases is its business (None: not known here)."""
    if config.tokenizer:
        return {"model_type": "imported", "normalization": "imported", "lowercase": None}
    return {"model_type": config.model_type, "normalization": _rule_name(config), "lowercase": config.lowercase}


def _read_corpus(config: Config, out_dir: Path, scratch: Path, num_proc: int) -> tuple[dict, list[Path], bool]:
    """Read the corpus in parallel units, and each task of `task_files`, into text shards under `scratch`
    (training documents) and a `datasets` folder `out_dir/heldout` (held-out documents, none: no folder).
    Returns the totals, the text shards and whether any document was held out."""
    for folder in (scratch, out_dir / "tokens", out_dir / "heldout"):
        folder.mkdir()
    units = [] if config.task_text == "only" else corpus.units(config.corpus, num_proc)
    sources = [*units, *config.task_files]
    jobs = [(source, i, config, scratch, out_dir / "heldout", SHARD_BYTES) for i, source in enumerate(sources)]
    parts = _parallel(_split_unit, jobs, num_proc)
    keys = ("documents", "heldout", "task_documents", "characters", "bytes", *readers.TALLY)
    totals = {key: sum(part[key] for part in parts) for key in keys}
    if totals["documents"] + totals["heldout"] == 0:
        skipped = totals["records_skipped"]
        why = f"; {skipped:,} records over {readers.MAX_DOCUMENT_CHARS:,} characters skipped" if skipped else ""
        if config.task_text == "only":
            raise StageError('tokenize.task_text: "only", and the tasks\' training files hold no text')
        raise StageError(f"tokenize.corpus: {_source(config.corpus)}: the corpus is empty (no document with text{why})")
    if totals["documents"] == 0:
        raise StageError(f"tokenize.heldout_fraction: {config.heldout_fraction} leaves no training document")
    heldout_shards = [part["heldout_shard"] for part in parts if part["heldout_shard"]]
    if heldout_shards:
        shards.finish_folder(out_dir / "heldout", heldout_shards, shards.DOCUMENTS)
    else:
        (out_dir / "heldout").rmdir()
    return {**totals, "units": len(units)}, [path for part in parts for path in part["text"]], bool(heldout_shards)


def validate(config: Config, pipeline: Pipeline) -> None:
    """Checked by the runner before any stage runs: the local corpus can be found, each local file's
    first bytes fit its format and, for a held-out-topic evaluation, its records have the label field;
    with `task_text`, an evaluate task has a training file and each is found; a given tokenizer can be
    read and has the special tokens pack and masking need."""
    if config.task_text != "none":
        tasktext.check(config.task_files, config.task_text, section(pipeline.stages, "evaluate", EvaluateConfig))
    if config.task_text != "only":
        _validate_corpus(config, pipeline)
    if config.tokenizer:
        _given_tokenizer(config)


def _validate_corpus(config: Config, pipeline: Pipeline) -> None:
    unavailable = next((entry[1] for entry in corpus.fingerprint(config.corpus) if entry[0] == "unavailable"), None)
    if unavailable is not None:
        raise StageError(unavailable)
    local = corpus.local_files(config.corpus)
    for path, fmt in local:
        sniff.check_start(path, fmt, config.corpus)
    if local and config.corpus.label_field and config.heldout_fraction > 0 and _classifies_topics(pipeline):
        problem = sniff.label_problem(*local[0], config.corpus)
        if problem:
            raise StageError(problem)


def _classifies_topics(pipeline: Pipeline) -> bool:
    """Whether the pipeline evaluates on the held-out documents' labels (a "heldout-topic" task)."""
    evaluate = section(pipeline.stages, "evaluate", EvaluateConfig)
    return evaluate is not None and any(task.kind == "heldout-topic" for task in evaluate.tasks)


def fingerprint(config: Config) -> list[list[Any]]:
    """What the runner adds to this stage's key besides the config: the local corpus files' stats and
    the content of a given tokenizer's files (name and hash, not its path), and with `task_text` the
    stats of the evaluate tasks' training files. One that cannot be found gives its error instead;
    `validate` reports it."""
    prints = [] if config.task_text == "only" else corpus.fingerprint(config.corpus)
    prints += tasktext.fingerprint(config.task_files)
    if config.tokenizer:
        try:
            found = tokenizer_files(Path(os.path.expanduser(config.tokenizer)))
        except TokenizerError as e:
            return [*prints, ["unavailable", f"tokenize.tokenizer: {e}"]]
        prints += [["tokenizer", f.name, content_hash(f)] for f in found]
    return prints


def is_heldout(title: str, text: str, fraction: float) -> bool:
    """Whether a document belongs to the held-out set: a hash of its title (its text when it has
    none) mapped to [0, 1), below `fraction`."""
    key = (title or text).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64 < fraction


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


def _training_lines(text_shards: list[Path], characters: int, config: Config) -> Iterator[str]:
    """Lines of a sample of the training documents, long ones cut at a space, up to
    tokenizer_max_chars: every document when they fit, else a random share of them (fixed seed)
    spread over the whole corpus, not just its first files."""
    import numpy as np

    from cram.stages.data.shards import read_batches

    budget = config.tokenizer_max_chars
    share = min(1.0, budget / max(characters, 1))
    rng = np.random.default_rng(0)
    for path in text_shards:
        for batch in read_batches(path):
            texts = batch.column("text").to_pylist()
            chosen = rng.random(len(texts)) < share
            for text in (t for t, keep in zip(texts, chosen) if keep):
                for line in text.splitlines():
                    for piece in readers.cut_text(line.strip(), config.max_line_chars):
                        yield piece
                        budget -= len(piece)
                        if budget <= 0:
                            return


def _rule_name(config: Config) -> str:
    # sentencepiece's "_cf" rules add case folding to NFKC: the tokenizer itself lowercases, so
    # whoever encodes text with it later gets the same normalisation for free.
    return config.normalization + ("_cf" if config.lowercase else "")


def _parallel(work: Callable[[Any], Any], jobs: list[Any], num_proc: int) -> list[Any]:
    """work(job) for each job, in `num_proc` processes (in this one when 1); results in job order."""
    if num_proc == 1 or len(jobs) <= 1:
        return [work(job) for job in jobs]
    # forkserver: workers start clean, not as forks of a process that may hold threads and locks.
    with multiprocessing.get_context("forkserver").Pool(min(num_proc, len(jobs)), _one_thread) as pool:
        return pool.map(work, jobs, chunksize=1)


def _one_thread() -> None:
    # A process per core already fills the machine: a byte-level BPE's encoder (`bytelevel`) is Python
    # and numpy under the GIL, and the `tokenizers` library's own threads in each worker only compete for
    # the cores (bench/README.md, "a given tokenizer"). So many cores want many processes (num_proc, at most
    # _MAX_PROCS by default), each on one thread. In this process (num_proc 1) its threads stay on.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _split_unit(job: tuple) -> dict[str, Any]:
    """One pass over one corpus unit or task file: the held-out split (a task's documents are all
    training documents), the training documents' text to scratch shards of at most ~SHARD_BYTES each
    (the units of the encoding pass), the held-out documents to a shard of the `heldout` output, and
    their sizes."""
    import pyarrow as pa
    import pyarrow.compute as pc

    source, index, config, scratch, heldout_dir, max_shard_bytes = job
    counts: dict[str, Any] = {"documents": 0, "heldout": 0, "characters": 0, "bytes": 0, "text": []}
    counts.update(dict.fromkeys(readers.TALLY, 0))
    task = isinstance(source, tasktext.TaskFile)
    fraction = 0.0 if task else config.heldout_fraction
    if task:
        batches = tasktext.documents(source, config.batch_size, readers.MAX_DOCUMENT_CHARS, counts)
    else:
        batches = corpus.documents(source, config.corpus, config.batch_size, counts)
    train, shard_bytes = None, 0
    with shards.ShardWriter(heldout_dir / f"data-{index:05d}.arrow", shards.DOCUMENTS) as heldout:
        for batch in batches:
            flags = [is_heldout(t, x, fraction) for t, x in zip(batch["title"], batch["text"])]
            held = [i for i, f in enumerate(flags) if f]
            if held:
                heldout.write({key: [values[i] for i in held] for key, values in batch.items()})
            texts = pa.array([text for text, f in zip(batch["text"], flags) if not f], type=pa.string())
            if len(texts) == 0:
                continue
            if train is None or shard_bytes >= max_shard_bytes:
                if train is not None:
                    train.close()
                train = shards.ShardWriter(scratch / f"data-{index:05d}-{len(counts['text']):04d}.arrow", shards.TEXT)
                counts["text"].append(train.path)
                shard_bytes = 0
            train.write({"text": texts})
            n_bytes = pc.sum(pc.binary_length(texts)).as_py() or 0
            counts["documents"] += len(texts)
            counts["characters"] += pc.sum(pc.utf8_length(texts)).as_py() or 0
            counts["bytes"] += n_bytes
            shard_bytes += n_bytes
        if train is not None:
            train.close()
    counts["task_documents"] = counts["documents"] if task else 0
    counts["heldout"] = heldout.rows
    counts["heldout_shard"] = heldout.path.name if heldout.rows else None
    if not heldout.rows:
        heldout.path.unlink()
    return counts


def _encode_shard(job: tuple[Path, Path, Path]) -> tuple[int, int]:
    """Encode one shard of training text into a shard of token ids; (tokens, unknown tokens)."""
    import numpy as np
    import pyarrow as pa

    text_path, tokens_path, tokenizer_file = job
    tokenizer = load_tokenizer(tokenizer_file)
    unk = tokenizer.special_ids.get("unk")
    n_tokens = n_unk = 0
    with shards.ShardWriter(tokens_path, shards.TOKENS) as out:
        for batch in shards.read_batches(text_path):
            offsets, values = tokenizer.encode_arrays(batch.column("text").to_pylist())
            out.write({"input_ids": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))})
            n_tokens += len(values)
            n_unk += 0 if unk is None else int(np.count_nonzero(values == unk))
    return n_tokens, n_unk


def _source(config: CorpusConfig) -> str:
    if config.kind == "files":
        return ", ".join(config.paths)
    return {"package": f"{config.package}/{config.file}", "disk": config.paths[0], "hub": config.name}[config.kind]


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
