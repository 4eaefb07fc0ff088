"""A kept model's folder, as the evaluate stage keeps it and as `cram export` writes it, read back with
every file checked: the file names, the checksums, and the classifier it holds.

    params.safetensors   the encoder and its `classifier.` head, fp32 (no masked-LM head)
    model.json           the encoder's ModelConfig
    classifier.json      what prediction needs: labels, text fields, max_length, buckets, pooling, head
    embedder.json        (an embedding model, instead) pooling, normalisation, document and query lengths, buckets
    checksums.json       (an export) each file's sha256; a kept folder in a run is checked by the store
    .cram-export         (an export) the marker of a folder cram wrote

An embedding model is the second kind of kept model: `params.safetensors` holds the encoder alone and
`embedder.json` says how its texts become vectors (`read_embedder`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cram.model.config import ModelConfig, ModelConfigError
from cram.stages import StageError
from cram.stages.shared.files import content_hash, write_atomic

if TYPE_CHECKING:
    import torch

    from cram.stages.shared.tokenizer import Tokenizer

PARAMS, MODEL, META = "params.safetensors", "model.json", "classifier.json"
EMBEDDER = "embedder.json"
CHECKSUMS = "checksums.json"
MARKER = ".cram-export"  # in every export (exporting.py): `--force` replaces a folder only when it holds this

_log = logging.getLogger(__name__)


class KeptError(StageError):
    """A kept or exported model that is missing, damaged or inconsistent: one line naming the file."""


@dataclass(frozen=True)
class KeptClassifier:
    """A kept classifier: its folder and what classifier.json and model.json say."""

    folder: Path
    meta: dict[str, Any]  # classifier.json
    cfg: ModelConfig

    @property
    def labels(self) -> list[str]:
        return list(self.meta["labels"])

    @property
    def task(self) -> str:
        return str(self.meta["task"])

    def params(self) -> dict[str, torch.Tensor]:
        """The fp32 params; KeptError naming the file where it is not a readable safetensors file."""
        return _load_params(self.folder / PARAMS)


@dataclass(frozen=True)
class KeptEmbedder:
    """A kept embedding model: its folder and what embedder.json and model.json say."""

    folder: Path
    meta: dict[str, Any]  # embedder.json
    cfg: ModelConfig

    @property
    def task(self) -> str:
        return str(self.meta["task"])

    @property
    def pooling(self) -> str:
        return str(self.meta["pooling"])

    def max_length(self, query: bool = False) -> int:
        """Where a text is cut, [CLS] and [SEP] included: a query's length, or a document's."""
        return int(self.meta["query_max_length" if query else "max_length"])

    def params(self) -> dict[str, torch.Tensor]:
        """The fp32 encoder params; KeptError naming the file where it is not a readable safetensors file."""
        return _load_params(self.folder / PARAMS)


def _load_params(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (OSError, SafetensorError) as e:
        raise KeptError(f"{path}: not readable params ({e})") from None


def load_tokenizer(path: Path) -> Tokenizer:
    """A kept or exported model's tokenizer; KeptError naming the file where it cannot be read."""
    from cram.stages.shared import tokenizer as tokenizers

    try:
        return tokenizers.load(path)
    except tokenizers.TokenizerError as e:
        raise KeptError(str(e)) from None


def write_checksums(folder: Path) -> None:
    """CHECKSUMS in `folder`: the sha256 of every other file in it, by relative name."""
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    hashes = {name: content_hash(folder / name) for name in names}
    write_atomic(folder / CHECKSUMS, json.dumps(hashes, indent=1) + "\n")


def verify_checksums(folder: Path, ours: bool = True) -> None:
    """KeptError naming the first file of `folder` that is missing or is not what CHECKSUMS recorded. A
    folder without CHECKSUMS is read unchecked, with one warning naming it where it is `ours` (cram wrote
    it: an export written before checksums, or one whose checksums.json was removed); a folder cram did
    not write (a released sentence-transformers model) never had them."""
    path = folder / CHECKSUMS
    if not path.is_file():
        if ours:
            _log.warning(
                f"{folder}: no {CHECKSUMS}, so its files are read unverified (a damaged or edited file goes "
                "unnoticed); export it again to have them checked"
            )
        return
    try:
        hashes = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KeptError(f"{path}: not readable ({e}); export it again") from None
    if not isinstance(hashes, dict):
        raise KeptError(f"{path}: not a JSON object of file -> sha256; export it again")
    for name, digest in hashes.items():
        file = folder / str(name)
        if not file.is_file():
            raise KeptError(f"{file}: missing, though {CHECKSUMS} lists it; export it again")
        if content_hash(file) != digest:
            raise KeptError(f"{file}: damaged (its sha256 is not the one {CHECKSUMS} recorded); export it again")


def read_classifier(folder: Path) -> KeptClassifier:
    """The classifier in `folder` (kept by evaluate or exported), its description checked against its
    head's params. The caller checks the files' hashes first (the store's or `verify_checksums`)."""
    meta, cfg = _description(folder, META, "classifier")
    check_meta(meta, folder / META)
    if not (folder / PARAMS).is_file():
        raise KeptError(f"{folder / PARAMS}: missing")
    classifier = KeptClassifier(folder, meta, cfg)
    _check_head(classifier)
    return classifier


def read_embedder(folder: Path) -> KeptEmbedder:
    """The embedding model in `folder` (kept by evaluate or exported), its description checked: the
    pooling, the lengths against the buckets and the buckets against the model's positions, the params
    an encoder's. The caller checks the files' hashes first (the store's or `verify_checksums`)."""
    meta, cfg = _description(folder, EMBEDDER, "embedding model")
    where = folder / EMBEDDER
    check_embedder_meta(meta, where)
    _check_positions(where, meta, cfg)
    _check_encoder(folder / PARAMS)
    return KeptEmbedder(folder, meta, cfg)


def check_embedder_meta(meta: Any, where: Path) -> None:
    """An embedder.json cram can embed with: its kind, task, pooling, normalisation, document and query
    lengths, buckets and params file; KeptError naming `where` and the field otherwise."""
    from cram.model.embedder import EMBEDDING_POOLINGS  # torch: embedding needs it anyway

    if not isinstance(meta, dict):
        raise KeptError(f"{where}: not a JSON object")
    if meta.get("kind") != "embedder":
        raise KeptError(f'{where}: kind {json.dumps(meta.get("kind"))}: expected "embedder"')
    if not isinstance(meta.get("task"), str) or not meta["task"]:
        raise KeptError(f"{where}: task {json.dumps(meta.get('task'))}: expected the task's name")
    if meta.get("pooling") not in EMBEDDING_POOLINGS:
        raise KeptError(f"{where}: pooling {json.dumps(meta.get('pooling'))}: allowed {', '.join(EMBEDDING_POOLINGS)}")
    if meta.get("normalize") is not True:
        raise KeptError(f"{where}: normalize {json.dumps(meta.get('normalize'))}: cram embeds unit vectors (true)")
    _check_lengths(meta, where, ("max_length", "query_max_length"))
    if meta.get("params") != PARAMS:
        raise KeptError(f"{where}: params {json.dumps(meta.get('params'))}: expected {json.dumps(PARAMS)}")


def _check_encoder(path: Path) -> None:
    """KeptError where the params file is missing, unreadable or holds no encoder (its token embeddings)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise KeptError(f"{path}: missing")
    try:
        with safe_open(path, "pt") as f:
            names = set(f.keys())
    except (OSError, SafetensorError) as e:
        raise KeptError(f"{path}: not readable params ({e})") from None
    if "embed.tokens.weight" not in names:
        raise KeptError(f"{path}: no encoder (embed.tokens.weight)")


def _description(folder: Path, name: str, kind: str) -> tuple[Any, ModelConfig]:
    """The JSON of `folder / name` and the ModelConfig beside it; KeptError naming the file otherwise."""
    path = folder / name
    try:
        return json.loads(path.read_text(encoding="utf-8")), ModelConfig.from_json(folder / MODEL)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ModelConfigError) as e:
        raise KeptError(f"{path}: not a readable {kind} ({e})") from None


def check_meta(meta: Any, where: Path) -> None:
    """Label names that map to ids and back (distinct non-empty strings, one per output; none for a
    regression), the text fields a prediction reads and a max_length the buckets hold. KeptError naming
    `where` otherwise."""
    labels = meta.get("labels") if isinstance(meta, dict) else None
    outputs = meta.get("num_outputs") if isinstance(meta, dict) else None
    ok = isinstance(labels, list) and all(isinstance(n, str) and n for n in labels)
    if not ok or len(set(labels)) != len(labels) or (len(labels) or 1) != outputs:
        raise KeptError(
            f"{where}: labels {json.dumps(labels)} do not round-trip to {outputs} output ids; "
            "expected distinct non-empty names, one per output (none for a regression)"
        )
    fields = meta.get("text_fields")
    if not isinstance(fields, list) or len(fields) not in (1, 2) or not all(isinstance(f, str) for f in fields):
        raise KeptError(f"{where}: text_fields {json.dumps(fields)}: expected one or two field names")
    _check_lengths(meta, where, ("max_length",))


def _check_lengths(meta: dict[str, Any], where: Path, lengths: tuple[str, ...]) -> None:
    """Buckets that are increasing positive lengths, and each of `lengths` (a key of `meta`) from 3 tokens ([CLS], one
    token, [SEP]) to the largest bucket; KeptError naming `where` and the key otherwise."""
    buckets = meta.get("buckets")
    ok = isinstance(buckets, list) and buckets and all(type(b) is int and b > 0 for b in buckets)
    if not ok or buckets != sorted(set(buckets)):
        raise KeptError(f"{where}: buckets {json.dumps(buckets)}: expected increasing positive lengths")
    for key in lengths:
        length = meta.get(key)
        if type(length) is not int or not 3 <= length <= max(buckets):
            raise KeptError(f"{where}: {key} {json.dumps(length)}: expected 3 to the largest bucket, {max(buckets)}")


def _check_head(classifier: KeptClassifier) -> None:
    """KeptError where the head's output layer has another number of outputs than the labels name, or
    the largest bucket is longer than the encoder's positions."""
    from safetensors import SafetensorError, safe_open

    path = classifier.folder / PARAMS
    try:
        with safe_open(path, "pt") as f:
            shape = f.get_slice("classifier.out.weight").get_shape() if "classifier.out.weight" in f.keys() else None
    except (OSError, SafetensorError) as e:
        raise KeptError(f"{path}: not readable params ({e})") from None
    if shape is None:
        raise KeptError(f"{path}: no classifier head (classifier.out.weight)")
    meta = classifier.meta
    if shape[0] != meta["num_outputs"]:
        raise KeptError(
            f"{classifier.folder / META}: names {meta['num_outputs']} outputs "
            f"({', '.join(meta['labels']) or 'a value'}), but the head in {PARAMS} has {shape[0]}"
        )
    _check_positions(classifier.folder / META, meta, classifier.cfg)


def _check_positions(where: Path, meta: dict[str, Any], cfg: ModelConfig) -> None:
    if max(meta["buckets"]) > cfg.max_seq_len:
        raise KeptError(
            f"{where}: buckets up to {max(meta['buckets'])} tokens, past the model's {cfg.max_seq_len} positions"
        )
