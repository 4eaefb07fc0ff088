"""The kept-model room (stages/kept): `cram predict` streams a chunk at a time, writes only whole
outputs, reads `--out`'s extension in any case; a kept or exported classifier is checked before use
(checksums, labels against its head, max_length, tokenizer, params), each problem one line, exit 2; and
kept folders of two tasks never collide."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from test_classifier_export import MODERNBERT, sp_model, with_classifier  # noqa: F401 (a fixture)
from test_export import fake_run
from typer.testing import CliRunner

from cram.pipeline.commands import cli, predict
from cram.pipeline.commands.export import export
from cram.stages.evaluating import keeping
from cram.stages.finetuning.tasks import Examples, Task
from cram.stages.kept import KeptError, open_export, predicting
from cram.stages.kept.folder import write_checksums
from cram.stages.kept.predicting import Settings

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "the cat sat on a mat while dog ran over fox".split()


@pytest.fixture
def exported(tmp_path, sp_model):  # noqa: F811
    run, _ = fake_run(tmp_path, sp_model)
    with_classifier(run, MODERNBERT, "modernbert")
    return export(run, tmp_path / "cram", task="t")


def texts_file(path: Path, n: int) -> Path:
    rng = np.random.default_rng(0)
    path.write_text("".join(" ".join(rng.choice(WORDS, rng.integers(1, 30))) + "\n" for _ in range(n)))
    return path


def test_a_large_input_is_predicted_in_chunks_equal_to_one_pass(tmp_path, exported, monkeypatch):
    texts = texts_file(tmp_path / "texts.txt", 300)
    whole, chunked = tmp_path / "whole.jsonl", tmp_path / "chunked.jsonl"
    predict.predict(exported, [texts], out=whole, settings=Settings(compile=False, batch_size=16, chunk=10_000))
    sizes = []
    outputs = predicting.Predictor.outputs
    monkeypatch.setattr(predicting.Predictor, "outputs", lambda self, t: sizes.append(len(t)) or outputs(self, t))
    # two files: a chunk spans the boundary between them, and the order of the rows is the inputs'
    half = tmp_path / "b.txt"
    lines = texts.read_text().splitlines(keepends=True)
    (tmp_path / "a.txt").write_text("".join(lines[:130]))
    half.write_text("".join(lines[130:]))
    files = [tmp_path / "a.txt", half]
    assert (
        predict.predict(exported, files, out=chunked, settings=Settings(compile=False, batch_size=16, chunk=64)) == 300
    )
    assert sizes == [64, 64, 64, 64, 44]
    ours, theirs = ([json.loads(line) for line in p.read_text().splitlines()] for p in (chunked, whole))
    assert len(ours) == 300
    for a, b in zip(ours, theirs):
        assert a["label"] == b["label"]
        assert max(abs(a["probabilities"][n] - p) for n, p in b["probabilities"].items()) < 1e-5


def test_out_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path, exported, monkeypatch):
    texts = texts_file(tmp_path / "texts.txt", 5)
    folder = tmp_path / "locked"
    folder.mkdir()

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    # A read-only folder, as root sees one too: the rename fails, and so does removing the temporary file.
    monkeypatch.setattr(os, "replace", refuse)
    monkeypatch.setattr(Path, "unlink", refuse)
    result = CliRunner().invoke(
        cli.app, ["predict", str(exported), str(texts), "--out", str(folder / "o.jsonl"), "--no-compile"]
    )
    assert result.exit_code == 2 and "cannot write it: Permission denied" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (folder / "o.jsonl").exists()


def test_out_extension_is_read_in_any_case(tmp_path, exported):
    texts = texts_file(tmp_path / "texts.txt", 3)
    out = tmp_path / "labels.CSV"
    predict.predict(exported, [texts], out=out, settings=Settings(compile=False))
    assert out.read_text().splitlines()[0] == "label,negative,neutral,positive"


def test_labels_that_do_not_match_the_head_are_refused(tmp_path, exported):
    meta = json.loads((exported / "classifier.json").read_text())
    two = {**meta, "labels": ["no", "yes"], "num_outputs": 2}  # consistent in itself, over a 3-output head
    (exported / "classifier.json").write_text(json.dumps(two))
    write_checksums(exported)
    with pytest.raises(KeptError, match=r"classifier.json: names 2 outputs \(no, yes\), but the head .* has 3"):
        open_export(exported)


def damage(folder: Path, how: str) -> str:
    """Damage an export's file; return the file's name."""
    if how == "tokenizer":
        (folder / "tokenizer.model").write_bytes(b"not a sentencepiece model")
        return "tokenizer.model"
    if how == "params":
        data = (folder / "params.safetensors").read_bytes()
        (folder / "params.safetensors").write_bytes(data[: len(data) // 2])
        return "params.safetensors"
    meta = json.loads((folder / "classifier.json").read_text())
    (folder / "classifier.json").write_text(json.dumps({**meta, "max_length": 100_000}))
    return "classifier.json"


@pytest.mark.parametrize("how", ["tokenizer", "params", "max_length"])
@pytest.mark.parametrize("checksums", [True, False])
def test_a_damaged_export_is_one_line_naming_the_file(tmp_path, exported, how, checksums):
    texts = texts_file(tmp_path / "texts.txt", 3)
    name = damage(exported, how)
    if not checksums:  # an export written before checksums: the readers themselves refuse it
        (exported / "checksums.json").unlink()
    result = CliRunner().invoke(cli.app, ["predict", str(exported), str(texts), "--no-compile"])
    assert result.exit_code == 2 and name in result.output, result.output
    # without checksums the reader may first warn that its files could not be verified (a logging line,
    # shown where the process's logging shows warnings)
    lines = [line for line in result.output.strip().splitlines() if "read unverified" not in line]
    assert len(lines) == 1 and "Traceback" not in result.output


def test_two_tasks_never_share_a_kept_folder(tmp_path):
    """`a/b` was `task1`, which is also the folder of a task named task1; `Topic` and `topic` share a folder
    on a file system that ignores case."""
    names = ["task1", "a/b", "Topic", "topic"]
    folders = [keeping.folder_of(name, i) for i, name in enumerate(names)]
    assert len({f.lower() for f in folders}) == len(names)
    model_json = tmp_path / "model.json"
    model_json.write_text("{}")
    empty = Examples([], np.zeros(0))
    tasks = [Task(n, ("accuracy",), ("x", "y"), empty, {"test": empty}) for n in names]
    keeper = keeping.Keeper("best", tmp_path / "out", model_json, {i: {"task": n} for i, n in enumerate(names)})
    for i, task in enumerate(tasks):
        keeper.offer(i, 0, task, {"w": torch.full((1,), float(i))}, {"scores": {"test": {"accuracy": 0.5}}})
    kept = keeper.finish([(i, 0) for i in range(len(names))], {i: i for i in range(len(names))})
    assert len(set(kept.values())) == len(names)
    for i, name in enumerate(names):
        assert json.loads((tmp_path / "out" / kept[name] / "classifier.json").read_text())["task"] == name


def test_sorted_batches_run_longest_first_and_come_back_in_input_order():
    import numpy as np
    import torch

    from cram.stages.kept.batches import Padding, run_sorted

    widths = []

    def graph(params, batch):  # each row's length, and the batch's padded width
        widths.append(batch["input_ids"].shape[1])
        return batch["attention_mask"].sum(dim=1, keepdim=True).float()

    rows = [np.arange(n) + 5 for n in (3, 9, 5, 7, 4)]
    padding = Padding({"pad": 0, "cls": 2, "sep": 3}, (), token_types=False)
    out = run_sorted(graph, {"w": torch.zeros(1)}, rows, padding, size=2)
    assert widths == [9, 5, 3]  # the longest batch first: later ones fit in the blocks it freed
    assert out[:, 0].tolist() == [3, 9, 5, 7, 4]
