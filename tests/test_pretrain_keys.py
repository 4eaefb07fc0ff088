"""Pretrain's key for the shipped pipelines and for runs that continue a checkpoint: the keyed config (what
`planning.plan` digests with the stage's version and the seed) pinned to the digests computed on 1f791be,
before pretrain resolved its run-time values (peak lr, optimizer) into a value of their own. A run folder or
store entry made before keeps its pretrain, and every stage below it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from safetensors.torch import save_file
from test_init_headless import bert_model, sentence_transformers

from cram import model
from cram.pipeline import config as cfg
from cram.pipeline import planning, runner

REPO = Path(__file__).resolve().parents[1]
CORPUS = ['tokenize.corpus.kind="hub"', 'tokenize.corpus.name="some/dataset"']
CONTINUED = ["pretrain.init=CKPT"]
CASES = {
    "pipeline.toml": ("pipeline.toml", []),
    "crammed-bert": ("configs/crammed-bert.toml", []),
    "adamw": ("pipeline.toml", ['pretrain.optimizer.kind="adamw"', "pretrain.optimizer.lr=5e-4"]),
    "stable_adamw": ("pipeline.toml", ['pretrain.optimizer.kind="stable_adamw"', "pretrain.optimizer.clip_norm=0"]),
    # continuing a cram checkpoint 256 wide: the from-scratch lr capped at 7.5e-4, AdamW, no head warm-up
    "continued": ("pipeline.toml", CONTINUED),
    "continued-below-cap": ("pipeline.toml", [*CONTINUED, "pretrain.optimizer.lr=1e-4"]),
    "continued-given": (
        "pipeline.toml",
        [*CONTINUED, "pretrain.init_lr=2e-4", 'pretrain.init_optimizer="muon"', "pretrain.head_warmup=0.05"],
    ),
    # a transformers BertModel (no masked-LM head): "auto" warms a made head for a tenth of the budget
    "continued-headless": ("pipeline.toml", ["pretrain.init=HEADLESS"]),
    # a sentence encoder: capped at its continuation rate
    "continued-sentence": ("pipeline.toml", ["pretrain.init=SENTENCE", "pretrain.head_warmup=0"]),
    "continued-zero-budget": ("pipeline.toml", [*CONTINUED, "pretrain.budget.hours=0"]),
}
KEYED = {
    "adamw": "bc301a9fe96f03eb55df3b78cf0895a1893ee9e8ea3bc261edc24cfb9ed6eb2e",
    "continued": "9b537b1536c1290e3b15af84ffa2a4f5aacf833c1806bfcedf1dc19aef12420c",
    "continued-below-cap": "eadf1eba8fe2646183aedc0edc868cad15a4496d6a388aff5500d1bc44f90852",
    "continued-given": "4a4ebb30133c442d48db3622ba2151fd1fd9e46d84a7d98b0bb2fabe8fac7ba2",
    "continued-headless": "5fc912cb6b9a57be2365cb24016b81d399378759fd3c3097ba2bd89aeb4c60a6",
    "continued-sentence": "9cbbe630c4a4f30fcedbcaa3279c4321d22df7d67dc837c428841a1fc2b0cab9",
    "continued-zero-budget": "0eeb36efb1d7bab33af553a72edf19ecaa8ec7eaf4930bbb88c461f94f88eaa6",
    "crammed-bert": "d921fb84348ab075a41e91f37ac5d55ee3952f4732f726a5802b94515601cd8c",
    "pipeline.toml": "7bc458dd75eb75fc4c37c1796b34ded2a39f81c681f362fa86aa693527750919",
    "stable_adamw": "047a9888fd859573a03e2af55d530262f910560a66564f015e37e2ad6fbe8b08",
}


def _checkpoint(folder: Path) -> Path:
    """A cram checkpoint 256 wide (model.json and params.safetensors)."""
    arch = model.ModelConfig(
        vocab_size=64, hidden=256, layers=1, heads=2, intermediate=64, max_seq_len=128, head_transform=True
    )
    params = model.init(arch, seed=0)
    folder.mkdir()
    (folder / "model.json").write_text(json.dumps(dataclasses.asdict(arch)))
    save_file(params, str(folder / "params.safetensors"))
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("init")
    return {
        "CKPT": str(_checkpoint(root / "ckpt")),
        "HEADLESS": str(bert_model(root / "headless")),
        "SENTENCE": str(sentence_transformers(root / "sentence")),
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_pretrains_key_is_that_of_before_its_values_were_resolved(case, checkpoints, tmp_path):
    path, overrides = CASES[case]
    for name, folder in checkpoints.items():
        overrides = [o.replace(f"={name}", f'="{folder}"') for o in overrides]
    specs = runner.default_stages()
    conf = cfg.load(REPO / path, runner.config_classes(specs), [*CORPUS, *overrides, f'run.root="{tmp_path}"'])
    (spec,) = [s for s in specs if s.NAME == "pretrain"]
    keyed = planning.keyed_config(spec, spec.config_in(conf))
    assert cfg.digest({"version": spec.VERSION, "config": keyed, "seed": 0}) == KEYED[case], keyed
