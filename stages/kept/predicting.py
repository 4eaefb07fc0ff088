"""A kept classifier run on texts, a chunk at a time: read, encode, predict and write CHUNK texts, then
the next, so memory holds one chunk whatever the input's length, and the rows come out in the input's
order. Within a chunk the texts are cut and batched as evaluate's test sets are (sorted by length,
padded to the task's buckets, one compiled prediction graph per bucket and no recompiles).

    predictor = Predictor.make(classifier, tokenizer_file, special_ids, Settings(compile=False))
    written = predict_files(predictor, [Path("texts.csv")], Path("labels.jsonl"))

A row is `{"label": NAME, "probabilities": {NAME: p, ...}}`, or `{"value": x}` for a regression; JSON
lines or CSV by the output's extension (any case). A file is written to a temporary path and renamed
once every row is in it.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, TextIO

from cram.stages import StageError
from cram.stages.kept.batches import Padding, join, run_sorted
from cram.stages.kept.folder import KeptClassifier, KeptError, load_tokenizer
from cram.stages.shared.files import temp_path
from cram.stages.shared.progress import Every
from cram.stages.shared.taskfiles import file_format, iter_texts

if TYPE_CHECKING:
    import ctypes

    import numpy as np
    import torch

    from cram.stages.kept.batches import Graph
    from cram.stages.shared.tokenizer import Tokenizer

CHUNK = 4_096  # texts read, encoded, predicted and written at a time
# glibc's malloc options (mallopt's parameter numbers) that make it give freed memory back.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MAP_APART_ABOVE = 32 * 1024 * 1024  # bytes: glibc's largest mmap threshold on 64-bit; unmapped when freed
TRIM_ABOVE = 64 * 1024  # bytes: free space at the heap's top past this goes back to the system
GLIBC_DEFAULT_THRESHOLD = 128 * 1024  # bytes: glibc's mmap and trim thresholds when nothing sets them
OUTPUTS = (".jsonl", ".csv")
PROGRESS_EVERY_S = 30.0


@dataclass(frozen=True)
class Settings:
    """How prediction runs: compiled (and by which backend) or eager, and the rows of a batch."""

    compile: bool = True
    backend: str = "inductor"
    batch_size: int = 128
    chunk: int = CHUNK


@dataclass(frozen=True)
class Predictor:
    """A classifier ready to predict: its params on the device, its tokenizer, the prediction graph."""

    classifier: KeptClassifier
    tokenizer: Tokenizer
    padding: Padding
    params: dict[str, torch.Tensor]
    graph: Graph
    settings: Settings

    @classmethod
    def make(
        cls, classifier: KeptClassifier, tokenizer: Path, special: dict[str, int], settings: Settings
    ) -> Predictor:
        """KeptError naming the tokenizer file where it cannot be read. It computes in fp32: on CUDA, not TF32."""
        from cram.model.classifier import make_classify_eval_step
        from cram.model.step import Compilation
        from cram.stages.shared import device as devices

        loaded = load_tokenizer(tokenizer)
        meta = classifier.meta
        cfg = dataclasses.replace(classifier.cfg, dropout=0.0)
        how = Compilation(compile=settings.compile, backend=settings.backend)
        graph = make_classify_eval_step(cfg, how, pooling=meta["pooling"], head=meta["head"])
        device = devices.resolve("auto")
        if device.type == "cuda":
            devices.use_tf32(False)  # no autocast here: its fp32 matmuls in fp32
        params = {k: v.to(device) for k, v in classifier.params().items()}
        buckets = tuple(meta["buckets"]) if settings.compile else ()  # eager: each batch to its longest row
        padding = Padding(special, buckets, cfg.token_types > 1)
        return cls(classifier, loaded, padding, params, graph, settings)

    def outputs(self, texts: list[tuple[str, ...]]) -> np.ndarray:
        """The model's outputs [N, num_outputs] (logits, or the regression value), in the texts' order."""
        special, length = self.padding.special, self.classifier.meta["max_length"]
        columns = [self.tokenizer.encode([t[i] for t in texts]) for i in range(len(texts[0]))]
        rows = [join(parts, special, length) for parts in zip(*columns)]
        return run_sorted(self.graph, self.params, rows, self.padding, self.settings.batch_size)

    def rows(self, outputs: np.ndarray) -> list[dict[str, Any]]:
        """One row a text: the label and every label's probability, or the regression's value."""
        import numpy as np

        if self.classifier.meta["regression"]:
            return [{"value": float(v)} for v in outputs[:, 0]]
        shifted = np.exp(outputs - outputs.max(-1, keepdims=True))
        probabilities = shifted / shifted.sum(-1, keepdims=True)
        labels = self.classifier.labels
        return [
            {"label": labels[int(p.argmax())], "probabilities": {n: round(float(v), 6) for n, v in zip(labels, p)}}
            for p in probabilities
        ]


def chunks(files: list[Path], fields: list[str], size: int) -> Iterator[list[tuple[str, ...]]]:
    """The texts of `files`, in order, `size` at a time (read as a custom task's files are, a record at a
    time: no file is held whole); StageError for a file that holds none."""
    chunk: list[tuple[str, ...]] = []
    for path in files:
        read = 0
        for text in iter_texts(path, fields):
            read += 1
            chunk.append(text)
            if len(chunk) == size:
                yield chunk
                chunk = []
        if not read:
            raise StageError(f"{path}: {'no text' if file_format(path) == 'text' else 'no records'}")
    if chunk:
        yield chunk


def fitted(settings: Settings, first_chunk: int) -> Settings:
    """`settings` with a batch no larger than the input, given the number of texts in its first chunk:
    the whole input where that is under a chunk, a chunk otherwise. A batch is padded to its size with
    filler rows (a compiled graph's shapes stay fixed), so `--batch-size 1000000` on 3 texts would
    compute a million rows; every chunk of the input then shares the one size."""
    return dataclasses.replace(settings, batch_size=max(1, min(settings.batch_size, first_chunk)))


def output_kind(path: Path | None) -> str:
    """ "csv" or "jsonl" by the output's extension in any case; JSON lines on a stream."""
    return "csv" if path is not None and path.suffix.lower() == ".csv" else "jsonl"


def predict_files(
    predictor: Predictor, files: list[Path], out: Path | None = None, stream: TextIO | None = None
) -> int:
    """Classify every text of FILES, a chunk at a time; write the rows to OUT (a temporary file renamed
    at the end) or to `stream` (by default the stdout of the moment); return how many were written.
    KeptError naming OUT where it cannot be written; nothing is left of it then."""
    if out is None:
        return _write_chunks(predictor, files, stream or sys.stdout, None)
    tmp = temp_path(out)
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            written = _write_chunks(predictor, files, f, out)
        os.replace(tmp, out)
    except OSError as e:
        _remove(tmp)
        raise KeptError(f"--out {out}: cannot write it: {e.strerror or e}") from None
    except BaseException:
        _remove(tmp)
        raise
    return written


def _write_chunks(predictor: Predictor, files: list[Path], f: TextIO, out: Path | None) -> int:
    meta, written, every = predictor.classifier.meta, 0, Every(PROGRESS_EVERY_S)
    table = csv.writer(f) if output_kind(out) == "csv" else None
    if table is not None:
        table.writerow(["value"] if meta["regression"] else ["label", *predictor.classifier.labels])
    for texts in chunks(files, meta["text_fields"], predictor.settings.chunk):
        if not written:
            predictor = dataclasses.replace(predictor, settings=fitted(predictor.settings, len(texts)))
        rows = predictor.rows(predictor.outputs(texts))
        if table is None:
            # Row by row through the stream's buffer: one write of a whole chunk's rows into a pipe whose reader
            # leaves is cut short without an error (Python's buffered writer returns the part the pipe took).
            f.writelines(json.dumps(row) + "\n" for row in rows)
        else:
            table.writerows([r["value"]] if "value" in r else [r["label"], *r["probabilities"].values()] for r in rows)
        written += len(rows)
        give_back_freed_memory()
        if every.due():
            print(f"predict: {written:,} texts", file=sys.stderr, flush=True)
    return written


@contextmanager
def tuned_allocator() -> Iterator[None]:
    """For the block, glibc maps blocks of MAP_APART_ABOVE bytes or more apart and trims its heap past
    TRIM_ABOVE bytes of free space at its top: glibc otherwise raises its trim threshold with each large
    block freed (a batch's activations) and keeps that memory, so the process grows with the file. Smaller
    blocks stay in the heap, where the next batch reuses the pages the last one freed: mapping every block
    past 64 KiB apart kept peak memory 9% lower in `cram predict` but made it 1.7-2.0x slower, and
    `cram embed` in bf16 1.2x, all of it page faults (bench/README.md, "predict memory").

    The thresholds are the process's, so a command enters this (`cram predict`, `cram embed`), not the
    library: a notebook or a server calling `predict_files` keeps its allocator as it set it. On leaving,
    the thresholds go back to those the process started with (glibc's environment settings, or its
    defaults); glibc has no call that reads them, nor one that turns its sliding thresholds back on. Only
    glibc on Linux: another C library (musl, Windows', macOS') keeps its own policy."""
    libc = glibc()
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, MAP_APART_ABOVE)
    libc.mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE)
    try:
        yield
    finally:
        for parameter, value in start_thresholds().items():
            libc.mallopt(parameter, value)


def give_back_freed_memory() -> None:
    """Hand the memory a chunk freed back to the system: glibc keeps it, fragmented, so a long file grew the
    process by ~300 bytes a line without this (bench/README.md, "predict memory"). It changes no setting of
    the allocator. A C library other than glibc has no `malloc_trim`: nothing to give back here."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


def glibc() -> ctypes.CDLL | None:
    """The C library through ctypes where it is glibc on Linux, else None: `ctypes.CDLL(None)` raises a
    TypeError on Windows, and only glibc has `mallopt`'s parameters and `malloc_trim` as used here."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return None
        import ctypes

        return ctypes.CDLL(None)
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def start_thresholds() -> dict[int, int]:
    """mallopt parameter -> the value the process started with: from GLIBC_TUNABLES
    (`glibc.malloc.mmap_threshold`, `glibc.malloc.trim_threshold`) or the older MALLOC_MMAP_THRESHOLD_ /
    MALLOC_TRIM_THRESHOLD_, else glibc's default of 128 KiB."""
    tunables = dict(
        item.split("=", 1) for item in os.environ.get("GLIBC_TUNABLES", "").split(":") if item.count("=") == 1
    )
    values = {}
    for parameter, name in ((M_MMAP_THRESHOLD, "mmap_threshold"), (M_TRIM_THRESHOLD, "trim_threshold")):
        given = tunables.get(f"glibc.malloc.{name}") or os.environ.get(f"MALLOC_{name.upper()}_", "")
        values[parameter] = int(given) if given.isdigit() else GLIBC_DEFAULT_THRESHOLD
    return values


def _remove(path: Path) -> None:
    """Delete a temporary file if it is there; a folder that refuses it (read-only) leaves nothing to remove."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass
