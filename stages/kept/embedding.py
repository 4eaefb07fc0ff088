"""An embedding model run on texts, a chunk at a time: read, encode, embed CHUNK texts, then the next,
so memory holds one chunk whatever the input's length, and the vectors come out in the input's order:
into one `.npy` file [N, H] of unit vectors (fp32, or fp16 to halve it), or a `.parquet` file of ids
beside them. Within a chunk the texts are cut at the model's document length (a query's with `query`)
and sorted by length; compiled, a batch is padded to the model's length buckets (one graph per bucket,
no recompiles), eager to its longest text.

    embedder, params, tokenizer_file, special_ids = open_embedder(Path("out/search"))  # an export
    embedding = Embedding.make(embedder, params, tokenizer_file, special_ids, Settings(compile=False))
    rows = embed_files(embedding, [Path("texts.txt")], Path("vectors.npy"), Request(query=True))

The file is written to a temporary path (a `.npy` by stages/retrieval/search.py's `write_embeddings`,
the one writer of embeddings) and renamed once every row is in it; the inputs are read twice, first to
count and check every record, so a bad record is refused before anything is embedded. Progress: a bar
on a terminal's stderr, a line every PROGRESS_EVERY_S seconds elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Union

from cram.stages import StageError
from cram.stages.kept.batches import Padding, join, run_sorted
from cram.stages.kept.exporting import open_embedder_export
from cram.stages.kept.folder import EMBEDDER, META, KeptEmbedder, KeptError, load_tokenizer
from cram.stages.kept.predicting import PROGRESS_EVERY_S, Settings, chunks, fitted, give_back_freed_memory
from cram.stages.kept.sentence import MODULES, read_sentence_folder
from cram.stages.shared.files import atomic
from cram.stages.shared.progress import bar
from cram.stages.shared.taskfiles import file_format, iter_records, record_texts

if TYPE_CHECKING:
    import numpy as np
    import torch

    from cram.stages.kept.batches import Graph
    from cram.stages.shared.tokenizer import Tokenizer

DTYPES = ("float32", "float16")
PRECISIONS = ("auto", "fp32", "bf16")
OUTPUTS = (".npy", ".parquet")
Ids = Union[list[str], range]  # the records' ids, or the texts' row numbers


@dataclass(frozen=True)
class Request:
    """What to embed: the text field of each record (plain text: each line), as queries (cut at the
    model's query length) or documents, into vectors of `dtype`; `id_field`: the field of each record
    whose value a `.parquet` output holds beside its vector (None: the row number); `precision`: the
    encoder's arithmetic, fp32 (sentence-transformers' own, 1e-4), bf16 autocast (vectors within ~1e-3), or
    "auto": bf16 on CUDA and on a CPU that multiplies bf16 natively, where it embeds 1.7x fp32's rows/s
    (bench/README.md, "cram embed"), fp32 elsewhere; `prompt`: the name of a sentence-transformers
    folder's prompt put before each text, as its `encode(prompt_name=...)` does (None: the folder's
    default prompt, where it names one)."""

    field: str = "text"
    query: bool = False
    dtype: str = "float32"
    id_field: str | None = None
    precision: str = "auto"
    prompt: str | None = None


@dataclass(frozen=True)
class Embedding:
    """An embedding model ready to embed: its params on the device, its tokenizer, the embedding graph, and
    the precision it computes in ("fp32" or "bf16")."""

    embedder: KeptEmbedder
    tokenizer: Tokenizer
    padding: Padding
    params: dict[str, torch.Tensor]
    graph: Graph
    settings: Settings
    precision: str

    @classmethod
    def make(
        cls,
        embedder: KeptEmbedder,
        params: dict[str, torch.Tensor],
        tokenizer: Path,
        special: dict[str, int],
        settings: Settings,
        precision: str = "auto",
    ) -> Embedding:
        """KeptError naming the tokenizer file where it cannot be read. `precision`: one of PRECISIONS."""
        from cram.model.embedder import make_embed_step
        from cram.model.step import Compilation
        from cram.stages.shared import device as devices

        loaded = load_tokenizer(tokenizer)
        cfg = dataclasses.replace(embedder.cfg, dropout=0.0)
        # SDPA, not the written-out product the training step uses on a CPU, and eager batches padded to
        # their longest text, not to a bucket: all-MiniLM-L6-v2 eagerly embedded 256 texts of 50-256
        # tokens (batch 128, 2 cores at load 13) in 50-64 s against 102-106 s (bench/NOTEBOOK.md, "cram embed").
        device = devices.resolve("auto")
        autocast = devices.autocast_dtype(precision, device)
        how = Compilation(compile=settings.compile, backend=settings.backend, autocast=autocast, attention="sdpa")
        graph = make_embed_step(cfg, how, pooling=embedder.pooling)
        on_device = {k: v.to(device) for k, v in params.items()}
        buckets = tuple(embedder.meta["buckets"]) if settings.compile else ()
        # The embedding reads no token types: every text is one segment.
        padding = Padding(special, buckets, token_types=False)
        return cls(embedder, loaded, padding, on_device, graph, settings, "fp32" if autocast is None else "bf16")

    def vectors(
        self, texts: list[str], query: bool = False, done: Callable[[int], None] | None = None, prompt: str = ""
    ) -> np.ndarray:
        """[N, H] fp32 unit vectors of `texts`, in their order, each cut as [CLS] prompt text [SEP] at the
        model's document length (`query`: its query length); `done(n)` after each batch of n."""
        length = self.embedder.max_length(query)
        rows = [
            join((ids,), self.padding.special, length) for ids in self.tokenizer.encode([prompt + t for t in texts])
        ]
        return run_sorted(self.graph, self.params, rows, self.padding, self.settings.batch_size, done)


def open_embedder(folder: Path) -> tuple[KeptEmbedder, dict[str, torch.Tensor], Path, dict[str, int]]:
    """(the embedding model, its fp32 params, its tokenizer file, the special ids) of an exported folder:
    cram's format (`embedder.json`) or a sentence-transformers one (an export, or a released model), its
    files checked against its checksums where it has them."""
    if (folder / EMBEDDER).is_file():
        embedder, tokenizer, special = open_embedder_export(folder)
        return embedder, embedder.params(), tokenizer, special
    if (folder / MODULES).is_file():
        return read_sentence_folder(folder)
    hint = " (a classifier: cram predict reads it)" if (folder / META).is_file() else ""
    raise KeptError(f"{folder}: neither {EMBEDDER} nor {MODULES}; not an exported embedding model{hint}")


def embed_files(embedding: Embedding, files: list[Path], out: Path, request: Request = Request()) -> int:
    """Embed every text of FILES into OUT, a chunk at a time, and return N: a `.npy` [N, H] of
    `request.dtype`, or a `.parquet` of ids and vectors (`write_parquet`). KeptError naming OUT where it
    cannot be written, StageError naming the input where a record cannot be read; nothing is left of OUT
    then."""
    from cram.stages.retrieval.search import write_embeddings

    check_request(request, out)
    prompt = prompt_text(embedding.embedder, request.prompt)
    size = embedding.settings.chunk
    count = sum(len(texts) for texts, _ in identified(files, request, size))  # all checked before any is embedded
    if not count:
        raise KeptError("no texts to embed: name at least one input file")
    with bar("embed", count, lines_every=PROGRESS_EVERY_S) as advance:
        chunks = _embedded(embedding, identified(files, request, size), request.query, advance, prompt)
        try:
            if out.suffix.lower() == ".parquet":
                write_parquet(out, chunks, count, request.dtype)
            else:
                write_embeddings(out, (vectors for vectors, _ in chunks), count, request.dtype)
        except OSError as e:
            raise KeptError(f"--out {out}: cannot write it: {e.strerror or e}") from None
        except ValueError as e:  # an input that changed between the count and the embedding
            raise KeptError(f"{e}; did an input change while it was embedded?") from None
    return count


def check_request(request: Request, out: Path) -> None:
    """KeptError naming the option where `request` cannot be written to OUT."""
    if request.dtype not in DTYPES:
        raise KeptError(f"--dtype {request.dtype}: allowed {', '.join(DTYPES)}")
    if request.precision not in PRECISIONS:
        raise KeptError(f"--precision {request.precision}: allowed {', '.join(PRECISIONS)}")
    if request.id_field is not None and out.suffix.lower() != ".parquet":
        raise KeptError(f"--id-field {request.id_field}: ids are written to a .parquet --out; {out.name} holds vectors")


def prompt_text(embedder: KeptEmbedder, name: str | None) -> str:
    """The text put before each text: the model's prompt `name`, or its default prompt (None); "" for a
    model without one. KeptError where it has no such prompt, or pools without the prompt's tokens
    (a Pooling module's `include_prompt: false`), which cram does not compute."""
    prompts, default = embedder.meta.get("prompts") or {}, embedder.meta.get("default_prompt")
    if name is not None and name not in prompts:
        has = f"the prompts {', '.join(prompts)}" if prompts else "no prompts"
        raise KeptError(f"--prompt {name}: {embedder.folder} has {has}")
    text = prompts.get(name if name is not None else default, "")
    if text and embedder.meta.get("pooled_prompt") is False:
        raise KeptError(
            f"{embedder.folder}: its Pooling module leaves the prompt {text!r} out of the pooling "
            "(include_prompt false), which cram does not compute; embed it with sentence-transformers"
        )
    return text


def _embedded(
    embedding: Embedding,
    chunks: Iterator[tuple[list[str], Ids]],
    query: bool,
    advance: Callable[[int], None],
    prompt: str,
) -> Iterator[tuple[np.ndarray, Ids]]:
    for n, (texts, ids) in enumerate(chunks):
        if n == 0:
            embedding = dataclasses.replace(embedding, settings=fitted(embedding.settings, len(texts)))
        yield embedding.vectors(texts, query, advance, prompt), ids
        give_back_freed_memory()


def identified(files: list[Path], request: Request, size: int) -> Iterator[tuple[list[str], Ids]]:
    """(texts, their ids) of FILES, `size` texts at a time: the ids are the records' `request.id_field`
    as text (a JSON number as its digits), or without one the texts' row numbers from 0. StageError
    naming the file and record where one is missing, or is no text or whole number."""
    if request.id_field is None:
        start = 0
        for texts in chunks(files, [request.field], size):
            yield [t[0] for t in texts], range(start, start + len(texts))
            start += len(texts)
        return
    texts: list[str] = []
    ids: list[str] = []
    for path in files:
        for text, key in _with_ids(path, request.field, request.id_field):
            texts.append(text)
            ids.append(key)
            if len(texts) == size:
                yield texts, ids
                texts, ids = [], []
    if texts:
        yield texts, ids


def _with_ids(path: Path, field: str, id_field: str) -> Iterator[tuple[str, str]]:
    if file_format(path) == "text":
        raise StageError(f"{path}: plain text has no fields; --id-field {id_field} reads CSV, TSV or JSON lines")
    read = 0
    for where, record in iter_records(path):
        (text,) = record_texts(record, (field,), where)
        key = record.get(id_field)
        if isinstance(key, bool) or not isinstance(key, (str, int)) or key == "":
            raise StageError(f"{where}: --id-field {id_field} is {key!r}; an id is a text or a whole number")
        read += 1
        yield text, str(key)
    if not read:
        raise StageError(f"{path}: no records")


def write_parquet(out: Path, chunks: Iterable[tuple[np.ndarray, Ids]], rows: int, dtype: str) -> None:
    """OUT as a Parquet file of `rows` rows in two columns, `id` (int64 row numbers, or the records' ids as
    text) and `embedding` (a fixed-size list of `dtype`, a unit vector a row), one row group a chunk, written
    to a temporary file renamed at the end; ValueError, nothing written, where the chunks hold another number
    of rows. pyarrow comes with datasets, a dependency already."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    with atomic(out) as tmp:
        writer, at = None, 0
        try:
            for vectors, ids in chunks:
                at += len(vectors)
                flat = pa.array(vectors.astype(np.dtype(dtype)).reshape(-1))
                column = pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])
                keys = pa.array(ids, pa.int64()) if isinstance(ids, range) else pa.array(ids, pa.string())
                table = pa.table({"id": keys, "embedding": column})
                writer = writer or pq.ParquetWriter(tmp, table.schema)
                writer.write_table(table)
        finally:
            if writer is not None:
                writer.close()
        if at != rows:
            raise ValueError(f"{out}: {at} rows embedded of the {rows} counted")
