"""`[pretrain] init` from the checkpoints people have: a headless BertModel continues with a masked-LM
head made from the seed (one warning naming it), its pooler carried unchanged into pretrain's params; a
sentence-transformers folder loads from its sub-folder with its pooling as evaluate's default; a zero
budget needs no head; `pooling = "pooler"` and unsupported families are checked before any stage runs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_bad_inputs import cram, write_workspace
from test_init import INIT_PIPELINE, stages_of
from test_tokenizer import bert_style

from cram import model
from cram.pipeline import config as pipeline_config
from cram.pipeline import runner
from cram.stages.pretraining.state import TrainState
from cram.stages.shared import pretrained
from cram.stages.shared.tokenizer import load as load_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

EAGER = INIT_PIPELINE.replace('init = "ckpt"\ncompile = true', 'init = "ckpt"\ncompile = false')
HEAD = ["head.dense.weight", "head.dense.bias", "head.norm.weight", "head.norm.bias", "head.decoder.bias"]
ST_MODULES = [
    {"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


def bert_model(folder: Path, cls: str = "BertModel") -> Path:
    """A small random headless BertModel (with BERT's pooler) beside a WordPiece tokenizer."""
    bert_style(folder)
    tok = load_tokenizer(folder)
    config = transformers.BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        pad_token_id=tok.special_ids["pad"],
    )
    torch.manual_seed(0)
    getattr(transformers, cls)(config).save_pretrained(folder)
    return folder


def sentence_transformers(root: Path, mode: str = "pooling_mode_mean_tokens") -> Path:
    """A sentence-transformers folder as `save` writes it: modules.json, the transformer in 0_Transformer."""
    bert_model(root / "0_Transformer")
    (root / "modules.json").write_text(json.dumps(ST_MODULES))
    (root / "1_Pooling").mkdir()
    modes = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False}
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 16, **modes, mode: True}))
    return root


@pytest.fixture(scope="module")
def headless(tmp_path_factory) -> Path:
    return bert_model(tmp_path_factory.mktemp("bert") / "ckpt")


@pytest.fixture
def ws(tmp_path, monkeypatch, headless) -> Path:
    monkeypatch.chdir(tmp_path)
    write_workspace(tmp_path)
    shutil.copytree(headless, tmp_path / "ckpt")
    (tmp_path / "pipeline.toml").write_text(EAGER)
    return tmp_path


def test_a_headless_bert_continues_with_a_made_head_and_keeps_its_pooler_unchanged(ws):
    result = cram("run", "pipeline.toml")
    assert result.exit_code == 0, result.output
    warned = re.findall(r"ckpt has no masked-LM head; initialised ([^()]+) from the run's seed", result.output)
    assert warned == [", ".join(HEAD)], result.output
    run = ws / "runs" / "base"
    outputs = stages_of(run)["pretrain"]["outputs"]
    assert outputs["head_initialised"] == HEAD and outputs["steps"] == 2
    assert json.loads((run / "pretrain" / "model.json").read_text())["pooler"] is True
    checkpoint = load_file(ws / "ckpt" / "model.safetensors")
    trained = load_file(run / "pretrain" / "params.safetensors")
    for name in model.bert.POOLER:  # neither a gradient step nor weight decay moved it
        assert torch.equal(trained[name], checkpoint[name])
    step = next((run / "pretrain" / "checkpoints").glob("step-*"))
    assert torch.equal(load_file(step / "params.safetensors")["pooler.dense.weight"], checkpoint["pooler.dense.weight"])
    assert not [k for k in load_file(step / "optimizer.safetensors") if "pooler" in k]  # AdamW never saw it
    moved = trained["layers.0.attn.out.weight"] - checkpoint["encoder.layer.0.attention.output.dense.weight"]
    assert moved.abs().max() > 0  # the encoder did train
    assert 0 < stages_of(run)["evaluate"]["outputs"]["mlm_loss"]


def test_a_zero_budget_needs_no_head_says_nothing_and_reports_no_mlm_figure(ws):
    result = cram("run", "pipeline.toml", "--set", "pretrain.budget.steps=0")
    assert result.exit_code == 0, result.output
    assert "initialised" not in result.output and "warning" not in result.output
    stages = stages_of(ws / "runs" / "base")
    assert stages["pretrain"]["outputs"]["val_loss_start"] is None and stages["pretrain"]["outputs"]["steps"] == 0
    assert "mlm_loss" not in stages["evaluate"]["outputs"] and 0 <= stages["evaluate"]["outputs"]["sent_accuracy"] <= 1


def test_pooling_pooler_fine_tunes_from_the_pooler_and_is_refused_where_it_cannot(ws):
    pooler = ["--set", 'evaluate.pooling="pooler"']
    wide = cram("run", "pipeline.toml", *pooler, "--dry-run")
    assert wide.exit_code == 2 and re.match(r"^error: evaluate\.head_width: \d+, but pooling = \"pooler\"", wide.output)
    ok = cram("run", "pipeline.toml", *pooler, "--set", "evaluate.head_width=0")
    assert ok.exit_code == 0, ok.output
    scratch = cram("run", "pipeline.toml", *pooler, "--set", 'pretrain.init=""', "--dry-run", "--name", "other")
    assert scratch.exit_code == 2 and len(scratch.output.strip().splitlines()) == 1, scratch.output
    assert scratch.output.startswith('error: evaluate.pooling: "pooler" starts the head from the checkpoint')


def test_a_sentence_transformers_folder_loads_from_its_sub_folder_and_sets_the_pooling(tmp_path):
    root = sentence_transformers(tmp_path / "st")
    found = pretrained.locate(root)
    assert (found.folder, found.pooling, found.tokenizer) == (
        root / "0_Transformer",
        "mean",
        root / "0_Transformer" / "tokenizer.json",
    )
    cfg, params = pretrained.load(found)
    hf = transformers.BertModel.from_pretrained(root / "0_Transformer").eval()
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 7:] = False
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    assert (model.encode(params, cfg, ids, mask)[mask] - expected[mask]).abs().max().item() <= 1e-4
    modules = runner.default_stages()
    classes = runner.config_classes(modules)
    (tmp_path / "p.toml").write_text(f'[pretrain]\ninit = "{root}"\n')
    # with cramming's head: the default, BERT's, reads the first token alone (tests/test_init_head.py)
    cramming = pipeline_config.load(tmp_path / "p.toml", classes, ['evaluate.head="cramming"'])
    assert cramming.stages["evaluate"].pooling == "mean"
    explicit = pipeline_config.load(tmp_path / "p.toml", classes, ['evaluate.pooling="first"'])
    assert explicit.stages["evaluate"].pooling == "first"
    assert (
        pipeline_config.load(tmp_path / "p.toml", classes, ['pretrain.init=""']).stages["evaluate"].pooling == "first"
    )
    cls = sentence_transformers(tmp_path / "cls", "pooling_mode_cls_token")
    assert pretrained.locate(cls).pooling == "first"


def test_an_unsupported_family_is_one_line_exit_2_naming_it(ws):
    config = json.loads((ws / "ckpt" / "config.json").read_text())
    (ws / "ckpt" / "config.json").write_text(json.dumps({**config, "model_type": "deberta-v2"}))
    result = cram("run", "pipeline.toml", "--dry-run")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "model_type='deberta-v2' (DeBERTa's disentangled relative attention" in result.output
    assert not (ws / "runs").exists()


def test_a_checkpoint_s_params_split_into_trained_and_kept_each_in_its_order():
    names = ["embed.tokens.weight", "pooler.dense.weight", "head.dense.weight", "pooler.dense.bias"]
    state = TrainState.from_json({"seed": 0}, {name: torch.zeros(1) for name in names}, {})
    assert list(state.params) == ["embed.tokens.weight", "head.dense.weight"]
    assert list(state.kept) == ["pooler.dense.weight", "pooler.dense.bias"]
    assert list(state.saved_params()) == [*state.params, *state.kept]
    assert "kept" not in state.to_json()
