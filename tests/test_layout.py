"""The package as installed and the stage store's keys: one `cram` namespace in site-packages, and cache
keys that do not depend on where a module lives (a runs root made by an earlier layout is reused)."""

import importlib.metadata
import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from cram.pipeline import config as cfg
from cram.pipeline import planning, runner

REPO = Path(__file__).resolve().parents[1]
SHADOWING = {"model", "pipeline", "stages"}

# Keys main computed (f162271) before `stages/` was regrouped and installed under `cram`, for each shipped
# pipeline with these overrides (a hub corpus, so no file fingerprint enters the key).
OVERRIDES = [
    'tokenize.corpus.kind="hub"',
    'tokenize.corpus.name="some/dataset"',
    "tokenize.vocab_size=512",
    "pretrain.optimizer.lr=5e-4",
    "pretrain.log_every_steps=7",
]
KEYS_BEFORE = {
    "pipeline.toml": {
        "tokenize": "b475f7bb577833966e2d85d06a2720ffdf272495e3c7885c04a8f1bd27caa9dd",
        "pack": "7335af0efd8ebd91dc863cf72d898e5fd033e4d98ef34c667d38f15ce574b944",
        "pretrain": "16dc41a4a817b90e3f176f81a9e59f7ce0dcc9577e031ff7f5525aaec591cd08",
        "evaluate": "1237533d5205cb95eba038deb312ecdb728f12c199fe95231e926cf5645879c7",  # VERSION 6: eager dropout
    },
    "configs/crammed-bert.toml": {
        "tokenize": "154fd62bd903288e2df5e42bd339223bafa2b3bd56cc21cf73541362b311bc0e",
        "pack": "b4fc1bfcf7e5e3da333cf3d89fac0993ff4fdde6d9016cd1bc3d8ae570fcc265",
        "pretrain": "82fa9734343fea6dd25c307e14c753970b49e478eac9511cfaddeaede070d16e",
        "evaluate": "bf95c6bfa9f7b6fd339c15c6f9694ccc0d99f0a2b38773acbd00d206b93c3086",  # VERSION 6: eager dropout
    },
}


# What each file has changed since, set back: the keys of the settings it had then must not move.
SINCE = {
    "pipeline.toml": [
        "pretrain.masking.rate=0.25",
        "pretrain.document_attention=false",
        "evaluate.mlm_mask_rate=0",
        "evaluate.mlm_lengths=[]",
        "pretrain.batch_size=32",
        "pretrain.microbatch=32",
        "evaluate.compile=true",
        'evaluate.backend="aot_eager"',
        # issue 45: the held-out retrieval task joined the topic task
        'evaluate.tasks=[{kind="heldout-topic", name="topic", epochs=2, seeds=3, lr=1e-3, max_length=64}]',
        # issue 46: Muon (OVERRIDES sets the lr), and another batch and lr where the step trains in fp32
        'pretrain.optimizer.kind="adamw"',
        "pretrain.fp32={}",
    ],
    "configs/crammed-bert.toml": [],
}


@pytest.mark.parametrize("config", sorted(KEYS_BEFORE))
def test_cache_keys_are_those_of_the_layout_before(config, tmp_path):
    modules = runner.default_stages()
    overrides = [*OVERRIDES, *SINCE[config], f'run.root="{tmp_path}"']
    conf = cfg.load(REPO / config, runner.config_classes(modules), overrides)
    keys = {step.name: step.key for step in planning.plan(conf, modules, tmp_path / "x")}
    assert {name: keys[name] for name in KEYS_BEFORE[config]} == KEYS_BEFORE[config]


def _top_level(paths: list[str]) -> set[str]:
    """The importable names that `paths` (files relative to site-packages) put at the top level."""
    names = set()
    for path in paths:
        first = Path(path).parts[0]
        if ".dist-info" in first or first == "__pycache__":
            continue
        names.add(first.removesuffix(".py"))
    return names


def test_the_installed_distribution_has_one_top_level_package():
    # From site-packages: the working directory may hold the source tree's own cram.egg-info.
    site_packages = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (dist,) = importlib.metadata.distributions(name="cram", path=site_packages)
    assert not _top_level([str(f) for f in dist.files or []]) & SHADOWING
    assert (dist.read_text("top_level.txt") or "cram").split() == ["cram"]
    # An editable install maps packages to folders through a finder: every name it maps is under cram.
    finders = [f for f in dist.files or [] if str(f).endswith("_finder.py")]
    for finder in finders:
        text = Path(finder.locate()).read_text()
        mapping = json.loads(text.split("MAPPING: dict[str, str] = ")[1].split("\n")[0].replace("'", '"'))
        assert mapping and all(name.startswith("cram.") for name in mapping)


@pytest.mark.slow
def test_a_built_wheel_installs_only_cram(tmp_path):
    source = tmp_path / "source"  # a copy: a build writes build/ and *.egg-info into the tree it builds
    for folder in ("model", "pipeline", "stages"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("cram-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert _top_level(names) == {"cram"}
    for module in (
        "cram/model/bert.py",
        "cram/pipeline/commands/cli.py",
        "cram/stages/pretrain.py",
        "cram/stages/pretraining/loop.py",
        "cram/stages/shared/masking.py",
    ):
        assert module in names


# A tokenizer.json written out by hand (a WordLevel vocabulary), so its hash, and the keys, are fixed.
TOKENIZER_JSON = (
    '{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,'
    '"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,"model":{"type":"WordLevel",'
    '"vocab":{"[UNK]":0,"[CLS]":1,"[SEP]":2,"[PAD]":3,"[MASK]":4,"a":5},"unk_token":"[UNK]"}}'
)
# The keys main computed (2a7587c) for pipeline.toml with that tokenizer given and a hub corpus, before
# the tokenizer-training fields were left out of the key beside a given tokenizer.
KEYS_WITH_A_GIVEN_TOKENIZER = {
    "tokenize": "bbeb4b457f72e66a7140fb20b86236a5886cb584db89fe28dde67a8d05766f5d",
    "pack": "ed75cbb50cf63e449e991760ac0ef398a045d88ab9b657b6ab547e202ad025fb",
}


@pytest.mark.parametrize("training", [[], ["tokenize.vocab_size=512", "tokenize.model_type='unigram'"]])
def test_a_given_tokenizers_keys_are_those_of_before_whatever_the_training_fields(training, tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(TOKENIZER_JSON)
    modules = runner.default_stages()
    corpus = ['tokenize.corpus.kind="hub"', 'tokenize.corpus.name="some/dataset"']
    overrides = [*corpus, *training, f'tokenize.tokenizer="{tmp_path / "tok"}"', f'run.root="{tmp_path}"']
    conf = cfg.load(REPO / "pipeline.toml", runner.config_classes(modules), overrides)
    keys = {step.name: step.key for step in planning.plan(conf, modules, tmp_path / "x")}
    assert {name: keys[name] for name in KEYS_WITH_A_GIVEN_TOKENIZER} == KEYS_WITH_A_GIVEN_TOKENIZER
