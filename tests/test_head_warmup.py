"""`pretrain.head_warmup`: a made masked-LM head trains alone (the encoder and its moments untouched) in
a graph of its own, then the whole model with a fresh AdamW; the switch resumes exactly; "auto" warms only
a made head and leaves every other run's key as it was; bad settings are refused before any stage."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_bad_inputs import cram, write_workspace
from test_init import stages_of
from test_init_headless import EAGER, bert_model
from test_pretrain import metrics, same_tensors
from test_step import random_batch

from cram import model
from cram.model import AdamW, ModelConfig
from cram.pipeline.planning import keyed_config
from cram.stages import StageError, Upstream, pretrain
from cram.stages.pretraining import head_warmup
from cram.stages.pretraining.continued import AUTO_FRACTION
from cram.stages.shared.tokenizer import load as load_tokenizer

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

HEADED = ModelConfig(vocab_size=128, hidden=32, layers=1, heads=2, intermediate=64, max_seq_len=16)
HEADED = dataclasses.replace(HEADED, head_transform=True, decoder_bias=True)
NO_CLIP = AdamW(clip_norm=0.0, eps=1e-6)  # clipping would scale the head by the whole model's norm
SEQ = 16


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "aot_eager"])
def test_the_head_step_moves_the_head_alone_as_the_whole_step_moves_it(compile):
    names = head_warmup.head_names(HEADED)
    assert names == ("head.dense.weight", "head.norm.weight", "head.decoder.bias")
    params = model.init(HEADED, 0)
    state = model.optimizer_init(model.AdamW(), params)
    batch, lr = random_batch(HEADED, 4, seed=1), torch.tensor(1e-2)
    how = model.Compilation(compile=compile, backend="aot_eager")
    head_p, head_s, head_m = model.make_train_step(HEADED, NO_CLIP, how, trained=names)(params, state, batch, lr)
    whole_p, whole_s, whole_m = model.make_train_step(HEADED, NO_CLIP, how)(params, state, batch, lr)
    assert list(head_p) == list(params) and list(head_s) == list(state)
    for name, p in params.items():
        if name in names:
            assert not torch.equal(head_p[name], p) and torch.allclose(head_p[name], whole_p[name], atol=1e-6)
        else:  # the encoder and its moments come back as they were
            assert torch.equal(head_p[name], p) and not torch.equal(whole_p[name], p), name
            assert torch.equal(head_s[f"exp_avg.{name}"], state[f"exp_avg.{name}"])
    assert torch.equal(head_m["loss"], whole_m["loss"]) and head_m["grad_norm"] < whole_m["grad_norm"]

    # Accumulated over microbatches: the gradients are the head's alone, applied to it alone.
    accumulate = model.make_accumulate_step(HEADED, how, trained=names)
    apply = model.make_apply_step(NO_CLIP, how)
    grads = {name: torch.zeros_like(params[name]) for name in names}
    grads, _ = accumulate(params, grads, batch)
    assert set(grads) == set(names)
    applied, _, _ = apply(params, state, grads, torch.tensor(1.0), lr)
    assert all(torch.allclose(applied[k], head_p[k], atol=1e-6) for k in params)


@pytest.fixture(scope="module")
def headless(tmp_path_factory) -> Path:
    return bert_model(tmp_path_factory.mktemp("bert") / "ckpt")


@pytest.fixture
def pack_of(tmp_path, headless) -> Upstream:
    """Packed random tokens of the headless checkpoint's vocabulary."""
    folder = tmp_path / "pack"
    folder.mkdir()
    tok = load_tokenizer(headless)
    rng = np.random.default_rng(0)
    np.save(folder / "train.npy", rng.integers(5, tok.vocab_size, size=(256, SEQ), dtype=np.uint16))
    np.save(folder / "val.npy", rng.integers(5, tok.vocab_size, size=(16, SEQ), dtype=np.uint16))
    outputs = {
        "train": "train.npy",
        "val": "val.npy",
        "seq_len": SEQ,
        "vocab_size": tok.vocab_size,
        "special_ids": tok.special_ids,
    }
    return Upstream(folder, outputs)


def continued(headless: Path, **kw) -> pretrain.Config:
    defaults = dict(
        init=str(headless),
        budget=pretrain.Budget(steps=8),
        head_warmup=4 * 4 * SEQ,  # tokens: the first 4 steps
        head_lr=1e-2,
        microbatch=4,
        batch_size=4,
        ramp=0.0,
        compile=False,
        log_every_steps=1,
        checkpoint_every_minutes=0,
        val_blocks=8,
        precision="fp32",
    )
    return pretrain.Config(**{**defaults, **kw})


def test_the_encoder_stays_the_checkpoints_until_the_switch_then_trains(headless, pack_of, tmp_path, make_ctx):
    config = continued(headless, checkpoint_every_steps=4, keep_checkpoints=4)
    out = pretrain.run(config, {"pack": pack_of}, tmp_path / "out", make_ctx())
    assert out["head_warmup_until"] == pytest.approx(0.5) and out["steps"] == 8
    start = load_file(tmp_path / "out" / "checkpoints" / "step-4" / "params.safetensors")
    original = load_file(headless / "model.safetensors")
    assert torch.equal(start["layers.0.attn.out.weight"], original["encoder.layer.0.attention.output.dense.weight"])
    assert torch.equal(start["embed.tokens.weight"], original["embeddings.word_embeddings.weight"])
    end = load_file(tmp_path / "out" / "params.safetensors")
    assert not torch.equal(end["layers.0.attn.out.weight"], start["layers.0.attn.out.weight"])
    lrs = [m["lr"] for m in metrics(tmp_path / "out")]
    # The head's constant lr, then the schedule (budget-triangle) started anew over the last 4 steps.
    restarted = config.optimizer.lr * model.lr_schedule(config.schedule, 0.0)
    assert lrs[:4] == [1e-2] * 4 and lrs[4] == pytest.approx(restarted)
    # The whole model starts a fresh AdamW: its step count restarts at the switch.
    moments = load_file(tmp_path / "out" / "checkpoints" / "step-8" / "optimizer.safetensors")
    assert moments["step"].item() == 4


def test_the_warm_up_counts_the_flops_of_a_frozen_encoder(headless, pack_of, tmp_path, make_ctx):
    """While the head trains alone, the encoder runs forward only: its steps count fewer FLOPs (MFU follows)."""
    out = pretrain.run(continued(headless, val_blocks=0), {"pack": pack_of}, tmp_path / "out", make_ctx())
    cfg = ModelConfig(**{**json.loads((tmp_path / "out" / "model.json").read_text()), "max_seq_len": SEQ})
    whole, alone = (model.flops_per_token(cfg, 0.25, encoder_trained=trained) for trained in (True, False))
    assert alone < whole / 2
    assert out["flops_seen"] == pytest.approx(4 * 4 * SEQ * (alone + whole))


@pytest.mark.parametrize("at", [2, 4], ids=["in-the-warm-up", "at-the-switch"])
def test_a_resume_in_the_warm_up_or_at_the_switch_is_bit_identical(headless, pack_of, tmp_path, make_ctx, at):
    config = continued(headless, checkpoint_every_steps=2, keep_checkpoints=4)
    pretrain.run(config, {"pack": pack_of}, tmp_path / "straight", make_ctx())
    resumed = tmp_path / "resumed" / "checkpoints"
    shutil.copytree(tmp_path / "straight" / "checkpoints" / f"step-{at}", resumed / f"step-{at}")
    pretrain.run(config, {"pack": pack_of}, tmp_path / "resumed", make_ctx())
    assert same_tensors(tmp_path / "straight" / "params.safetensors", tmp_path / "resumed" / "params.safetensors")
    curve = [[(m["step"], m["loss"], m["lr"]) for m in metrics(tmp_path / d)] for d in ("straight", "resumed")]
    assert curve[0][at:] == curve[1]


def test_compiled_each_mode_is_one_graph_and_both_pass_the_canary(headless, pack_of, tmp_path, make_ctx):
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    config = continued(headless, compile=True, backend="aot_eager", canary_steps=1, head_warmup=0.5)
    out = pretrain.run(config, {"pack": pack_of}, tmp_path / "out", make_ctx())
    # fullgraph=True: a break would raise; a recompile past the declared graph count too.
    assert counters["stats"]["unique_graphs"] - before == 2 and out["steps"] == 8
    assert out["canary_diff"] < config.canary_tolerance and out["head_warmup_until"] == pytest.approx(0.5)


def test_auto_warms_a_made_head_alone_and_keeps_every_other_key(headless, tmp_path):
    with_head = tmp_path / "headed"
    bert_model(with_head, cls="BertForMaskedLM")
    made = pretrain.Config(init=str(headless), budget=pretrain.Budget(steps=8))
    assert keyed_config(pretrain, made)["head_warmup"] == AUTO_FRACTION
    for config in (
        pretrain.Config(),  # no init
        pretrain.Config(init=str(with_head), budget=pretrain.Budget(steps=8)),  # it brought its head
        pretrain.Config(init=str(headless), budget=pretrain.Budget(tokens=0)),  # a zero budget trains nothing
        pretrain.Config(init=str(headless), head_warmup=0.0),  # switched off
    ):
        assert "head_warmup" not in keyed_config(pretrain, config) and "head_lr" not in keyed_config(pretrain, config)


REFUSALS = {
    "without-init": (
        ['pretrain.init=""', "pretrain.head_warmup=0.2"],
        r"pretrain\] head_warmup: 0\.2 warms up the masked-LM head of `pretrain\.init`'s checkpoint",
    ),
    "longer-than-the-budget": (
        ["pretrain.budget.steps=0", "pretrain.budget.tokens=1000", "pretrain.head_warmup=1000"],
        r"^error: pretrain\.head_warmup: 1000 tokens is not shorter than the budget \(1000 tokens at most\)",
    ),
    "not-a-fraction-or-tokens": (
        ["pretrain.head_warmup=1.5"],
        r"pretrain\] head_warmup: 1\.5 must be a fraction of the budget in \[0, 1\), a whole number of tokens",
    ),
}


@pytest.mark.parametrize("how", list(REFUSALS))
def test_bad_warm_ups_are_refused_before_any_stage(tmp_path, monkeypatch, headless, how):
    refused_before_any_stage(tmp_path, monkeypatch, headless, *REFUSALS[how])


def refused_before_any_stage(tmp_path: Path, monkeypatch, checkpoint: Path, overrides: list[str], message: str) -> None:
    """`cram run` of the test workspace continuing `checkpoint` with `overrides`: one line matching `message`,
    exit 2, and no stage run."""
    monkeypatch.chdir(tmp_path)
    write_workspace(tmp_path)
    shutil.copytree(checkpoint, tmp_path / "ckpt")
    (tmp_path / "pipeline.toml").write_text(EAGER)
    result = cram("run", "pipeline.toml", *[a for o in overrides for a in ("--set", o)])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and re.search(message, result.output), result.output
    assert not (tmp_path / "runs").exists()


def test_a_tied_decoder_without_head_params_has_nothing_to_warm_up(headless, pack_of):
    tied = dict(head_transform=False, decoder_bias=False)
    cfg = ModelConfig(vocab_size=64, hidden=16, layers=1, heads=2, intermediate=32, max_seq_len=16, **tied)
    assert head_warmup.head_names(cfg) == ()
    from cram.stages.pretraining.continued import check_head_warmup

    with pytest.raises(StageError, match=r"head_warmup: 0\.2, but the model has no masked-LM head params of its own"):
        check_head_warmup(continued(headless, head_warmup=0.2), cfg, None)
    check_head_warmup(continued(headless, head_warmup=0.0), cfg, None)  # off: nothing to check


def test_the_warning_names_the_warm_up_and_the_results_record_where_it_ended(tmp_path, monkeypatch, headless):
    monkeypatch.chdir(tmp_path)
    write_workspace(tmp_path)
    shutil.copytree(headless, tmp_path / "ckpt")
    (tmp_path / "pipeline.toml").write_text(EAGER)
    result = cram("run", "pipeline.toml", "--set", "pretrain.budget.steps=4", "--set", "pretrain.head_warmup=0.5")
    assert result.exit_code == 0, result.output
    assert "they train alone, the encoder frozen, for pretrain.head_warmup" in result.output
    assert stages_of(tmp_path / "runs" / "base")["pretrain"]["outputs"]["head_warmup_until"] == pytest.approx(0.5)


def test_the_course_gives_the_head_its_constant_lr_then_starts_the_schedule_at_the_switch():
    from cram.stages.pretraining.loop import Course
    from cram.stages.pretraining.state import TrainState

    config = pretrain.Config(optimizer=AdamW(lr=1e-3), decay_to=0.1)
    course = Course.of(config, 1e-3, head_warmup.HeadWarmup(("head.bias",), lr=0.5, until=0.2))
    switched = TrainState(seed=0, full_start=0.2)

    def scheduled(position: float) -> float:
        return 1e-3 * model.lr_schedule(config.schedule, position, "", 0.1)

    assert course.lr(TrainState(seed=0, full_start=None), 0.1, head_alone=True) == 0.5
    assert course.lr(switched, 0.2, head_alone=False) == scheduled(0.0)
    assert course.lr(switched, 0.6, head_alone=False) == pytest.approx(scheduled(0.5))
    assert scheduled(0.5) != scheduled(0.6)  # the schedule restarts at the switch: it does not read 0.6
    assert Course.of(config, 1e-3, None).lr(TrainState(seed=0), 0.6, head_alone=False) == scheduled(0.6)
