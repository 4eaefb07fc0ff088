"""A token-classification task through `cram run` on the real pipeline (a few-KB corpus, a tiny eager model),
from a WNUT-17-style CoNLL folder (tab-separated, lower-case hyphenated types): entity F1 beside the all-O and
dictionary baselines, the seed validation chose, its kept tagger, its dry-run line, bad input refused before
any stage runs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from test_bad_inputs import PIPELINE, TASK, WORDS, cram, write_workspace

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = '{kind="token-classification", name="wnut", path="wnut", seeds=2, epochs=2, lr=3e-3}'
TYPES = {"person": ["ann", "bob", "eve"], "creative-work": ["the hobbit", "star wars"], "location": ["new york"]}


def write_wnut(folder: Path, seed: int = 0) -> None:
    """train / dev / test CoNLL files as WNUT-17 writes them: `token<TAB>tag`, a blank line between sentences."""
    rng = random.Random(seed)
    folder.mkdir()
    for split, n in (("wnut17train.conll", 40), ("dev.conll", 10), ("test.conll", 10)):
        sentences = []
        for _ in range(n):
            lines = [f"{w}\tO" for w in rng.sample(WORDS, 3)]
            kind = rng.choice(sorted(TYPES))
            words = rng.choice(TYPES[kind]).split()
            lines += [f"{w}\t{'B' if i == 0 else 'I'}-{kind}" for i, w in enumerate(words)]
            lines += [f"{w}\tO" for w in rng.sample(WORDS, 2)]
            sentences.append("\n".join(lines))
        name = "train.conll" if split.startswith("wnut") else split
        (folder / name).write_text("\n\n".join(sentences) + "\n")


def workspace(ws: Path, task: str = TOKENS) -> None:
    write_workspace(ws)
    write_wnut(ws / "wnut")
    (ws / "pipeline.toml").write_text(PIPELINE.replace(f"tasks = [{TASK}]", f"tasks = [{task}]"))


def test_a_conll_folder_is_tagged_scored_beside_both_baselines_and_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    workspace(tmp_path)
    dry = cram("run", "pipeline.toml", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "wnut 20 steps (2 epochs x 10 batches of 4; more where a sentence is windowed)" in dry.output, dry.output
    result = cram("run", "pipeline.toml")
    assert result.exit_code == 0, result.output
    stage = tmp_path / "runs" / "base" / "evaluate"
    task = json.loads((stage / "results.json").read_text())["tasks"]["wnut"]
    assert task["kind"] == "token-classification" and task["seeds"] == [0, 1] and task["scheme"] == "IOB2"
    assert task["labels"][0] == "O" and "B-creative-work" in task["labels"] and task["untrained_types"] == []
    assert task["sentences"] == {"train": 40, "validation": 10, "test": 10} and task["validation"] == "file"
    assert set(task["median"]) == {"validation", "test"} and set(task["median"]["test"]) == {
        "f1", "precision", "recall", "accuracy"}  # fmt: skip
    assert task["baselines"]["test"]["all_o"]["f1"] == 0
    # every test entity is a training one: the dictionary finds them all
    assert task["baselines"]["test"]["dictionary"]["f1"] == 1 == task["baseline"]["test"]["f1"]
    chosen = max(range(2), key=lambda i: (task["scores"]["validation"]["f1"][i], -i))
    assert task["chosen"]["seed"] == chosen and task["chosen"]["test"]["f1"] == task["scores"]["test"]["f1"][chosen]
    assert set(task["by_type"]["test"]) <= {"person", "creative-work", "location"}
    inspect = cram("inspect", "runs/base", "evaluate", "--lines", "0").output
    assert '"wnut_test_f1"' in inspect and '"wnut_test_baseline"' in inspect and '"wnut_chosen_f1"' in inspect
    (kept,) = (stage / "classifiers" / "0-wnut").iterdir()
    assert kept.name == f"seed-{chosen}"
    meta = json.loads((kept / "classifier.json").read_text())
    assert (meta["kind"], meta["head"], meta["labels"], meta["num_outputs"]) == (
        "token-classification", "modernbert", task["labels"], len(task["labels"]))  # fmt: skip
    assert meta["score"] == task["scores"]["validation"]["f1"][chosen]  # kept by validation, never test


@pytest.mark.parametrize(
    ("task", "files", "message"),
    [
        ('{kind="token-classification", name="w"}', {}, "path: a token-classification task needs the folder"),
        (TOKENS, {"test.conll": "a\tB-person\nb\tX-person\n"}, "test.conll:2: tag 'X-person' is none of"),
        (TOKENS, {"test.conll": "a\tB-person\nb\n"}, "test.conll:2: expected a token and its tag"),
    ],
)
def test_bad_input_is_refused_in_one_line_before_any_stage_runs(tmp_path, monkeypatch, task, files, message):
    monkeypatch.chdir(tmp_path)
    workspace(tmp_path, task)
    for name, text in files.items():
        (tmp_path / "wnut" / name).write_text(text)
    result = cram("run", "pipeline.toml")
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "runs" / "base" / "tokenize").exists()
