"""The classifier head a run continuing a checkpoint fine-tunes with by default (`evaluate.head = "auto"`): its
family's, so that the default path ends in a folder transformers serves, predicting as `cram predict` does;
cramming's from scratch, keyed as before `head` existed; cramming's where the user sets it, with the dry run
naming what an export would need."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from retrieval_sets import write_beir
from test_bad_inputs import cram
from test_export_parity import FIRSTS, SECONDS, assert_same, cram_rows
from test_init_headless import headless, sentence_transformers, ws  # noqa: F401 (fixtures)

from cram.pipeline import config as pipeline_config
from cram.pipeline import planning, runner

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

PAIR_TASK = (
    '[{kind="custom", name="two", path="pairs", text_fields=["a", "b"], label_field="label", metrics=["accuracy"]}]'
)
WORDS = "the a cat dog sat ran on under mat rug sun rain".split()


def pair_task(folder: Path) -> None:
    """A custom pair task: train.csv and test.csv with fields a, b and label (no test row a training row)."""
    folder.mkdir()
    for split, n, size in (("train", 24, 2), ("test", 8, 3)):
        words = [" ".join(WORDS[(i * step + k) % 12] for k in range(size)) for i in range(n) for step in (1, 3)]
        rows = [f"{words[2 * i]},{words[2 * i + 1]},{'yes' if i % 2 else 'no'}" for i in range(n)]
        (folder / f"{split}.csv").write_text("a,b,label\n" + "\n".join(rows) + "\n")


def evaluate_of(config: Path, *sets: str):
    return pipeline_config.load(config, runner.config_classes(runner.default_stages()), list(sets)).stages["evaluate"]


def evaluate_key(root: Path, *sets: str) -> str:
    modules = runner.default_stages()
    overrides = [f'run.root="{root}"', *sets]
    conf = pipeline_config.load(Path("pipeline.toml"), runner.config_classes(modules), overrides)
    return next(step.key for step in planning.plan(conf, modules, root / "x") if step.name == "evaluate")


@pytest.mark.slow
def test_a_default_run_from_a_headless_bert_exports_a_classifier_that_predicts_as_cram_does(ws, tmp_path):  # noqa: F811
    pair_task(ws / "pairs")
    task = ["--set", f"evaluate.tasks={PAIR_TASK}"]
    assert cram("run", "pipeline.toml", *task).exit_code == 0
    exported = cram("export", "runs/base", "--task", "two", "--to", "hf", "--format", "transformers")
    assert exported.exit_code == 0, exported.output
    assert cram("export", "runs/base", "--task", "two", "--to", "mine").exit_code == 0
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"a": a, "b": b}) + "\n" for a, b in zip(FIRSTS, SECONDS)))
    classify = transformers.pipeline("text-classification", model=str(ws / "hf"), device="cpu")
    theirs = classify([{"text": a, "text_pair": b} for a, b in zip(FIRSTS, SECONDS)], top_k=None, truncation=True)
    assert_same(theirs, cram_rows(ws / "mine", texts, tmp_path))

    dry = cram("run", "pipeline.toml", *task, "--dry-run", "--force", "evaluate")
    assert dry.exit_code == 0, dry.output
    expected = "head \"bert\" (pretrain.init's family's, which `cram export --format transformers` writes as BERT's"
    assert expected in dry.output.splitlines()[-1], dry.output


def test_cramming_s_head_set_with_init_is_kept_and_the_dry_run_names_what_an_export_needs(ws):  # noqa: F811
    result = cram("run", "pipeline.toml", "--set", 'evaluate.head="cramming"', "--dry-run")
    assert result.exit_code == 0, result.output
    line = result.output.splitlines()[-1]
    assert re.search(
        r"head \"cramming\" \(evaluate\.head's; an export to transformers' BERT classifier needs "
        r"evaluate\.head_width=0 \(the hidden size 16, not 1024\)\)$",
        line,
    ), line


def test_the_dry_run_names_no_classifier_head_where_no_task_takes_one(ws):  # noqa: F811
    beir = write_beir(ws / "beir", train_qrels=True)
    task = f'evaluate.tasks=[{{kind="retrieval", name="r", path="{beir}", batch_size=8}}]'
    result = cram("run", "pipeline.toml", "--set", task, "--dry-run")
    assert result.exit_code == 0, result.output
    line = result.output.splitlines()[-1]
    assert "fine-tunes r " in line and "head" not in line, line


def test_auto_resolves_per_start_and_only_a_continued_checkpoint_s_key_moves(ws, tmp_path):  # noqa: F811
    toml = ws / "pipeline.toml"
    assert (evaluate_of(toml).head, evaluate_of(toml).pooling) == ("bert", "first")
    assert evaluate_of(toml, 'evaluate.head="cramming"').head == "cramming"
    assert evaluate_of(toml, 'pretrain.init=""').head == "cramming"  # from scratch: cramming's, as before
    continued, cramming = evaluate_key(tmp_path), evaluate_key(tmp_path, 'evaluate.head="cramming"')
    assert continued != cramming  # its fine-tune changed
    scratch = ['pretrain.init=""']
    assert evaluate_key(tmp_path, *scratch) == evaluate_key(tmp_path, *scratch, 'evaluate.head="cramming"')

    # A sentence encoder's mean pooling is BERT's classifier's no more: the family's head reads [CLS].
    st = sentence_transformers(tmp_path / "st")
    (tmp_path / "st.toml").write_text(f'[pretrain]\ninit = "{st}"\n')
    assert (evaluate_of(tmp_path / "st.toml").head, evaluate_of(tmp_path / "st.toml").pooling) == ("bert", "first")
    chosen = evaluate_of(tmp_path / "st.toml", 'evaluate.head="cramming"')
    assert (chosen.head, chosen.pooling) == ("cramming", "mean")
