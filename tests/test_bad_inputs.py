"""A battery of bad inputs against one finished run of the real pipeline (a few-KB corpus, a tiny
eager model): each case must end with exit code 2 and one line naming the file, key or value, and
leave the run exactly as it was (every stage done, every file identical)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import socket
from pathlib import Path
from typing import Callable

import pytest
from typer.testing import CliRunner

from cram.pipeline import cli

pytestmark = pytest.mark.usefixtures("one_thread")

STAGES = ("tokenize", "pack", "pretrain", "evaluate")
TASK = '{kind="custom", name="sent", path="tasks", text_fields=["text"], metrics=["accuracy"]}'
PIPELINE = f"""
[run]
name = "base"
root = "runs"
device = "cpu"

[tokenize]
vocab_size = 96
heldout_fraction = 0.2

[tokenize.corpus]
kind = "files"
paths = ["corpus.jsonl"]
format = "jsonl"
text_field = "text"

[pack]
seq_len = 16

[pretrain]
compile = false
val_blocks = 4
microbatch = 4
batch_size = 4
log_every_steps = 1

[pretrain.model]
hidden = 16
layers = 1
heads = 2
intermediate = 32

[pretrain.budget]
steps = 2

[evaluate]
compile = false
epochs = 1
seeds = 1
batch_size = 4
buckets = [16]
max_length = 16
mlm_batch_size = 8
tasks = [{TASK}]
"""
WORDS = "the a cat dog sat ran on under mat rug sun rain good bad happy sad big small red blue".split()


def write_workspace(ws: Path) -> None:
    rng = random.Random(0)
    with open(ws / "corpus.jsonl", "w") as f:
        for i in range(120):
            text = " ".join(rng.choice(WORDS) for _ in range(40))
            f.write(json.dumps({"title": f"doc {i}", "text": text, "topic": ["sky", "home", "pets"][i % 3]}) + "\n")
    (ws / "tasks").mkdir()
    for split, n in (("train", 24), ("test", 8)):
        rows = ["text,label"] + [f"{rng.choice(WORDS)} {rng.choice(WORDS)},{i % 2}" for i in range(n)]
        (ws / "tasks" / f"{split}.csv").write_text("\n".join(rows) + "\n")
    (ws / "pipeline.toml").write_text(PIPELINE)


def cram(*args: str):
    return CliRunner().invoke(cli.app, list(args), env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("finished")
    write_workspace(ws)
    cwd = os.getcwd()
    os.chdir(ws)
    try:
        result = cram("run", "pipeline.toml")
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0, result.output
    assert _statuses(ws / "runs" / "base") == ["done"] * 4
    return ws


@pytest.fixture
def ws(finished, tmp_path, monkeypatch) -> Path:
    """A copy of the finished workspace (file times kept, so every stage stays done), as the cwd."""
    copy = tmp_path / "ws"
    shutil.copytree(finished, copy)
    monkeypatch.chdir(copy)
    return copy


def _statuses(run: Path) -> list[str]:
    return [r["status"] for r in json.loads((run / "manifest.json").read_text())["stages"].values()]


def snapshot(run: Path) -> dict[str, str]:
    """Every file of the run but its event log (which may record the refusal), by content."""
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != "events.jsonl"
    }


def sets(**values: str) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def tasks(**fields: str) -> list[str]:
    """`--set evaluate.tasks=[...]`: the custom task with some fields changed."""
    task = {
        "kind": '"custom"',
        "name": '"sent"',
        "path": '"tasks"',
        "text_fields": '["text"]',
        "metrics": '["accuracy"]',
        **fields,
    }
    return sets(**{"evaluate.tasks": "[{" + ", ".join(f"{k}={v}" for k, v in task.items()) + "}]"})


def rewrite(path: str, text: str | bytes) -> Callable[[Path], None]:
    def change(ws: Path) -> None:
        target = ws / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(text) if isinstance(text, bytes) else target.write_text(text)

    return change


def remove(path: str) -> Callable[[Path], None]:
    return lambda ws: (ws / path).unlink()


def nothing(ws: Path) -> None:
    pass


def one_class(ws: Path) -> None:
    for split in ("train", "test"):
        (ws / "tasks" / f"{split}.csv").write_text("text,label\n" + "good cat,1\n" * 6)


def float_labels(ws: Path) -> None:
    (ws / "tasks" / "train.csv").unlink()
    (ws / "tasks" / "train.jsonl").write_text('{"text": "cat", "label": 0.5}\n{"text": "dog", "label": 1}\n')


def log_folder_is_a_file(ws: Path) -> None:  # what a read-only run directory does too (tests run as root here)
    shutil.rmtree(ws / "runs" / "base" / "logs")
    (ws / "runs" / "base" / "logs").write_text("")


def live_lock(ws: Path) -> None:
    # This test's own process: alive, on this host.
    (ws / "runs" / "base" / ".lock").write_text(
        json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": "now"})
    )


RUN = ("run", "pipeline.toml")
FORCE_EVAL = ("--force", "evaluate")
CASES = [
    # config values: caught when the config is read, or by the stage's `validate` before anything runs
    ("lr nan", nothing, [*RUN, *sets(**{"pretrain.optimizer.lr": "nan"})], "pretrain.optimizer.lr: nan"),
    ("lr inf", nothing, [*RUN, *sets(**{"pretrain.optimizer.lr": "inf"})], "pretrain.optimizer.lr: inf"),
    ("lr -inf", nothing, [*RUN, *sets(**{"pretrain.optimizer.lr": "-inf"})], "pretrain.optimizer.lr: -inf"),
    ("lr zero", nothing, [*RUN, *sets(**{"pretrain.optimizer.lr": "0"})], "optimizer.lr=0.0: must be positive"),
    ("lr negative", nothing, [*RUN, *sets(**{"pretrain.optimizer.lr": "-1e-3"})], "optimizer.lr=-0.001"),
    ("betas", nothing, [*RUN, *sets(**{"pretrain.optimizer.betas": "[0.9, 1.5]"})], "optimizer.betas"),
    ("preset", nothing, [*RUN, *sets(**{"pretrain.model.preset": '"huge"'})], "pretrain.model.preset: 'huge'"),
    ("heads", nothing, [*RUN, *sets(**{"pretrain.model.heads": "3"})], "model.heads=3: must divide model.hidden=16"),
    ("odd glu", nothing, [*RUN, *sets(**{"pretrain.model.intermediate": "33"})], "model.intermediate=33"),
    ("norm eps nan", nothing, [*RUN, *sets(**{"pretrain.model.norm_eps": "nan"})], "pretrain.model.norm_eps: nan"),
    ("schedule", nothing, [*RUN, *sets(**{"pretrain.schedule": '"cosine-ish"'})], "pretrain.schedule: 'cosine-ish'"),
    ("schedule args", nothing, [*RUN, *sets(**{"pretrain.schedule_args": "{bogus = 1.0}"})], "pretrain.schedule_args"),
    ("cuda", nothing, [*RUN, *FORCE_EVAL, *sets(**{"run.device": '"cuda"'})], "run.device: 'cuda' but CUDA"),
    ("device name", nothing, [*RUN, *sets(**{"run.device": '"tpu"'})], "device: 'tpu' is not one of"),
    ("budget", nothing, [*RUN, *sets(**{"pretrain.budget.steps": "-5"})], "steps: -5 must be > 0"),
    ("hours nan", nothing, [*RUN, *sets(**{"pretrain.budget.hours": "nan"})], "pretrain.budget.hours: nan"),
    ("evaluate lr", nothing, [*RUN, *sets(**{"evaluate.lr": "nan"})], "evaluate.lr: nan"),
    ("mlm mask rate", nothing, [*RUN, *sets(**{"evaluate.mlm_mask_rate": "1.5"})], "mlm_mask_rate: 1.5 must be in"),
    ("val fraction", nothing, [*RUN, *sets(**{"pack.val_fraction": "inf"})], "pack.val_fraction: inf"),
    ("vocab", nothing, [*RUN, *sets(**{"tokenize.vocab_size": "5"})], "vocab_size: 5 must be between"),
    (
        "microbatch type",
        nothing,
        [*RUN, *sets(**{"pretrain.microbatch": '"big"'})],
        "pretrain.microbatch: expected an integer, got 'big'",
    ),
    ("seed negative", nothing, [*RUN, *sets(**{"run.seed": "-1"})], "seed: -1 must be in [0, 2**63 - 1]"),
    ("seed 2**64", nothing, [*RUN, *sets(**{"run.seed": str(2**64)})], f"seed: {2**64} must be in [0, 2**63 - 1]"),
    ("root empty", nothing, [*RUN, *sets(**{"run.root": '""'})], "root: '' must name a folder"),
    ("device index", nothing, [*RUN, *sets(**{"run.device": '"cuda:abc"'})], "device: 'cuda:abc' is not one of"),
    ("backend empty", nothing, [*RUN, *sets(**{"pretrain.backend": '""'})], "pretrain.backend: '' is not a torch"),
    (
        "backend unknown",
        nothing,
        [*RUN, *sets(**{"pretrain.backend": '"no-such-backend"'})],
        "pretrain.backend: 'no-such-backend' is not a torch.compile backend; choose one of",
    ),
    ("evaluate backend", nothing, [*RUN, *sets(**{"evaluate.backend": '"nope"'})], "evaluate.backend: 'nope' is not"),
    (
        "masks no token",
        nothing,
        [*RUN, *sets(**{"pack.seq_len": "8", "pretrain.masking.rate": "0.05"})],
        "pretrain.masking.rate: 0.05 masks no token of a 8-token block",
    ),
    (
        "mlm masks no token",
        nothing,
        [*RUN, *sets(**{"evaluate.mlm_mask_rate": "0.02"})],
        "evaluate.mlm_mask_rate: 0.02 masks no token of a 16-token block",
    ),
    ("mlm seed", nothing, [*RUN, *sets(**{"evaluate.mlm_seed": "-1"})], "evaluate.mlm_seed: -1 must be in"),
    ("memory hidden", nothing, [*RUN, *sets(**{"pretrain.model.hidden": "1000000"})], "lower pretrain.microbatch"),
    ("memory layers", nothing, [*RUN, *sets(**{"pretrain.model.layers": "10000000"})], "GiB parameters, AdamW state"),
    (
        "memory microbatch",
        nothing,
        [*RUN, *sets(**{"pretrain.microbatch": "1000000000", "pretrain.batch_size": "1000000000"})],
        "GiB activations of microbatch 1000000000), more than 90% of the",
    ),
    ("unknown key", nothing, [*RUN, *sets(**{"pretrain.lr": "1e-3"})], "unknown key 'lr'"),
    ("unknown section", rewrite("pipeline.toml", PIPELINE + "\n[pretrian]\n"), RUN, "unknown section [pretrian]"),
    ("bad --set", nothing, [*RUN, "--set", "lr"], "expected section.key=value"),
    # the corpus: found before the first stage runs
    (
        "corpus missing",
        nothing,
        [*RUN, *sets(**{"tokenize.corpus.paths": '["nope/*.jsonl"]'})],
        "tokenize.corpus.paths: 'nope/*.jsonl' matches no file",
    ),
    ("corpus no paths", nothing, [*RUN, *sets(**{"tokenize.corpus.paths": "[]"})], 'kind = "files" needs at least'),
    ("corpus format", nothing, [*RUN, *sets(**{"tokenize.corpus.format": '"xml"'})], "format: 'xml' is not allowed"),
    (
        "corpus package",
        nothing,
        [*RUN, *sets(**{"tokenize.corpus.kind": '"package"', "tokenize.corpus.package": '"no-such-package"'})],
        "'no-such-package' is not installed",
    ),
    ("corpus text field", nothing, [*RUN, *sets(**{"tokenize.corpus.text_field": '""'})], "text_field: must name"),
    # evaluate's tasks: their files are read before the first stage runs
    ("task folder", nothing, [*RUN, *tasks(path='"nope"')], "evaluate.tasks[0].path: nope is not a directory"),
    ("task label column", nothing, [*RUN, *tasks(label_field='"sentiment"')], "has no field 'sentiment'"),
    ("task text column", nothing, [*RUN, *tasks(text_fields='["body"]')], "has no field 'body'"),
    ("task metric", nothing, [*RUN, *tasks(metrics='["auc"]')], "unknown metric 'auc'"),
    ("task one class", one_class, RUN, "holds one class only"),
    (
        "task not utf-8",
        rewrite("tasks/train.csv", "text,label\ncaf\xe9 ok,1\nbad,0\n".encode("latin-1")),
        RUN,
        "tasks/train.csv: not UTF-8",
    ),
    (
        "glue tsv not utf-8",
        rewrite("glue/SST-2/train.tsv", "sentence\tlabel\ncaf\xe9\t1\n".encode("latin-1")),
        [*RUN, *tasks(kind='"glue"', name='"sst2"', path='"glue"', text_fields="[]", metrics="[]")],
        "glue/SST-2/train.tsv: not UTF-8",
    ),
    ("task no test file", remove("tasks/test.csv"), RUN, "has no test|dev|validation.csv or .jsonl"),
    (
        "task label per example",
        rewrite("tasks/train.csv", "text,label\n" + "".join(f"cat sat,0.{i}\n" for i in range(1, 10))),
        RUN,
        "holds 9 classes in 9 examples, each label once",
    ),
    (
        "task label float",
        float_labels,
        RUN,
        "label 0.5 of field 'label' is not a class",
    ),
    (
        "task regression nan",
        rewrite("tasks/train.csv", "text,label\ncat sat,nan\ndog ran,1.5\n"),
        [*RUN, *tasks(metrics='["pearson"]')],
        "tasks/train.csv: label 'nan' of field 'label' is not a finite number",
    ),
    (
        "task regression inf",
        rewrite("tasks/train.csv", "text,label\ncat sat,inf\ndog ran,1.5\n"),
        [*RUN, *tasks(metrics='["pearson"]')],
        "label 'inf' of field 'label' is not a finite number",
    ),
    (
        "task regression constant",
        rewrite("tasks/train.csv", "text,label\ncat sat,2\ndog ran,2\n"),
        [*RUN, *tasks(metrics='["spearman"]')],
        "field 'label' holds one value only (2); a correlation with a constant target is undefined",
    ),
    ("task unseen label", rewrite("tasks/test.csv", "text,label\ncat sat,7\n"), RUN, "label '7' of field 'label'"),
    ("task empty", rewrite("tasks/train.csv", "text,label\n"), RUN, "tasks/train.csv: no records"),
    (
        "task too long",
        nothing,
        [*RUN, *sets(**{"evaluate.buckets": "[16, 32]", "evaluate.max_length": "32"})],
        "beyond pack.seq_len = 16",
    ),
    (
        "heldout none",
        nothing,
        [
            *RUN,
            *tasks(kind='"heldout-topic"', name='"topic"', path='""', text_fields="[]", metrics="[]"),
            *sets(**{"tokenize.heldout_fraction": "0.0"}),
        ],
        "tokenize.heldout_fraction = 0 holds out none",
    ),
    (
        "heldout unlabelled",
        nothing,
        [
            *RUN,
            *tasks(kind='"heldout-topic"', name='"topic"', path='""', text_fields="[]", metrics="[]"),
            *sets(**{"tokenize.corpus.label_field": '""'}),
        ],
        "needs labelled documents",
    ),
    # the command line and the config file
    ("only and from", nothing, [*RUN, "--only", "pack", "--from", "pretrain"], "--only pack and --from pretrain"),
    ("unknown stage", nothing, [*RUN, "--only", "train"], "unknown stage 'train'"),
    ("config dir", nothing, ["run", "tasks"], "tasks: a directory"),
    ("config missing", nothing, ["run", "nope.toml"], "nope.toml: no such config file"),
    ("config not toml", rewrite("pipeline.toml", "[run\n"), RUN, "pipeline.toml: not valid TOML"),
    ("config not utf-8", rewrite("pipeline.toml", b'[run]\nname = "\xff"\n'), RUN, "pipeline.toml: not valid TOML"),
    (
        "root is a file",
        rewrite("elsewhere", "a file"),
        [*RUN, *sets(**{"run.root": '"elsewhere"'})],
        "elsewhere: a file, where the run directory",
    ),
    ("run name", nothing, [*RUN, "--name", "../x"], "run name '../x' is not allowed"),
    # run directories
    ("manifest json", rewrite("runs/base/manifest.json", "{"), ["status", "runs/base"], "not valid JSON"),
    ("manifest list", rewrite("runs/base/manifest.json", "[]"), ["status", "runs/base"], "not a cram manifest"),
    ("manifest stages", rewrite("runs/base/manifest.json", '{"stages": [1]}'), RUN, "not a cram manifest"),
    (
        "manifest records",
        rewrite("runs/base/manifest.json", '{"stages": {"pack": 3}}'),
        ["resume", "runs/base"],
        "not a cram manifest",
    ),
    ("not a run", nothing, ["status", "tasks"], "tasks: no manifest.json; not a run directory"),
    ("resume no config", remove("runs/base/config.toml"), ["resume", "runs/base"], "no saved config"),
    ("log unwritable", log_folder_is_a_file, RUN, "cannot write the run's log"),
    ("live lock", live_lock, [*RUN, *FORCE_EVAL], "is in use by pid"),
    ("inspect stage", nothing, ["inspect", "runs/base", "train"], "no stage 'train' in the manifest"),
    ("inspect config", rewrite("runs/base/config.toml", "[run"), ["inspect", "runs/base"], "not a readable config"),
    (
        "inspect plot folder",
        nothing,
        ["inspect", "runs/base", "--plot", "missing/curves.png"],
        "the folder missing does not exist",
    ),
    # export targets and sources
    ("export onto the run", nothing, ["export", "runs/base", "--to", "runs/base", "--force"], "inside the runs folder"),
    (
        "export into a stage",
        nothing,
        ["export", "runs/base", "--to", "runs/base/pretrain", "--force"],
        "inside the runs folder",
    ),
    ("export onto the root", nothing, ["export", "runs/base", "--to", "runs", "--force"], "inside the runs folder"),
    ("export to cwd", nothing, ["export", "runs/base", "--to", ".", "--force"], "holds the runs folder"),
    ("export over a folder", nothing, ["export", "runs/base", "--to", "tasks", "--force"], "not an earlier export"),
    (
        "export onto a file",
        rewrite("out", "x"),
        ["export", "runs/base", "--to", "out"],
        "exists and is not a directory",
    ),
    ("export format", nothing, ["export", "runs/base", "--to", "out", "--format", "onnx"], "--format onnx"),
    (
        "export no params",
        remove("runs/base/pretrain/params.safetensors"),
        ["export", "runs/base", "--to", "out"],
        "params.safetensors: missing, though stage pretrain is done",
    ),
]


@pytest.mark.parametrize("setup, args, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_loses_nothing(ws, setup, args, message):
    setup(ws)
    run = ws / "runs" / "base"
    before = snapshot(run)
    result = cram(*args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert snapshot(run) == before
    if "manifest" not in " ".join(args) and (run / "manifest.json").read_text().startswith("{\n"):
        assert _statuses(run) == ["done"] * 4
    assert not (ws / "out").is_dir()


def test_enough_bad_inputs():
    assert len(CASES) >= 40


def test_the_finished_run_is_all_cached(ws):
    before = snapshot(ws / "runs" / "base")
    result = cram(*RUN)
    assert result.exit_code == 0, result.output
    assert snapshot(ws / "runs" / "base") == before


def test_editing_a_task_file_reruns_evaluate_alone(ws):
    (ws / "tasks" / "test.csv").write_text("text,label\ncat sat,0\ndog ran,1\n")
    result = cram(*RUN, "--dry-run")
    assert result.exit_code == 0, result.output
    plan = {
        line.split()[1]: line.split()[3]
        for line in result.output.splitlines()
        if line.startswith("│") and line.split()[1] in STAGES
    }
    assert plan == {"tokenize": "skip", "pack": "skip", "pretrain": "skip", "evaluate": "run"}, result.output


def test_ls_lists_every_run_and_marks_the_unreadable_one(ws):
    shutil.copytree(ws / "runs" / "base", ws / "runs" / "broken")
    (ws / "runs" / "broken" / "manifest.json").write_text("{")
    result = cram("ls", "runs")
    assert result.exit_code == 0, result.output
    assert "base" in result.output and "evaluate" in result.output
    assert "broken" in result.output and "unreadable manifest" in result.output
    assert "warning:" in result.output and "broken/manifest.json: not valid JSON" in result.output


def test_inspect_lines_0_shows_no_events_and_negative_is_refused(ws):
    result = cram("inspect", "runs/base", "pretrain", "--lines", "0")
    assert result.exit_code == 0 and "log tail" in result.output
    assert result.output.rstrip().endswith(")")  # the log-tail heading, and no event after it
    assert cram("inspect", "runs/base", "--lines", "-1").exit_code == 2


def test_a_single_long_document_is_named_as_such(ws):
    rng = random.Random(1)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(3000)]
    (ws / "one.txt").write_text(" ".join(words))
    args = sets(
        **{
            "tokenize.corpus.paths": '["one.txt"]',
            "tokenize.corpus.format": '"text"',
            "tokenize.corpus.text_unit": '"file"',
            "tokenize.heldout_fraction": "0.0",
            "run.name": '"one"',
            "evaluate.tasks": "[]",
        }
    )
    result = cram(*RUN, "--only", "tokenize", *args)
    assert result.exit_code == 0, result.output
    result = cram(*RUN, "--only", "pack", *args)
    assert result.exit_code == 2 and "one document of" in result.output and "too few" not in result.output


def test_damaged_final_params_are_named_when_evaluate_reads_them(ws):
    params = ws / "runs" / "base" / "pretrain" / "params.safetensors"
    data = params.read_bytes()  # same size: the store's marker checks sizes, so a truncation re-runs pretrain
    params.write_bytes(b"\xff" * 100 + data[100:])
    result = cram(*RUN, *FORCE_EVAL)
    assert result.exit_code == 2, result.output
    error = result.output.strip().splitlines()[-1]
    assert error.startswith("error: stage 'evaluate' failed") and "pretrain/params.safetensors: unreadable" in error


def test_the_shipped_configs_pass_validation_offline(tmp_path, monkeypatch):
    """GLUE from the hub is fetched when evaluate runs, not to check a config: a dry run stays offline."""
    monkeypatch.chdir(tmp_path)
    repo = Path(__file__).resolve().parents[1]
    for config in (repo / "pipeline.toml", repo / "configs" / "crammed-bert.toml"):
        result = cram("run", str(config), "--dry-run")
        assert result.exit_code == 0, result.output
        assert result.output.count(" run ") == 4, result.output


def test_an_unlabelled_corpus_without_evaluate_tasks_evaluates_the_masked_lm_alone(ws):
    """evaluate's default task classifies held-out topics; a corpus without labels leaves it out (one
    log line says why) instead of refusing a config that never asked for it."""
    (ws / "pipeline.toml").write_text(PIPELINE.replace(f"tasks = [{TASK}]\n", "buckets = [16, 32, 64]\n", 1))
    (ws / "pipeline.toml").write_text((ws / "pipeline.toml").read_text().replace("buckets = [16]\n", "", 1))
    unlabelled = sets(**{"tokenize.corpus.label_field": '""', "run.name": '"plain"'})
    result = cram(*RUN, *unlabelled, "--dry-run")
    assert result.exit_code == 0, result.output
    result = cram(*RUN, *unlabelled)
    assert result.exit_code == 0, result.output
    results = json.loads((ws / "runs" / "plain" / "evaluate" / "results.json").read_text())
    assert results["tasks"] == {} and "loss" in results["mlm"]
    events = (ws / "runs" / "plain" / "logs" / "events.jsonl").read_text()
    assert events.count('"no topic task"') == 1 and "needs labelled documents" in events
