"""The optimizers as kinds (model/optimizers.py): a config class a kind, registered under the `kind` the TOML
names; the TOML, the key and the state layout as they were; a bad kind refused naming the key and the kinds."""

from __future__ import annotations

import dataclasses

import pytest

from cram import model
from cram.model import OPTIMIZERS, AdamW, Muon, OptimizerConfig, StableAdamW, muon, optimizer_config
from cram.pipeline import config as cfg
from cram.pipeline import runner

SMALL = model.ModelConfig(vocab_size=64, hidden=32, layers=2, heads=2, intermediate=64, max_seq_len=16)


def test_each_kind_is_one_registered_class_whose_kind_is_its_name():
    assert OPTIMIZERS == {"adamw": AdamW, "stable_adamw": StableAdamW, "muon": Muon}
    for kind, cls in OPTIMIZERS.items():
        made = optimizer_config(kind, lr=2e-3)
        assert type(made) is cls and made.kind == kind and made.lr == 2e-3
    # what each runs, as the update reads it
    assert [(c.orthogonalises_hidden, c.clips_rate, c.fuses_in_place) for c in OPTIMIZERS.values()] == [
        (False, False, True),
        (False, True, False),
        (True, False, False),
    ]


def test_a_bad_kind_and_the_shared_base_are_refused_naming_what_is_allowed():
    with pytest.raises(ValueError, match="optimizer.kind='lion': allowed adamw, stable_adamw, muon"):
        optimizer_config("lion")
    with pytest.raises(TypeError, match="OptimizerConfig: not a registered optimizer; make one of adamw"):
        OptimizerConfig()
    with pytest.raises(ValueError, match="optimizer.lr=0"):
        Muon(lr=0)


def test_the_settings_are_shared_and_carry_across_kinds():
    adamw = AdamW(lr=5e-3, clip_norm=0.0)
    muon = adamw.as_kind("muon", lr=1e-3)
    assert type(muon) is Muon and (muon.lr, muon.clip_norm, muon.betas) == (1e-3, 0.0, adamw.betas)
    assert dataclasses.replace(muon, lr=2e-3) == Muon(lr=2e-3, clip_norm=0.0)  # replace keeps the kind
    # the key's and config.toml's plain form: the same fields, `kind` among them, whichever class
    assert cfg.as_plain(muon) == {**cfg.as_plain(adamw), "lr": 1e-3, "kind": "muon"}


def _pretrain(text: str, source: str = "p.toml"):
    conf = cfg.parse(text, runner.config_classes(runner.default_stages()), source)
    return conf.stages["pretrain"]


def test_the_toml_names_the_kind_and_a_run_folders_config_reads_back_as_it_was():
    assert _pretrain("").optimizer == AdamW()
    read = _pretrain('[pretrain.optimizer]\nkind = "muon"\nlr = 7e-3\n')
    assert read.optimizer == Muon(lr=7e-3)
    assert _pretrain('[pretrain.optimizer]\nkind = "stable_adamw"\nclip_norm = 0\n').optimizer == StableAdamW(
        clip_norm=0.0
    )
    again = _pretrain(cfg.to_toml({"pretrain": cfg.as_plain(read)}))
    assert again.optimizer == read.optimizer and type(again.optimizer) is Muon


@pytest.mark.parametrize(
    "table, message",
    [
        ('kind = "lion"', "p.toml: [pretrain.optimizer] optimizer.kind='lion': allowed adamw, stable_adamw, muon"),
        ('kind = "muon"\nmomentum = 0.9', "p.toml: [pretrain.optimizer] unknown key 'momentum'"),
        ("kind = 3", "p.toml: [pretrain.optimizer] optimizer.kind=3: allowed adamw, stable_adamw, muon"),
    ],
)
def test_a_bad_optimizer_table_is_refused_naming_the_key(table, message):
    with pytest.raises(cfg.ConfigError) as e:
        _pretrain(f"[pretrain.optimizer]\n{table}\n")
    assert message in str(e.value)


def test_each_kind_starts_from_the_state_layout_it_reads():
    params = model.init(SMALL, seed=0)
    full = {"step", *(f"{m}.{n}" for n in params for m in ("exp_avg", "exp_avg_sq"))}
    assert set(model.optimizer_init(AdamW(), params)) == set(model.optimizer_init(StableAdamW(), params)) == full
    hidden = {f"exp_avg_sq.{n}" for n in params if muon.takes(n)}
    assert hidden and set(model.optimizer_init(Muon(), params)) == full - hidden
