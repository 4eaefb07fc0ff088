"""A checkpoint whose masked-LM head predicts no better than uniform (a sentence encoder re-saved as
`BertForMaskedLM`, its head initialised at random) continues as a headless one under the defaults: the
head made anew and warmed up alone, at a sentence encoder's rate, said in one warning line and in the
`init_head` figure; a resume keeps that decision; a head that predicts keeps the files' lr and no warm-up;
numbers given as `init_lr` or `head_warmup` win; the key is the one the files give."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from structlog.testing import capture_logs
from test_head_warmup import continued
from test_init_headless import HEAD, bert_model
from test_pretrain import same_tensors

from cram import model
from cram.model import AdamW
from cram.pipeline.planning import keyed_config
from cram.stages import Upstream, pretrain
from cram.stages.pretraining import continued as continuing
from cram.stages.pretraining.continued import AUTO_FRACTION, SENTENCE_ENCODER_LR, UNTRAINED_MARGIN
from cram.stages.shared.tokenizer import load as load_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

SEQ = 16
USED = range(5, 15)  # the tokens the packed text is made of: a head that predicts them beats uniform
FROM_SCRATCH_LR = 5e-3  # the default pipeline's, which "auto" caps


@pytest.fixture(scope="module")
def random_head(tmp_path_factory) -> Path:
    """A BertForMaskedLM as transformers saves a fresh one: its head's transform random, its bias zero."""
    return bert_model(tmp_path_factory.mktemp("random") / "ckpt", cls="BertForMaskedLM")


@pytest.fixture(scope="module")
def trained_head(tmp_path_factory, random_head) -> Path:
    """The same checkpoint with a head that predicts the packed text's tokens: well below uniform."""
    folder = tmp_path_factory.mktemp("trained") / "ckpt"
    shutil.copytree(random_head, folder)
    mlm = transformers.BertForMaskedLM.from_pretrained(folder)
    with torch.no_grad():
        mlm.cls.predictions.bias.fill_(-10.0)
        mlm.cls.predictions.bias[USED.start : USED.stop] = 10.0
    mlm.save_pretrained(folder)
    return folder


@pytest.fixture
def pack_of(tmp_path, random_head) -> Upstream:
    folder = tmp_path / "pack"
    folder.mkdir()
    tok = load_tokenizer(random_head)
    rng = np.random.default_rng(0)
    np.save(folder / "train.npy", rng.integers(USED.start, USED.stop, size=(256, SEQ), dtype=np.uint16))
    np.save(folder / "val.npy", rng.integers(USED.start, USED.stop, size=(16, SEQ), dtype=np.uint16))
    outputs = {"train": "train.npy", "val": "val.npy", "seq_len": SEQ}
    return Upstream(folder, {**outputs, "vocab_size": tok.vocab_size, "special_ids": tok.special_ids})


def defaults(checkpoint: Path, **kw) -> pretrain.Config:
    """A continued run with every continuation setting at its default, from a from-scratch lr."""
    settings = dict(head_warmup="auto", head_lr=0.0, optimizer=AdamW(lr=FROM_SCRATCH_LR))
    return continued(checkpoint, **{**settings, **kw})


def verdict(figure: str, vocab_size: int) -> tuple[str, float]:
    found = re.fullmatch(r"(untrained|trained): loss (\d+\.\d\d), uniform (\d+\.\d\d)", figure)
    assert found, figure
    assert float(found[3]) == pytest.approx(math.log(vocab_size), abs=0.005)
    return found[1], float(found[2])


def test_a_random_head_continues_as_a_headless_checkpoint_and_says_so_once(random_head, pack_of, tmp_path, make_ctx):
    with capture_logs() as logs:
        out = pretrain.run(defaults(random_head), {"pack": pack_of}, tmp_path / "out", make_ctx())
    vocab = pack_of.outputs["vocab_size"]
    kind, loss = verdict(out["init_head"], vocab)
    assert kind == "untrained" and loss >= math.log(vocab) - UNTRAINED_MARGIN
    assert out["peak_lr"] == pytest.approx(SENTENCE_ENCODER_LR)  # not the masked-LM rate the files give
    assert out["head_initialised"] == HEAD and 0 < out["head_warmup_until"] < 0.5
    said = [e["event"] for e in logs if "no better than uniform" in e["event"]]
    assert len(said) == 1 and [e for e in logs if e["log_level"] == "warning"] == [
        e for e in logs if e["event"] in said
    ]
    assert f"held-out loss {loss:.2f}" in said[0] and ", ".join(HEAD) in said[0] and "peak lr 3.33e-05" in said[0]
    assert f"pretrain.head_warmup ({AUTO_FRACTION:g})" in said[0]
    continuing_line = next(e for e in logs if e["event"] == "continuing")
    assert continuing_line["peak_lr"] == pytest.approx(SENTENCE_ENCODER_LR)


def test_the_made_head_replaces_the_random_one_and_the_encoder_is_the_checkpoints(random_head, make_ctx):
    config = defaults(random_head)
    ctx = make_ctx()
    found = continuing.load(config.init, ctx)
    made = continuing.params(config, ctx, found, math.log(found.cfg.vocab_size), config.optimizer.lr)
    kept = continuing.params(config, ctx, found, 1.0, config.optimizer.lr)
    fresh = model.init(found.cfg, ctx.seed, names=HEAD)
    for name in HEAD:
        assert torch.equal(made[name], fresh[name]) and torch.equal(kept[name], found.params[name])
    assert not torch.equal(made["head.dense.weight"], found.params["head.dense.weight"])
    assert torch.equal(made["layers.0.attn.out.weight"], found.params["layers.0.attn.out.weight"])


def test_a_head_that_predicts_keeps_the_files_rate_and_no_warm_up(trained_head, pack_of, tmp_path, make_ctx):
    with capture_logs() as logs:
        out = pretrain.run(defaults(trained_head), {"pack": pack_of}, tmp_path / "out", make_ctx())
    kind, loss = verdict(out["init_head"], pack_of.outputs["vocab_size"])
    assert kind == "trained" and loss < 3.0  # about ln 10: the head spreads itself over the ten tokens used
    assert out["peak_lr"] == pytest.approx(1.5e-3)  # a masked-LM encoder 16 wide
    assert "head_initialised" not in out and "head_warmup_until" not in out
    assert not [e for e in logs if e["log_level"] == "warning"]
    trained = load_file(tmp_path / "out" / "params.safetensors")
    bias = load_file(trained_head / "model.safetensors")["cls.predictions.bias"]
    assert (trained["head.decoder.bias"] - bias).abs().max() < 0.1  # trained on from the checkpoint's own


def test_numbers_given_win_over_the_measurement(random_head, pack_of, tmp_path, make_ctx):
    config = defaults(random_head, init_lr=2e-3, head_warmup=0.0)
    out = pretrain.run(config, {"pack": pack_of}, tmp_path / "out", make_ctx())
    assert verdict(out["init_head"], pack_of.outputs["vocab_size"])[0] == "untrained"
    assert out["peak_lr"] == 2e-3 and "head_warmup_until" not in out and out["head_initialised"] == HEAD


def test_a_resume_keeps_the_start_s_decision(random_head, pack_of, tmp_path, make_ctx):
    config = defaults(random_head, checkpoint_every_steps=2, keep_checkpoints=4)
    straight = pretrain.run(config, {"pack": pack_of}, tmp_path / "straight", make_ctx())
    resumed_dir = tmp_path / "resumed" / "checkpoints"
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step-4", resumed_dir / "step-4")
    resumed = pretrain.run(config, {"pack": pack_of}, tmp_path / "resumed", make_ctx())
    assert same_tensors(tmp_path / "straight" / "params.safetensors", tmp_path / "resumed" / "params.safetensors")
    assert resumed["init_head"] == straight["init_head"] and resumed["peak_lr"] == straight["peak_lr"]


def test_the_key_holds_what_the_files_give(random_head):
    """Decided at run time from what the key already holds: the key itself is the one the files give."""
    key = keyed_config(pretrain, defaults(random_head))
    assert key["optimizer"]["lr"] == 1.5e-3 and "head_warmup" not in key and "init_lr" not in key
