"""`tokenize.task_text`: the evaluate tasks' training text as pretraining documents (task-adaptive
pretraining), alone or beside the corpus; never a test row's text; the training files in the key, and
the key of a config without the option unchanged."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from cram.pipeline import config as cfg
from cram.pipeline import planning, runner
from cram.stages import StageError, evaluate, tokenize
from cram.stages.data import tasktext
from cram.stages.data.source import CorpusConfig
from cram.stages.finetuning.kind import topic_gap

TRAIN_WORD = "zephyrine"  # only in the task's training rows
TEST_WORD = "quillamorph"  # only in the task's test rows
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "do", "fi"]


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n))


def write_corpus(path: Path, n: int = 120) -> list[str]:
    rng = random.Random(0)
    texts = [words(rng, 30) + "." for _ in range(n)]
    path.write_text("".join(json.dumps({"title": f"Doc {i}", "body": t}) + "\n" for i, t in enumerate(texts)))
    return texts


def write_task(folder: Path, n_train: int = 40, n_test: int = 12) -> list[str]:
    """A custom task; every training row says TRAIN_WORD, every test row TEST_WORD (many times, so that a
    tokenizer trained on test text would surely make a piece of it). Returns the training texts."""
    rng = random.Random(1)
    folder.mkdir(parents=True, exist_ok=True)
    train = [f"{TRAIN_WORD} {words(rng, 12)}." for _ in range(n_train)]
    test = [f"{TEST_WORD} " * 10 + words(rng, 12) + "." for _ in range(n_test)]
    for name, texts in (("train", train), ("test", test)):
        rows = [{"text": t, "label": ["pos", "neg"][i % 2]} for i, t in enumerate(texts)]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return train


def custom(path: Path, **kw) -> evaluate.TaskConfig:
    return evaluate.TaskConfig(
        kind="custom", name="t", path=str(path), text_fields=("text",), metrics=("accuracy",), **kw
    )


def linked(task_text: str, tasks: list, corpus_path: Path | None = None) -> tokenize.Config:
    corpus = CorpusConfig(kind="files", paths=(str(corpus_path),), format="jsonl", text_field="body", label_field="")
    config = tokenize.Config(corpus=corpus, vocab_size=200, heldout_fraction=0.2, task_text=task_text, num_proc=1)
    return config.linked({"evaluate": evaluate.Config(tasks=tasks)})


def decoded(out: Path, outputs: dict) -> tuple[list[str], list[str], list[str]]:
    """(the decoded training documents, the held-out texts, the tokenizer's pieces)."""
    import datasets
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(out / outputs["tokenizer"]))
    tokens = datasets.load_from_disk(str(out / outputs["tokens"]))
    held = list(datasets.load_from_disk(str(out / outputs["heldout"]))["text"]) if outputs["heldout"] else []
    return [sp.decode(ids) for ids in tokens["input_ids"]], held, [sp.id_to_piece(i) for i in range(len(sp))]


def run(config: tokenize.Config, tmp_path: Path, make_ctx) -> tuple[Path, dict]:
    out = tmp_path / "out"
    out.mkdir()
    return out, tokenize.run(config, {}, out, make_ctx())


def test_only_the_training_rows_reach_the_tokens_and_no_test_row_does(tmp_path, make_ctx):
    train = write_task(tmp_path / "task")
    config = linked("only", [custom(tmp_path / "task")], tmp_path / "absent.jsonl")
    tokenize.validate(config, SimpleNamespace(stages={"evaluate": evaluate.Config(tasks=[custom(tmp_path / "task")])}))
    out, outputs = run(config, tmp_path, make_ctx)
    documents, held, pieces = decoded(out, outputs)
    assert documents == train  # every training row, in order, and nothing else: no corpus is read
    assert outputs["documents"] == outputs["task_documents"] == len(train) and outputs["heldout"] is None
    assert not any(TEST_WORD in text for text in documents + held)
    assert not any("quill" in piece or "morph" in piece for piece in pieces)


def test_add_pretrains_on_both_and_holds_out_only_corpus_documents(tmp_path, make_ctx):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    train = write_task(tmp_path / "task")
    out, outputs = run(linked("add", [custom(tmp_path / "task")], tmp_path / "corpus.jsonl"), tmp_path, make_ctx)
    documents, held, _ = decoded(out, outputs)
    kept = [t for i, t in enumerate(corpus) if not tokenize.is_heldout(f"Doc {i}", t, 0.2)]
    assert documents == kept + train
    assert held == [t for t in corpus if t not in kept] and held
    assert outputs["task_documents"] == len(train) and outputs["documents"] == len(kept) + len(train)
    assert not any(TEST_WORD in text for text in documents + held)


def write_token_task(folder: Path) -> list[str]:
    """A CoNLL token task whose training sentences say TRAIN_WORD and whose test sentences TEST_WORD; returns
    the training sentences as task text reads them (their words joined by spaces)."""
    rng = random.Random(2)
    folder.mkdir(parents=True, exist_ok=True)
    train = [[TRAIN_WORD, *words(rng, 6).split(), "Paris"] for _ in range(30)]
    test = [[TEST_WORD] * 10 + ["Rome"] for _ in range(8)]
    for name, sentences in (("train", train), ("test", test)):
        lines = ["\n".join(f"{w}\t{'B-LOC' if w in ('Paris', 'Rome') else 'O'}" for w in s) for s in sentences]
        (folder / f"{name}.conll").write_text("\n\n".join(lines) + "\n")
    return [" ".join(s) for s in train]


def test_a_token_task_gives_its_training_sentences_words_and_no_test_sentence(tmp_path, make_ctx):
    train = write_token_task(tmp_path / "ner")
    task = evaluate.TaskConfig(kind="token-classification", name="ner", path=str(tmp_path / "ner"))
    config = linked("only", [task], tmp_path / "absent.jsonl")
    tokenize.validate(config, SimpleNamespace(stages={"evaluate": evaluate.Config(tasks=[task])}))
    assert [f.name for f in tasktext.train_files(config.task_files[0])] == ["train.conll"]
    out, outputs = run(config, tmp_path, make_ctx)
    documents, held, pieces = decoded(out, outputs)
    assert documents == train and outputs["task_documents"] == len(train)
    assert not any(TEST_WORD in text for text in documents) and not any("quill" in piece for piece in pieces)


def test_a_token_task_without_a_training_file_is_refused_naming_its_entry(tmp_path):
    (tmp_path / "ner").mkdir()
    (tmp_path / "ner" / "test.conll").write_text("Rome\tB-LOC\n")
    task = evaluate.TaskConfig(kind="token-classification", name="ner", path=str(tmp_path / "ner"))
    config = linked("add", [task], tmp_path / "absent.jsonl")
    with pytest.raises(StageError, match=r"evaluate.tasks\[0\].path: .* has no train file"):
        tasktext.check(config.task_files, "add", evaluate.Config(tasks=[task]))


def test_a_pair_is_one_document_and_a_local_glue_task_reads_train_tsv_only(tmp_path):
    mrpc = tmp_path / "glue" / "MRPC"
    mrpc.mkdir(parents=True)
    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    (mrpc / "train.tsv").write_text(header + "1\t1\t2\tA cat sat.\tThe cat sat.\n0\t3\t4\tRain fell.\tSun shone.\n")
    (mrpc / "dev.tsv").write_text(header + f"1\t5\t6\t{TEST_WORD}.\tA {TEST_WORD}.\n")
    task = evaluate.TaskConfig(kind="glue", name="mrpc", path=str(tmp_path / "glue"))
    (files,) = tasktext.of_tasks([task])
    batches = list(tasktext.documents(files, 1000, 1 << 20, {"documents_cut": 0}))
    assert [b["text"] for b in batches] == [["A cat sat.\nThe cat sat.", "Rain fell.\nSun shone."]]
    assert tasktext.train_files(files) == [mrpc / "train.tsv"]


PIPELINE = """
[run]
root = "{root}"

[tokenize]
{option}

[tokenize.corpus]
kind = "files"
paths = ["{corpus}"]
format = "jsonl"
text_field = "body"

[[evaluate.tasks]]
kind = "custom"
name = "t"
path = "{task}"
text_fields = ["text"]
metrics = ["accuracy"]
"""


def keys(tmp_path: Path, option: str = "") -> dict[str, str]:
    modules = runner.default_stages()
    text = PIPELINE.format(root=tmp_path / "runs", option=option, corpus=tmp_path / "corpus.jsonl", task=tmp_path / "t")
    conf = cfg.parse(text, runner.config_classes(modules))
    return {step.name: step.key for step in planning.plan(conf, modules, tmp_path / "runs" / "x")}


def test_the_task_s_training_file_is_in_the_key_and_its_test_file_is_not(tmp_path):
    write_corpus(tmp_path / "corpus.jsonl")
    write_task(tmp_path / "t")
    before = keys(tmp_path, 'task_text = "add"')
    with open(tmp_path / "t" / "test.jsonl", "a") as f:
        f.write(json.dumps({"text": "another test row", "label": "pos"}) + "\n")
    assert keys(tmp_path, 'task_text = "add"')["tokenize"] == before["tokenize"]
    with open(tmp_path / "t" / "train.jsonl", "a") as f:
        f.write(json.dumps({"text": "another training row", "label": "pos"}) + "\n")
    assert keys(tmp_path, 'task_text = "add"')["tokenize"] != before["tokenize"]
    assert keys(tmp_path, 'task_text = "only"')["tokenize"] != keys(tmp_path, 'task_text = "add"')["tokenize"]


def test_the_default_key_is_the_one_without_the_option(tmp_path):
    write_corpus(tmp_path / "corpus.jsonl")
    write_task(tmp_path / "t")
    assert keys(tmp_path, 'task_text = "none"') == keys(tmp_path)
    default = planning.keyed_config(tokenize, linked("none", [custom(tmp_path / "t")], tmp_path / "corpus.jsonl"))
    assert "task_text" not in default and "task_files" not in default
    assert tokenize.fingerprint(linked("none", [custom(tmp_path / "t")], tmp_path / "corpus.jsonl")) == (
        tokenize.fingerprint(linked("none", [], tmp_path / "corpus.jsonl"))
    )


def test_only_keys_no_corpus_and_a_saved_config_reads_back_alike(tmp_path):
    write_task(tmp_path / "t")
    one = linked("only", [custom(tmp_path / "t")], tmp_path / "a.jsonl")
    other = linked("only", [custom(tmp_path / "t")], tmp_path / "b.jsonl")
    assert planning.keyed_config(tokenize, one) == planning.keyed_config(tokenize, other)
    assert tokenize.fingerprint(one) == tokenize.fingerprint(other)
    modules = runner.default_stages()
    text = PIPELINE.format(root=tmp_path, option='task_text = "add"', corpus=tmp_path / "c.jsonl", task=tmp_path / "t")
    conf = cfg.parse(text, runner.config_classes(modules))
    again = cfg.parse(cfg.to_toml(conf.to_dict()), runner.config_classes(modules))
    assert again.stages["tokenize"] == conf.stages["tokenize"] and len(conf.stages["tokenize"].task_files) == 1


def test_only_leaves_the_topic_task_nothing_to_classify():
    assert "task_text" in topic_gap(tokenize.Config(task_text="only"))


@pytest.mark.parametrize(
    "evaluate_config, expected",
    [
        (evaluate.Config(), "its tasks are of kind heldout-retrieval, heldout-topic, without a training file"),
        (evaluate.Config(tasks=[]), "evaluate.tasks is empty"),
        (None, "no evaluate stage"),
        (evaluate.Config(tasks=[evaluate.TaskConfig(kind="glue", name="sst2")]), "evaluate.tasks[0] (GLUE sst2)"),
    ],
)
def test_task_text_without_a_training_file_names_the_key(evaluate_config, expected):
    sections = {} if evaluate_config is None else {"evaluate": evaluate_config}
    config = tokenize.Config(task_text="add").linked(sections)
    with pytest.raises(StageError, match="^tokenize.task_text: ") as e:
        tokenize.validate(config, SimpleNamespace(stages=sections))
    assert expected in str(e.value)


def test_a_test_set_that_shares_rows_with_training_or_is_its_file_is_refused(tmp_path):
    from cram.stages.finetuning.finetune import load_task

    write_task(tmp_path / "t")
    train = (tmp_path / "t" / "train.jsonl").read_text().splitlines(keepends=True)
    with open(tmp_path / "t" / "test.jsonl", "a") as f:
        f.writelines(train[:3])
    with pytest.raises(StageError, match=r"^evaluate.tasks\[0\].path: 3 of the 15 rows of test.jsonl"):
        load_task(custom(tmp_path / "t"), 0, None)
    (tmp_path / "t" / "test.jsonl").unlink()
    (tmp_path / "t" / "test.jsonl").symlink_to(tmp_path / "t" / "train.jsonl")
    with pytest.raises(StageError, match=r"^evaluate.tasks\[0\].path: train.jsonl and test.jsonl are the same file"):
        load_task(custom(tmp_path / "t"), 0, None)


def test_the_example_config_parses_and_checks_out_up_to_the_missing_checkpoint(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cram.pipeline.commands import cli

    config = Path(__file__).resolve().parents[1] / "configs" / "adapt-classifier.toml"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "domain").mkdir(parents=True)
    write_corpus(tmp_path / "data" / "domain" / "a.jsonl")
    (tmp_path / "data" / "domain" / "a.jsonl").write_text(
        (tmp_path / "data" / "domain" / "a.jsonl").read_text().replace('"body"', '"text"')
    )
    write_task(tmp_path / "data" / "my-task")
    conf = cfg.load(config, runner.config_classes(runner.default_stages()))
    (task,) = conf.stages["tokenize"].task_files
    assert (task.kind, task.path, task.text_fields, conf.stages["tokenize"].task_text) == (
        "custom",
        "data/my-task",
        ("text",),
        "add",
    )
    result = CliRunner().invoke(cli.app, ["run", str(config), "--dry-run"], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: pretrain.init: ") and "models/ModernBERT-base" in result.output


def test_only_over_training_rows_all_blank_is_refused_before_any_stage_naming_the_file(tmp_path):
    write_task(tmp_path / "task")
    train = tmp_path / "task" / "train.jsonl"
    train.write_text("".join(json.dumps({"text": blank, "label": "pos"}) + "\n" for blank in ("", "  ", "\t\n")))
    tasks = [custom(tmp_path / "task")]
    sections = {"evaluate": evaluate.Config(tasks=tasks)}
    with pytest.raises(StageError) as refused:
        tokenize.validate(linked("only", tasks), SimpleNamespace(stages=sections))
    assert str(refused.value).startswith('tokenize.task_text: "only" pretrains on the tasks\' training rows alone')
    assert f"every text in {train} is blank" in str(refused.value)
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    tokenize.validate(linked("add", tasks, corpus), SimpleNamespace(stages=sections))  # the corpus has text
    train.write_text(train.read_text() + json.dumps({"text": "a word", "label": "neg"}) + "\n")
    tokenize.validate(linked("only", tasks), SimpleNamespace(stages=sections))
