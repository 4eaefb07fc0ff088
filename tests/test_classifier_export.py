"""A kept fine-tuned classifier: exported as each family's ...ForSequenceClassification (logits equal to
cram's), as cram's own folder, used by `cram predict`, and every bad input refused in one line."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_export import BERT, MODERNBERT, corpus, fake_run
from typer.testing import CliRunner

from cram.model.classifier import classify, init_head_params
from cram.model.hf import classifier_blockers, family_head
from cram.pipeline.commands import cli, predict
from cram.pipeline.commands.classifiers import ClassifierError
from cram.pipeline.commands.export import export
from cram.pipeline.schema import StageRecord
from cram.pipeline.store import write_marker
from cram.stages import Upstream, evaluate, tokenize
from cram.stages.evaluating import keeping
from cram.stages.finetuning.kind import describe
from cram.stages.finetuning.tasks import Examples, Task
from cram.stages.kept import KeptError, load_export, open_export, read_classifier
from cram.stages.kept.predicting import Settings
from cram.stages.shared.special import SPECIAL_IDS

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "e" * 64
ROBERTA = dataclasses.replace(BERT, position_offset=SPECIAL_IDS["pad"] + 1, token_types=1)
FAMILIES = {"modernbert": MODERNBERT, "bert": BERT, "roberta": ROBERTA}
LABELS = ["negative", "neutral", "positive"]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "The cat sat on the mat.", "Numbers like 1,234.5", "a"]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    path.write_bytes(tokenize.train_tokenizer(corpus(), tokenize.Config(vocab_size=MODERNBERT.vocab_size)))
    return path


def with_classifier(run, cfg, head, pooling="first", width=0, labels=LABELS, keep="best", **task):
    """RUN with a done evaluate stage that kept a classifier of task `t` (seed 0), checksummed as the
    store does; returns its params. `task`: text_fields, max_length, buckets other than ("text",), 24, (8, 24)."""
    params = load_file(run / "pretrain" / "params.safetensors")
    fresh = init_head_params(cfg, len(labels) or 1, seed=0, width=width, head=head)
    params.update({k: v * 20 if v.ndim == 2 else v + 0.1 * torch.randn_like(v) for k, v in fresh.items()})
    length, buckets = task.get("max_length", 24), task.get("buckets", (8, 24))
    config = evaluate.Config(tasks=[], head=head, head_width=width, pooling=pooling, max_length=length, buckets=buckets)
    fields = task.get("text_fields", ("text",))
    task_cfg = evaluate.TaskConfig(kind="custom", name="t", path="x", text_fields=fields, metrics=("accuracy",))
    empty = Examples([], np.zeros(0, np.int64))
    task = Task("t", ("accuracy",), tuple(labels), empty, {"test": empty})
    upstream = Upstream(run / "tokenize", {"tokenizer": "tokenizer.model", "special_ids": SPECIAL_IDS})
    folder = run / "evaluate"
    folder.mkdir()
    meta = {0: describe(config.tuning(), task_cfg, task, config.max_length, keeping.tokenizer_fields(upstream))}
    keeper = keeping.Keeper(keep, folder, run / "pretrain" / "model.json", meta)
    keeper.offer(0, 0, task, params, {"scores": {"test": {"accuracy": 0.5}}})
    kept = keeper.finish([(0, 0)], {0: 0})
    record = {
        "status": "done",
        "key": KEY,
        "outputs": {"results": "results.json", **({"classifiers": kept} if kept else {})},
    }
    write_marker(folder, "evaluate", KEY, StageRecord.from_json(record, "record"))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stages"]["evaluate"] = record
    (run / "manifest.json").write_text(json.dumps(manifest))
    return {k: v for k, v in params.items() if not k.startswith("head.")}


@pytest.mark.parametrize(
    "family, head, pooling",
    [
        ("modernbert", "modernbert", "first"),
        ("modernbert", "modernbert", "mean"),
        ("bert", "bert", "first"),
        ("bert", "cramming", "first"),  # at the hidden width (head_width 0), cramming's head is BERT's
        ("roberta", "roberta", "first"),
    ],
)
def test_transformers_classifier_logits_equal_cram_and_predict_agrees(tmp_path, sp_model, family, head, pooling):
    transformers = pytest.importorskip("transformers")
    cfg = FAMILIES[family]
    assert family_head(cfg) == family and classifier_blockers(cfg, head, 0, pooling) == []
    run, _ = fake_run(tmp_path, sp_model, cfg=cfg)
    params = with_classifier(run, cfg, head, pooling)
    out = export(run, tmp_path / "hf", fmt="transformers", task="t")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(hf).__name__ == {"modernbert": "ModernBert", "bert": "Bert", "roberta": "Roberta"}[family] + (
        "ForSequenceClassification"
    )
    assert hf.config.id2label == dict(enumerate(LABELS)) and hf.config.label2id == {n: i for i, n in enumerate(LABELS)}
    ids = torch.randint(5, cfg.vocab_size, (3, cfg.max_seq_len))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 9:] = False
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long()).logits
    ours = classify(params, cfg, ids, mask, pooling, head=head)
    assert expected.abs().max() > 0.1  # not a comparison of near-zero numbers
    assert (ours - expected).abs().max().item() <= 1e-4

    # `cram predict` on the cram-format export gives the labels the transformers model gives.
    folder = export(run, tmp_path / "cram", task="t")
    loaded_cfg, loaded, _ = load_export(folder)
    assert loaded_cfg == cfg and loaded.keys() == params.keys()
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    rows = tmp_path / "labels.jsonl"
    assert predict.predict(folder, [texts], out=rows, settings=Settings(compile=False, batch_size=2)) == len(TEXTS)
    got = [json.loads(line) for line in rows.read_text().splitlines()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        encoded = tokenizer(TEXTS, padding=True, truncation=True, max_length=24, return_tensors="pt")
        probabilities = hf(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]).logits.softmax(-1)
    assert [r["label"] for r in got] == [LABELS[i] for i in probabilities.argmax(-1)]
    ours = torch.tensor([[r["probabilities"][n] for n in LABELS] for r in got])
    assert (ours - probabilities).abs().max() < 1e-4


def test_a_regression_exports_with_its_problem_type_and_predicts_values(tmp_path, sp_model):
    transformers = pytest.importorskip("transformers")
    run, _ = fake_run(tmp_path, sp_model, cfg=BERT)
    params = with_classifier(run, BERT, "bert", labels=[])
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        export(run, tmp_path / "hf", "transformers", task="t")
    )
    assert hf.config.problem_type == "regression" and hf.config.num_labels == 1
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n\n")
    csv_out = tmp_path / "values.csv"
    predict.predict(export(run, tmp_path / "cram", task="t"), [texts], out=csv_out, settings=Settings(compile=False))
    lines = csv_out.read_text().splitlines()
    assert lines[0] == "value" and len(lines) == 1 + len(TEXTS)
    ids = torch.tensor([[SPECIAL_IDS["cls"], 7, 8, SPECIAL_IDS["sep"]]])
    with torch.no_grad():
        assert (
            abs(
                hf(input_ids=ids).logits
                - classify(params, BERT, ids, torch.ones_like(ids, dtype=torch.bool), head="bert")
            ).max()
            < 1e-4
        )


def test_a_head_transformers_cannot_hold_is_refused_naming_the_setting(tmp_path, sp_model):
    run, _ = fake_run(tmp_path, sp_model)  # ModernBERT's layout
    with_classifier(run, MODERNBERT, "cramming", width=1024)
    result = CliRunner().invoke(
        cli.app, ["export", str(run), "--task", "t", "--to", str(tmp_path / "x"), "--format", "transformers"]
    )
    assert result.exit_code == 2 and 'set evaluate.head="modernbert"' in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
    assert classifier_blockers(BERT, "cramming", 1024, "first") == [
        "evaluate.head_width=0 (the hidden size 32, not 1024)"
    ]
    assert classifier_blockers(BERT, "bert", 0, "mean") == ['evaluate.pooling="first"']
    export(run, tmp_path / "cram", task="t")  # cram's own format holds any head


def test_a_damaged_kept_classifier_is_refused_by_export_and_predict(tmp_path, sp_model):
    run, _ = fake_run(tmp_path, sp_model)
    with_classifier(run, MODERNBERT, "modernbert")
    params = next((run / "evaluate" / "classifiers").rglob("params.safetensors"))
    data = bytearray(params.read_bytes())
    data[-1] ^= 1  # same size, other bytes
    params.write_bytes(bytes(data))
    with pytest.raises(ClassifierError, match="params.safetensors: damaged"):
        export(run, tmp_path / "x", task="t")
    texts = tmp_path / "t.txt"
    texts.write_text("a text\n")
    result = CliRunner().invoke(cli.app, ["predict", str(run), str(texts), "--task", "t", "--no-compile"])
    assert result.exit_code == 2 and "damaged" in result.output and not (tmp_path / "x").exists()


def test_bad_inputs_are_one_line_exit_2_and_write_nothing(tmp_path, sp_model, monkeypatch):
    run, _ = fake_run(tmp_path, sp_model)
    with_classifier(run, MODERNBERT, "modernbert")
    good = tmp_path / "in.csv"
    good.write_text("text,other\nhello there,1\n")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"body": "no text field"}\n')
    (tmp_path / "in.xml").write_text("<a/>")
    (run / "evaluate" / "out.jsonl").parent.mkdir(exist_ok=True)
    cases = [
        (
            ["export", str(run), "--task", "nope", "--to", str(tmp_path / "e")],
            "kept no classifier of that task; it kept: t",
        ),
        (["predict", str(run), str(good), "--task", "nope"], "it kept: t"),
        (["predict", str(run), str(good)], "name the task to classify with --task"),
        (["predict", str(run), str(wrong), "--task", "t"], "record 1 has no field 'text'"),
        (["predict", str(run), str(tmp_path / "in.xml"), "--task", "t"], "unknown extension '.xml'"),
        (["predict", str(run), str(good), "--task", "t", "--out", str(good)], "is one of the inputs"),
        (["predict", str(run), str(good), "--task", "t", "--out", str(tmp_path / "o.txt")], "unknown extension '.txt'"),
        (["predict", str(run), str(good), "--task", "t", "--out", str(run / "evaluate" / "o.jsonl")], "inside the run"),
    ]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for args, message in cases:
        result = CliRunner().invoke(cli.app, [*args, "--no-compile"] if args[0] == "predict" else args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before

    folder = export(run, tmp_path / "cram", task="t")
    meta = json.loads((folder / "classifier.json").read_text())
    (folder / "classifier.json").write_text(json.dumps({**meta, "labels": ["a", "a", "b"]}))
    with pytest.raises(KeptError, match="classifier.json: damaged .*; export it again"):
        open_export(folder)  # the export's checksums see the edit
    with pytest.raises(KeptError, match=r'labels \["a", "a", "b"\] do not round-trip'):
        read_classifier(folder)
    hf = export(run, tmp_path / "hf", fmt="transformers", task="t")
    with pytest.raises(predict.PredictError, match="a transformers export: export with --format cram"):
        predict.predict(hf, [good], settings=Settings(compile=False))


def test_a_run_that_kept_nothing_names_evaluate_keep(tmp_path, sp_model):
    run, _ = fake_run(tmp_path, sp_model)
    with_classifier(run, MODERNBERT, "modernbert", keep="none")
    (run / "config.toml").write_text('[run]\nname = "run"\n\n[evaluate]\nkeep = "none"\n')
    assert not (run / "evaluate" / "classifiers").exists()
    with pytest.raises(ClassifierError, match='evaluate kept no classifier \\(evaluate.keep = "none"\\)'):
        export(run, tmp_path / "x", task="t")


def test_keep_best_holds_one_candidate_and_the_overall_best_is_written_by_its_holder(tmp_path):
    """Two ranks' keepers (as under torchrun): each holds its own best; after the gather the holder of the
    overall best writes it, the other writes nothing."""
    task = Task("t", ("accuracy",), ("a", "b"), Examples([], np.zeros(0)), {"test": Examples([], np.zeros(0))})
    model_json = tmp_path / "model.json"
    model_json.write_text(json.dumps(dataclasses.asdict(MODERNBERT)))
    meta = {0: {"task": "t"}}
    ranks = [keeping.Keeper("best", tmp_path / "out", model_json, meta) for _ in range(2)]
    jobs = [(0, 10), (0, 11), (0, 12), (0, 13)]
    scores = {0: 0.5, 1: 0.7, 2: 0.9, 3: float("nan")}
    runs = {j: {"scores": {"test": {"accuracy": s}}} for j, s in scores.items()}
    for j, (i, seed) in enumerate(jobs):
        ranks[j % 2].offer(i, seed, task, {"w": torch.full((2,), float(seed))}, runs[j])
    assert [len(r.held) for r in ranks] == [1, 1] and ranks[0].held[0][0] == 12  # its best so far only
    best = keeping.best_jobs(jobs, runs, [task])
    assert best == {0: 2}
    written = [r.finish(jobs, best) for r in ranks]
    assert written == [{"t": "classifiers/0-t/seed-12"}] * 2
    folders = sorted(p.name for p in (tmp_path / "out" / "classifiers" / "0-t").iterdir())
    assert folders == ["seed-12"]
    assert load_file(tmp_path / "out" / "classifiers/0-t/seed-12/params.safetensors")["w"].tolist() == [12.0, 12.0]

    every = keeping.Keeper("all", tmp_path / "all", model_json, meta)
    for j, (i, seed) in enumerate(jobs):
        every.offer(i, seed, task, {"w": torch.zeros(1)}, runs[j])
    assert every.finish(jobs, best) == {"t": "classifiers/0-t/seed-12"} and not every.held
    assert sorted(p.name for p in (tmp_path / "all" / "classifiers" / "0-t").iterdir()) == [
        f"seed-{s}" for s in range(10, 14)
    ]
    assert keeping.folder_of("sst2", 0) == "0-sst2" and keeping.folder_of("a/b", 3).startswith("3-a_b-")


def test_predict_compiles_once_per_bucket_and_reports_progress_off_a_terminal(tmp_path, sp_model, monkeypatch, capsys):
    from torch._dynamo.utils import counters

    from cram.stages.kept import predicting

    run, _ = fake_run(tmp_path, sp_model)
    with_classifier(run, MODERNBERT, "modernbert")  # buckets (8, 24)
    folder = export(run, tmp_path / "cram", task="t")
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(["a b"] * 5 + ["the quick brown fox jumps over the lazy dog " * 2] * 5) + "\n")
    monkeypatch.setattr(predicting, "PROGRESS_EVERY_S", 0.0)
    torch._dynamo.reset()  # graphs other tests compiled for the same prediction code would count against the limit
    before = counters["stats"]["unique_graphs"]
    # batches of 2 in chunks of 4: short and long, every one through one of two graphs, none recompiled
    settings = Settings(backend="aot_eager", batch_size=2, chunk=4)
    predict.predict(folder, [texts], out=tmp_path / "o.jsonl", settings=settings)
    assert counters["stats"]["unique_graphs"] - before == 2
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 10
    assert "predict: 8 texts" in capsys.readouterr().err
