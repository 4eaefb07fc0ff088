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

from cram.pipeline import store
from cram.pipeline.commands import cli
from cram.stages.shared.store_entry import DAMAGED

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
precision = "fp32"

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
precision = "fp32"
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
        # Three words a test row, two a training row: no test row is a training row (evaluate refuses one).
        size = 2 if split == "train" else 3
        rows = ["text,label"] + [" ".join(rng.choice(WORDS) for _ in range(size)) + f",{i % 2}" for i in range(n)]
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
    """Every file of the run by content, but its event log (which may record the refusal) and the note a
    check leaves in an output it found damaged (so that the next run computes it again)."""
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name not in ("events.jsonl", DAMAGED)
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


def parquet(path: str, columns: dict[str, list]) -> Callable[[Path], None]:
    def write(ws: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(columns), ws / path)

    return write


def remove(path: str) -> Callable[[Path], None]:
    return lambda ws: (ws / path).unlink()


def flip(path: str, keep_time: bool = False) -> Callable[[Path], None]:
    """Invert 1,000 bytes of `path` in place: the same size, and with `keep_time` the same modification
    time, as a disk's or a careless tool's damage may leave it."""

    def change(ws: Path) -> None:
        target = ws / path
        stat = target.stat()
        data = bytearray(target.read_bytes())
        start = len(data) // 3
        data[start : start + 1000] = bytes(b ^ 0xFF for b in data[start : start + 1000])
        target.write_bytes(bytes(data))
        if keep_time:
            os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    return change


def sizes_only(folder: Path) -> None:
    """Rewrite the store marker at `folder` as it was before checksums: stage, key, record and sizes."""
    marker = json.loads((folder / store.MARKER).read_text())
    kept = ("stage", "key", "record", "files")
    (folder / store.MARKER).write_text(json.dumps({k: v for k, v in marker.items() if k in kept}))


def jsonl_task(train: str) -> Callable[[Path], None]:
    """A custom task in JSON lines in tasks2/: `train`, and a test file of two rows."""

    def write(ws: Path) -> None:
        rewrite("tasks2/train.jsonl", train)(ws)
        rewrite("tasks2/test.jsonl", '{"text": "a dog ran", "label": 0}\n{"text": "the sun", "label": 1}\n')(ws)

    return write


def nothing(ws: Path) -> None:
    pass


def one_class(ws: Path) -> None:
    for split in ("train", "test"):
        (ws / "tasks" / f"{split}.csv").write_text("text,label\n" + "good cat,1\n" * 6)


def float_labels(ws: Path) -> None:
    (ws / "tasks" / "train.csv").unlink()
    (ws / "tasks" / "train.jsonl").write_text('{"text": "cat", "label": 0.5}\n{"text": "dog", "label": 1}\n')


def shared_test_rows(ws: Path) -> None:
    train = (ws / "tasks" / "train.csv").read_text().splitlines(keepends=True)
    with open(ws / "tasks" / "test.csv", "a") as f:
        f.writelines(train[1:3])


def train_as_test(ws: Path) -> None:
    (ws / "tasks" / "test.csv").unlink()
    (ws / "tasks" / "test.csv").symlink_to("train.csv")


def log_folder_is_a_file(ws: Path) -> None:  # what a read-only run directory does too (tests run as root here)
    shutil.rmtree(ws / "runs" / "base" / "logs")
    (ws / "runs" / "base" / "logs").write_text("")


def edit_record(stage: str, drop: tuple[str, ...] = (), **fields: object) -> Callable[[Path], None]:
    """Change fields of a stage's manifest record (written on one line, as no cram writes it)."""

    def change(ws: Path) -> None:
        path = ws / "runs" / "base" / "manifest.json"
        manifest = json.loads(path.read_text())
        record = manifest["stages"][stage]
        record.update(fields)
        for key in drop:
            del record[key]
        path.write_text(json.dumps(manifest))

    return change


def break_metrics_line(ws: Path) -> None:
    """The first metrics.jsonl line made invalid JSON, the file's size kept (the store checks sizes)."""
    path = ws / "runs" / "base" / "pretrain" / "metrics.jsonl"
    data = path.read_bytes()
    path.write_bytes(b"x" + data[1:])


def dangling_root(ws: Path) -> None:
    (ws / "gone").symlink_to("nowhere")


def tokenizer_without_mask(ws: Path) -> None:
    from tokenizers import Tokenizer, models

    (ws / "nomask").mkdir()
    words = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", *WORDS]
    Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")).save(
        str(ws / "nomask" / "tokenizer.json")
    )


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
    (
        "baseline without init",
        nothing,
        [*RUN, *sets(**{"evaluate.baseline": '"init"'})],
        'evaluate.baseline: "init" fine-tunes pretrain.init\'s checkpoint beside the continued model, and '
        "pretrain.init is not set",
    ),
    ("only baseline", nothing, [*RUN, "--only", "baseline"], "stage 'baseline' has nothing to do with this config"),
    ("baseline value", nothing, [*RUN, *sets(**{"evaluate.baseline": '"start"'})], "evaluate.baseline: 'start' is not"),
    ("mlm mask rate", nothing, [*RUN, *sets(**{"evaluate.mlm_mask_rate": "1.5"})], "mlm_mask_rate: 1.5 must be in"),
    ("val fraction", nothing, [*RUN, *sets(**{"pack.val_fraction": "inf"})], "pack.val_fraction: inf"),
    ("vocab", nothing, [*RUN, *sets(**{"tokenize.vocab_size": "5"})], "vocab_size: 5 must be between"),
    (
        "tokenizer missing",
        nothing,
        [*RUN, *sets(**{"tokenize.tokenizer": '"no-such-tokenizer"'})],
        "tokenize.tokenizer: no-such-tokenizer: no such file or folder",
    ),
    (
        "tokenizer missing dry run",
        nothing,
        [*RUN, "--dry-run", *sets(**{"tokenize.tokenizer": '"no-such-tokenizer"'})],
        "tokenize.tokenizer: no-such-tokenizer: no such file or folder",
    ),
    (
        "tokenizer no mask",
        tokenizer_without_mask,
        [*RUN, *sets(**{"tokenize.tokenizer": '"nomask"'})],
        "tokenize.tokenizer: nomask/tokenizer.json: no mask token ('[MASK]' or '<mask>' is not in its vocabulary)",
    ),
    (
        "tokenizer unreadable",
        rewrite("badtok/tokenizer.json", "{not json"),
        [*RUN, "--dry-run", *sets(**{"tokenize.tokenizer": '"badtok"'})],
        "tokenize.tokenizer: badtok/tokenizer.json: not a readable tokenizer.json",
    ),
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
    (
        "phases not increasing",
        nothing,
        [*RUN, *sets(**{"pretrain.phases": "[{seq_len=8, until=0.6}, {seq_len=16, until=0.4}, {seq_len=16}]"})],
        "pretrain.phases[1].until: 0.4 must be above the previous phase's 0.6",
    ),
    (
        "phase until outside (0, 1)",
        nothing,
        [*RUN, *sets(**{"pretrain.phases": "[{seq_len=8, until=1.5}, {seq_len=16}]"})],
        "until: 1.5 must be in (0, 1)",
    ),
    (
        "phase length not dividing",
        nothing,
        [*RUN, *sets(**{"pretrain.phases": "[{seq_len=12, until=0.5}, {seq_len=16}]"})],
        "pretrain.phases[0].seq_len: 12 must divide the longest phase's 16",
    ),
    (
        "phase microbatch below one",
        nothing,
        [*RUN, *sets(**{"pretrain.phases": "[{seq_len=128}]"})],
        "pretrain.phases[0].microbatch: 4 x 16 tokens (pack.seq_len) is not a whole number of 128-token sequences",
    ),
    (
        "phase masks no token",
        nothing,
        [*RUN, *sets(**{"pretrain.phases": "[{seq_len=2, until=0.5}, {seq_len=16}]"})],
        "pretrain.masking.rate: 0.25 masks no token of a 2-token block",
    ),
    (
        "end rate outside (0, 1)",
        nothing,
        [*RUN, *sets(**{"pretrain.masking.end_rate": "1.5"})],
        "end_rate: 1.5 must be",
    ),
    (
        "end rate masks no token",
        nothing,
        [*RUN, *sets(**{"pretrain.masking.end_rate": "0.02"})],
        "pretrain.masking.end_rate: 0.02 masks no token of a 16-token block",
    ),
    (
        "masking leaves every token visible",
        nothing,
        [*RUN, *sets(**{"pretrain.masking.mask_token": "0", "pretrain.masking.random_token": "0"})],
        "mask_token, random_token: 0 and 0 leave every selected token as it was",
    ),
    (
        "all [MASK] at a rate that masks nothing",
        nothing,
        [
            *RUN,
            *sets(**{"pretrain.masking.mask_token": "1", "pretrain.masking.random_token": "0"}),
            *sets(**{"pretrain.masking.rate": "0.01"}),
        ],
        "pretrain.masking.rate: 0.01 masks no token of a 16-token block",
    ),
    (
        "masking phase rates not one per phase",
        nothing,
        [*RUN, *sets(**{"pretrain.masking.phase_rates": "[0.4, 0.2]"})],
        "pretrain.masking.phase_rates: 2 rates for 1 phase(s)",
    ),
    (
        "unknown optimizer kind",
        nothing,
        [*RUN, *sets(**{"pretrain.optimizer.kind": '"lion"'})],
        "optimizer.kind='lion': allowed adamw, stable_adamw",
    ),
    (
        "lr floor outside [0, 1)",
        nothing,
        [*RUN, *sets(**{"pretrain.decay_to": "1"})],
        "decay_to: 1.0 must be in [0, 1)",
    ),
    (
        "unknown decay shape",
        nothing,
        [*RUN, *sets(**{"pretrain.decay_shape": '"sqrt"'})],
        "pretrain.decay_shape: 'sqrt' is not allowed; choose one of '', 'linear', 'cosine', '1-sqrt'",
    ),
    (
        "mlm length beyond learned positions",
        nothing,
        [*RUN, *sets(**{"pretrain.model.position": '"learned"', "evaluate.mlm_lengths": "[16, 32]"})],
        "evaluate.mlm_lengths: 32 is beyond the model's 16 learned positions",
    ),
    (
        "mlm length beyond learned positions dry run",
        nothing,
        [*RUN, "--dry-run", *sets(**{"pretrain.model.position": '"learned"', "evaluate.mlm_lengths": "[32]"})],
        "evaluate.mlm_lengths: 32 is beyond the model's 16 learned positions",
    ),
    (
        "mlm length masks no token",
        nothing,
        [*RUN, *FORCE_EVAL, "--dry-run", *sets(**{"evaluate.mlm_lengths": "[16, 2]"})],
        "pretrain.masking.rate (at evaluate.mlm_lengths): 0.25 masks no token of a 2-token block",
    ),
    (
        "mlm rate masks no token at a length",
        nothing,
        [*RUN, *FORCE_EVAL, *sets(**{"evaluate.mlm_lengths": "[8]", "evaluate.mlm_mask_rate": "0.05"})],
        "evaluate.mlm_mask_rate (at evaluate.mlm_lengths): 0.05 masks no token of a 8-token block",
    ),
    ("init its own run", nothing, [*RUN, *sets(**{"pretrain.init": '"runs/base"'})], "pretrain.init: runs/base is"),
    (
        "init inside its own run",
        nothing,
        [*RUN, "--dry-run", *sets(**{"pretrain.init": '"runs/base/pretrain"'})],
        "pretrain.init: runs/base/pretrain is this run's own directory (runs/base) or inside it",
    ),
    (
        "init a run whose params were damaged in place",
        flip("runs/base/pretrain/params.safetensors", keep_time=True),
        [*RUN, "--name", "other", *sets(**{"pretrain.init": '"runs/base"'})],
        "pretrain.init: runs/base/pretrain/params.safetensors: damaged, its sha256 is not the one its store entry",
    ),
    (
        "init a run whose tokenizer a check found damaged",  # its note, which verify writes
        rewrite(f"runs/base/tokenize/{DAMAGED}", "runs/base/tokenize/tokenizer.model: damaged (noted)\n"),
        [*RUN, "--name", "other", *sets(**{"pretrain.init": '"runs/base"'})],
        "pretrain.init: runs/base/tokenize/tokenizer.model: damaged (noted); `cram run` in that run computes it",
    ),
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
        "field 'label' of task 'sent' holds one value only (2); a correlation with a constant target is undefined",
    ),
    (
        "task regression constant test",
        lambda ws: (
            rewrite("tasks/train.csv", "text,label\ncat sat,2\ndog ran,1.5\n")(ws),
            rewrite("tasks/test.csv", "text,label\ncat ran,3\ndog sat,3.0\n")(ws),
        ),
        [*RUN, *tasks(metrics='["pearson"]')],
        "tasks/test.csv: field 'label' of task 'sent' holds one value only (3); a correlation with a constant",
    ),
    ("task unseen label", rewrite("tasks/test.csv", "text,label\ncat sat,7\n"), RUN, "label '7' of field 'label'"),
    ("task empty", rewrite("tasks/train.csv", "text,label\n"), RUN, "tasks/train.csv: no records"),
    (
        "task text a number",
        jsonl_task('{"text": "a cat", "label": 0}\n{"text": 5, "label": 1}\n'),
        [*RUN, *tasks(path='"tasks2"')],
        "tasks2/train.jsonl:2: record 2: text field 'text' holds int 5, not text",
    ),
    (
        "task text a lone surrogate",
        jsonl_task('{"text": "a cat", "label": 0}\n{"text": "a \\ud83d", "label": 1}\n'),
        [*RUN, *tasks(path='"tasks2"')],
        "tasks2/train.jsonl:2: record 2: field 'text' holds a lone surrogate \\ud83d at character 2",
    ),
    (
        "corpus lone surrogate in the first bytes",
        rewrite("s.jsonl", '{"text": "a b", "topic": "x"}\n{"text": "c \\ud83d d", "topic": "y"}\n'),
        [*RUN, "--dry-run", *sets(**{"tokenize.corpus.paths": '["s.jsonl"]'})],
        "s.jsonl:2: field 'text' holds a lone surrogate \\ud83d at character 2 (half of a UTF-16 pair, from a JSON "
        'escape), which UTF-8 cannot encode; fix the file or set tokenize.corpus.encoding_errors = "replace"',
    ),
    (
        "task csv quote left open",
        rewrite("tasks/train.csv", 'text,label\ncat sat,0\n"dog ran,1\nsun set,0\n'),
        [*RUN, "--dry-run"],
        "tasks/train.csv:3: record 2: unexpected end of data; a quoted field is quoted whole",
    ),
    (
        "predict csv malformed quoting",
        rewrite("in.csv", 'text\n"Quoted" start of a line\nplain line two\n"unbalanced quote\nline four\n'),
        ["predict", "runs/base", "in.csv", "--task", "sent"],
        "in.csv:2: record 1: ',' expected after '\"'",
    ),
    (
        "predict text an object",
        rewrite("in.jsonl", '{"text": "fine"}\n{"text": {"a": 1}}\n'),
        ["predict", "runs/base", "in.jsonl", "--task", "sent"],
        "in.jsonl:2: record 2: text field 'text' holds dict {'a': 1}, not text (the classifier reads text)",
    ),
    ("task test rows in train", shared_test_rows, RUN, "evaluate.tasks[0].path: 2 of the 10 rows of test.csv have"),
    ("task test is train", train_as_test, RUN, "train.csv and test.csv are the same file"),
    # tokenize.task_text: the evaluate tasks' training files, so there must be one
    (
        "task text without tasks",
        nothing,
        [*RUN, *sets(**{"tokenize.task_text": '"add"', "evaluate.tasks": "[]"})],
        'tokenize.task_text: "add" pretrains on the training files of [[evaluate.tasks]]',
    ),
    (
        "task text of topics",
        nothing,
        [
            *RUN,
            *sets(**{"tokenize.task_text": '"only"'}),
            *tasks(kind='"heldout-topic"', text_fields="[]", metrics="[]"),
        ],
        "its tasks are of kind heldout-topic, without a training file of their own",
    ),
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
    # the corpus: a wrong format, a CSV without the text column, records without the label field
    (
        "corpus wrong format",
        rewrite("book.txt", "The Tragedie of Hamlet\n"),
        [*RUN, *sets(**{"tokenize.corpus.paths": '["book.txt"]', "tokenize.corpus.format": '"json"'})],
        'book.txt: not JSON (starts with "The Tragedie"); set tokenize.corpus.format = "text"',
    ),
    (
        "corpus csv column",
        rewrite("c.csv", "body,topic\na b,x\n"),
        [*RUN, *sets(**{"tokenize.corpus.paths": '["c.csv"]', "tokenize.corpus.format": '"csv"'})],
        "c.csv: no text column 'text' (tokenize.corpus.text_field); columns are: body, topic",
    ),
    (
        "corpus without labels",
        rewrite("plain.jsonl", '{"text": "a b c"}\n' * 5),
        [
            *RUN,
            *tasks(kind='"heldout-topic"', name='"topic"', path='""', text_fields="[]", metrics="[]"),
            *sets(**{"tokenize.corpus.paths": '["plain.jsonl"]'}),
        ],
        "plain.jsonl: records without the label field 'topic' (tokenize.corpus.label_field)",
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
    (
        "manifest field types",
        edit_record("pretrain", status=5, duration_s="slow"),
        ["status", "runs/base"],
        "stages.pretrain.status: expected a string, got 5",
    ),
    (
        "manifest duration",
        edit_record("pretrain", duration_s="slow"),
        ["status", "runs/base"],
        'stages.pretrain.duration_s: expected a number or null, got "slow"',
    ),
    (
        "inspect plot metrics",
        break_metrics_line,
        ["inspect", "runs/base", "--plot", "curves.png"],
        "metrics.jsonl: line 1 is not valid JSON",
    ),
    (
        "compare plot metrics",
        break_metrics_line,
        ["compare", "runs/base", "--plot", "curves.png"],
        "metrics.jsonl: line 1 is not valid JSON",
    ),
    ("compare out folder", nothing, ["compare", "runs/base", "--out", "nodir/t.md"], "the folder nodir does not exist"),
    ("compare out is a folder", rewrite("t.md/x", ""), ["compare", "runs/base", "--out", "t.md"], "t.md: a folder"),
    (
        "root dangling link",
        dangling_root,
        [*RUN, *sets(**{"run.root": '"gone"'})],
        "gone: a link to nowhere, which does not exist",
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
    (
        "export no outputs",
        edit_record("pretrain", drop=("outputs",)),
        ["export", "runs/base", "--to", "out"],
        "stage pretrain is done, but its outputs lack params, model_config",
    ),
    # a stored file whose bytes changed though its size did not: refused where it would be copied out
    (
        "export damaged params",
        flip("runs/base/pretrain/params.safetensors"),
        ["export", "runs/base", "--to", "out"],
        "params.safetensors: damaged, its sha256 is not the one written; nothing exported",
    ),
    (
        "export damaged tokenizer",
        flip("runs/base/tokenize/tokenizer.model", keep_time=True),
        ["export", "runs/base", "--to", "out"],
        "tokenizer.model: damaged",
    ),
    ("verify no run", nothing, ["verify", "tasks"], "tasks: neither a run directory"),
    # settings checked whatever the store holds
    (
        "canary steps past the maximum",
        nothing,
        [*RUN, *sets(**{"pretrain.canary_steps": "1000000"})],
        "[pretrain] canary_steps: 1000000 must be between 0 (off) and 100",
    ),
    (
        "evaluate canary steps past the maximum",
        nothing,
        [*RUN, *sets(**{"evaluate.canary_steps": "1000000"})],
        "[evaluate] canary_steps: 1000000 must be between 0 (off) and 100",
    ),
    (
        "init_lr without init, pretrain done",
        nothing,
        [*RUN, *sets(**{"pretrain.init_lr": "1e-4"})],
        "[pretrain] init_lr: 0.0001 is the peak lr of continuing `pretrain.init`'s checkpoint, and the run has no init",
    ),
    (
        "head_warmup without init, pretrain done",
        nothing,
        [*RUN, *sets(**{"pretrain.head_warmup": "0.2"})],
        "[pretrain] head_warmup: 0.2 warms up the masked-LM head of `pretrain.init`'s checkpoint",
    ),
    (
        "task text only over blank training texts",
        rewrite("tasks/train.csv", "text,label\n,0\n  ,1\n"),
        [*RUN, "--dry-run", *sets(**{"tokenize.task_text": '"only"'})],
        'tokenize.task_text: "only" pretrains on the tasks\' training rows alone, and every text in tasks/train.csv '
        "is blank",
    ),
]


@pytest.mark.parametrize("setup, args, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_loses_nothing(ws, setup, args, message, plain_machine):
    setup(ws)
    run = ws / "runs" / "base"
    before = snapshot(run)
    result = cram(*args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert snapshot(run) == before
    assert sorted(p.name for p in (ws / "runs").iterdir() if not p.name.startswith(".")) == ["base"]
    if "manifest" not in " ".join(args) and (run / "manifest.json").read_text().startswith("{\n"):
        assert _statuses(run) == ["done"] * 4
    assert not (ws / "out").is_dir()


# A text field that holds no text is refused, not trained on as its str(): found only when tokenize reads
# the records, so the stage fails with the line (exit 2) and the run's earlier result is kept.
UNREADABLE_TEXT = [
    (
        "corpus text a number",
        rewrite("n.jsonl", '{"text": "a b", "topic": "x"}\n{"text": 12345, "topic": "y"}\n'),
        [*RUN, *sets(**{"tokenize.corpus.paths": '["n.jsonl"]'})],
        "n.jsonl:2: text field 'text' holds int 12345, not text (tokenize.corpus.text_field)",
    ),
    (
        "corpus text column of numbers",
        parquet("n.parquet", {"text": [12, 7], "topic": ["x", "y"]}),
        [*RUN, *sets(**{"tokenize.corpus.paths": '["n.parquet"]', "tokenize.corpus.format": '"parquet"'})],
        "n.parquet: row 1: text field 'text' holds int 12, not text",
    ),
]


@pytest.mark.parametrize("setup, args, message", [c[1:] for c in UNREADABLE_TEXT], ids=[c[0] for c in UNREADABLE_TEXT])
def test_a_text_field_that_holds_no_text_is_refused_when_read(ws, setup, args, message):
    setup(ws)
    result = cram(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output.strip().splitlines()[-1], result.output
    assert _statuses(ws / "runs" / "base") == ["done"] * 4


def test_a_run_evaluated_without_tasks_is_told_it_fine_tuned_none(ws):
    result = cram(*RUN, *sets(**{"evaluate.tasks": "[]"}))
    assert result.exit_code == 0, result.output
    (ws / "in.csv").write_text("text\na b\n")
    result = cram("predict", "runs/base", "in.csv", "--task", "sent", "--no-compile")
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (
        "error: runs/base: evaluate kept no classifier, since it fine-tuned none (evaluate.tasks = []); add the "
        "task to [[evaluate.tasks]] and run it: cram run runs/base/config.toml"
    )


@pytest.mark.usefixtures("default_csv_field_limit")
def test_predict_reads_tsv_unquoted_long_fields_and_upper_case_csv_and_names_a_field_past_the_limit(ws, monkeypatch):
    from cram.stages.shared import taskfiles

    lines = ['"Quoted" at the start', 'a "b', "plain", '"open quote', 'end"']
    (ws / "in.tsv").write_text("text\n" + "".join(f"{line}\n" for line in lines))
    result = cram("predict", "runs/base", "in.tsv", "--task", "sent", "--no-compile")
    assert result.exit_code == 0, result.output
    assert sum(line.startswith('{"label"') for line in result.output.splitlines()) == 5, result.output
    (ws / "in.csv").write_text("text\nshort\n" + "cat " * 50_000 + "\n")
    result = cram("predict", "runs/base", "in.csv", "--task", "sent", "--no-compile")
    assert result.exit_code == 0, result.output
    assert sum(line.startswith('{"label"') for line in result.output.splitlines()) == 2, result.output
    result = cram("predict", "runs/base", "in.csv", "--task", "sent", "--no-compile", "--out", "labels.CSV")
    assert result.exit_code == 0, result.output
    assert (ws / "labels.CSV").read_text().startswith("label,"), (ws / "labels.CSV").read_text()
    monkeypatch.setattr(taskfiles, "MAX_FIELD_CHARS", 100_000)
    result = cram("predict", "runs/base", "in.csv", "--task", "sent", "--no-compile")
    assert result.exit_code == 2 and result.output.strip() == (
        "error: in.csv: record 2: field 'text' holds 200,000 characters, over the 100,000 a field may hold "
        "(the classifier reads text)"
    ), result.output


def test_enough_bad_inputs():
    assert len(CASES) >= 43


def test_the_finished_run_is_all_cached(ws):
    before = snapshot(ws / "runs" / "base")
    result = cram(*RUN)
    assert result.exit_code == 0, result.output
    assert snapshot(ws / "runs" / "base") == before


def test_editing_a_task_file_reruns_evaluate_alone(ws):
    (ws / "tasks" / "test.csv").write_text("text,label\ncat sat on,0\ndog ran on,1\n")
    result = cram(*RUN, "--dry-run")
    assert result.exit_code == 0, result.output
    plan = {
        line.split()[1]: line.split()[3]
        for line in result.output.splitlines()
        if line.startswith("│") and line.split()[1] in STAGES
    }
    assert plan == {"tokenize": "skip", "pack": "skip", "pretrain": "skip", "evaluate": "run"}, result.output


def test_a_dry_run_says_each_tasks_fine_tune_steps(ws):
    topic = '{kind="heldout-topic", name="topic", label_field="topic"}'
    result = cram(*RUN, *FORCE_EVAL, "--dry-run", *sets(**{"evaluate.tasks": f"[{TASK}, {topic}]"}))
    assert result.exit_code == 0, result.output
    line = result.output.strip().splitlines()[-1]
    # 24 training rows in batches of 4, one epoch, one seed (the stage's settings)
    assert line == (
        "evaluate: fine-tunes sent 6 steps (1 epoch x 6 batches of 4) x 1 seed; "
        "topic steps known after tokenize x 1 seed"
    ), result.output
    result = cram(*RUN, *FORCE_EVAL, "--dry-run", *sets(**{"evaluate.epochs": "2", "evaluate.seeds": "2"}))
    assert result.exit_code == 0, result.output
    line = result.output.strip().splitlines()[-1]
    assert line == "evaluate: fine-tunes sent 12 steps (2 epochs x 6 batches of 4) x 2 seeds", result.output


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
    sizes_only(params.parent)  # made before checksums: only a size change re-runs pretrain
    data = params.read_bytes()
    params.write_bytes(b"\xff" * 100 + data[100:])
    result = cram(*RUN, *FORCE_EVAL)
    assert result.exit_code == 2, result.output
    error = result.output.strip().splitlines()[-1]
    assert error.startswith("error: stage 'evaluate' failed") and "pretrain/params.safetensors: unreadable" in error


def test_final_params_holding_nan_are_named_when_evaluate_reads_them(ws):
    from safetensors.torch import load_file, save_file

    params = ws / "runs" / "base" / "pretrain" / "params.safetensors"
    sizes_only(params.parent)  # made before checksums: only a size change re-runs pretrain
    tensors = load_file(params)
    tensors["final_norm.weight"][0] = float("nan")
    save_file(tensors, params, metadata={"cram.order": json.dumps(list(tensors))})
    result = cram(*RUN, *FORCE_EVAL)
    assert result.exit_code == 2, result.output
    error = result.output.strip().splitlines()[-1]
    assert "pretrain/params.safetensors: final_norm.weight holds NaN or inf values" in error, result.output


def test_the_shipped_configs_pass_validation_offline(tmp_path, monkeypatch, plain_machine):
    """GLUE from the hub is fetched when evaluate runs, not to check a config: a dry run stays offline."""
    monkeypatch.chdir(tmp_path)
    repo = Path(__file__).resolve().parents[1]
    for config in (repo / "pipeline.toml", repo / "configs" / "crammed-bert.toml"):
        result = cram("run", str(config), "--dry-run")
        assert result.exit_code == 0, result.output
        assert result.output.count(" run ") == 4, result.output


def test_a_stage_whose_upstream_outputs_lack_a_file_names_the_folder_and_key(ws):
    edit_record("pack", outputs={})(ws)
    result = cram(*RUN, "--force", "pretrain")
    assert result.exit_code == 2, result.output
    error = result.output.strip().splitlines()[-1]
    assert "runs/base/pack: its stage's recorded outputs name no 'train'" in error, result.output
    assert _statuses(ws / "runs" / "base") == ["done"] * 4  # the failed attempt is kept beside the result


def test_gc_on_a_read_only_root_removes_nothing_and_says_so(ws, monkeypatch):
    entry = next((ws / "runs" / ".store").glob("pack-*[0-9a-f]"))
    shutil.copytree(entry, entry.with_name("pack-" + "0" * 64))  # an entry no run refers to
    real_open = os.open

    def read_only(path, *args, **kwargs):  # what a read-only filesystem does, even to root
        if ".store" in str(path):
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    result = cram("gc", "runs")
    monkeypatch.undo()
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: runs: its store cannot be changed (Read-only file system") and line.endswith(
        "nothing removed"
    ), result.output
    assert entry.with_name("pack-" + "0" * 64).is_dir()


def _manifest_edit(**fields: object) -> Callable[[Path], None]:
    return edit_record("pretrain", **fields)


def _metrics(text: str) -> Callable[[Path], None]:
    return rewrite("runs/base/pretrain/metrics.jsonl", text)


def _dangling_stage(ws: Path) -> None:
    view = ws / "runs" / "base" / "pack"
    view.unlink()
    view.symlink_to("../.store/pack-" + "0" * 64)


def _no_run(ws: Path) -> None:
    shutil.rmtree(ws / "runs" / "base")


DAMAGES = {
    "manifest not json": rewrite("runs/base/manifest.json", "{"),
    "manifest empty": rewrite("runs/base/manifest.json", ""),
    "manifest binary": rewrite("runs/base/manifest.json", b"\xff\xfe"),
    "record key": _manifest_edit(key=5),
    "record outputs": _manifest_edit(outputs=[1]),
    "record started": _manifest_edit(started=3),
    "record pid": _manifest_edit(status="running", pid="x"),
    "record upstream": _manifest_edit(upstream_keys={"pack": 5}),
    "record attempt": _manifest_edit(attempt="x"),
    "record attempt fields": _manifest_edit(attempt={"status": 1}),
    "record no outputs": edit_record("pretrain", drop=("outputs",)),
    "outputs metrics number": _manifest_edit(outputs={"metrics": 5, "params": 5}),
    "pack outputs empty": edit_record("pack", outputs={}),
    "metrics broken": _metrics('{"step": 1}\n[]\n{'),
    "metrics not numbers": _metrics('{"tokens_seen": "x", "loss": "y"}\n'),
    "metrics binary": _metrics(b"\xff\xfe\n"),
    "metrics a folder": lambda ws: (
        remove("runs/base/pretrain/metrics.jsonl")(ws),
        rewrite("runs/base/pretrain/metrics.jsonl/x", "")(ws),
    ),
    "stage link gone": lambda ws: (ws / "runs" / "base" / "pretrain").unlink(),
    "stage link dangling": _dangling_stage,
    "config garbage": rewrite("runs/base/config.toml", b"\xff[run"),
    "config gone": remove("runs/base/config.toml"),
    "events garbage": rewrite("runs/base/logs/events.jsonl", b'\xff\n[1]\n"x"\n{"stage": 5}\n'),
    "lock garbage": rewrite("runs/base/.lock", b"\xff"),
    "marker garbage": lambda ws: [
        rewrite(str(p.relative_to(ws)), "[")(ws) for p in ws.glob("runs/.store/*/.cram-entry.json")
    ],
    "run gone": _no_run,
    "store gone": lambda ws: shutil.rmtree(ws / "runs" / ".store"),
    "root dangling": lambda ws: (shutil.rmtree(ws / "runs"), (ws / "runs").symlink_to("nowhere")),
    "root a file": lambda ws: (shutil.rmtree(ws / "runs"), (ws / "runs").write_text("")),
}
COMMANDS = [
    ["status", "runs/base"],
    ["inspect", "runs/base"],
    ["inspect", "runs/base", "pretrain", "--plot", "c.png"],
    ["ls", "runs"],
    ["compare", "runs/base", "runs/base", "--plot", "p.png", "--out", "t.csv"],
    ["export", "runs/base", "--to", "out"],
    ["gc", "runs", "--dry-run"],
    ["gc", "runs"],
    [*RUN, "--dry-run"],
    ["resume", "runs/base"],
    ["sweep", "pipeline.toml", "--grid", "pretrain.budget.steps=2,3", "--dry-run"],
]


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGES)
def test_no_command_ends_in_a_traceback_on_a_damaged_run(finished, tmp_path, monkeypatch, damage):
    """Every command on every damage: an answer or one error line, never a traceback."""
    failures = []
    for i, args in enumerate(COMMANDS):
        copy = tmp_path / str(i)
        shutil.copytree(finished, copy, symlinks=True)
        monkeypatch.chdir(copy)
        DAMAGES[damage](copy)
        result = cram(*args)
        escaped = result.exception is not None and not isinstance(result.exception, SystemExit)
        if escaped or "Traceback" in result.output or result.exit_code not in (0, 1, 2):
            failures.append(f"{' '.join(args)}: exit {result.exit_code} {result.exception!r}")
    assert not failures, "\n".join(failures)


@pytest.fixture
def linked(finished, tmp_path, monkeypatch) -> Path:
    """A copy of the finished workspace with the run's links kept: its stages are the store's entries."""
    copy = tmp_path / "linked"
    shutil.copytree(finished, copy, symlinks=True)
    monkeypatch.chdir(copy)
    return copy


def _plan(result) -> dict[str, tuple[str, str]]:
    rows = [line.strip("│ ").split("│") for line in result.output.splitlines() if line.startswith("│")]
    return {cells[0].strip(): (cells[1].strip(), cells[2].strip()) for cells in rows}


@pytest.mark.parametrize(
    "stage, name",
    [
        ("tokenize", "tokenizer.model"),
        ("tokenize", "tokens/data-00000.arrow"),
        ("pack", "train.npy"),
        ("pretrain", "params.safetensors"),
    ],
)
def test_a_same_size_change_to_a_stored_file_is_found_and_its_stage_computed_again(linked, stage, name):
    path = Path("runs/base") / stage / name
    flip(str(path))(linked)
    plan = _plan(cram(*RUN, "--dry-run"))  # the file's time changed: the plan hashes it
    assert plan[stage] == ("run", "files damaged") and plan["evaluate"] == ("skip", "done"), plan
    result = cram("verify", "runs/base")
    assert result.exit_code == 1, result.output
    assert f"damaged: {path}: damaged" in result.output and "3 of 4 stage output(s) intact" in result.output
    started = json.loads((linked / "runs/base/manifest.json").read_text())["stages"][stage]["started"]
    result = cram(*RUN)
    assert result.exit_code == 0, result.output
    assert json.loads((linked / "runs/base/manifest.json").read_text())["stages"][stage]["started"] != started
    assert cram("verify", "runs").exit_code == 0  # the damaged entry was set aside for gc
    assert cram("export", "runs/base", "--to", "out").exit_code == 0


def test_a_change_that_kept_size_and_time_is_found_when_the_file_is_read_and_by_verify(linked):
    flip("runs/base/pretrain/params.safetensors", keep_time=True)(linked)
    assert _plan(cram(*RUN, "--dry-run"))["pretrain"] == ("skip", "done")  # the plan's cheap check misses it
    result = cram(*RUN, *FORCE_EVAL)  # evaluate reads the params: hashed first
    assert result.exit_code == 2, result.output
    error = result.output.strip().splitlines()[-1]
    assert "pretrain/params.safetensors: damaged" in error and "stage 'evaluate' did not start" in error
    assert _plan(cram(*RUN, "--dry-run"))["pretrain"] == ("run", "files damaged")  # noted in the entry
    flip("runs/base/tokenize/tokenizer.model", keep_time=True)(linked)
    result = cram("verify", "runs")
    assert result.exit_code == 1 and "tokenizer.model: damaged" in result.output, result.output
    assert _plan(cram(*RUN, "--dry-run"))["tokenize"] == ("run", "files damaged")


def test_an_output_made_before_checksums_is_trusted_on_its_sizes(linked):
    for stage in STAGES:
        sizes_only(linked / "runs" / "base" / stage)
    flip("runs/base/pack/train.npy")(linked)
    assert set(_plan(cram(*RUN, "--dry-run")).values()) == {("skip", "done")}
    result = cram("verify", "runs/base")
    assert result.exit_code == 0 and "4 of 4 stage output(s) intact (4 made before checksums" in result.output


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
