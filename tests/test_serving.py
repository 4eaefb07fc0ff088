"""Serving that behaves like a Unix tool and a library: `cram predict ... | head -1` ends quietly with the
status every Unix tool gives a closed pipe (141), an `--out` that is a directory or lies where nothing can
be written is refused before any model is loaded, glibc's allocator is tuned only on glibc and only for
the command (a library caller keeps its own settings), and a batch is never larger than its input."""

import ctypes
import os
import subprocess
import sys
import tempfile

import pytest
from test_classifier_export import sp_model  # noqa: F401 (a fixture)
from test_kept import exported, texts_file  # noqa: F401 (a fixture)
from typer.testing import CliRunner

from cram.pipeline.commands import cli, predict
from cram.stages.kept import batches, predicting
from cram.stages.kept.predicting import Settings

pytestmark = pytest.mark.usefixtures("one_thread")
EAGER = Settings(compile=False)


def test_a_closed_pipe_ends_quietly_as_unix_tools_do(tmp_path, exported):  # noqa: F811
    texts = texts_file(tmp_path / "texts.txt", 1500)  # ~150 KB of rows: twice what a pipe holds
    command = [sys.executable, "-c", "from cram.pipeline.commands.cli import main; main()"]
    child = subprocess.Popen(
        [*command, "predict", str(exported), str(texts), "--no-compile"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    first = child.stdout.readline()  # as `head -1` reads, then leaves
    child.stdout.close()
    stderr = child.stderr.read().decode()
    assert child.wait(timeout=300) == 141, stderr
    assert first.startswith(b'{"label"') and stderr == ""


def refuse_to_load(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before --out was checked")

    monkeypatch.setattr(predict, "_classifier", load)
    from cram.pipeline.commands import embed

    monkeypatch.setattr(embed, "open_source", load)


@pytest.mark.parametrize("command, out", [("predict", "rows.jsonl"), ("embed", "vectors.npy")])
def test_an_out_that_cannot_be_written_is_refused_before_any_model_is_loaded(tmp_path, monkeypatch, command, out):
    texts = texts_file(tmp_path / "texts.txt", 3)
    refuse_to_load(monkeypatch)
    (tmp_path / out).mkdir()
    cases = [
        (tmp_path / out, "a directory; name the file to write in it"),
        (tmp_path / "nowhere" / out, "the folder"),
    ]
    for path, message in cases:
        result = CliRunner().invoke(cli.app, [command, str(tmp_path), str(texts), "--out", str(path)])
        assert result.exit_code == 2 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1

    # A read-only folder (root writes in one anyway, so the refusal is made here as the system makes it).
    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    result = CliRunner().invoke(cli.app, [command, str(tmp_path), str(texts), "--out", str(tmp_path / f"x-{out}")])
    assert result.exit_code == 2, result.output
    assert (
        result.output.strip() == f"error: --out {tmp_path / f'x-{out}'}: cannot write in {tmp_path}: Permission denied"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out, "texts.txt"])


class FakeLibc:
    """glibc as ctypes shows it, recording each mallopt and malloc_trim."""

    def __init__(self):
        self.calls = []

    def mallopt(self, parameter, value):
        self.calls.append(("mallopt", parameter, value))
        return 1

    def malloc_trim(self, pad):
        self.calls.append(("malloc_trim", pad))
        return 1


@pytest.fixture
def libc(monkeypatch):
    fake = FakeLibc()
    monkeypatch.setattr(ctypes, "CDLL", lambda name, *a, **k: fake if name is None else pytest.fail(name))
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.35", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    return fake


def test_a_library_caller_keeps_its_allocator_and_the_command_restores_it(tmp_path, exported, libc):  # noqa: F811
    texts = texts_file(tmp_path / "texts.txt", 5)
    assert predict.predict(exported, [texts], out=tmp_path / "a.jsonl", settings=EAGER) == 5
    assert libc.calls and {c[0] for c in libc.calls} == {"malloc_trim"}  # memory given back, no setting changed
    libc.calls.clear()
    result = CliRunner().invoke(
        cli.app, ["predict", str(exported), str(texts), "--out", str(tmp_path / "b.jsonl"), "--no-compile"]
    )
    assert result.exit_code == 0, result.output
    settings = [c[1:] for c in libc.calls if c[0] == "mallopt"]
    mmap, trim = predicting.M_MMAP_THRESHOLD, predicting.M_TRIM_THRESHOLD
    assert settings[:2] == [(mmap, 32 << 20), (trim, 64 << 10)]
    assert sorted(settings[2:]) == sorted([(mmap, 128 << 10), (trim, 128 << 10)])  # glibc's own, at the end
    assert libc.calls[-1][0] == "mallopt"


def test_the_thresholds_restored_are_those_the_environment_gave_glibc(monkeypatch):
    mmap, trim = predicting.M_MMAP_THRESHOLD, predicting.M_TRIM_THRESHOLD
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1048576:glibc.malloc.arena_max=2")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "200000")
    assert predicting.start_thresholds() == {mmap: 1 << 20, trim: 200_000}


@pytest.mark.parametrize("platform, libc_name", [("win32", None), ("darwin", None), ("linux", "musl")])
def test_no_allocator_tuning_off_glibc_and_predict_runs(tmp_path, exported, monkeypatch, platform, libc_name):  # noqa: F811
    def no_cdll(name, *args, **kwargs):  # Windows: ctypes.CDLL(None) is a TypeError
        raise TypeError("expected str, bytes or os.PathLike object, not NoneType")

    def confstr(name):
        if libc_name is None:
            raise ValueError("unrecognized configuration name")
        return None

    texts = texts_file(tmp_path / "texts.txt", 3)
    # Once as this machine runs it: what the run imports lazily is imported under the real platform.
    assert predict.predict(exported, [texts], out=tmp_path / "a.jsonl", settings=EAGER) == 3
    monkeypatch.setattr(ctypes, "CDLL", no_cdll)
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(os, "confstr", confstr, raising=False)
    assert predict.predict(exported, [texts], out=tmp_path / "a.jsonl", settings=EAGER) == 3
    result = CliRunner().invoke(cli.app, ["predict", str(exported), str(texts), "--no-compile"])
    assert result.exit_code == 0 and result.output.count('{"label"') == 3, result.output
    assert predicting.glibc() is None


def test_a_batch_is_no_larger_than_its_input(tmp_path, exported, monkeypatch):  # noqa: F811
    sizes = []
    inputs = batches.Padding.inputs

    def spy(self, rows, lengths, index, size):
        if size > 3:
            raise AssertionError(f"a batch of {size:,} rows for 3 texts")
        sizes.append(size)
        return inputs(self, rows, lengths, index, size)

    monkeypatch.setattr(batches.Padding, "inputs", spy)
    texts = texts_file(tmp_path / "texts.txt", 3)
    huge = Settings(compile=False, batch_size=1_000_000)
    assert predict.predict(exported, [texts], out=tmp_path / "a.jsonl", settings=huge) == 3
    assert sizes == [3]
    # Past one chunk, every chunk is padded to the one batch size: a compiled graph's shape stays fixed.
    sizes.clear()
    monkeypatch.setattr(
        batches.Padding,
        "inputs",
        lambda self, rows, lengths, index, size: sizes.append(size) or inputs(self, rows, lengths, index, size),
    )
    texts = texts_file(tmp_path / "more.txt", 10)
    chunked = Settings(compile=False, batch_size=1_000_000, chunk=4)
    assert predict.predict(exported, [texts], out=tmp_path / "b.jsonl", settings=chunked) == 10
    assert sizes == [4, 4, 4]
