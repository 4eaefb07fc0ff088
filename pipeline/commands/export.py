"""Export a finished run's encoder, and load cram's own export back.

    export(Path("runs/default"), Path("out/default"))                       # cram's format
    export(Path("runs/default"), Path("out/hf"), fmt="transformers")        # a ModernBERT (or BERT) directory
    cfg, params, tokenizer = load_export(Path("out/default"))               # ready for model.encode
    export(Path("runs/default"), Path("out/topic"), task="topic")           # the kept topic classifier

cram's format: `params.safetensors` (cram's parameter names), `model.json` (the `ModelConfig`), the run's
tokenizer (`tokenizer.model`, sentencepiece, or `tokenizer.json` when tokenize reused a tokenizers one),
`special_ids.json` and a `README.md` model card.
The transformers format holds what `AutoModelForMaskedLM.from_pretrained` and
`AutoTokenizer.from_pretrained` read: `config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`, and the same card. It exists for the ModernBERT layout and, with `post_norm`,
BERT's or RoBERTa's (`model/hf.py`, the one mapping, and its `transformers_blockers`); building its
tokenizer from sentencepiece needs `tokenizers` and `protobuf`.
With `task`, the classifier the evaluate stage kept for that task (`pipeline/commands/classifiers.py`): cram's
format adds its `classifier.json` (what `cram predict` reads), the transformers format is the family's
`...ForSequenceClassification` (`hf.classifier_to_transformers`), with `id2label` and `label2id`.
Both formats hold `.cram-export`, the marker by which `--force` knows a folder it may replace: an
earlier export, never a run, the runs folder or anything else.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from cram.model.config import ModelConfig, ModelConfigError
from cram.pipeline import rundir, store
from cram.pipeline.commands import classifiers
from cram.stages.shared.figures import is_number
from cram.stages.shared.tokenizer import FILE_NAMES as TOKENIZER_FILE_NAMES
from cram.stages.shared.tokenizer import in_folder as tokenizer_in

FORMATS = ("cram", "transformers")
MARKER = ".cram-export"  # in every export: `--force` replaces a folder only when it holds this file


class ExportError(Exception):
    """A run directory, target or architecture that cannot be exported; one line, exit code 2."""


def export(run_dir: Path, to: Path, fmt: str = "cram", force: bool = False, task: str | None = None) -> Path:
    """Write the final params of RUN_DIR's pretrain stage (or, with `task`, the classifier its evaluate
    stage kept for that task) to TO, atomically; return TO."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt}: allowed {', '.join(FORMATS)}")
    run = finished_run(run_dir)
    kept = None if task is None else classifiers.find(run_dir, task)
    cfg = _model_config(run["pretrain_dir"] / run["pretrain"]["model_config"]) if kept is None else kept.cfg
    if fmt == "transformers":
        _check_transformers(run_dir, cfg, kept)
    target = _check_target(run_dir, to, force)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        if fmt == "cram":
            _write_cram(run, tmp, kept)
        else:
            _write_transformers(run, cfg, tmp, kept)
        (tmp / "README.md").write_text(model_card(run_dir, fmt, task), encoding="utf-8")
        (tmp / MARKER).write_text(json.dumps({"run": str(run_dir.resolve()), "format": fmt}) + "\n")
        _replace_dir(tmp, target)
    except OSError as e:
        raise ExportError(f"--to {to}: cannot write the export: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return to


def _check_transformers(run_dir: Path, cfg: ModelConfig, kept: classifiers.Kept | None) -> None:
    """ExportError naming the settings to change where the model (or the kept classifier's head) has no
    place in transformers' family of it."""
    from cram.model import hf  # torch: only an export to transformers needs it

    if blockers := hf.transformers_blockers(cfg):
        raise ExportError(
            f"{run_dir}: the model does not map onto transformers' {hf.layout(cfg)}; set {', '.join(blockers)}"
        )
    if kept is not None:
        meta = kept.meta
        if blockers := hf.classifier_blockers(cfg, meta["head"], meta["head_width"], meta["pooling"]):
            raise ExportError(
                f"--task {meta['task']}: its head (evaluate.head = {json.dumps(meta['head'])}, head_width "
                f"{meta['head_width']}, pooling {json.dumps(meta['pooling'])}) has no place in transformers' "
                f"{hf.layout(cfg)} classifier; set {', '.join(blockers)} and re-run evaluate"
            )


def load_export(path: Path) -> tuple[ModelConfig, dict[str, Any], Path]:
    """(ModelConfig, fp32 params, tokenizer path) of a cram-format export: a sentencepiece `tokenizer.model`,
    or the `tokenizer.json` of a run that reused a tokenizers tokenizer."""
    from safetensors.torch import load_file

    for name in ("model.json", "params.safetensors"):
        if not (path / name).is_file():
            raise ExportError(f"{path}: no {name}; is it a cram-format export (`cram export RUN_DIR --to DIR`)?")
    tokenizer = tokenizer_in(path)
    if tokenizer is None:
        raise ExportError(f"{path}: no {' or '.join(TOKENIZER_FILE_NAMES)}; is it a cram-format export?")
    return _model_config(path / "model.json"), load_file(path / "params.safetensors"), tokenizer


def fast_tokenizer(sp_model: Path, special_ids: dict[str, int]) -> Any:
    """A `tokenizers.Tokenizer` that encodes like the sentencepiece model, wrapped in [CLS] ... [SEP].

    Built from the model's own pieces, scores and normaliser (the approach of transformers'
    `SpmConverter`): BPE merges ranked by the score of the merged piece, or the unigram pieces with
    their scores. Unlike sentencepiece, the special pieces typed in the text ("[MASK]") become their ids.
    """
    try:
        from sentencepiece import sentencepiece_model_pb2
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
        from tokenizers.models import BPE, Unigram
    except ImportError as e:
        raise ExportError(
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
        tokenizer = Tokenizer(Unigram(pieces, unk_id=proto.trainer_spec.unk_id))
    else:
        raise ExportError(
            f"{sp_model}: a sentencepiece {proto.trainer_spec.model_type} model; only bpe and unigram map"
        )

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
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in names.values()])
    cls, sep = names["cls"], names["sep"]
    tokenizer.post_processor = processors.TemplateProcessing(  # the layout evaluate fine-tunes on
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, special_ids["cls"]), (sep, special_ids["sep"])],
    )
    return tokenizer


def model_card(run_dir: Path, fmt: str, task: str | None = None) -> str:
    """README.md of an export: how to load it, the run's figures per stage and its resolved config."""
    stages = rundir.Manifest.load(run_dir).records
    saved = run_dir / rundir.CONFIG
    try:
        config = saved.read_text(encoding="utf-8") if saved.is_file() else ""
    except (OSError, UnicodeDecodeError) as e:
        raise ExportError(f"{saved}: not a readable config ({e}); the model card quotes it") from None
    if task is not None:
        usage = (
            "cram predict DIR texts.csv --out labels.jsonl"
            if fmt == "cram"
            else "from transformers import pipeline\n\n"
            'classify = pipeline("text-classification", model="DIR")\nclassify(["a text"])'
        )
    elif fmt == "cram":
        usage = (
            "from pathlib import Path\n\nfrom cram import model\n"
            "from cram.pipeline.commands.export import load_export\n\n"
            'cfg, params, tokenizer = load_export(Path("DIR"))\nhidden = model.encode(params, cfg, input_ids, mask)'
        )
    else:
        usage = (
            "from transformers import AutoModelForMaskedLM, AutoTokenizer\n\n"
            'model = AutoModelForMaskedLM.from_pretrained("DIR")\ntokenizer = AutoTokenizer.from_pretrained("DIR")'
        )
    lines = [
        f"# {run_dir.name}",
        "",
        f"A BERT-style masked language model crammed by `cram` (run `{run_dir.name}`), exported in the `{fmt}` format."
        if task is None
        else f"The `{task}` classifier fine-tuned by `cram` (run `{run_dir.name}`), exported in the `{fmt}` format.",
        "",
        "```python",
        usage,
        "```",
        "",
        "## Figures",
        "",
    ]
    for stage, record in stages.items():
        figures = {k: v for k, v in record.outputs.items() if is_number(v)}
        if figures:
            lines += [
                f"**{stage}**: "
                + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()),
                "",
            ]
    lines += ["## Config", "", "```toml", config.strip(), "```", ""]
    return "\n".join(lines)


_NEEDED = {"tokenize": ("tokenizer", "special_ids"), "pretrain": ("params", "model_config")}  # what export reads


def finished_run(run_dir: Path) -> dict[str, Any]:
    """What an export reads of RUN_DIR's tokenize and pretrain stages (their outputs and folders), once
    they are done and the files read are the ones the store recorded."""
    try:
        stages = rundir.records(run_dir)
    except rundir.RunDirError as e:
        raise ExportError(str(e)) from None
    run = {}
    for stage in ("tokenize", "pretrain"):
        record = stages.get(stage)
        if record is None or record.status != "done" or not (run_dir / stage).is_dir():
            raise ExportError(
                f"{run_dir}: stage {stage} is not done (status {record.status if record else 'missing'}); "
                f"run it first: cram resume {run_dir}"
            )
        run[stage], run[f"{stage}_dir"] = record.outputs, run_dir / stage
        missing = [k for k in _NEEDED[stage] if k not in run[stage]]
        if missing:
            raise ExportError(
                f"{run_dir / rundir.MANIFEST}: stage {stage} is done, but its outputs lack {', '.join(missing)}; "
                f"re-run it: cram run {run_dir / rundir.CONFIG} --force {stage}"
            )
    for stage, key in (("tokenize", "tokenizer"), ("pretrain", "params"), ("pretrain", "model_config")):
        path = run[f"{stage}_dir"] / str(run[stage].get(key))
        if not path.is_file():
            raise ExportError(
                f"{path}: missing, though stage {stage} is done; re-run it: "
                f"cram run {run_dir / rundir.CONFIG} --force {stage}"
            )
        # What is copied must be what the stage wrote: a damaged file is refused (and noted in its entry).
        damage = store.verify(run[f"{stage}_dir"], stages[stage].key or "", [str(run[stage].get(key))])
        if damage is not None:
            raise ExportError(f"{damage}; nothing exported: cram resume {run_dir} computes {stage} again")
    return run


def _model_config(path: Path) -> ModelConfig:
    try:
        return ModelConfig.from_json(path)
    except ModelConfigError as e:
        raise ExportError(str(e)) from None


def _check_target(run_dir: Path, to: Path, force: bool) -> Path:
    """TO resolved, once it is known to be safe to write: never a run, the runs folder or what holds
    them, never inside them, and, when it exists and is not empty, an earlier export to replace."""
    target, run = to.resolve(), run_dir.resolve()
    runs_root = run.parent
    if target == runs_root or runs_root in target.parents:
        raise ExportError(
            f"--to {to}: inside the runs folder {runs_root} (it holds run {run_dir.name}); "
            "export to a folder outside it"
        )
    if target in runs_root.parents or target == Path.cwd().resolve() or target in Path.cwd().resolve().parents:
        raise ExportError(
            f"--to {to}: holds the runs folder {runs_root} or the current directory; "
            "name a new folder for the export, e.g. --to exports/" + run_dir.name
        )
    inside = next((p for p in target.parents if (p / rundir.MANIFEST).is_file()), None)
    if inside is not None:
        raise ExportError(f"--to {to}: inside the run directory {inside}; export to a folder outside it")
    if target.exists() and not target.is_dir():
        raise ExportError(f"--to {to}: exists and is not a directory")
    if target.is_dir() and any(target.iterdir()):
        if not (target / MARKER).is_file():
            raise ExportError(
                f"--to {to}: not empty and not an earlier export (no {MARKER}); "
                "--force replaces only an earlier export: choose a new or empty folder"
            )
        if not force:
            raise ExportError(f"--to {to}: holds an earlier export; pass --force to replace it")
        run_inside = next(target.rglob(rundir.MANIFEST), None)
        if run_inside is not None:
            raise ExportError(f"--to {to}: holds a run directory ({run_inside.parent}); not replacing it")
    return target


def _replace_dir(new: Path, to: Path) -> None:
    """Rename NEW to TO; an existing TO is moved aside first and deleted only once NEW is in place."""
    old = to.parent / f".{to.name}.old-{os.getpid()}"
    if to.exists():
        os.replace(to, old)
    os.replace(new, to)
    shutil.rmtree(old, ignore_errors=True)


def _write_cram(run: dict[str, Any], out: Path, kept: classifiers.Kept | None = None) -> None:
    pretrain, tokenize = run["pretrain_dir"], run["tokenize_dir"]
    if kept is None:
        shutil.copyfile(pretrain / run["pretrain"]["params"], out / "params.safetensors")
        shutil.copyfile(pretrain / run["pretrain"]["model_config"], out / "model.json")
    else:
        for name in (classifiers.PARAMS, classifiers.MODEL, classifiers.META):
            shutil.copyfile(kept.folder / name, out / name)
    tokenizer = tokenize / run["tokenize"]["tokenizer"]
    shutil.copyfile(tokenizer, out / ("tokenizer.json" if tokenizer.suffix == ".json" else "tokenizer.model"))
    (out / "special_ids.json").write_text(json.dumps(run["tokenize"]["special_ids"], indent=1) + "\n")


def _write_transformers(run: dict[str, Any], cfg: ModelConfig, out: Path, kept: classifiers.Kept | None) -> None:
    from safetensors.torch import load_file, save_file

    from cram.model import hf

    special = run["tokenize"]["special_ids"]
    source = run["tokenize_dir"] / run["tokenize"]["tokenizer"]
    if source.suffix == ".json":  # a tokenizers tokenizer, already in transformers' format: copied as it is
        tokenizer = _tokenizer_json(source)
        shutil.copyfile(source, out / "tokenizer.json")
    else:
        tokenizer = fast_tokenizer(source, special)
        tokenizer.save(str(out / "tokenizer.json"))
    if kept is None:
        config, state = hf.to_transformers(cfg, load_file(run["pretrain_dir"] / run["pretrain"]["params"]), special)
    else:
        config, state = hf.classifier_to_transformers(cfg, kept.params(), special, kept.meta["pooling"], kept.labels)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = {f"{role}_token": tokenizer.id_to_token(i) for role, i in special.items()}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "model_max_length": cfg.max_seq_len,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _tokenizer_json(path: Path) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ExportError(f"--format transformers needs tokenizers ({e}): pip install -e '.[export]'") from None
    return Tokenizer.from_file(str(path))
