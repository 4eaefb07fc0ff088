"""`cram embed --out vectors.parquet`: an `id` column (each record's `--id-field`, else the row number) beside
an `embedding` column holding the vectors the `.npy` holds, in order, across files and chunks; bad ids one
line, exit 2, nothing written; progress as plain lines where stderr is no terminal, a bar where it is;
`--precision bf16` near fp32's vectors, and "auto" (the default) bf16 only where the CPU multiplies it natively."""

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_classifier_export import FAMILIES, sp_model  # noqa: F401 (a fixture)
from test_embed import EAGER, TEXTS, embedder_run, invoke, vectors

from cram.pipeline.commands.embed import embed
from cram.pipeline.errors import CramError
from cram.stages.kept import embedding
from cram.stages.kept.embedding import Request

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def run(tmp_path, sp_model):  # noqa: F811
    return embedder_run(tmp_path, sp_model)


def table(path):
    read = pq.read_table(path)
    return read.column("id").to_pylist(), np.array(read.column("embedding").to_pylist()), read.schema


def test_row_numbers_and_vectors_as_the_npy_holds_them(tmp_path, run):
    whole = vectors(run, tmp_path)
    lines = tmp_path / "texts.txt"  # written by `vectors`
    out = tmp_path / "v.parquet"
    chunked = dataclasses.replace(EAGER, chunk=4)  # two chunks: two row groups, numbered on
    assert embed(run, [lines], out, request=Request(precision="fp32"), settings=chunked).rows == len(TEXTS)
    ids, found, schema = table(out)
    assert ids == list(range(len(TEXTS))) and schema.field("id").type == pa.int64()
    assert schema.field("embedding").type == pa.list_(pa.float32(), FAMILIES["bert"].hidden)
    assert np.abs(found - whole).max() < 1e-6 and pq.ParquetFile(out).num_row_groups == 2
    half = tmp_path / "half.parquet"
    embed(run, [lines], half, request=Request(dtype="float16", precision="fp32"), settings=EAGER)
    assert pq.read_schema(half).field("embedding").type == pa.list_(pa.float16(), FAMILIES["bert"].hidden)
    assert np.abs(table(half)[1].astype(np.float32) - whole).max() < 1e-3


def test_the_id_field_of_each_record_across_files(tmp_path, run):
    whole = vectors(run, tmp_path)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.csv"
    first.write_text(
        "".join(json.dumps({"doc": f"d{i}" if i % 2 else i, "text": t}) + "\n" for i, t in enumerate(TEXTS[:3]))
    )
    second.write_text("doc,text\n" + "".join(f'x-{i},"{t}"\n' for i, t in enumerate(TEXTS[3:])))
    out = tmp_path / "ids.parquet"
    result = invoke(run, first, second, "--id-field", "doc", "--out", out)
    assert result.exit_code == 0 and f"{len(TEXTS)} vectors (float32, computed in fp32)" in result.output, result.output
    ids, found, schema = table(out)
    assert ids == ["0", "d1", "2", "x-0", "x-1", "x-2"] and schema.field("id").type == pa.string()
    assert np.abs(found - whole).max() < 1e-6


def test_bad_ids_are_one_line_exit_2_and_write_nothing(tmp_path, run):
    texts = tmp_path / "t.txt"
    texts.write_text("a text\n")
    records = tmp_path / "r.jsonl"
    records.write_text('{"id": "a", "text": "one"}\n{"text": "two"}\n')
    listed = tmp_path / "l.jsonl"
    listed.write_text('{"id": [1], "text": "one"}\n')
    out = tmp_path / "v.parquet"
    cases = [
        ((records, "--id-field", "id", "--out", tmp_path / "v.npy"), "--id-field id: ids are written to a .parquet"),
        ((texts, "--id-field", "id", "--out", out), "t.txt: plain text has no fields; --id-field id reads CSV"),
        ((records, "--id-field", "id", "--out", out), "record 2: --id-field id is None; an id is a text or a whole"),
        ((listed, "--id-field", "id", "--out", out), "--id-field id is [1]; an id is a text or a whole number"),
    ]
    for args, message in cases:
        result = invoke(run, *args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert not list(tmp_path.glob("*.parquet")) and not list(tmp_path.glob("*.npy")) and not list(tmp_path.glob(".*"))


def test_progress_is_plain_lines_without_a_terminal(tmp_path, run, monkeypatch, capsys):
    lines = tmp_path / "texts.txt"
    lines.write_text("\n".join(TEXTS) + "\n")
    monkeypatch.setattr(embedding, "PROGRESS_EVERY_S", 0.0)  # a line after every batch
    embed(run, [lines], tmp_path / "v.npy", settings=EAGER)
    written = capsys.readouterr().err.splitlines()
    assert written == [f"embed: {n}/{len(TEXTS)}" for n in range(2, len(TEXTS) + 1, 2)]


def test_a_terminal_gets_a_bar(tmp_path, run, monkeypatch, capsys):
    lines = tmp_path / "texts.txt"
    lines.write_text("\n".join(TEXTS) + "\n")
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: stderr is a terminal
    monkeypatch.setenv("TTY_INTERACTIVE", "1")
    embed(run, [lines], tmp_path / "v.npy", settings=EAGER)
    drawn = capsys.readouterr().err
    assert "embed" in drawn and f"{len(TEXTS)}/{len(TEXTS)}" in drawn and "embed: " not in drawn


def test_bf16_is_close_to_fp32_and_an_unknown_precision_is_refused(tmp_path, run):
    full = vectors(run, tmp_path)
    half = vectors(run, tmp_path, name="bf16.npy", precision="bf16")
    assert half.dtype == np.float32 and 0 < np.abs(half - full).max() < 3e-2  # computed in bf16, near fp32's
    assert np.allclose(np.linalg.norm(half, axis=1), 1, atol=1e-5)
    result = invoke(run, tmp_path / "texts.txt", "--out", tmp_path / "x.npy", "--precision", "fp16")
    assert result.exit_code == 2 and "--precision fp16: allowed auto, fp32, bf16" in result.output, result.output
    assert not (tmp_path / "x.npy").exists()


@pytest.mark.parametrize("native", [True, False])
def test_the_default_precision_is_bf16_where_the_cpu_multiplies_it_natively(tmp_path, run, monkeypatch, native):
    from typer.testing import CliRunner

    from cram.pipeline.commands import cli
    from cram.stages.shared import device as devices

    if devices.resolve("auto").type != "cpu":
        pytest.skip("the CPU's choice: on CUDA auto is bf16")
    monkeypatch.setattr(devices, "native_cpu_bf16", lambda: native)
    chosen = "bf16" if native else "fp32"
    expected = vectors(run, tmp_path, name="set.npy", precision=chosen)
    args = ["embed", str(run), str(tmp_path / "texts.txt"), "--out", str(tmp_path / "auto.npy"), "--no-compile"]
    result = CliRunner().invoke(cli.app, args)  # no --precision: "auto"
    assert result.exit_code == 0 and f"computed in {chosen}" in result.output, result.output
    assert np.abs(np.load(tmp_path / "auto.npy") - expected).max() < 1e-6  # bf16 and fp32 are ~1e-3 apart


def test_an_input_that_shrinks_after_the_count_leaves_no_parquet(tmp_path, run, monkeypatch):
    lines = tmp_path / "texts.txt"
    lines.write_text("\n".join(TEXTS) + "\n")
    read = embedding.identified
    calls = []

    def shrinking(files, request, size):  # the second reading (the embedding's) finds the last chunk gone
        calls.append(1)
        chunks = list(read(files, request, size))
        return iter(chunks if len(calls) == 1 else chunks[:-1])

    monkeypatch.setattr(embedding, "identified", shrinking)
    out = tmp_path / "v.parquet"
    with pytest.raises(CramError, match="rows embedded of the 6 counted; did an input change"):
        embed(run, [lines], out, settings=dataclasses.replace(EAGER, chunk=4))
    assert not out.exists() and not list(tmp_path.glob(".*"))
