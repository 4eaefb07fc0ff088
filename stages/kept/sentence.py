"""The sentence-transformers format of an embedding model, written and read: a transformers base-model
folder (the Transformer module, at the folder's root) with the modules that make its vectors beside it.

    modules.json                        Transformer (the root), Pooling, Normalize
    sentence_bert_config.json           max_seq_length: the document length (the query length is in the card)
    config_sentence_transformers.json   cosine similarity, no prompts (read: the folder's prompts)
    1_Pooling/config.json               pooling_mode_mean_tokens ("mean") or pooling_mode_cls_token ("first")
    2_Normalize/                        unit vectors (no settings)

Written in the spelling sentence-transformers 2 to 5 wrote, which 6 reads as well. cram's checkpoint
reader (stages/shared/pretrained.py) reads that spelling and 6's own (the class paths of
`sentence_transformers.base.modules`, `"pooling_mode": "mean"`): `[pretrain] init` on either keeps its
pooling. `read_sentence_folder` reads such a folder (an export, a released model such as
all-MiniLM-L6-v2, or one sentence-transformers 6 saved) as an embedding model cram runs, through that
same checkpoint reader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cram.stages.kept.folder import (
    MARKER,
    PARAMS,
    KeptEmbedder,
    KeptError,
    check_embedder_meta,
    load_tokenizer,
    verify_checksums,
)

if TYPE_CHECKING:
    from torch import Tensor

MODULES = "modules.json"
CONFIG = "sentence_bert_config.json"
SETTINGS = "config_sentence_transformers.json"  # its prompts, and the one encode adds by default
_TYPE = "sentence_transformers.models."
_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_MODULES = ("Transformer", "Pooling", "Normalize")
_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)  # a released model's: its length is the last


def write_sentence_modules(out: Path, embedder: KeptEmbedder) -> None:
    """The files that make OUT, a transformers base-model folder of `embedder`, a sentence-transformers one."""
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": _TYPE + kind}
        for i, (path, kind) in enumerate((("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")))
    ]
    _write(out / MODULES, modules)
    _write(out / CONFIG, {"max_seq_length": embedder.max_length(), "do_lower_case": False})
    _write(
        out / SETTINGS,
        {"prompts": {}, "default_prompt_name": None, "similarity_fn_name": "cosine"},
    )
    from cram.stages.shared.pretrained import POOLING_FLAGS

    modes = {flag: embedder.pooling == pooling for flag, pooling in POOLING_FLAGS.items()}
    pooling = {"word_embedding_dimension": embedder.cfg.hidden, **modes, **dict.fromkeys(_OTHER_MODES, False)}
    (out / "1_Pooling").mkdir()
    _write(out / "1_Pooling" / "config.json", {**pooling, "include_prompt": True})
    (out / "2_Normalize").mkdir()


def read_sentence_folder(folder: Path) -> tuple[KeptEmbedder, dict[str, Tensor], Path, dict[str, int]]:
    """(the embedding model, its fp32 params, its tokenizer file, the special ids) of a sentence-transformers
    folder whose vectors cram computes exactly: mean or first-token pooling, normalised. Its files are
    checked against checksums.json first where it has one (an export of cram's; one without it is read
    with a warning, a released model's folder in silence)."""
    from cram.stages.shared import pretrained

    verify_checksums(folder, ours=(folder / MARKER).is_file())
    try:
        found = pretrained.locate(folder)
        cfg, params = pretrained.load(found)
    except pretrained.PretrainedError as e:
        raise KeptError(str(e)) from None
    if found.modules != _MODULES:
        raise KeptError(
            f"{folder / MODULES}: modules {', '.join(found.modules)}; cram embeds with {', '.join(_MODULES)}, "
            "in that order (unit vectors of the pooled transformer)"
        )
    if found.pooling is None:
        raise KeptError(
            f"{folder / MODULES}: its Pooling module's config.json names a pooling cram does not compute; "
            f"it computes {pretrained.POOLINGS_READ}"
        )
    if found.tokenizer is None:
        raise KeptError(f"{folder}: no tokenizer.json")
    special = load_tokenizer(found.tokenizer).special_ids
    _check_case(found.folder)
    length = min(_max_length(found.folder, folder), cfg.max_seq_len)
    prompts, default = _prompts(folder)
    meta = {
        "kind": "embedder",
        "task": folder.name,
        "pooling": found.pooling,
        "normalize": True,
        "max_length": length,
        "query_max_length": length,  # one length for both: the format holds one
        "buckets": [b for b in _BUCKETS if b < length] + [length],
        "params": PARAMS,
        "prompts": prompts,
        "default_prompt": default,
        "pooled_prompt": found.pooled_prompt,
    }
    check_embedder_meta(meta, folder / MODULES)
    return KeptEmbedder(folder, meta, cfg), params, found.tokenizer, special


def _prompts(folder: Path) -> tuple[dict[str, str], str | None]:
    """The folder's prompts by name and the name of the one `encode` adds by default (None: none), from
    config_sentence_transformers.json (none without it)."""
    if not (folder / SETTINGS).is_file():
        return {}, None
    settings = _read(folder / SETTINGS)
    settings = settings if isinstance(settings, dict) else {}
    prompts = settings.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise KeptError(f"{folder / SETTINGS}: prompts {json.dumps(prompts)}: expected names and their texts")
    default = settings.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise KeptError(
            f"{folder / SETTINGS}: default_prompt_name {json.dumps(default)} is none of its prompts "
            f"({', '.join(prompts) or 'none'})"
        )
    return prompts, default


def _check_case(module: Path) -> None:
    """KeptError where the Transformer module lower-cases each text before its tokenizer (its
    sentence_bert_config.json's do_lower_case, which some older folders set): cram embeds a text as written."""
    path = module / CONFIG
    settings = _read(path) if path.is_file() else None
    if isinstance(settings, dict) and settings.get("do_lower_case") is True:
        raise KeptError(
            f"{path}: do_lower_case true: sentence-transformers lower-cases each text before its tokenizer, "
            "cram embeds it as written, so their vectors would differ"
        )


def _max_length(module: Path, root: Path) -> int:
    """Where the folder's model cuts a text: sentence_bert_config.json's max_seq_length, else its
    tokenizer's model_max_length, read where sentence-transformers reads them: in the Transformer module's
    folder (`module`: the root, or a sub-folder such as `0_Transformer/` in older layouts), then the root."""
    for folder in dict.fromkeys((module, root)):
        for name, key in ((CONFIG, "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
            if (folder / name).is_file():
                settings = _read(folder / name)
                value = settings.get(key) if isinstance(settings, dict) else None
                if type(value) is int and value >= 3:
                    return value
    raise KeptError(f"{module / CONFIG}: no max_seq_length (nor a model_max_length in tokenizer_config.json)")


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KeptError(f"{path}: not readable JSON ({e})") from None


def _write(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
