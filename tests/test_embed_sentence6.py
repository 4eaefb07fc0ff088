"""A folder that sentence-transformers 6 saves itself (its own module class paths in modules.json,
`"pooling_mode": "mean"` in the Pooling module's config.json, the length in tokenizer_config.json) is read
by `cram embed`, which embeds as its `encode` does (1e-4), and by `[pretrain] init`, which keeps its
pooling. The model is a small random BertModel saved locally: nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_init_headless import bert_model

from cram.pipeline import config as pipeline_config
from cram.pipeline import errors, runner
from cram.pipeline.commands.embed import embed
from cram.stages.kept.embedding import Request
from cram.stages.kept.fast_tokenizer import post_processor
from cram.stages.kept.predicting import Settings
from cram.stages.shared import pretrained

sentence_transformers = pytest.importorskip("sentence_transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

LENGTH = 24  # under the model's 32 positions
TEXTS = ["The cat sat on the mat.", "a", " ".join(["the quick brown fox jumps over the lazy dog"] * 5), "dog and cat"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    """A small random BertModel whose tokenizer.json wraps a text in [CLS] ... [SEP], as BERT's does."""
    from tokenizers import Tokenizer

    folder = bert_model(tmp_path_factory.mktemp("bert") / "bert")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    special = {role: tokenizer.token_to_id(f"[{role.upper()}]") for role in ("cls", "sep")}
    tokenizer.post_processor = post_processor(special, {role: f"[{role.upper()}]" for role in special})
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def saved(bert: Path, folder: Path, mode: str, **settings: object) -> sentence_transformers.SentenceTransformer:
    """A SentenceTransformer of BERT, `mode` pooling and normalisation, saved by sentence-transformers to
    FOLDER; `settings`: its prompts, default_prompt_name, the Pooling module's include_prompt."""
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(str(bert), max_seq_length=LENGTH)
    include = {"include_prompt": settings.pop("include_prompt")} if "include_prompt" in settings else {}
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode=mode, **include)
    modules = [transformer, pooling, Normalize()]
    model = sentence_transformers.SentenceTransformer(modules=modules, device="cpu", **settings)
    model.save(str(folder))
    return model


@pytest.mark.parametrize("mode, pooling", [("mean", "mean"), ("cls", "first")])
def test_cram_embeds_a_folder_sentence_transformers_6_saved_as_its_encode_does(tmp_path, bert, mode, pooling):
    folder = tmp_path / "st6"
    model = saved(bert, folder, mode)
    types = [m["type"] for m in json.loads((folder / "modules.json").read_text())]
    assert not any(t.startswith("sentence_transformers.models.") for t in types), types  # 6's own spelling
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode"] == mode

    lines = tmp_path / "texts.txt"
    lines.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "v.npy"
    settings = Settings(compile=False, batch_size=2)
    assert embed(folder, [lines], out, request=Request(precision="fp32"), settings=settings).rows == len(TEXTS)
    ours = np.load(out)
    theirs = model.encode(TEXTS, batch_size=2)
    assert ours.shape == theirs.shape and np.abs(ours - theirs).max() < 1e-4
    loaded = sentence_transformers.SentenceTransformer(str(folder), device="cpu")  # what it saved, read back
    assert np.abs(theirs - loaded.encode(TEXTS, batch_size=2)).max() < 1e-6
    assert pretrained.locate(folder).pooling == pooling


PROMPTS = {"query": "query: ", "passage": "passage: "}


@pytest.mark.parametrize("default", ["query", None])
def test_cram_embed_puts_the_folders_prompt_before_each_text_as_encode_does(tmp_path, bert, default):
    folder = tmp_path / "prompts"
    model = saved(bert, folder, "mean", prompts=PROMPTS, default_prompt_name=default)
    lines = tmp_path / "texts.txt"
    lines.write_text("\n".join(TEXTS) + "\n")
    for name in (None, "passage"):
        out = tmp_path / f"{name}.npy"
        request = Request(prompt=name, precision="fp32")
        embed(folder, [lines], out, request=request, settings=Settings(compile=False, batch_size=2))
        theirs = model.encode(TEXTS, batch_size=2, prompt_name=name)
        assert np.abs(np.load(out) - theirs).max() < 1e-4, name
    plain = model.encode(TEXTS, batch_size=2, prompt="")
    assert (np.abs(np.load(tmp_path / "None.npy") - plain).max() < 1e-6) == (default is None)


def test_a_prompt_the_folder_lacks_or_pools_without_is_refused_naming_it(tmp_path, bert):
    lines = tmp_path / "texts.txt"
    lines.write_text("a text\n")
    settings = Settings(compile=False)
    saved(bert, tmp_path / "p", "mean", prompts=PROMPTS)
    with pytest.raises(errors.CramError, match=r"--prompt doc: .* has the prompts .*passage, query"):
        embed(tmp_path / "p", [lines], tmp_path / "v.npy", request=Request(prompt="doc"), settings=settings)
    saved(bert, tmp_path / "left", "mean", prompts=PROMPTS, default_prompt_name="query", include_prompt=False)
    with pytest.raises(errors.CramError, match=r"include_prompt false"):
        embed(tmp_path / "left", [lines], tmp_path / "v.npy", settings=settings)
    assert not (tmp_path / "v.npy").exists()


def test_pretrain_init_of_a_sentence_transformers_6_folder_keeps_its_pooling(tmp_path, bert):
    folder = tmp_path / "st6"
    saved(bert, folder, "mean")
    found = pretrained.locate(folder)
    assert found.sentence and found.pooling == "mean" and found.modules == ("Transformer", "Pooling", "Normalize")
    cfg, params = pretrained.load(found)
    assert cfg.hidden == 16 and cfg.layers == 1
    (tmp_path / "p.toml").write_text(f'[pretrain]\ninit = "{folder}"\n')
    classes = runner.config_classes(runner.default_stages())
    # cramming's head reads the pooling it is given (BERT's reads [CLS] alone: tests/test_init_head.py)
    config = pipeline_config.load(tmp_path / "p.toml", classes, ['evaluate.head="cramming"'])
    assert config.stages["evaluate"].pooling == "mean"


@pytest.mark.parametrize("mode, pooling", [("cls", "first"), ("mean", None), ("lasttoken", None)])
def test_a_retrieval_task_without_a_pooling_takes_the_init_folders_own(tmp_path, bert, mode, pooling):
    folder = tmp_path / "st6"
    saved(bert, folder, mode)
    (tmp_path / "p.toml").write_text(f'[pretrain]\ninit = "{folder}"\n')
    classes = runner.config_classes(runner.default_stages())
    tasks = pipeline_config.load(tmp_path / "p.toml", classes).stages["evaluate"].tasks
    retrieval = [t for t in tasks if t.kind == "heldout-retrieval"]
    assert retrieval and all(t.pooling == pooling for t in retrieval)  # None: mean, the key as before
    assert all(t.pooling is None for t in tasks if t.kind == "heldout-topic")
    own = ['evaluate.tasks=[{kind="heldout-retrieval", name="r", pooling="mean"}]']
    chosen = pipeline_config.load(tmp_path / "p.toml", classes, own)
    assert chosen.stages["evaluate"].tasks[0].pooling == "mean"  # a task's own pooling stays


@pytest.mark.parametrize(
    "settings, pooling",
    [
        ({"pooling_mode": "mean"}, "mean"),
        ({"pooling_mode": ["cls"]}, "first"),
        ({"pooling_mode": "lasttoken"}, None),
        ({"pooling_mode": ["mean", "max"]}, None),
        ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "mean"),
        ({"pooling_mode_cls_token": True}, "first"),
        ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, None),
        ({"pooling_mode_mean_tokens": False}, None),
        ([], None),
    ],
)
def test_both_spellings_of_a_pooling_read_as_one(settings, pooling):
    assert pretrained.sentence_pooling(settings) == pooling
