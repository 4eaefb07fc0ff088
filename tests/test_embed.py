"""A kept embedding model exported as a sentence-transformers folder embeds as `cram embed` does: each
family's layout (BERT, ModernBERT, RoBERTa), mean and first-token pooling, short texts, texts past the
document length and queries cut at the query length, through `SentenceTransformer(folder).encode`
(1e-4). `with_embedder` writes a kept embedding model as the evaluate stage keeps one."""

import dataclasses
import json

import numpy as np
import pytest
from safetensors.torch import load_file, save_file
from test_classifier_export import FAMILIES, KEY, sp_model  # noqa: F401 (a fixture)
from test_export import fake_run

from cram.pipeline.commands.embed import embed
from cram.pipeline.commands.export import export
from cram.pipeline.schema import StageRecord
from cram.pipeline.store import write_marker
from cram.stages.kept.embedding import Request
from cram.stages.kept.predicting import Settings
from cram.stages.shared.special import SPECIAL_IDS

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 4)  # past every length here
TEXTS = ["The cat sat on the mat.", "a", LONG, "Numbers like 1,234.5", LONG + " again", "dog"]
MAX_LENGTH, QUERY_MAX_LENGTH, BUCKETS = 13, 7, (8, 16)
EAGER = Settings(compile=False, batch_size=2)


def with_embedder(run, cfg, pooling="mean", tasks=("search",), **lengths):
    """RUN with a done evaluate stage that kept an embedding model of each of `tasks` (seed 0, the
    pretrained encoder without its masked-LM head), checksummed as the store does. `lengths`:
    max_length, query_max_length, buckets other than MAX_LENGTH, QUERY_MAX_LENGTH, BUCKETS."""
    params = {k: v for k, v in load_file(run / "pretrain" / "params.safetensors").items() if not k.startswith("head.")}
    folder = run / "evaluate"
    folder.mkdir()
    kept = {}
    for index, task in enumerate(tasks):
        kept[task] = f"embedders/{index}-{task}/seed-0"
        out = folder / kept[task]
        out.mkdir(parents=True)
        save_file(params, out / "params.safetensors")
        (out / "model.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        meta = {
            "kind": "embedder",
            "task": task,
            "task_kind": "retrieval",
            "pooling": pooling,
            "normalize": True,
            "max_length": lengths.get("max_length", MAX_LENGTH),
            "query_max_length": lengths.get("query_max_length", QUERY_MAX_LENGTH),
            "buckets": list(lengths.get("buckets", BUCKETS)),
            "tokenizer": {"stage": "tokenize", "key": "k", "file": "tokenizer.model", "special_ids": SPECIAL_IDS},
            "seed": 0,
            "metric": "ndcg@10",
            "score": 0.5,
            "scores": {"test": {"ndcg@10": 0.5}},
            "params": "params.safetensors",
        }
        (out / "embedder.json").write_text(json.dumps(meta, indent=1))
    record = {"status": "done", "key": KEY, "outputs": {"results": "results.json", "embedders": kept}}
    write_marker(folder, "evaluate", KEY, StageRecord.from_json(record, "record"))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stages"]["evaluate"] = record
    (run / "manifest.json").write_text(json.dumps(manifest))
    return params


def embedder_run(tmp_path, sp_model):  # noqa: F811
    """A run folder holding one kept BERT-layout embedding model (task "search")."""
    run, _ = fake_run(tmp_path, sp_model, cfg=FAMILIES["bert"])
    with_embedder(run, FAMILIES["bert"])
    return run


def invoke(*args):
    """`cram embed ARGS --no-compile` through the CLI, in fp32 unless ARGS name a precision: "auto" computes
    in bf16 on some CPU kinds, and the tests compare vectors to 1e-6 on every kind."""
    from typer.testing import CliRunner

    from cram.pipeline.commands import cli

    pinned = [] if "--precision" in args else ["--precision", "fp32"]
    return CliRunner().invoke(cli.app, ["embed", *map(str, args), "--no-compile", *pinned])


def vectors(source, tmp_path, texts=TEXTS, name="v.npy", **request):
    """`cram embed`'s vectors of `texts` (a plain-text file, a line each) with SOURCE's embedding model, in
    fp32 unless `request` names a precision."""
    lines = tmp_path / "texts.txt"
    lines.write_text("\n".join(texts) + "\n")
    out = tmp_path / name
    written = embed(source, [lines], out, request=Request(**{"precision": "fp32", **request}), settings=EAGER)
    assert written.rows == len(texts)
    return np.load(out)


@pytest.mark.parametrize(
    "family, pooling",
    [("bert", "mean"), ("bert", "first"), ("modernbert", "mean"), ("modernbert", "first"), ("roberta", "mean")],
)
def test_sentence_transformers_encodes_as_cram_embed(tmp_path, sp_model, family, pooling):  # noqa: F811
    sentence_transformers = pytest.importorskip("sentence_transformers")
    cfg = FAMILIES[family]
    run, _ = fake_run(tmp_path, sp_model, cfg=cfg)
    with_embedder(run, cfg, pooling)
    folder = export(run, tmp_path / "st", fmt="sentence-transformers", task="search")

    model = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    assert model.max_seq_length == MAX_LENGTH and model.get_embedding_dimension() == cfg.hidden
    assert (
        type(model[0].auto_model).__name__
        == {"bert": "Bert", "modernbert": "ModernBert", "roberta": "Roberta"}[family] + "Model"
    )
    documents = vectors(run, tmp_path)
    assert documents.shape == (len(TEXTS), cfg.hidden) and documents.dtype == np.float32
    assert np.abs(model.encode(TEXTS, batch_size=4) - documents).max() < 1e-4

    model.max_seq_length = QUERY_MAX_LENGTH  # queries: cut at the query length, as the card says
    queries = vectors(run, tmp_path, name="q.npy", query=True)
    assert np.abs(model.encode(TEXTS, batch_size=4) - queries).max() < 1e-4
    long = [i for i, t in enumerate(TEXTS) if t.startswith(LONG)]
    assert np.abs(queries[long] - documents[long]).max() > 1e-2  # the query length cut them elsewhere

    # cram embed reads the export back (checksums, then the base model through the checkpoint reader).
    assert np.abs(vectors(folder, tmp_path, name="again.npy") - documents).max() < 1e-4


def test_the_export_is_a_sentence_transformers_folder_cram_reads_as_a_checkpoint(tmp_path, sp_model):  # noqa: F811
    from cram.stages.shared import pretrained

    cfg = FAMILIES["bert"]
    run, _ = fake_run(tmp_path, sp_model, cfg=cfg)
    params = with_embedder(run, cfg, "first")
    folder = export(run, tmp_path / "st", fmt="sentence-transformers", task="search")
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode_cls_token"] is True
    assert json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"] == MAX_LENGTH
    assert json.loads((folder / "tokenizer_config.json").read_text())["model_max_length"] == MAX_LENGTH
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["BertModel"]
    assert "model.safetensors" in json.loads((folder / "checksums.json").read_text())
    readme = (folder / "README.md").read_text()
    assert "SentenceTransformer" in readme and f"model.max_seq_length = {QUERY_MAX_LENGTH}" in readme

    found = pretrained.locate(folder)  # `[pretrain] init` on the export: the same encoder, its pooling kept
    loaded_cfg, loaded = pretrained.load(found)
    assert found.sentence and found.pooling == "first"
    assert all(np.array_equal(loaded[k].numpy(), v.numpy()) for k, v in params.items())
    assert loaded_cfg.hidden == cfg.hidden and loaded_cfg.layers == cfg.layers


def test_the_cram_format_export_embeds_as_the_run_does(tmp_path, sp_model):  # noqa: F811
    cfg = FAMILIES["modernbert"]
    run, _ = fake_run(tmp_path, sp_model, cfg=cfg)
    with_embedder(run, cfg)
    folder = export(run, tmp_path / "cram", task="search")
    assert (folder / "embedder.json").is_file() and "cram embed DIR" in (folder / "README.md").read_text()
    assert np.array_equal(vectors(folder, tmp_path, name="a.npy", query=True), vectors(run, tmp_path, query=True))


@pytest.mark.parametrize(("precision", "tolerance"), [("fp32", 1e-5), ("bf16", 5e-3)])
def test_the_compiled_embedding_equals_the_eager_one(tmp_path, sp_model, precision, tolerance):  # noqa: F811
    cfg = FAMILIES["bert"]
    run, _ = fake_run(tmp_path, sp_model, cfg=cfg)
    with_embedder(run, cfg)
    lines = tmp_path / "texts.txt"
    lines.write_text("\n".join(TEXTS) + "\n")
    compiled = Settings(compile=True, backend="aot_eager", batch_size=2)  # both buckets, one graph each
    embed(run, [lines], tmp_path / "c.npy", request=Request(precision=precision), settings=compiled)
    eager = vectors(run, tmp_path, precision=precision)
    assert np.abs(np.load(tmp_path / "c.npy") - eager).max() < tolerance
