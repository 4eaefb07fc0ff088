"""`pretrain.init_lr` and `init_optimizer`: a run that continues a checkpoint trains at most at the rate measured
for continuing one of its kind ("auto"), or at the number given; a run whose lr the cap leaves alone keeps its key,
and one it lowers trains (and is keyed) at the lower rate. It trains with AdamW, with which those rates were
measured, whatever optimizer a run from scratch takes ("auto"), or with the optimizer given. Either setting
without init is refused before any stage."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_head_warmup import continued, pack_of, refused_before_any_stage  # noqa: F401  (pack_of: a fixture)
from test_init_headless import bert_model, sentence_transformers
from test_pretrain import metrics

from cram.model import AdamW, ModelConfig, Muon, muon, optimizer_config
from cram.pipeline.planning import keyed_config
from cram.stages import pretrain
from cram.stages.pretraining.continued import continuation_lr, optimizer_kind, peak_lr
from cram.stages.pretraining.resolved import Batch, Resolved
from cram.stages.shared import pretrained

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def headless(tmp_path_factory) -> Path:
    return bert_model(tmp_path_factory.mktemp("bert") / "ckpt")


@pytest.fixture(scope="module")
def sentence(tmp_path_factory) -> Path:
    return sentence_transformers(tmp_path_factory.mktemp("st") / "minilm")


def at(lr: float, init: Path | str = "", **kw) -> pretrain.Config:
    return pretrain.Config(init=str(init), optimizer=AdamW(lr=lr), budget=pretrain.Budget(steps=8), **kw)


def peak(config: pretrain.Config) -> float:
    """The peak lr `config` trains at, asked for at its `optimizer.lr`."""
    return peak_lr(config, config.optimizer.lr)


def test_the_continuation_rate_is_by_width_for_a_masked_lm_and_lowest_for_a_sentence_encoder(headless, sentence):
    masked_lm, st = pretrained.locate(headless), pretrained.locate(sentence)
    assert not masked_lm.sentence and st.sentence
    for hidden, rate in ((16, 1.5e-3), (128, 1.5e-3), (256, 7.5e-4), (768, 2.5e-4)):
        assert continuation_lr(masked_lm, ModelConfig(hidden=hidden, heads=2)) == pytest.approx(rate)
    assert continuation_lr(st, ModelConfig(hidden=384, heads=2)) == pytest.approx(1e-4 / 3)


def test_a_cram_checkpoints_width_comes_from_its_model_json_alone(tmp_path):
    """Planning a continued run reads no weights of a cram checkpoint for its lr (a large one would be hashed)."""
    folder = tmp_path / "export"
    folder.mkdir()
    cfg = ModelConfig(vocab_size=64, hidden=256, layers=1, heads=2, intermediate=64, max_seq_len=16)
    (folder / "model.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    (folder / "params.safetensors").write_bytes(b"not read")
    assert peak(at(5e-3, folder)) == pytest.approx(7.5e-4)


def test_auto_caps_a_from_scratch_lr_and_keeps_a_lower_one(headless, sentence):
    assert peak(at(5e-3)) == 5e-3  # no init: as given
    assert peak(at(5e-3, headless)) == 1.5e-3  # the default pipeline's lr, capped
    assert peak(at(1e-4, headless)) == 1e-4  # below the cap: as given
    assert peak(at(5e-3, sentence)) == pytest.approx(1e-4 / 3)
    assert peak(at(5e-3, headless, init_lr=2e-2)) == 2e-2  # a number is the peak, above the cap too
    zero = dataclasses.replace(at(5e-3, headless), budget=pretrain.Budget(tokens=0))
    assert peak(zero) == 5e-3  # nothing trains


def test_the_key_holds_the_lr_the_run_trains_at(headless):
    def key(config: pretrain.Config) -> dict:
        return keyed_config(pretrain, config)

    assert "init_lr" not in key(at(1e-4, headless)) and key(at(1e-4, headless))["optimizer"]["lr"] == 1e-4
    capped = key(at(5e-3, headless))
    assert capped["optimizer"]["lr"] == 1.5e-3 and "init_lr" not in capped
    # The same training, whichever way it was asked for, is one key: capped, or given at the cap.
    assert key(at(1.5e-3, headless)) == capped == key(at(1e-4, headless, init_lr=1.5e-3))
    assert key(at(5e-3, headless, init_lr=2e-3))["optimizer"]["lr"] == 2e-3
    assert key(at(5e-3))["optimizer"]["lr"] == 5e-3  # a random init: as given


def test_a_continued_run_trains_and_reports_at_the_capped_peak(headless, pack_of, tmp_path, make_ctx):  # noqa: F811
    config = continued(headless, optimizer=AdamW(lr=5e-3), head_warmup=0.0)
    out = pretrain.run(config, {"pack": pack_of}, tmp_path / "out", make_ctx())
    assert out["peak_lr"] == 1.5e-3
    lrs = [m["lr"] for m in metrics(tmp_path / "out")]
    assert max(lrs) <= 1.5e-3 and max(lrs) > 1.5e-3 / 4  # the schedule runs over the capped peak


def test_a_continued_run_trains_with_adamw_unless_init_optimizer_names_another(headless):
    with_muon = Muon(lr=5e-3)
    assert optimizer_kind(pretrain.Config(optimizer=with_muon)) == "muon"  # from scratch: as given
    from_muon = pretrain.Config(init=str(headless), optimizer=with_muon, budget=pretrain.Budget(steps=8))
    assert optimizer_kind(from_muon) == "adamw"
    assert optimizer_kind(dataclasses.replace(from_muon, init_optimizer="muon")) == "muon"
    # A continued run of a config whose from-scratch optimizer is Muon is the AdamW run, key and all.
    assert keyed_config(pretrain, from_muon) == keyed_config(pretrain, at(5e-3, headless))
    chosen = keyed_config(pretrain, dataclasses.replace(from_muon, init_optimizer="muon"))
    assert chosen["optimizer"]["kind"] == "muon" and "init_optimizer" not in chosen


def test_a_continued_run_of_a_muon_config_trains_as_the_adamw_one(headless, pack_of, tmp_path, make_ctx):  # noqa: F811
    params = {}
    for kind in ("adamw", "muon"):
        config = continued(headless, optimizer=optimizer_config(kind, lr=5e-3), head_warmup=0.0)
        pretrain.run(config, {"pack": pack_of}, tmp_path / kind, make_ctx())
        params[kind] = load_file(tmp_path / kind / "params.safetensors")
    given = continued(headless, optimizer=AdamW(lr=5e-3), head_warmup=0.0, init_optimizer="muon")
    pretrain.run(given, {"pack": pack_of}, tmp_path / "given", make_ctx())
    muon_trained = load_file(tmp_path / "given" / "params.safetensors")
    hidden = [name for name in params["adamw"] if muon.takes(name)]
    assert hidden and all(torch.equal(params["adamw"][n], params["muon"][n]) for n in params["adamw"])
    assert not any(torch.equal(params["adamw"][n], muon_trained[n]) for n in hidden)


REFUSALS = {
    "without-init": (
        ['pretrain.init=""', "pretrain.init_lr=1e-4"],
        r"pretrain\] init_lr: 0\.0001 is the peak lr of continuing `pretrain\.init`'s checkpoint, and the run "
        r"has no init",
    ),
    "not-positive": (["pretrain.init_lr=0.0"], r"pretrain\] init_lr: 0\.0 must be > 0, or 'auto'"),
    "optimizer-without-init": (
        ['pretrain.init=""', "pretrain.init_optimizer='muon'"],
        r"pretrain\] init_optimizer: 'muon' is the optimizer of continuing `pretrain\.init`'s checkpoint, and the "
        r"run has no init: set pretrain\.optimizer\.kind instead",
    ),
    "unknown-optimizer": (
        ["pretrain.init_optimizer='lion'"],
        r"pretrain\] init_optimizer: 'lion': allowed auto, adamw, stable_adamw, muon",
    ),
}


@pytest.mark.parametrize("how", list(REFUSALS))
def test_bad_init_lrs_are_refused_before_any_stage(tmp_path, monkeypatch, headless, how):
    refused_before_any_stage(tmp_path, monkeypatch, headless, *REFUSALS[how])


def test_a_run_resolves_its_values_once_and_its_config_stays_as_the_file_says(headless):
    config = pretrain.Config(init=str(headless), optimizer=Muon(lr=5e-3), budget=pretrain.Budget(steps=8))
    arch = pretrained.architecture(pretrained.locate(headless))
    resolved = Resolved.of(config, Batch.given(config), arch)
    # continuing: AdamW at the capped peak, a made head warmed up at it; the file's Muon at 5e-3 untouched
    assert type(resolved.optimizer) is AdamW and resolved.peak_lr == 1.5e-3 and resolved.optimizer.kind == "adamw"
    assert resolved.made_head and resolved.warmup is not None and resolved.warmup.lr == 1.5e-3
    assert config.optimizer == Muon(lr=5e-3)
    # an fp32 table's lr below the cap is the peak; the batch is the one it was made from
    fp32 = Batch(microbatch=4, batch_size=4, lr=1e-4, by_fp32=True)
    assert Resolved.of(config, fp32, arch).peak_lr == 1e-4 and Resolved.of(config, fp32, arch).batch is fp32
    # a sentence encoder's head measured untrained: its rate
    assert Resolved.of(config, Batch.given(config), arch, untrained=True).peak_lr == pytest.approx(1e-4 / 3)
