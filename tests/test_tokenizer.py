"""Reusing an existing tokenizer: `stages/shared/tokenizer.load` on folders saved by transformers (BERT and
RoBERTa special tokens), on sentencepiece models and on broken ones; the tokenize stage encoding with a
given tokenizer in parallel exactly as the tokenizer itself does; and a whole pipeline run with one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
from test_bad_inputs import PIPELINE, cram, write_workspace
from test_tokenize import config, held_out, write_corpus

from cram.stages import StageError, tokenize
from cram.stages.shared import tokenizer
from cram.stages.shared.special import SPECIAL_IDS

SENTENCES = [
    f"{a} {b} sat on the {c} while it was {d}."
    for a in ("the cat", "a dog", "my bird", "Her Fish")
    for b in ("quietly", "happily", "often")
    for c in ("mat", "rug", "chair", "sofa")
    for d in ("sunny", "raining", "late")
]
# Not cram's order (SPECIAL_IDS): a stage that assumed cram's ids would be caught.
BERT = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
ROBERTA = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def bert_style(folder: Path, specials: list[str] = BERT) -> Path:
    """A WordPiece tokenizer saved by transformers, as a BERT checkpoint's folder holds one."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(SENTENCES, trainers.WordPieceTrainer(vocab_size=120, special_tokens=specials))
    names = dict(unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")
    PreTrainedTokenizerFast(tokenizer_object=tok, **names).save_pretrained(folder)
    return folder


def roberta_style(folder: Path) -> Path:
    """A byte-level BPE tokenizer with RoBERTa's special tokens, saved by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=300, special_tokens=ROBERTA))
    names = dict(bos_token="<s>", eos_token="</s>", cls_token="<s>", sep_token="</s>", unk_token="<unk>")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", mask_token="<mask>", **names).save_pretrained(
        folder
    )
    return folder


def word_level(path: Path, words: list[str]) -> Path:
    """A tokenizer.json with exactly `words` (ids in order), no config files."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {"bert": bert_style(root / "bert"), "roberta": roberta_style(root / "roberta")}


def test_bert_and_roberta_folders_give_their_special_ids_and_vocab_size(folders):
    from tokenizers import Tokenizer

    bert, roberta = tokenizer.load(folders["bert"]), tokenizer.load(folders["roberta"])
    assert bert.special_ids == {"pad": 3, "unk": 0, "cls": 1, "sep": 2, "mask": 4}
    assert roberta.special_ids == {"pad": 1, "unk": 3, "cls": 0, "sep": 2, "mask": 4}
    for tok, folder in ((bert, folders["bert"]), (roberta, folders["roberta"])):
        reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
        assert tok.kind == "tokenizers" and tok.file == folder / "tokenizer.json"
        assert tok.vocab_size == reference.get_vocab_size(with_added_tokens=True)
        # No special tokens added: pack adds [CLS]/[SEP] itself.
        assert tok.encode(SENTENCES[:3]) == [reference.encode(s, add_special_tokens=False).ids for s in SENTENCES[:3]]
    assert tokenizer.load(folders["bert"] / "tokenizer.json").special_ids == bert.special_ids


def test_a_saved_truncation_or_padding_is_not_applied(tmp_path):
    from tokenizers import Tokenizer

    path = word_level(tmp_path / "tokenizer.json", ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]", "a", "b"])
    saved = Tokenizer.from_file(str(path))
    saved.enable_truncation(max_length=3)
    saved.enable_padding(pad_id=3, pad_token="[PAD]", length=8)
    saved.save(str(path))
    assert tokenizer.load(path).encode(["a b a b a", "b"]) == [[5, 6, 5, 6, 5], [6]]


def test_the_config_files_names_win_over_the_usual_ones(tmp_path):
    # Two mask-like tokens: the config's (an AddedToken dict, as transformers writes it) is the one.
    word_level(tmp_path / "tokenizer.json", ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]", "<extra_mask>", "a"])
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"mask_token": {"content": "<extra_mask>"}}))
    assert tokenizer.load(tmp_path).special_ids == {"pad": 3, "unk": 0, "cls": 1, "sep": 2, "mask": 5}


def test_crams_own_sentencepiece_model_gives_special_ids(tmp_path):
    model = tokenize.train_tokenizer(iter(SENTENCES * 4), tokenize.Config(vocab_size=60))
    (tmp_path / "tokenizer.model").write_bytes(model)
    for path in (tmp_path / "tokenizer.model", tmp_path):
        tok = tokenizer.load(path)
        assert (tok.kind, tok.vocab_size, tok.special_ids) == ("sentencepiece", 60, SPECIAL_IDS)
    assert SPECIAL_IDS["mask"] not in tok.encode(["a [MASK] typed in the text stays text"])[0]


def folder_with(name: str, content: bytes) -> Callable[[Path], Path]:
    def make(path: Path) -> Path:
        path.mkdir()
        (path / name).write_bytes(content)
        return path

    return make


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: p, "no such file or folder"),
        (lambda p: p.mkdir() or p, "holds neither tokenizer.json nor tokenizer.model"),
        (lambda p: word_level(p / "tokenizer.json", ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "a"]).parent, "no mask token"),
        (lambda p: word_level(p / "tokenizer.json", ["<unk>", "<mask>", "<pad>", "</s>"]).parent, "no cls token"),
        (folder_with("tokenizer.json", b"{not json"), "not a readable tokenizer.json"),
        (folder_with("tokenizer.model", b"\x00junk"), "not a readable sentencepiece model"),
    ],
    ids=["missing", "empty folder", "no mask", "no cls", "bad json", "bad model"],
)
def test_a_tokenizer_that_cannot_serve_is_one_line_naming_its_path(tmp_path, setup, message):
    path = setup(tmp_path / "tok")
    with pytest.raises(tokenizer.TokenizerError) as caught:
        tokenizer.load(path)
    line = str(caught.value)
    assert message in line and str(tmp_path / "tok") in line and "\n" not in line
    if message == "no mask token":
        assert "'[MASK]' or '<mask>'" in line


def test_reading_a_tokenizer_json_needs_no_transformers(folders):
    code = (
        "import sys; from pathlib import Path; from cram.stages.shared import tokenizer; "
        f"tokenizer.load(Path({str(folders['roberta'])!r})); assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tokenize_encodes_in_parallel_exactly_as_the_tokenizer_does(folders, tmp_path, make_ctx, monkeypatch):
    import datasets
    from tokenizers import Tokenizer

    path = tmp_path / "corpus.jsonl"
    records = write_corpus(path)
    monkeypatch.setattr(tokenize.corpus, "UNIT_BYTES", 8000)  # several units, read and encoded by 2 processes
    monkeypatch.setattr(tokenize, "SHARD_BYTES", 1000)
    out = tmp_path / "out"
    out.mkdir()
    cfg = config(path, tokenizer=str(folders["roberta"]), num_proc=2, batch_size=7, vocab_size=13)
    outputs = tokenize.run(cfg, {}, out, make_ctx())

    assert len(list((out / "tokens").glob("*.arrow"))) > 10 and outputs["num_proc"] == 2
    reference = Tokenizer.from_file(str(folders["roberta"] / "tokenizer.json"))
    train = [r["body"] for r in records if not held_out(r)]
    ids = datasets.load_from_disk(str(out / outputs["tokens"]))["input_ids"]
    assert ids == [reference.encode(text, add_special_tokens=False).ids for text in train]

    assert outputs["tokenizer"] == "tokenizer.json"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (folders["roberta"] / name).read_bytes()
    assert outputs["vocab_size"] == reference.get_vocab_size(with_added_tokens=True)  # not the config's 13
    assert outputs["special_ids"] == {"pad": 1, "unk": 3, "cls": 0, "sep": 2, "mask": 4}
    assert (outputs["model_type"], outputs["normalization"], outputs["lowercase"]) == ("imported", "imported", None)
    assert outputs["unk_fraction"] == 0  # byte-level BPE has no unknown text
    assert not (out / "scratch").exists()


def test_a_tokenizers_content_is_in_the_fingerprint_and_its_place_is_not(folders, tmp_path):
    import shutil

    copy = shutil.copytree(folders["bert"], tmp_path / "copy")
    base = tokenize.Config(tokenizer=str(folders["bert"]))
    assert tokenize.fingerprint(base) == tokenize.fingerprint(tokenize.Config(tokenizer=str(copy)))
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text().replace("[MASK]", "[MASK2]"))
    assert tokenize.fingerprint(base) != tokenize.fingerprint(tokenize.Config(tokenizer=str(copy)))
    plain = tokenize.Config()
    assert tokenize.fingerprint(plain) == tokenize.corpus.fingerprint(plain.corpus)  # no tokenizer: as before


def test_validate_refuses_a_tokenizer_without_a_mask_token(tmp_path):
    path = word_level(tmp_path / "tok" / "tokenizer.json", ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "a"])
    with pytest.raises(StageError, match=r"^tokenize\.tokenizer: .*tok/tokenizer\.json: no mask token"):
        tokenize.validate(tokenize.Config(tokenizer=str(path.parent)), SimpleNamespace(stages={}))


@pytest.mark.usefixtures("one_thread")
def test_a_pipeline_with_an_imported_tokenizer_runs_end_to_end(tmp_path, monkeypatch):
    import numpy as np

    monkeypatch.chdir(tmp_path)
    write_workspace(tmp_path)
    bert_style(tmp_path / "tok")
    (tmp_path / "pipeline.toml").write_text(PIPELINE.replace("[tokenize]\n", '[tokenize]\ntokenizer = "tok"\n'))
    result = cram("run", "pipeline.toml")
    assert result.exit_code == 0, result.output

    run = tmp_path / "runs" / "base"
    stages = json.loads((run / "manifest.json").read_text())["stages"]
    assert [r["status"] for r in stages.values()] == ["done"] * 4
    special = {"pad": 3, "unk": 0, "cls": 1, "sep": 2, "mask": 4}
    assert stages["tokenize"]["outputs"]["special_ids"] == stages["pack"]["outputs"]["special_ids"] == special
    vocab = tokenizer.load(tmp_path / "tok").vocab_size
    assert stages["pack"]["outputs"]["vocab_size"] == vocab
    assert json.loads((run / "pretrain" / "model.json").read_text())["vocab_size"] == vocab
    blocks = np.load(run / "pack" / stages["pack"]["outputs"]["train"])
    flat = blocks.reshape(-1)
    after_sep = flat[np.flatnonzero(flat[:-1] == special["sep"]) + 1]
    # [CLS] doc [SEP] [CLS] doc [SEP] ... in the tokenizer's ids (cram's cls id, 2, is [SEP] here)
    assert flat[0] == special["cls"] and len(after_sep) > 10 and (after_sep == special["cls"]).all()
    assert stages["evaluate"]["outputs"]["mlm_loss"] > 0
    assert os.path.islink(run / "tokenize") and (run / "tokenize" / "tokenizer.json").is_file()


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_fresh_run_with_a_tokenizer_lacking_a_mask_writes_nothing(tmp_path, monkeypatch, dry_run):
    monkeypatch.chdir(tmp_path)
    write_workspace(tmp_path)
    word_level(tmp_path / "nomask" / "tokenizer.json", ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "a"])
    (tmp_path / "pipeline.toml").write_text(PIPELINE.replace("[tokenize]\n", '[tokenize]\ntokenizer = "nomask"\n'))
    result = cram("run", "pipeline.toml", *(["--dry-run"] if dry_run else []))
    assert result.exit_code == 2, result.output
    assert result.output == (
        "error: tokenize.tokenizer: nomask/tokenizer.json: no mask token "
        "('[MASK]' or '<mask>' is not in its vocabulary)\n"
    )
    assert not (tmp_path / "runs").exists()
