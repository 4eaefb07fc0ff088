"""A BEIR task (`kind = "retrieval"`) takes the retrieval kind's own epochs, seeds, lr and document length where
neither it nor [evaluate] sets them, not the stage's GLUE rules; its documents as long as the buckets and the
model's positions allow, up to BEIR_MAX_LENGTH. Read as `cram` reads a pipeline.toml: the config holds what runs."""

from __future__ import annotations

from dataclasses import astuple

import pytest
from test_evaluate_keys import _evaluate_key as evaluate_key

from cram.pipeline import config as cfg
from cram.pipeline import runner
from cram.stages.evaluating.config import Config
from cram.stages.retrieval import kind as retrieval_kind
from cram.stages.retrieval.settings import BEIR_DEFAULTS, BEIR_MAX_LENGTH

BEIR = '[[evaluate.tasks]]\nkind = "retrieval"\nname = "scifact"\npath = "beir"\n'
TOPIC = '[[evaluate.tasks]]\nkind = "heldout-topic"\nname = "topic"\n'
HELDOUT = '[[evaluate.tasks]]\nkind = "heldout-retrieval"\nname = "retrieval"\n'


def settings(toml: str) -> dict:
    """Each task's (epochs, seeds, lr, max_length) as the evaluate stage runs them, by name."""
    specs = runner.default_stages()
    pipeline = cfg.parse(toml, runner.config_classes(specs), "pipeline.toml")
    config = pipeline.stages["evaluate"]
    return {t.name: astuple(config.task_settings(t)) for t in config.tasks}


def test_a_beir_task_takes_the_kinds_defaults_and_the_other_kinds_the_stages():
    found = settings("[evaluate]\n" + BEIR + TOPIC + HELDOUT)
    stage = Config()
    # the default buckets end at 128: the documents are cut there, not refused
    assert found["scifact"] == (BEIR_DEFAULTS["epochs"], BEIR_DEFAULTS["seeds"], BEIR_DEFAULTS["lr"], 128)
    assert found["topic"] == found["retrieval"] == (stage.epochs, stage.seeds, stage.lr, stage.max_length)
    assert (stage.epochs, stage.seeds) != (BEIR_DEFAULTS["epochs"], BEIR_DEFAULTS["seeds"])


@pytest.mark.parametrize(
    "buckets, positions, expected",
    [
        ("[32, 64, 128, 256, 512]", 512, BEIR_MAX_LENGTH),  # the longest bucket within BEIR_MAX_LENGTH
        ("[32, 64, 200, 300]", 512, 200),
        ("[32, 64, 128, 256]", 100, 64),  # a model from scratch has pack's positions
    ],
)
def test_its_documents_are_as_long_as_the_buckets_and_the_models_positions_allow(buckets, positions, expected):
    found = settings(f"[pack]\nseq_len = {positions}\n[evaluate]\nbuckets = {buckets}\n" + BEIR)
    assert found["scifact"][3] == expected


def test_its_own_settings_and_the_ones_evaluate_sets_win_over_the_kinds():
    own = settings("[evaluate]\n" + BEIR + "epochs = 4\nlr = 1e-4\nmax_length = 64\n")
    assert own["scifact"] == (4, BEIR_DEFAULTS["seeds"], 1e-4, 64)
    stage = settings("[evaluate]\nseeds = 1\nmax_length = 96\n" + BEIR)
    assert stage["scifact"] == (BEIR_DEFAULTS["epochs"], 1, BEIR_DEFAULTS["lr"], 96)


def test_the_kinds_defaults_are_in_the_stage_key_so_a_change_of_them_runs_the_task_again(monkeypatch):
    before = evaluate_key("[evaluate]\n" + BEIR, monkeypatch)
    monkeypatch.setattr(retrieval_kind, "BEIR_DEFAULTS", {**BEIR_DEFAULTS, "lr": BEIR_DEFAULTS["lr"] * 2})
    assert evaluate_key("[evaluate]\n" + BEIR, monkeypatch) != before
