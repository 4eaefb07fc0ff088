"""Plans that read nothing that did not change (a checkpoint's hash cached by its metadata in the store),
and inputs that change under a running stage or a disk that fills: one line naming the file, nothing
half-written in the store, earlier results intact."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from test_bad_inputs import PIPELINE, cram, write_workspace
from test_tokenizer import bert_style

from cram.pipeline import store
from cram.stages import pack, tokenize
from cram.stages.shared import files, pretrained


def fake_checkpoint(folder: Path) -> pretrained.Pretrained:
    """A transformers-style folder as `locate` finds one (its contents are never parsed here)."""
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "bert"}')
    (folder / "model.safetensors").write_bytes(os.urandom(1 << 16))
    return pretrained.locate(folder)


@pytest.fixture
def hash_calls(monkeypatch) -> list[Path]:
    """Every file the store's hash cache reads, in order."""
    calls: list[Path] = []
    real = store.content_hash

    def counting(path: Path) -> str:
        calls.append(Path(path))
        return real(path)

    monkeypatch.setattr(store, "content_hash", counting)
    return calls


def test_a_checkpoint_is_hashed_once_then_again_only_when_its_metadata_changes(tmp_path, hash_calls):
    found = fake_checkpoint(tmp_path / "ckpt")
    root = tmp_path / "runs" / store.STORE
    root.mkdir(parents=True)
    uncached = pretrained.fingerprint(found)
    with files.hashes_from(store.hash_cache(root)):
        assert pretrained.fingerprint(found) == uncached
        assert [p.name for p in hash_calls] == ["config.json", "model.safetensors"]
        assert pretrained.fingerprint(found) == uncached
        assert len(hash_calls) == 2  # the cache hit read no checkpoint bytes

        weights = found.weights[0]
        stat = weights.stat()
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1000))  # a new time, the same bytes
        assert pretrained.fingerprint(found) == uncached
        assert [p.name for p in hash_calls[2:]] == ["model.safetensors"]

        replaced = weights.with_name("new.safetensors")  # another file (a new inode) put in its place
        replaced.write_bytes(os.urandom(1 << 16))
        os.utime(replaced, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1000))
        os.replace(replaced, weights)
        changed = pretrained.fingerprint(found)
        assert changed[1][1] != uncached[1][1] and [p.name for p in hash_calls[3:]] == ["model.safetensors"]


def test_without_a_store_nothing_is_written_and_every_plan_hashes(tmp_path, hash_calls):
    found = fake_checkpoint(tmp_path / "ckpt")
    root = tmp_path / "runs" / store.STORE  # not made: a first --dry-run
    with files.hashes_from(store.hash_cache(root)):
        pretrained.fingerprint(found)
        pretrained.fingerprint(found)
    assert len(hash_calls) == 4 and not (tmp_path / "runs").exists()


def test_a_plan_with_an_init_checkpoint_reads_it_only_when_it_changed(tmp_path, monkeypatch, hash_calls):
    from test_init import INIT_PIPELINE, modernbert

    monkeypatch.chdir(tmp_path)
    write_workspace(tmp_path)
    modernbert(tmp_path / "ckpt")
    (tmp_path / "pipeline.toml").write_text(INIT_PIPELINE)
    (tmp_path / "runs" / store.STORE).mkdir(parents=True)  # a runs root whose store exists
    for expected in (2, 0, 0):
        del hash_calls[:]
        result = cram("run", "pipeline.toml", "--dry-run")
        assert result.exit_code == 0, result.output
        assert len(hash_calls) == expected  # config.json and model.safetensors, once
    os.utime(tmp_path / "ckpt" / "config.json")
    cram("run", "pipeline.toml", "--dry-run")
    assert [p.name for p in hash_calls] == ["config.json"]


def _store_items(ws: Path) -> list[str]:
    return sorted(p.name.split("-")[0] + p.name[p.name.index("-") + 65 :] for p in (ws / "runs" / ".store").glob("*-*"))


def _tokenize_workspace(ws: Path, monkeypatch, **extra: str) -> None:
    monkeypatch.chdir(ws)
    write_workspace(ws)
    lines = "".join(f"{key} = {value}\n" for key, value in extra.items())
    (ws / "pipeline.toml").write_text(PIPELINE.replace("[tokenize]\n", f"[tokenize]\n{lines}"))


def test_a_tokenizer_rewritten_while_tokenize_runs_is_refused_and_nothing_kept(tmp_path, monkeypatch):
    _tokenize_workspace(tmp_path, monkeypatch, tokenizer='"tok"', num_proc="1")
    bert_style(tmp_path / "tok")
    read = tokenize._read_corpus

    def read_then_rewrite(*args):
        found = read(*args)
        file = tmp_path / "tok" / "tokenizer.json"
        file.write_text(file.read_text().replace('"sat"', '"sit"'))
        return found

    monkeypatch.setattr(tokenize, "_read_corpus", read_then_rewrite)
    result = cram("run", "pipeline.toml", "--only", "tokenize")
    assert result.exit_code == 2, result.output
    assert "tokenizer.json: changed while tokenize ran; nothing was kept: run it again (log: " in result.output
    assert _store_items(tmp_path) == []  # no entry, no partial, no lock
    stages = json.loads((tmp_path / "runs" / "base" / "manifest.json").read_text())["stages"]
    assert stages["tokenize"]["status"] == "failed"


@pytest.mark.parametrize("how", ["shrinks", "is deleted"])
def test_a_corpus_file_that_changes_mid_run_is_named_and_nothing_kept(tmp_path, monkeypatch, how):
    _tokenize_workspace(tmp_path, monkeypatch, num_proc="1")
    pipeline = (tmp_path / "pipeline.toml").read_text().replace('paths = ["corpus.jsonl"]', 'paths = ["c*.jsonl"]')
    (tmp_path / "pipeline.toml").write_text(pipeline)
    lines = (tmp_path / "corpus.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "corpus.jsonl").write_text("".join(lines[:60]))
    (tmp_path / "c2.jsonl").write_text("".join(lines[60:]))
    make = tokenize._make_tokenizer

    def change_then_make(*args):  # after the corpus was read: the outputs would not match its key
        if how == "shrinks":
            (tmp_path / "c2.jsonl").write_text("".join(lines[60:90]))
        else:
            (tmp_path / "c2.jsonl").unlink()
        return make(*args)

    monkeypatch.setattr(tokenize, "_make_tokenizer", change_then_make)
    result = cram("run", "pipeline.toml", "--only", "tokenize")
    assert result.exit_code == 2, result.output
    assert "c2.jsonl: changed while tokenize ran; nothing was kept: run it again" in result.output
    assert _store_items(tmp_path) == []


def test_a_disk_that_fills_during_pack_removes_the_partial_entry_and_keeps_earlier_results(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_workspace(tmp_path)
    assert cram("run", "pipeline.toml", "--only", "tokenize").exit_code == 0
    assert cram("run", "pipeline.toml", "--only", "pack").exit_code == 0
    before = _store_items(tmp_path)
    run = tmp_path / "runs" / "base"
    first_pack = os.readlink(run / "pack")

    class Full:
        """A file on a disk with 1,000 bytes left."""

        def __init__(self, path, mode):
            self._file, self.name, self.left = open(path, mode), str(path), 1000

        def write(self, data):
            size = memoryview(data).nbytes
            if size > self.left:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= size
            return self._file.write(data)

        def __getattr__(self, name):
            return getattr(self._file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._file.close()

    monkeypatch.setattr(pack, "open", Full, raising=False)
    result = cram("run", "pipeline.toml", "--only", "pack", "--set", "pack.seq_len=32")
    assert result.exit_code == 1, result.output
    assert ".npy: No space left on device while pack wrote it" in result.output
    assert _store_items(tmp_path) == before  # the new key's partial removed; tokenize and the first pack kept
    assert os.readlink(run / "pack") == first_pack
    assert store.verify(run / "pack", json.loads((run / "manifest.json").read_text())["stages"]["pack"]["key"]) is None
