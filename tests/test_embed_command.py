"""`cram embed` as a user runs it: one file or several in order, the .npy's dtype and shape, and every
bad input (a missing file, an unknown task, an absent field, an --out that is not .npy, a run without
embedding models, a damaged export or kept model, an embedder.json cram cannot use) one line, exit 2,
nothing written."""

import dataclasses
import errno
import json
import os

import numpy as np
import pytest
from test_classifier_export import FAMILIES, sp_model, with_classifier  # noqa: F401 (a fixture)
from test_embed import EAGER, TEXTS, embedder_run, invoke, vectors, with_embedder
from test_export import MODERNBERT, fake_run
from typer.testing import CliRunner

from cram.pipeline.commands import cli
from cram.pipeline.commands.embed import embed
from cram.pipeline.commands.export import export
from cram.pipeline.errors import CramError
from cram.stages.kept import KeptError, read_embedder
from cram.stages.kept.embedding import Request

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def run(tmp_path, sp_model):  # noqa: F811
    return embedder_run(tmp_path, sp_model)


def test_one_file_or_several_give_the_texts_vectors_in_order(tmp_path, run):
    whole = vectors(run, tmp_path)  # TEXTS from one plain-text file
    first, second, third = tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.csv"
    first.write_text("\n".join(TEXTS[:2]) + "\n\n")  # a blank line is no text
    second.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(TEXTS[2:4])))
    third.write_text("body,id\n" + "".join(f'"{t}",{i}\n' for i, t in enumerate(TEXTS[4:])))
    out = tmp_path / "several.npy"
    result = invoke(run, second, third, "--field", "body", "--out", out)
    assert result.exit_code == 0 and "4 vectors (float32, computed in fp32)" in result.output, result.output
    assert np.abs(np.load(out) - whole[2:]).max() < 1e-6
    # Chunks of 2 texts that straddle the files: the rows still come out in the inputs' order.
    chunked = dataclasses.replace(EAGER, chunk=3)
    request = Request(field="body", precision="fp32")
    assert embed(run, [first, first], tmp_path / "twice.npy", request=request, settings=chunked).rows == 4
    assert np.abs(np.load(tmp_path / "twice.npy") - np.concatenate([whole[:2], whole[:2]])).max() < 1e-6


def test_float16_halves_the_file_and_keeps_the_vectors(tmp_path, run):
    full = vectors(run, tmp_path)
    half = vectors(run, tmp_path, name="half.npy", dtype="float16")
    assert half.dtype == np.float16 and half.shape == full.shape == (len(TEXTS), FAMILIES["bert"].hidden)
    assert np.abs(half.astype(np.float32) - full).max() < 1e-3
    assert np.allclose(np.linalg.norm(full, axis=1), 1, atol=1e-5)


def test_bad_inputs_are_one_line_exit_2_and_write_nothing(tmp_path, sp_model, run):  # noqa: F811
    texts = tmp_path / "t.txt"
    texts.write_text("a text\n")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"body": "no text field"}\n')
    several, _ = fake_run(tmp_path / "several", sp_model, cfg=FAMILIES["bert"])
    with_embedder(several, FAMILIES["bert"], tasks=("a", "b"))
    classifying, _ = fake_run(tmp_path / "classifying", sp_model)
    with_classifier(classifying, MODERNBERT, "modernbert")
    out = tmp_path / "v.npy"
    cases = [
        ((run, tmp_path / "missing.txt", "--out", out), "missing.txt: not a file"),
        ((run, texts, "--task", "nope", "--out", out), "kept no embedding model of that task; it kept: search"),
        ((run, wrong, "--out", out), "record 1 has no field 'text'"),
        ((run, texts, "--out", tmp_path / "v.jsonl"), "unknown extension '.jsonl'; allowed .npy, .parquet"),
        ((run, texts, "--out", out, "--dtype", "int8"), "--dtype int8: allowed float32, float16"),
        ((classifying, texts, "--out", out), "evaluate kept no embedding model"),
        ((several, texts, "--out", out), "kept embedding models of a, b; name one with --task"),
        ((tmp_path / "nowhere", texts, "--out", out), "neither a run directory nor an exported embedding model"),
        ((run, texts, "--out", run / "evaluate" / "v.npy"), "inside the run directory"),
    ]
    for args, message in cases:
        result = invoke(*args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert not list(tmp_path.glob("*.npy")) and not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize(
    "fmt, damage",
    [
        ("sentence-transformers", "model.safetensors"),
        ("sentence-transformers", "tokenizer.json"),
        ("cram", "params.safetensors"),
    ],
)
def test_a_damaged_export_is_refused_in_one_line(tmp_path, run, fmt, damage):
    folder = export(run, tmp_path / "export", fmt=fmt, task="search")
    path = folder / damage
    if damage == "tokenizer.json":
        path.write_text(path.read_text().replace('"[UNK]"', '"[UNKNOWN]"'))  # still a tokenizer, but not this one
    else:
        path.write_bytes(path.read_bytes()[:-100])  # cut short
    texts = tmp_path / "t.txt"
    texts.write_text("a text\n")
    result = invoke(folder, texts, "--out", tmp_path / "v.npy")
    assert result.exit_code == 2 and f"{damage}: damaged" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "v.npy").exists()


def test_a_damaged_kept_embedding_model_is_refused_by_embed_and_export(tmp_path, run):
    params = next((run / "evaluate" / "embedders").rglob("params.safetensors"))
    data = bytearray(params.read_bytes())
    data[-1] ^= 1  # same size, other bytes
    params.write_bytes(bytes(data))
    texts = tmp_path / "t.txt"
    texts.write_text("a text\n")
    result = invoke(run, texts, "--out", tmp_path / "v.npy")
    assert result.exit_code == 2 and "params.safetensors: damaged" in result.output, result.output
    with pytest.raises(CramError, match="params.safetensors: damaged"):
        export(run, tmp_path / "x", fmt="sentence-transformers", task="search")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("pooling", "max", 'pooling "max": allowed mean, first'),
        ("normalize", False, "normalize false: cram embeds unit vectors"),
        ("query_max_length", 40, "query_max_length 40: expected 3 to the largest bucket, 16"),
        ("max_length", 2, "max_length 2: expected 3"),
        ("buckets", [16, 8], "buckets [16, 8]: expected increasing positive lengths"),
        ("buckets", [8, 32], "buckets up to 32 tokens, past the model's 24 positions"),
        ("kind", "classifier", 'kind "classifier": expected "embedder"'),
        ("params", "weights.bin", 'params "weights.bin": expected "params.safetensors"'),
    ],
)
def test_an_embedder_json_cram_cannot_use_is_refused_naming_the_field(run, field, value, message):
    folder = next((run / "evaluate" / "embedders").iterdir()) / "seed-0"
    meta = json.loads((folder / "embedder.json").read_text())
    (folder / "embedder.json").write_text(json.dumps({**meta, field: value}))
    with pytest.raises(KeptError, match="embedder.json: ") as caught:
        read_embedder(folder)
    assert message in str(caught.value)


def test_an_embedding_models_folder_without_params_or_encoder_is_refused(run):
    folder = next((run / "evaluate" / "embedders").iterdir()) / "seed-0"
    (folder / "params.safetensors").unlink()
    with pytest.raises(KeptError, match="params.safetensors: missing"):
        read_embedder(folder)


def test_export_refuses_what_sentence_transformers_cannot_hold(tmp_path, sp_model, run):  # noqa: F811
    cases = [
        (dict(fmt="sentence-transformers"), "name a retrieval task with --task"),
        (dict(fmt="sentence-transformers", task="nope"), "kept no classifier; it kept embedding models of: search"),
    ]
    for kwargs, message in cases:
        with pytest.raises(CramError, match=message):
            export(run, tmp_path / "x", **kwargs)
    odd = dataclasses.replace(MODERNBERT, qk_norm=True)
    other, _ = fake_run(tmp_path / "odd", sp_model, cfg=odd)
    with_embedder(other, odd)
    result = CliRunner().invoke(
        cli.app,
        ["export", str(other), "--task", "search", "--to", str(tmp_path / "x"), "--format", "sentence-transformers"],
    )
    assert result.exit_code == 2 and "set pretrain.model.qk_norm=false" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
    export(other, tmp_path / "cram", task="search")  # cram's own format holds any layout


def test_a_sentence_transformers_folder_whose_vectors_cram_cannot_compute_is_refused(tmp_path, run):
    folder = export(run, tmp_path / "st", fmt="sentence-transformers", task="search")
    (folder / "checksums.json").unlink()  # edited by hand, as a user's own folder: no checksums to fail first
    texts = tmp_path / "t.txt"
    texts.write_text("a text\n")
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    modules = json.loads((folder / "modules.json").read_text())
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    edits = [
        ("1_Pooling/config.json", {**pooling, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True}),
        ("1_Pooling/config.json", {**pooling, "pooling_mode_max_tokens": True}),  # mean and max, concatenated
        ("1_Pooling/config.json", {"embedding_dimension": 16, "pooling_mode": "max"}),  # sentence-transformers 6
        ("1_Pooling/config.json", {"embedding_dimension": 16, "pooling_mode": ["mean", "cls"]}),
        ("modules.json", modules[:2]),  # no Normalize
        ("modules.json", [*modules[:2], dense, modules[2]]),  # a projection after the pooling
        ("sentence_bert_config.json", {"max_seq_length": 16, "do_lower_case": True}),  # texts lower-cased first
    ]
    pooling_refused = 'names a pooling cram does not compute; it computes pooling_mode "mean" or "cls"'
    expected = "cram embeds with Transformer, Pooling, Normalize, in that order"
    messages = [pooling_refused] * 4 + [f"Transformer, Pooling; {expected}", f"Pooling, Dense, Normalize; {expected}"]
    messages.append("sentence_bert_config.json: do_lower_case true: sentence-transformers lower-cases each text")
    for (name, value), message in zip(edits, messages):
        original = (folder / name).read_text()
        (folder / name).write_text(json.dumps(value))
        result = invoke(folder, texts, "--out", tmp_path / "v.npy")
        assert result.exit_code == 2 and message in result.output, result.output
        (folder / name).write_text(original)
    assert not (tmp_path / "v.npy").exists()
    assert invoke(folder, texts, "--out", tmp_path / "v.npy").exit_code == 0  # as exported, it embeds


def test_an_export_without_checksums_is_read_with_one_warning_naming_it(tmp_path, run, caplog):
    texts = tmp_path / "t.txt"
    texts.write_text("a text\n")

    def warnings(folder) -> list[str]:
        caplog.clear()
        result = invoke(folder, texts, "--out", tmp_path / "v.npy")
        assert result.exit_code == 0, result.output
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        return [message for message in said if "checksums.json" in message]

    for fmt in ("cram", "sentence-transformers"):
        folder = export(run, tmp_path / fmt, fmt=fmt, task="search")
        assert warnings(folder) == []  # checked against them
        (folder / "checksums.json").unlink()
        (warned,) = warnings(folder)
        assert warned.startswith(f"{folder}: no checksums.json, so its files are read unverified"), warned
    (folder / ".cram-export").unlink()  # a sentence-transformers folder cram did not write never had them
    assert warnings(folder) == []


@pytest.mark.parametrize("module, kind", [("0_Transformer", "Transformer"), ("0_BERT", "BERT")])
def test_an_older_sentence_transformers_layout_embeds_as_the_export_it_came_from(tmp_path, run, module, kind):
    """The transformer in a sub-folder of its own, its length and tokenizer beside it there, as older
    sentence-transformers versions saved it (`0_Transformer/`, and the earliest `0_BERT/` with the class
    `models.BERT`): read as the same model."""
    folder = export(run, tmp_path / "st", fmt="sentence-transformers", task="search")
    expected = vectors(folder, tmp_path, name="root.npy")
    (folder / "checksums.json").unlink()  # the files move: the export's checksums no longer hold
    (folder / module).mkdir()
    for name in ("config.json", "model.safetensors", "sentence_bert_config.json", "tokenizer.json"):
        (folder / name).rename(folder / module / name)
    (folder / "tokenizer_config.json").rename(folder / module / "tokenizer_config.json")
    modules = json.loads((folder / "modules.json").read_text())
    modules[0] = {**modules[0], "path": module, "type": f"sentence_transformers.models.{kind}"}
    (folder / "modules.json").write_text(json.dumps(modules))
    assert np.abs(vectors(folder, tmp_path, name="moved.npy") - expected).max() < 1e-6


class FullDisk:
    """A file whose writes fail as a full disk's do once `room` bytes are in it."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= size
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def test_a_full_disk_is_one_line_the_temporary_file_removed_and_the_earlier_output_intact(tmp_path, run, monkeypatch):
    from cram.stages.retrieval import search

    texts = tmp_path / "t.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "v.npy"
    earlier = invoke(run, texts, "--out", out, "--batch-size", "2")
    assert earlier.exit_code == 0, earlier.output
    before = out.read_bytes()
    # The header (128 bytes) and one batch of 2 fp32 vectors fit; the next batch meets the full disk.
    room = 128 + 2 * 4 * FAMILIES["bert"].hidden
    monkeypatch.setattr(search, "open", lambda *a, **k: FullDisk(open(*a, **k), room), raising=False)
    result = invoke(run, texts, "--out", out, "--batch-size", "2")
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: --out {out}: cannot write it: No space left on device", result.output
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_stray_carriage_return_is_no_line_end_a_text_file_gives_a_vector_a_line(tmp_path, run):
    texts = tmp_path / "t.txt"
    texts.write_bytes(b"the cat sat\r\na dog ran \r over the mat\r\nfox\n")
    result = invoke(run, texts, "--out", tmp_path / "v.npy")
    assert result.exit_code == 0 and "3 vectors" in result.output, result.output
    assert np.load(tmp_path / "v.npy").shape[0] == 3


def test_a_batch_is_no_larger_than_the_input(tmp_path, run, monkeypatch):
    from cram.stages.kept import batches

    inputs = batches.Padding.inputs

    def spy(self, rows, lengths, index, size):
        assert size <= len(TEXTS), f"a batch of {size:,} rows for {len(TEXTS)} texts"
        return inputs(self, rows, lengths, index, size)

    monkeypatch.setattr(batches.Padding, "inputs", spy)
    texts = tmp_path / "t.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    result = invoke(run, texts, "--out", tmp_path / "v.npy", "--batch-size", "1000000")
    assert result.exit_code == 0 and f"{len(TEXTS)} vectors" in result.output, result.output
