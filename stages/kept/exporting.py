"""A model written in a format other tools read, and cram's own export read back.

    write_export(source, card, "cram", Path("out/default"), run_dir)          # cram's format
    write_export(source, card, "transformers", Path("out/hf"), run_dir)       # a ModernBERT/BERT/RoBERTa folder
    write_export(source, card, "sentence-transformers", Path("out/st"), run_dir)  # an embedding model's
    cfg, params, tokenizer = load_export(Path("out/default"))                 # ready for model.encode
    classifier, tokenizer, special_ids = open_export(Path("out/topic"))       # a kept classifier, for prediction
    embedder, tokenizer, special_ids = open_embedder_export(Path("out/search"))  # a kept embedding model

cram's format: `params.safetensors` (cram's parameter names), `model.json` (the `ModelConfig`), the run's
tokenizer (`tokenizer.model`, sentencepiece, or `tokenizer.json`), `special_ids.json`, with a classifier
its `classifier.json` (an embedding model: its `embedder.json`). The transformers format holds what
`AutoModelForMaskedLM` (a classifier: `AutoModelForSequenceClassification`, with `id2label`; an embedding
model: `AutoModel`, the family's base model) and `AutoTokenizer` read: `config.json`,
`model.safetensors`, `tokenizer.json`, `tokenizer_config.json`; the sentence-transformers format of an
embedding model is that folder with the pooling and normalisation modules beside it (sentence.py). The
tokenizer encodes as cram does: a pair's second text as segment 1 where the model reads token types, and a
kept model's texts cut at its task's `max_length` (`model_max_length`). Every format holds a `README.md`
model card, `.cram-export` (the marker by which `--force` knows a folder it may replace) and
`checksums.json` (each file's sha256, checked whenever cram reads the export back).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cram.model.config import ModelConfig, ModelConfigError
from cram.stages.kept.card import Card, model_card
from cram.stages.kept.folder import (
    EMBEDDER,
    MARKER,
    META,
    MODEL,
    PARAMS,
    KeptClassifier,
    KeptEmbedder,
    KeptError,
    read_classifier,
    read_embedder,
    verify_checksums,
    write_checksums,
)
from cram.stages.kept.sentence import write_sentence_modules
from cram.stages.shared.tokenizer import FILE_NAMES as TOKENIZER_FILE_NAMES
from cram.stages.shared.tokenizer import in_folder as tokenizer_in

# Every format `write_export` writes, with what it holds: `cram export --format`'s help is made from it.
FORMATS = {
    "cram": "params, model.json, tokenizer",
    "transformers": "a folder transformers' Auto classes read",
    "sentence-transformers": "a kept embedding model, with --task",
}
SENTENCE = "sentence-transformers"  # an embedding model's alone
SPECIAL_IDS = "special_ids.json"


@dataclass(frozen=True)
class Source:
    """What an export writes: the encoder (pretrain's, a kept classifier's or embedding model's) and the
    run's tokenizer."""

    params: Path  # params.safetensors
    model: Path  # model.json
    tokenizer: Path  # tokenize's tokenizer.model or tokenizer.json
    special_ids: dict[str, int]
    classifier: KeptClassifier | None = None
    embedder: KeptEmbedder | None = None

    @property
    def task(self) -> str | None:
        """The task of the kept model exported; None for the pretrained encoder."""
        kept = self.classifier or self.embedder
        return None if kept is None else kept.task

    def config(self) -> ModelConfig:
        return model_config(self.model)


def model_config(path: Path) -> ModelConfig:
    try:
        return ModelConfig.from_json(path)
    except ModelConfigError as e:
        raise KeptError(str(e)) from None


def check_transformers(source: Source) -> None:
    """KeptError naming the settings to change where the model (or the classifier's head) has no place
    in transformers' family of it."""
    from cram.model import hf  # torch: only an export to transformers needs it

    cfg = source.config()
    if blockers := hf.transformers_blockers(cfg):
        raise KeptError(
            f"{source.model}: the model does not map onto transformers' {hf.layout(cfg)}; set {', '.join(blockers)}"
        )
    if source.classifier is not None:
        meta = source.classifier.meta
        if blockers := hf.classifier_blockers(cfg, meta["head"], meta["head_width"], meta["pooling"]):
            raise KeptError(
                f"--task {meta['task']}: its head (evaluate.head = {json.dumps(meta['head'])}, head_width "
                f"{meta['head_width']}, pooling {json.dumps(meta['pooling'])}) has no place in transformers' "
                f"{hf.layout(cfg)} classifier; set {', '.join(blockers)} and re-run evaluate"
            )


def write_export(source: Source, card: Card, fmt: str, target: Path, run_dir: Path) -> None:
    """Write `source` to TARGET in format `fmt`, atomically: built in a temporary folder beside it, then
    renamed over it (an earlier export is moved aside and deleted once the new one is in place). The
    caller has checked TARGET is safe to replace."""
    if fmt not in FORMATS:
        raise KeptError(f"--format {fmt}: allowed {', '.join(FORMATS)}")
    if fmt == SENTENCE and source.embedder is None:
        raise KeptError(f"--format {fmt}: the format of an embedding model; name a retrieval task with --task")
    source.config()  # a model.json cram cannot read is refused before anything is written
    if fmt != "cram":
        check_transformers(source)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        (_write_cram if fmt == "cram" else _write_transformers)(source, tmp)
        if fmt == SENTENCE:
            write_sentence_modules(tmp, source.embedder)
        (tmp / "README.md").write_text(model_card(card, fmt, source.task, source.embedder), encoding="utf-8")
        (tmp / MARKER).write_text(json.dumps({"run": str(run_dir.resolve()), "format": fmt}) + "\n")
        write_checksums(tmp)
        _replace_dir(tmp, target)
    except OSError as e:
        raise KeptError(f"--to {target}: cannot write the export: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_export(path: Path) -> tuple[ModelConfig, dict[str, Any], Path]:
    """(ModelConfig, fp32 params, tokenizer path) of a cram-format export, its files checked against its
    checksums: a sentencepiece `tokenizer.model`, or the `tokenizer.json` of a run that reused one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    for name in (MODEL, PARAMS):
        if not (path / name).is_file():
            raise KeptError(f"{path}: no {name}; is it a cram-format export (`cram export RUN_DIR --to DIR`)?")
    tokenizer = tokenizer_in(path)
    if tokenizer is None:
        raise KeptError(f"{path}: no {' or '.join(TOKENIZER_FILE_NAMES)}; is it a cram-format export?")
    verify_checksums(path)
    cfg = model_config(path / MODEL)
    try:
        return cfg, load_file(path / PARAMS), tokenizer
    except (OSError, SafetensorError) as e:
        raise KeptError(f"{path / PARAMS}: not readable params ({e})") from None


def open_export(folder: Path) -> tuple[KeptClassifier, Path, dict[str, int]]:
    """(the classifier, its tokenizer file, the special ids) of a cram-format classifier export, its
    files checked against its checksums."""
    if not (folder / META).is_file():
        hint = " (a transformers export: export with --format cram)" if (folder / "config.json").is_file() else ""
        raise KeptError(f"{folder}: no {META}; not a classifier exported by cram export --task{hint}")
    verify_checksums(folder)
    return read_classifier(folder), *_export_tokenizer(folder)


def open_embedder_export(folder: Path) -> tuple[KeptEmbedder, Path, dict[str, int]]:
    """(the embedding model, its tokenizer file, the special ids) of a cram-format embedder export, its
    files checked against its checksums."""
    verify_checksums(folder)
    return read_embedder(folder), *_export_tokenizer(folder)


def _export_tokenizer(folder: Path) -> tuple[Path, dict[str, int]]:
    """The tokenizer file and the special ids of a cram-format export."""
    tokenizer = tokenizer_in(folder)
    if tokenizer is None:
        raise KeptError(f"{folder}: no {' or '.join(TOKENIZER_FILE_NAMES)}; export it again")
    path = folder / SPECIAL_IDS
    try:
        special = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise KeptError(f"{path}: not readable ({e}); export it again") from None
    if not isinstance(special, dict) or not all(type(special.get(r)) is int for r in ("pad", "cls", "sep")):
        raise KeptError(f"{path}: expected the ids of pad, cls and sep; export it again")
    return tokenizer, special


def _replace_dir(new: Path, to: Path) -> None:
    """Rename NEW to TO; an existing TO is moved aside first and deleted only once NEW is in place."""
    old = to.parent / f".{to.name}.old-{os.getpid()}"
    if to.exists():
        os.replace(to, old)
    os.replace(new, to)
    shutil.rmtree(old, ignore_errors=True)


def _write_cram(source: Source, out: Path) -> None:
    shutil.copyfile(source.params, out / PARAMS)
    shutil.copyfile(source.model, out / MODEL)
    if source.classifier is not None:
        shutil.copyfile(source.classifier.folder / META, out / META)
    if source.embedder is not None:
        shutil.copyfile(source.embedder.folder / EMBEDDER, out / EMBEDDER)
    tokenizer = source.tokenizer
    shutil.copyfile(tokenizer, out / ("tokenizer.json" if tokenizer.suffix == ".json" else "tokenizer.model"))
    (out / SPECIAL_IDS).write_text(json.dumps(source.special_ids, indent=1) + "\n")


def _write_transformers(source: Source, out: Path) -> None:
    from safetensors.torch import load_file, save_file

    from cram.model import hf
    from cram.model.tagger import tagger_to_transformers
    from cram.stages.kept.fast_tokenizer import SPLIT_SPECIAL, fast_tokenizer, kept_tokenizer, read_json

    cfg, special, classifier, embedder = source.config(), source.special_ids, source.classifier, source.embedder
    # a kept model reads a typed special token as cram's sentencepiece model does: as text
    typed_as_text = source.tokenizer.suffix != ".json" and source.task is not None
    if source.task is not None:  # a kept model reads its texts as cram fine-tuned on them (cram's layout)
        tokenizer = kept_tokenizer(source.tokenizer, special)
        tokenizer.save(str(out / "tokenizer.json"))
    elif source.tokenizer.suffix != ".json":
        tokenizer = fast_tokenizer(source.tokenizer, special)
        tokenizer.save(str(out / "tokenizer.json"))
    else:  # an encoder encodes no pairs: the tokenizer it was given, byte for byte
        tokenizer = read_json(source.tokenizer, special, layout=False)
        shutil.copyfile(source.tokenizer, out / "tokenizer.json")
    params = load_file(source.params)
    if embedder is not None:
        config, state = hf.base_to_transformers(cfg, params, special)
    elif classifier is None:
        config, state = hf.to_transformers(cfg, params, special)
    elif classifier.meta.get("per_token"):  # a tagger (a token-classification task's): a tag per token
        config, state = tagger_to_transformers(cfg, params, special, classifier.labels)
    else:
        pooling = classifier.meta["pooling"]
        config, state = hf.classifier_to_transformers(cfg, params, special, pooling, classifier.labels)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = {f"{role}_token": tokenizer.id_to_token(i) for role, i in special.items()}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        # a kept model's texts are cut where evaluate cut them (an embedder's documents); an encoder's at its
        # positions, and a tagger's too: it tags every word (cram windows a longer text; the pipeline, given
        # `stride`, reads it in chunks), and a cut would drop the words past it silently
        "model_max_length": cfg.max_seq_len if _whole(source) else (classifier or embedder).meta["max_length"],
        # BERT's segments where the model reads them: a pair's second text is segment 1, as cram fine-tunes
        "model_input_names": ["input_ids", "attention_mask"] + (["token_type_ids"] if cfg.token_types > 1 else []),
        **(SPLIT_SPECIAL if typed_as_text else {}),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _whole(source: Source) -> bool:
    """Whether the export's tokenizer reads a text up to the model's positions: an encoder's, or a tagger's."""
    return source.task is None or bool(source.classifier and source.classifier.meta.get("per_token"))
