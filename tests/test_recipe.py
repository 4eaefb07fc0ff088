"""configs/crammed-bert.toml: cramming's recipe where cram offers the option, and every deviation stated
with its reason."""

from __future__ import annotations

from pathlib import Path

from cram.pipeline import config as cfg
from cram.stages import ORDER, load

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "crammed-bert.toml"


def recipe():
    return cfg.load(RECIPE, {name: load(name).Config for name in ORDER}).stages


def test_the_recipe_uses_crammings_options():
    stages = recipe()
    assert stages["pack"].boundary == "sep" and stages["pack"].seq_len == 128
    assert stages["tokenize"].vocab_size == 32768 and stages["tokenize"].lowercase
    pretrain = stages["pretrain"]
    assert (pretrain.batch_size, pretrain.ramp, pretrain.budget.hours, pretrain.masking.rate) == (8192, 0.6, 24.0, 0.25)
    assert pretrain.budget.steps is None and pretrain.budget.tokens is None
    optimizer = pretrain.optimizer
    assert (optimizer.lr, optimizer.betas, optimizer.eps, optimizer.weight_decay, optimizer.clip_norm) == (
        1e-3,
        (0.9, 0.98),
        1e-12,
        0.01,
        0.5,
    )
    evaluate = stages["evaluate"]
    assert (evaluate.dropout, evaluate.head_width, evaluate.epochs, evaluate.batch_size, evaluate.lr) == (
        0.1,
        1024,
        5,
        16,
        4e-5,
    )
    assert {t.name for t in evaluate.tasks} == {"cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte"}


def test_the_recipe_states_each_deviation_and_why():
    text = RECIPE.read_text(encoding="utf-8")
    deviations = text[text.index("# Where it deviates, and why:") : text.index("[run]")]
    for topic in ("tokenizer:", "corpus:", "precision:", "budget clock:"):
        assert f"# - {topic}" in deviations, topic
