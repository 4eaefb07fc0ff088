"""`cram embed`: texts into vectors with an embedding model the evaluate stage kept (a run directory's;
`--task` names it where the run kept several) or one exported (`cram export RUN --task NAME`, cram's
format or sentence-transformers'; a released sentence-transformers folder too). The embedding itself:
stages/kept/embedding.py.

    embed(Path("runs/default"), [Path("texts.txt")], Path("vectors.npy"))
    embed(Path("out/search"), [Path("queries.jsonl")], Path("q.npy"), request=Request(query=True))

Inputs are read as `cram predict` reads them: plain text (a line a text), or CSV / TSV / JSON lines
holding the `--field`. The output is one `.npy` of unit vectors [texts, hidden] in the inputs' order
(fp32, or fp16), or one `.parquet` of an `id` (each record's `--id-field`, else its row number) and an
`embedding` per text, written to a temporary file renamed once every row is in it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from cram.pipeline import errors, rundir
from cram.pipeline.commands import classifiers, predict
from cram.stages import StageError
from cram.stages.kept import EMBEDDER, KeptEmbedder, KeptError
from cram.stages.kept.embedding import OUTPUTS, Embedding, Request, check_request, embed_files, open_embedder
from cram.stages.kept.predicting import Settings

if TYPE_CHECKING:
    import torch

# Eager by default: compiled, a batch pads to a length bucket and each bucket costs a compile (minutes
# cold on a loaded 2-core machine) for no faster embedding (bench/README.md, "cram embed").
EAGER = Settings(compile=False)


class EmbedError(errors.CramError):
    """An input, output or embedding model `cram embed` cannot use; one line, exit code 2."""


class Embedded(NamedTuple):
    """What `embed` wrote: how many vectors, and the precision the encoder computed them in."""

    rows: int
    precision: str


def embed(
    source: Path,
    files: list[Path],
    out: Path,
    task: str | None = None,
    request: Request = Request(),
    settings: Settings = EAGER,
) -> Embedded:
    """Embed every text of FILES with SOURCE's embedding model (a run directory's, `task` naming it where
    it kept several, or an exported folder) into OUT."""
    try:
        predict.check_paths(files, out, OUTPUTS)
    except predict.PredictError as e:
        raise EmbedError(str(e)) from None
    try:
        check_request(request, out)
        embedding = Embedding.make(*open_source(source, task), settings, request.precision)
        return Embedded(embed_files(embedding, files, out, request), embedding.precision)
    except KeptError as e:
        raise EmbedError(str(e)) from None
    except StageError as e:  # an input file the reader refuses
        raise EmbedError(f"{e} (--field names the field that holds the text)") from None


def open_source(source: Path, task: str | None) -> tuple[KeptEmbedder, dict[str, torch.Tensor], Path, dict[str, int]]:
    """(the embedding model, its params, its tokenizer file, the special ids) of a run directory or an
    exported folder."""
    if (source / rundir.MANIFEST).is_file():
        embedder = classifiers.find_embedder(source, task)
        try:
            run = classifiers.finished_run(source, doing="embedded")
        except classifiers.RunError as e:
            raise EmbedError(str(e)) from None
        return embedder, embedder.params(), run.tokenizer, run.special_ids
    if not source.is_dir():
        raise EmbedError(f"{source}: neither a run directory nor an exported embedding model's folder")
    if task is not None and not (source / EMBEDDER).is_file():
        raise EmbedError(f"--task {task}: {source} holds one model; --task picks one of a run directory's")
    opened = open_embedder(source)
    if task is not None and task != opened[0].task:
        raise EmbedError(f"--task {task}: {source} holds the embedding model of task {opened[0].task!r}")
    return opened
