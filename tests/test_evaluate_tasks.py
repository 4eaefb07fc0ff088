"""Fine-tuning tasks and metrics (stages/finetuning/tasks.py, metrics.py): hand-computed scores, both
local GLUE layouts, custom CSV/JSON-lines tasks, the held-out topics, and the errors bad input gets."""

import json
import re

import numpy as np
import pytest

from cram.stages import StageError
from cram.stages.evaluate import Config, TaskConfig
from cram.stages.finetuning import metrics, tasks

# ----------------------------------------------------------------------------------------- metrics


def test_accuracy_and_binary_f1_by_hand():
    pred, gold = np.array([1, 1, 0, 1, 0]), np.array([1, 0, 0, 1, 1])
    assert metrics.accuracy(pred, gold) == pytest.approx(3 / 5)
    # TP = 2, FP = 1, FN = 1: F1 = 2TP / (2TP + FP + FN) = 4/6
    assert metrics.f1(pred, gold) == pytest.approx(4 / 6)
    assert metrics.f1(np.zeros(3, int), np.zeros(3, int)) == 0.0  # no positive anywhere


def test_macro_f1_by_hand():
    pred, gold = np.array([0, 0, 0, 1, 2]), np.array([0, 0, 1, 1, 1])
    # class 0: TP 2, FP 1 -> 0.8; class 1: TP 1, FN 2 -> 0.5; class 2: FP 1 -> 0
    assert metrics.macro_f1(pred, gold) == pytest.approx((0.8 + 0.5 + 0.0) / 3)


def test_matthews_by_hand():
    pred, gold = np.array([1, 1, 0, 1, 0, 0]), np.array([1, 0, 0, 1, 1, 0])
    # TP 2, TN 2, FP 1, FN 1: (4 - 1) / sqrt(3 * 3 * 3 * 3)
    assert metrics.matthews(pred, gold) == pytest.approx(1 / 3)
    # three classes: correct 5 of 6, true counts (2, 2, 2), predicted (2, 1, 3):
    # (5*6 - 12) / sqrt((36 - 14) * (36 - 12))
    three = metrics.matthews(np.array([0, 0, 1, 2, 2, 2]), np.array([0, 0, 1, 1, 2, 2]))
    assert three == pytest.approx(18 / np.sqrt(22 * 24))
    assert metrics.matthews(np.ones(4, int), np.array([0, 1, 0, 1])) == 0.0  # constant prediction


def test_pearson_spearman_and_tied_ranks_by_hand():
    x, y = np.array([1.0, 2, 3, 4]), np.array([2.0, 4, 5, 9])
    assert metrics.pearson(x, y) == pytest.approx(11 / np.sqrt(5 * 26))
    assert metrics.pearson(np.ones(4), y) == 0.0
    np.testing.assert_array_equal(metrics.rank(np.array([3.0, 1, 3, 2])), [3.5, 1, 3.5, 2])
    # ranks (1, 2.5, 2.5, 4) and (1, 3, 2, 4): 4.5 / sqrt(4.5 * 5)
    spearman = metrics.spearman(np.array([1.0, 2, 2, 3]), np.array([1.0, 3, 2, 4]))
    assert spearman == pytest.approx(4.5 / np.sqrt(4.5 * 5))


def test_glue_average_counts_mnli_twice_and_uses_main_scores():
    scores = {
        "cola/test": {"matthews": 0.4},
        "mnli/matched": {"accuracy": 0.8},
        "mnli/mismatched": {"accuracy": 0.7},
        "mrpc/test": {"f1": 0.9, "accuracy": 0.1},
        "stsb/test": {"spearman": 0.6, "pearson": 0.0},
    }
    assert tasks.glue_average(scores) == pytest.approx((0.4 + 0.8 + 0.7 + 0.9 + 0.6) / 5)


def test_majority_baseline_predicts_the_commonest_training_class():
    train = tasks.Examples([("a",)] * 3, np.array([1, 1, 0]))
    test = tasks.Examples([("b",)] * 4, np.array([0, 1, 1, 1]))
    task = tasks.Task("t", ("accuracy", "f1", "matthews"), ("no", "yes"), train, {"test": test})
    assert tasks.majority_baseline(task, test) == {"accuracy": 0.75, "f1": pytest.approx(6 / 7), "matthews": 0.0}
    regression = tasks.Task(
        "r",
        ("pearson",),
        (),
        tasks.Examples([("a",)] * 2, np.array([1.0, 3.0])),
        {"test": tasks.Examples([("b",)] * 2, np.array([0.0, 5.0]))},
    )
    assert tasks.majority_baseline(regression, regression.tests["test"]) == {"pearson": 0.0}


# ------------------------------------------------------------------------------- GLUE, both layouts

# Rows of each fixture task, in the hub's columns; the TSV writer turns them into GLUE's layout.
ROWS = {
    "cola": {
        "train": [("The cat sat .", 1), ('He said "hi" to .', 0), ("Dogs bark loudly .", 1)],
        "validation": [("Sat the cat .", 0), ("Birds sing .", 1)],
    },
    "mrpc": {
        "train": [("A b c .", "A b c !", 1), ("One thing .", "Another thing .", 0)],
        "validation": [("It rains .", "Rain falls .", 1)],
    },
    "stsb": {
        "train": [("A man runs .", "A man is running .", 4.5), ("A dog .", "A car .", 0.25)],
        "validation": [("Kids play .", "Children play .", 4.0), ("A cat .", "The sea .", 0.5)],
    },
    "mnli": {
        "train": [("P one .", "H one .", 0), ("P two .", "H two .", 2), ("P three .", "H three .", 1)],
        "validation_matched": [("P m .", "H m .", 1)],
        "validation_mismatched": [("P mm .", "H mm .", 2)],
    },
}
TSV_FILES = {
    "train": "train.tsv",
    "validation": "dev.tsv",
    "validation_matched": "dev_matched.tsv",
    "validation_mismatched": "dev_mismatched.tsv",
}


def write_glue_tsv(root, name):
    """The task's rows in the original GLUE download's layout, under root/<GLUE folder name>/."""
    spec = tasks.GLUE[name]
    folder = root / spec.tsv_dir
    folder.mkdir(parents=True)
    for split, rows in ROWS[name].items():
        if name == "cola":  # no header: source, label, original mark, sentence
            lines = [f"gj04\t{label}\t\t{text}" for text, label in rows]
        else:  # the label column first, as in MRPC (the loader finds columns by name)
            lines = ["\t".join([spec.tsv_label, "id", *spec.tsv_text])]
            for i, (*texts, label) in enumerate(rows):
                value = spec.labels[label] if name == "mnli" else label  # MNLI writes label names
                lines.append("\t".join([str(value), str(i), *texts]))
        text = "\n".join(lines) + "\n"
        # MRPC's files start with a byte-order mark, as GLUE's download writes them
        (folder / TSV_FILES[split]).write_text(text, encoding="utf-8-sig" if name == "mrpc" else "utf-8")
    return folder


def write_glue_saved(root, name):
    """The task as `datasets.load_dataset("nyu-mll/glue", name).save_to_disk(root / name)` leaves it."""
    import datasets

    spec = tasks.GLUE[name]
    splits = {}
    for split, rows in ROWS[name].items():
        columns = list(zip(*rows))
        data = {c: list(v) for c, v in zip(spec.hf_text, columns[:-1])}
        data.update(label=list(columns[-1]), idx=list(range(len(rows))))
        splits[split] = datasets.Dataset.from_dict(data)
    datasets.DatasetDict(splits).save_to_disk(str(root / name))
    return root / name


@pytest.mark.parametrize("name", list(ROWS))
def test_both_local_layouts_load_the_same_examples(tmp_path, name):
    write_glue_tsv(tmp_path / "tsv", name)
    tsv = tasks.load_glue(name, str(tmp_path / "tsv"), "t")
    saved = tasks.load_glue(name, str(write_glue_saved(tmp_path / "hf", name)), "t")
    assert tsv.metrics == saved.metrics == tasks.GLUE[name].metrics
    assert set(tsv.tests) == set(saved.tests) == {t for t, _, _ in tasks.GLUE[name].tests}
    for left, right in [(tsv.train, saved.train)] + [(tsv.tests[t], saved.tests[t]) for t in tsv.tests]:
        assert left.texts == right.texts
        np.testing.assert_array_equal(left.labels, right.labels)
    assert tsv.train.texts[0] == tuple(ROWS[name]["train"][0][:-1])
    assert tsv.regression == (name == "stsb")


@pytest.mark.parametrize("write", [write_glue_tsv, write_glue_saved])
def test_glue_regression_targets_that_are_one_value_are_refused(tmp_path, monkeypatch, write):
    constant = {**ROWS["stsb"], "validation": [("Kids play .", "Children play .", 4.0)] * 2}
    monkeypatch.setitem(ROWS, "stsb", constant)
    folder = write(tmp_path, "stsb")
    with pytest.raises(StageError, match=r"GLUE stsb's label holds one value only \(4\); a correlation with a const"):
        tasks.load_glue("stsb", str(folder), "t")


def test_tsv_keeps_quotes_and_a_task_folder_works_directly(tmp_path):
    folder = write_glue_tsv(tmp_path, "cola")
    task = tasks.load_glue("cola", str(folder), "t")
    assert task.train.texts[1] == ('He said "hi" to .',)
    np.testing.assert_array_equal(task.train.labels, [1, 0, 1])


def test_missing_glue_data_names_what_was_expected(tmp_path):
    with pytest.raises(StageError, match=r"tasks\[0\]\.path: .* holds no GLUE rte data; expected train.tsv"):
        tasks.load_glue("rte", str(tmp_path), "tasks[0]")
    folder = write_glue_tsv(tmp_path, "mrpc")
    (folder / "dev.tsv").unlink()
    with pytest.raises(StageError, match="dev.tsv: missing"):
        tasks.load_glue("mrpc", str(tmp_path), "t")
    with pytest.raises(StageError, match="unknown GLUE task 'sst-2'"):
        tasks.load_glue("sst-2", str(tmp_path), "t")


def test_glue_label_column_missing_or_unknown_label(tmp_path):
    folder = tmp_path / "RTE"
    folder.mkdir()
    (folder / "train.tsv").write_text("index\tsentence1\tsentence2\tgold\n0\ta\tb\tentailment\n")
    with pytest.raises(StageError, match="train.tsv: no column 'label'"):
        tasks.load_glue("rte", str(tmp_path), "t")
    (folder / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n")
    (folder / "dev.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n")
    with pytest.raises(StageError, match="label 'maybe' is not one of entailment, not_entailment"):
        tasks.load_glue("rte", str(tmp_path), "t")


def test_glue_from_the_hub_offline_is_a_clear_error(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(StageError, match="could not be loaded from the hub .*set path to a local GLUE directory"):
        tasks.load_glue("sst2", "", "t")


# ------------------------------------------------------------------------------------ custom tasks


def test_custom_csv_and_jsonl_tasks(tmp_path):
    csv_dir = tmp_path / "csv"
    csv_dir.mkdir()
    (csv_dir / "train.csv").write_text('q,a,label\n"x, y",b,pos\nc,d,neg\ne,f,pos\n')
    (csv_dir / "dev.csv").write_text("q,a,label\ng,h,neg\n")
    task = tasks.load_custom("pairs", str(csv_dir), ("q", "a"), "label", ("f1", "accuracy"), "t")
    assert task.label_names == ("neg", "pos") and task.train.texts[0] == ("x, y", "b")
    np.testing.assert_array_equal(task.train.labels, [1, 0, 1])
    np.testing.assert_array_equal(task.tests["test"].labels, [0])

    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()
    records = [{"text": "a", "score": 1}, {"text": "b", "score": 2.5}]
    (jsonl / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (jsonl / "test.jsonl").write_text(json.dumps({"text": "c", "score": 0.5}) + "\n" + '{"text": "d", "score": 2}\n')
    regression = tasks.load_custom("scores", str(jsonl), ("text",), "score", ("spearman",), "t")
    assert regression.regression and regression.num_outputs == 1
    np.testing.assert_array_equal(regression.train.labels, np.array([1.0, 2.5], dtype=np.float32))


def test_custom_task_bad_input(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "a", "label": 10}\n{"text": "b", "label": 2}\n')
    with pytest.raises(StageError) as refused:
        tasks.load_custom("c", str(tmp_path), ("text",), "label", ("accuracy",), "t")
    assert str(refused.value) == f"t.path: {tmp_path} has no test|dev|validation.csv or .jsonl"
    (tmp_path / "test.jsonl").write_text('{"text": "c", "label": 3}\n')
    with pytest.raises(StageError, match="label '3' of field 'label' never occurs in train.jsonl"):
        tasks.load_custom("c", str(tmp_path), ("text",), "label", ("accuracy",), "t")
    with pytest.raises(StageError, match="train.jsonl:1: record 1 has no field 'topic'"):
        tasks.load_custom("c", str(tmp_path), ("text",), "topic", ("accuracy",), "t")
    with pytest.raises(StageError, match="is not a directory"):
        tasks.load_custom("c", str(tmp_path / "nope"), ("text",), "label", ("accuracy",), "t")
    # numeric labels order numerically: 2 before 10
    (tmp_path / "test.jsonl").write_text('{"text": "c", "label": 10}\n')
    assert tasks.load_custom("c", str(tmp_path), ("text",), "label", ("accuracy",), "t").label_names == ("2", "10")


@pytest.mark.parametrize(
    "text, shown",
    [("12345", "int 12345"), ('{"a": 1}', "dict {'a': 1}"), ('["a", "b"]', "list ['a', 'b']"), ('"\\ud83d"', "")],
)
def test_a_custom_text_that_is_no_text_is_refused_naming_file_and_line(tmp_path, text, shown):
    (tmp_path / "train.jsonl").write_text(f'{{"text": "a b", "label": 0}}\n{{"text": {text}, "label": 1}}\n')
    (tmp_path / "test.jsonl").write_text('{"text": "c", "label": 0}\n')
    with pytest.raises(StageError) as refused:
        tasks.load_custom("c", str(tmp_path), ("text",), "label", ("accuracy",), "t")
    why = f"text field 'text' holds {shown}, not text" if shown else "lone surrogate \\ud83d at character 0"
    assert str(refused.value).startswith(f"{tmp_path / 'train.jsonl'}:2: record 2: ") and why in str(refused.value)


def test_custom_files_with_a_byte_order_mark_or_an_upper_case_extension_load(tmp_path):
    (tmp_path / "train.JSONL").write_text('\ufeff{"text": "a", "label": "x"}\n{"text": "b", "label": "y"}\n')
    (tmp_path / "test.CSV").write_text('\ufefftext,label\n"c, d",x\n')
    task = tasks.load_custom("c", str(tmp_path), ("text",), "label", ("accuracy",), "t")
    assert task.train.texts == [("a",), ("b",)] and task.tests["test"].texts == [("c, d",)]


# -------------------------------------------------------------------------------- held-out topics


def test_topics_leave_out_unlabelled_and_split_deterministically(tmp_path):
    import datasets

    rows = [(f"text {i}", f"title {i}", ["Art", "Science", "", "Uncategorized"][i % 4]) for i in range(40)]
    columns = {"text": [r[0] for r in rows], "title": [r[1] for r in rows], "label": [r[2] for r in rows]}
    datasets.Dataset.from_dict(columns).save_to_disk(str(tmp_path / "a"))
    reversed_columns = {k: v[::-1] for k, v in columns.items()}
    datasets.Dataset.from_dict(reversed_columns).save_to_disk(str(tmp_path / "b"))
    task = tasks.load_topics("topic", tmp_path / "a", 0.2)
    again = tasks.load_topics("topic", tmp_path / "b", 0.2)
    assert task.label_names == ("Art", "Science") and task.metrics == ("accuracy", "macro_f1")
    assert len(task.train.texts) == 16 and len(task.tests["test"].texts) == 4  # 2 per topic of 10
    assert set(task.tests["test"].labels) == {0, 1}
    assert sorted(task.tests["test"].texts) == sorted(again.tests["test"].texts)  # row order does not matter


# ---------------------------------------------------------------------------------- config checks


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="glue", name="wnli"), "name: 'wnli' is no GLUE task"),
        (dict(kind="custom", name="c", path="x", text_fields=("t",), metrics=("auc",)), "unknown metric 'auc'"),
        (dict(kind="custom", name="c", path="x", text_fields=("t",), metrics=("accuracy", "pearson")), "mixes"),
        (dict(kind="custom", name="c", path="x", metrics=("accuracy",)), "text_fields"),
        (dict(kind="glue", name="cola", metrics=("accuracy",)), "only a custom task"),
        (dict(test_fraction=1.0), "test_fraction"),
        (dict(kind="ner", name="n"), r"tasks\[0\]\.kind: 'ner' is no kind of task; choose one of heldout-topic, glue"),
        (dict(kind="custom", name="c", path="x", text_fields=("t",), metrics=("f1",), pooling="mean"), "only a retr"),
        (dict(kind="heldout-retrieval", name="r", label_field="y"), "label_field: only a classification task"),
    ],
)
def test_task_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Config(tasks=[TaskConfig(**kwargs)])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(buckets=(64, 32)), "buckets"),
        (dict(max_length=256), "max_length"),
        (dict(tasks=[TaskConfig(), TaskConfig()]), "the name 'topic' is used twice"),
        (dict(seeds=0), "seeds"),
    ],
)
def test_stage_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Config(**kwargs)


def test_the_helpers_values_are_the_configs_own_a_tasks_settings_its_own_where_it_sets_them():
    config = Config(
        epochs=4, seeds=2, lr=3e-5, max_length=96, batch_size=8, head_width=0, mlm_seed=7, mlm_lengths=(64,)
    )
    task = TaskConfig(epochs=1, max_length=32)
    settings = config.task_settings(task)
    assert (settings.epochs, settings.seeds, settings.lr, settings.max_length) == (1, 2, 3e-5, 32)
    assert config.task_settings(TaskConfig(seeds=9)).seeds == 9
    tuning = config.tuning()
    assert (tuning.lr, tuning.batch_size, tuning.head_width, tuning.buckets) == (3e-5, 8, 0, (32, 64, 128))
    mlm = config.mlm_settings()
    assert (mlm.seed, mlm.lengths, mlm.batch_size, mlm.corruption) == (7, (64,), 128, "pretrain")


@pytest.mark.parametrize(
    "train, metric, message",
    [
        ('{"text": "a", "y": 0.5}\n{"text": "b", "y": 1}\n', "accuracy", "label 0.5 of field 'y' is not a class"),
        ('{"text": "a", "y": true}\n{"text": "b", "y": 1}\n', "accuracy", "label True of field 'y' is not a class"),
        ('{"text": "a", "y": [1]}\n{"text": "b", "y": 1}\n', "accuracy", "label [1] of field 'y' is not a class"),
        ("".join(f'{{"text": "t{i}", "y": "{i}.5"}}\n' for i in range(5)), "accuracy", "holds 5 classes in 5 examples"),
        (
            '{"text": "a", "y": NaN}\n{"text": "b", "y": 1}\n',
            "pearson",
            "label nan of field 'y' is not a finite number",
        ),
        ('{"text": "a", "y": "inf"}\n{"text": "b", "y": 1}\n', "pearson", "label 'inf' of field 'y' is not a finite"),
        ('{"text": "a", "y": 1e300}\n{"text": "b", "y": 1}\n', "pearson", "label 1e+300 of field 'y' is not a finite"),
        ('{"text": "a", "y": true}\n{"text": "b", "y": 1}\n', "pearson", "label True of field 'y' is not a finite"),
        ('{"text": "a", "y": 2}\n{"text": "b", "y": 2.0}\n', "spearman", "field 'y' of task 'c' holds one value"),
    ],
)
def test_custom_labels_are_what_their_metrics_claim(tmp_path, train, metric, message):
    (tmp_path / "train.jsonl").write_text(train)
    (tmp_path / "test.jsonl").write_text('{"text": "c", "y": 1}\n{"text": "d", "y": 0}\n')
    with pytest.raises(StageError, match=re.escape(message)):
        tasks.load_custom("c", str(tmp_path), ("text",), "y", (metric,), "t")


def test_integer_and_string_classes_and_varied_targets_load(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "a", "y": 1}\n{"text": "b", "y": "two"}\n{"text": "c", "y": 1}\n')
    (tmp_path / "test.jsonl").write_text('{"text": "d", "y": 1}\n')
    assert tasks.load_custom("c", str(tmp_path), ("text",), "y", ("accuracy",), "t").label_names == ("1", "two")
    (tmp_path / "train.jsonl").write_text('{"text": "a", "y": "1.5"}\n{"text": "b", "y": -2}\n')
    (tmp_path / "test.jsonl").write_text('{"text": "c", "y": 1}\n{"text": "d", "y": 0.25}\n')
    regression = tasks.load_custom("c", str(tmp_path), ("text",), "y", ("pearson",), "t")
    np.testing.assert_array_equal(regression.train.labels, np.array([1.5, -2.0], dtype=np.float32))
    np.testing.assert_array_equal(regression.tests["test"].labels, np.array([1.0, 0.25], dtype=np.float32))


def test_regression_test_targets_that_are_one_value_are_refused_naming_the_task_and_file(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "a", "y": 1.5}\n{"text": "b", "y": -2}\n')
    (tmp_path / "test.jsonl").write_text('{"text": "c", "y": 3}\n{"text": "d", "y": 3.0}\n')
    message = f"{tmp_path / 'test.jsonl'}: field 'y' of task 'c' holds one value only (3); a correlation"
    with pytest.raises(StageError, match=re.escape(message)):
        tasks.load_custom("c", str(tmp_path), ("text",), "y", ("pearson",), "t")


@pytest.mark.usefixtures("default_csv_field_limit")
def test_a_custom_task_field_past_csv_s_default_limit_loads(tmp_path):
    long = "word " * 40_000
    (tmp_path / "train.csv").write_text(f"text,label\n{long},a\nshort,b\n")
    (tmp_path / "test.csv").write_text("text,label\nc,a\n")
    task = tasks.load_custom("c", str(tmp_path), ("text",), "label", ("accuracy",), "t")
    assert task.train.texts == [(long,), ("short",)]


def test_every_registered_kind_is_a_kind_and_owns_its_fields_alone():
    import dataclasses

    from cram.stages.evaluating import kinds
    from cram.stages.tasks.kind import Kind

    names = [name for kind in kinds.KINDS for name in kind.kinds]
    assert len(names) == len(set(names)) == len(kinds.BY_NAME) == 6
    assert TaskConfig().kind in names and all(isinstance(kind, Kind) for kind in kinds.KINDS)
    fields = {f.name for f in dataclasses.fields(TaskConfig)}
    owned = [key for kind in kinds.KINDS for key in kind.fields]
    assert len(owned) == len(set(owned)) and set(owned) <= fields
    assert all(set(kind.unkeyed) <= set(kind.fields) and set(kind.lengths) <= fields for kind in kinds.KINDS)
    for name in names:  # each kind's own fields stay off the other kinds' entries
        for kind in kinds.KINDS:
            if name not in kind.kinds and kind.fields:
                key = kind.fields[-1]
                value = "first" if key == "pooling" else ("x",) if key in ("text_fields", "metrics") else "x"
                with pytest.raises(ValueError, match=f"{key}: only a {kind.name} task takes them; {name} has none"):
                    Config(tasks=[TaskConfig(kind=name, name="t", path="p", **{key: value})])
