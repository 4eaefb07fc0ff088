"""A fine-tuning task's length is bounded by the positions of the model evaluate fine-tunes: those of the
checkpoint pretrain continues (a released encoder keeps its own, whatever pack.seq_len it continues at), else
pack's seq_len; past them it is refused before any stage, naming which."""

import shutil

import pytest
from test_bad_inputs import cram, write_workspace
from test_head_warmup import refused_before_any_stage
from test_init_headless import EAGER, bert_model

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def headless(tmp_path_factory):
    return bert_model(tmp_path_factory.mktemp("bert") / "ckpt")  # 32 positions; the workspace packs 16


def test_a_continued_checkpoint_takes_tasks_up_to_its_own_positions(tmp_path, monkeypatch, headless):
    monkeypatch.chdir(tmp_path)
    write_workspace(tmp_path)
    shutil.copytree(headless, tmp_path / "ckpt")
    (tmp_path / "pipeline.toml").write_text(EAGER)
    longer = ["--set", "evaluate.buckets=[16, 32]", "--set", "evaluate.max_length=32"]
    result = cram("run", "pipeline.toml", *longer, "--dry-run")
    assert result.exit_code == 0, result.output


def test_past_the_checkpoints_positions_is_refused_naming_them(tmp_path, monkeypatch, headless):
    overrides = ["evaluate.buckets=[16, 32, 64]", "evaluate.max_length=64"]
    message = r"max_length 64 pads to 64, beyond the 32 positions of pretrain.init's checkpoint"
    refused_before_any_stage(tmp_path, monkeypatch, headless, overrides, message)
