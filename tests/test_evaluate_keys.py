"""The evaluate and baseline stages' keys: a run folder or store entry made before task kinds became plug-ins
(stages/evaluating/kinds.py) must resume with no stage re-run, so the keyed config of each kind of task and the
fingerprint of the files it reads are pinned to the digests computed on 5e92fb3 (the commit before kinds), but
where a setting changed since (`KEYED`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cram.pipeline import config as cfg
from cram.pipeline import planning, runner

CASES = {
    "default": "",
    "glue": """[evaluate]
epochs = 3
lr = 2e-5
head = "cramming"
[[evaluate.tasks]]
kind = "glue"
name = "sst2"
path = "glue"
[[evaluate.tasks]]
kind = "glue"
name = "mrpc"
seeds = 2
""",
    "custom": """[evaluate]
keep = "all"
[[evaluate.tasks]]
kind = "custom"
name = "sent"
path = "data/sent"
text_fields = ["text"]
label_field = "y"
metrics = ["accuracy", "f1"]
max_length = 96
[[evaluate.tasks]]
kind = "custom"
name = "sim"
path = "data/sim"
text_fields = ["a", "b"]
metrics = ["spearman", "pearson"]
""",
    "topics": """[evaluate]
mlm_lengths = [64, 128]
[[evaluate.tasks]]
name = "topic"
test_fraction = 0.3
seeds = 2
lr = 1e-3
""",
    "beir": """[evaluate]
[[evaluate.tasks]]
kind = "retrieval"
name = "scifact"
path = "beir"
[[evaluate.tasks]]
kind = "retrieval"
name = "nf"
path = "beir"
pairs = "pairs.jsonl"
query_max_length = 24
batch_size = 16
pooling = "first"
epochs = 1
""",
    "heldout-retrieval": """[evaluate]
[[evaluate.tasks]]
kind = "heldout-retrieval"
name = "retrieval"
test_fraction = 0.25
epochs = 1
seeds = 3
lr = 5e-4
max_length = 64
query_max_length = 32
[[evaluate.tasks]]
kind = "heldout-topic"
name = "topic"
""",
    "baseline": """[pretrain]
init = "ckpt"
[evaluate]
baseline = "init"
[[evaluate.tasks]]
kind = "retrieval"
name = "scifact"
path = "beir"
batch_size = 8
[[evaluate.tasks]]
kind = "custom"
name = "sent"
path = "data/sent"
text_fields = ["text"]
metrics = ["accuracy"]
""",
}

# The digests of 5e92fb3's keyed configs ({"version", "config", "seed"}, as `planning.plan` digests them), but
# the default's: its retrieval task's lr moved from 5e-4 to 3e-3 (bench/README.md, "retrieval lr"), so a
# default run's evaluate runs again, as any change of its settings makes it; and the two with BEIR tasks that
# set no epochs, seeds or lr: they take the retrieval kind's own (`BEIR_DEFAULTS`), no longer the stage's.
KEYED = {
    "default/evaluate": "1ac812fb37d71400035b36f6ce0845254a9dfa0b024b596d85607d7a81f547fa",
    "glue/evaluate": "c45f883da08ec52db7ebb6cd7c879d05da0cfbe25d624817537706c4e91cbb77",
    "custom/evaluate": "656da98dc080e70f4b6c7dded5386c8c7cc3714881620fe3b4877f73ce3effdb",
    "topics/evaluate": "328711d78b76d6df7e3d7138b7bc4bb39ff2aab8b89040a4a61c48704a1d3f71",
    "beir/evaluate": "f321486b060974cf46c50f1e263982f9c39e258d713180045c894d6b493d0b59",
    "heldout-retrieval/evaluate": "4c095df783f6b53d41f4b2ef821219d00cde2e9744d35610d114d17b8aa31fed",
    "baseline/baseline": "07468f1c99ea6f667512375680cff14c341cb82a6bc4e9cd9ecc622c7aecda0b",
    "baseline/evaluate": "e242991968ed756864dc661fb65223f313eeea51d0707fea9bca89666dda2d00",
}
# The digests of 5e92fb3's fingerprints of the tasks' files (`FILES`, relative paths, fixed times).
FINGERPRINTS = {
    "glue/evaluate": "3f1b9a09d97f02abe5c244914d41ec0ee4f9013fd73ac92f412bc978d3ac1bb5",
    "custom/evaluate": "940085273ac00e5f52cba77a0a666439ffb86bcd6d82b320b57a64aeb7f6bd22",
    "beir/evaluate": "4396f3f62c675c88e1fe837187a41ef3c5df524f95cbbb540c7f0d5401301ae9",
    "baseline/baseline": "ac1ea2bda412a4b983bd8accaef587956823889920bafa231bb08296946f42e1",
    "baseline/evaluate": "7deb5e6a7f931d5fd994a84410271829b58556a5e583307bb8769d7e5a622c14",
    "topics/evaluate": "4f53cda18c2baa0c0354bb5f9a3ecbe5ed12ab4d8e11ba873c2f11161202b945",
}
FILES = {
    "beir/corpus.jsonl": "c",
    "beir/queries.jsonl": "qq",
    "beir/qrels/test.tsv": "ttt",
    "pairs.jsonl": "pppp",  # outside the BEIR folder: fingerprinted apart
    "beir/pairs.jsonl": "in",
    "data/sent/train.csv": "tr",
    "data/sent/test.csv": "te",
    "glue/SST-2/train.tsv": "x",
}


def _configs(case: str) -> dict:
    """The evaluate and baseline stages' configs that `case`'s TOML makes (baseline: where it runs)."""
    specs = runner.default_stages()
    pipeline = cfg.parse(CASES[case], runner.config_classes(specs), case)
    scoring = [s for s in specs if s.NAME in ("evaluate", "baseline")]
    return {s.NAME: (s, config) for s in scoring if (config := s.config_in(pipeline)) is not None}


@pytest.mark.parametrize("pinned", sorted(KEYED))
def test_a_stage_keys_each_kind_of_task_as_5e92fb3_did(pinned):
    case, stage = pinned.split("/")
    spec, config = _configs(case)[stage]
    keyed = planning.keyed_config(spec, config)
    assert cfg.digest({"version": spec.VERSION, "config": keyed, "seed": 0}) == KEYED[pinned], keyed


@pytest.mark.parametrize("pinned", sorted(FINGERPRINTS))
def test_the_files_a_task_reads_are_fingerprinted_as_5e92fb3_did(pinned, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for i, (path, text) in enumerate(sorted(FILES.items())):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
        os.utime(path, ns=(1_700_000_000_000_000_000 + i,) * 2)
    case, stage = pinned.split("/")
    spec, config = _configs(case)[stage]
    found = spec.fingerprint(config)
    assert cfg.digest(found) == FINGERPRINTS[pinned], found


def _evaluate_key(toml: str, monkeypatch) -> str:
    monkeypatch.setitem(CASES, "toml", toml)
    spec, config = _configs("toml")["evaluate"]
    return cfg.digest({"version": spec.VERSION, "config": planning.keyed_config(spec, config), "seed": 0})


@pytest.mark.parametrize(
    "added, same",
    [
        ("ignore_identical_ids = true\nnegatives_per_pair = 1\n", True),  # the defaults, written out
        ("ignore_identical_ids = false\n", False),
        ('hard_negatives = "mined"\nnegatives_per_pair = 3\n', False),
    ],
)
def test_a_retrieval_setting_at_its_default_leaves_the_key_and_moves_it_otherwise(added, same, monkeypatch):
    # each added to the case's last task (the TOML's last table)
    assert (_evaluate_key(CASES["beir"] + added, monkeypatch) == KEYED["beir/evaluate"]) is same
    mined = _evaluate_key(CASES["beir"] + 'hard_negatives = "mined"\n', monkeypatch)
    assert mined != _evaluate_key(CASES["beir"] + 'hard_negatives = "mined"\nnegatives_per_pair = 3\n', monkeypatch)
