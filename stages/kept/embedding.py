"""An embedding model run on texts, a chunk at a time: read, encode, embed CHUNK texts, then the next,
so memory holds one chunk whatever the input's length, and the vectors come out in the input's order
into one `.npy` file [N, H] of unit vectors (fp32, or fp16 to halve it). Within a chunk the texts are
cut at the model's document length (a query's with `query`), sorted by length and padded to its
buckets: one compiled graph per bucket, no recompiles.

    embedder, params, tokenizer_file, special_ids = open_embedder(Path("out/search"))  # an export
    embedding = Embedding.make(embedder, params, tokenizer_file, special_ids, Settings(compile=False))
    rows = embed_files(embedding, [Path("texts.txt")], Path("vectors.npy"), Request(query=True))

The file is written to a temporary path (stages/retrieval/search.py's `write_embeddings`, the one
writer of embeddings) and renamed once every row is in it; the inputs are read twice, first to count
and check every record, so a bad record is refused before anything is embedded.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cram.stages.kept.batches import Padding, join, run_sorted
from cram.stages.kept.exporting import open_embedder_export
from cram.stages.kept.folder import EMBEDDER, META, Embedder, KeptError
from cram.stages.kept.predicting import PROGRESS_EVERY_S, Settings, chunks, give_back_freed_memory
from cram.stages.kept.sentence import MODULES, read_sentence_folder
from cram.stages.shared.progress import Every

if TYPE_CHECKING:
    import numpy as np
    import torch

    from cram.stages.kept.batches import Graph
    from cram.stages.shared.tokenizer import Tokenizer

DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class Request:
    """What to embed: the text field of each record (plain text: each line), as queries (cut at the
    model's query length) or documents, into vectors of `dtype`."""

    field: str = "text"
    query: bool = False
    dtype: str = "float32"


@dataclass(frozen=True)
class Embedding:
    """An embedding model ready to embed: its params on the device, its tokenizer, the embedding graph."""

    embedder: Embedder
    tokenizer: Tokenizer
    padding: Padding
    params: dict[str, torch.Tensor]
    graph: Graph
    settings: Settings

    @classmethod
    def make(
        cls,
        embedder: Embedder,
        params: dict[str, torch.Tensor],
        tokenizer: Path,
        special: dict[str, int],
        settings: Settings,
    ) -> Embedding:
        """KeptError naming the tokenizer file where it cannot be read."""
        from cram.model.embedder import make_embed_step
        from cram.model.step import Compilation
        from cram.stages.shared import device as devices
        from cram.stages.shared import tokenizer as tokenizers

        try:
            loaded = tokenizers.load(tokenizer)
        except tokenizers.TokenizerError as e:
            raise KeptError(str(e)) from None
        cfg = dataclasses.replace(embedder.cfg, dropout=0.0)
        how = Compilation(compile=settings.compile, backend=settings.backend)
        graph = make_embed_step(cfg, how, pooling=embedder.pooling)
        device = devices.resolve("auto")
        on_device = {k: v.to(device) for k, v in params.items()}
        # The embedding reads no token types: every text is one segment.
        padding = Padding(special, tuple(embedder.meta["buckets"]), token_types=False)
        return cls(embedder, loaded, padding, on_device, graph, settings)

    def vectors(self, texts: list[str], query: bool = False) -> np.ndarray:
        """[N, H] fp32 unit vectors of `texts`, in their order, each cut as [CLS] text [SEP] at the
        model's document length (`query`: its query length)."""
        length = self.embedder.max_length(query)
        rows = [join((ids,), self.padding.special, length) for ids in self.tokenizer.encode(texts)]
        return run_sorted(self.graph, self.params, rows, self.padding, self.settings.batch_size)


def open_embedder(folder: Path) -> tuple[Embedder, dict[str, torch.Tensor], Path, dict[str, int]]:
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
    """Embed every text of FILES into OUT (`.npy`, [N, H] of `request.dtype`), a chunk at a time, and
    return N. KeptError naming OUT where it cannot be written, StageError naming the input where a
    record cannot be read; nothing is left of OUT then."""
    from cram.stages.retrieval.search import write_embeddings

    if request.dtype not in DTYPES:
        raise KeptError(f"--dtype {request.dtype}: allowed {', '.join(DTYPES)}")
    fields, size = [request.field], embedding.settings.chunk
    count = sum(len(texts) for texts in chunks(files, fields, size))  # every record checked before any is embedded
    if not count:
        raise KeptError("no texts to embed: name at least one input file")
    try:
        write_embeddings(out, _batches(embedding, files, request), count, request.dtype)
    except OSError as e:
        raise KeptError(f"--out {out}: cannot write it: {e.strerror or e}") from None
    except ValueError as e:  # an input that changed between the count and the embedding
        raise KeptError(f"{e}; did an input change while it was embedded?") from None
    return count


def _batches(embedding: Embedding, files: list[Path], request: Request) -> Iterator[np.ndarray]:
    written, every = 0, Every(PROGRESS_EVERY_S)
    for texts in chunks(files, [request.field], embedding.settings.chunk):
        vectors = embedding.vectors([t[0] for t in texts], request.query)
        written += len(vectors)
        yield vectors
        give_back_freed_memory()
        if every.due():
            print(f"embed: {written:,} texts", file=sys.stderr, flush=True)
